// `#[context_parallel]` marks the op that mixes a sequence's positions (attention): called with
// several tensors, it must take several (`DotProductAttention`, not `CausalSelfAttention`).
use megatron::prelude::*;

#[megatron::module]
pub struct TwoInputs {
    #[context_parallel]
    core: CausalSelfAttention,
}

#[megatron::module]
impl TwoInputs {
    fn forward(&self, x: Tensor) -> Tensor {
        self.core(x, x)
    }
}

fn main() {}
