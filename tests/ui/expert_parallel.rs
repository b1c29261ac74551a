// #[expert_parallel] misuse: a type that is not a layer of experts, options it does not take,
// and a tensor-parallel split input (the router and the dispatcher take whole tokens).
use megatron::moe::RoutedExperts;
use megatron::prelude::*;

#[megatron::module]
pub struct NotExperts {
    #[expert_parallel]
    fc: Linear,
}

#[megatron::module]
impl NotExperts {
    fn forward(&self, x: Tensor) -> Tensor {
        self.fc(x)
    }
}

#[megatron::module]
pub struct WithOptions {
    #[expert_parallel(capacity_factor = 1.0)]
    experts: RoutedExperts,
}

#[megatron::module]
pub struct SplitInput {
    #[column_parallel]
    up: Linear,
    #[expert_parallel]
    experts: RoutedExperts,
}

#[megatron::module]
impl SplitInput {
    fn forward(&self, x: Tensor) -> Tensor {
        self.experts(self.up(x))
    }
}

fn main() {}
