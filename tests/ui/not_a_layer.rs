// A split attribute on a field whose type cannot be split: the trait's message, at the field.
use megatron::prelude::*;

#[megatron::module]
pub struct Mlp {
    #[column_parallel]
    fc1: Linear,
    #[row_parallel]
    fc2: Linear,
}

#[megatron::module]
impl Mlp {
    fn forward(&self, x: Tensor) -> Tensor {
        self.fc2(gelu(self.fc1(x)))
    }
}

#[megatron::module]
pub struct Block {
    #[column_parallel]
    mlp: Mlp,
    #[row_parallel]
    out: Linear,
}

#[megatron::module]
impl Block {
    fn forward(&self, x: Tensor) -> Tensor {
        self.out(self.mlp(x))
    }
}

fn main() {}
