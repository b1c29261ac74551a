// `#[local]` runs a layer on whatever this rank holds: one tensor in, not token ids.
use megatron::prelude::*;

#[megatron::module]
pub struct LocalOfIds {
    #[local]
    norm: QkNorm,
}

#[megatron::module]
impl LocalOfIds {
    fn forward(&self, tokens: Ids) -> Tensor {
        self.norm(tokens)
    }
}

#[megatron::module]
pub struct LocalOfTwo {
    #[local]
    norm: QkNorm,
}

#[megatron::module]
impl LocalOfTwo {
    fn forward(&self, x: Tensor) -> Tensor {
        self.norm(x, x)
    }
}

fn main() {}
