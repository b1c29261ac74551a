// An op left without #[op]: the sharding error says it may be an op, and the type error says
// which attribute a field that is not a module takes.
use megatron::prelude::*;
use megatron::tensor_parallel::CausalSelfAttention;

#[megatron::module]
pub struct Attention {
    #[column_parallel]
    qkv: Linear,
    core: CausalSelfAttention,
    #[row_parallel]
    proj: Linear,
}

#[megatron::module]
impl Attention {
    fn forward(&self, x: Tensor) -> Tensor {
        self.proj(self.core(self.qkv(x)))
    }
}

fn main() {}
