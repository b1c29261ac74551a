// `#[local]` runs a layer on this rank's part of split values: tensors, not token ids, and split
// ones (a layer on a whole value takes no attribute).
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
pub struct LocalOfWhole {
    #[column_parallel]
    fc: Linear,
    #[local]
    norm: QkNorm,
}

#[megatron::module]
impl LocalOfWhole {
    fn forward(&self, x: Tensor) -> Tensor {
        self.norm(self.fc(x), x)
    }
}

fn main() {}
