// #[graph_scope(mlp)] on a module that holds an #[expert_parallel] layer: its dispatch is an
// all-to-all with sizes known only at run time, so no graph can capture the module whole.
use megatron::moe::RoutedExperts;
use megatron::prelude::*;

#[megatron::module]
pub struct Moe {
    #[expert_parallel]
    experts: RoutedExperts,
}

#[megatron::module]
impl Moe {
    fn forward(&self, x: Tensor) -> Tensor {
        self.experts(x)
    }
}

#[megatron::module]
pub struct Layer {
    #[graph_scope(mlp)]
    mlp: Moe,
}

#[megatron::module]
impl Layer {
    fn forward(&self, x: Tensor) -> Tensor {
        self.mlp(x)
    }
}

fn main() {}
