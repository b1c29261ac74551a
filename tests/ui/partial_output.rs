// `#[partial_output]` takes a module whose forward ends in a row-parallel layer, from a whole
// input.
use megatron::prelude::*;

#[megatron::module]
pub struct EndsInNorm {
    #[column_parallel]
    fc1: Linear,
    #[row_parallel]
    fc2: Linear,
    ln: LayerNorm,
}

#[megatron::module]
impl EndsInNorm {
    fn forward(&self, x: Tensor) -> Tensor {
        self.ln(self.fc2(gelu(self.fc1(x))))
    }
}

#[megatron::module]
pub struct Caller {
    // Its output is the norm's, whole: there is no partial output to hand over.
    #[partial_output]
    branch: EndsInNorm,
}

#[megatron::module]
impl Caller {
    fn forward(&self, x: Tensor) -> Tensor {
        x + self.branch(x)
    }
}

#[megatron::module]
pub struct SplitInput {
    #[column_parallel]
    up: Linear,
    #[partial_output]
    down: EndsInNorm,
}

#[megatron::module]
impl SplitInput {
    fn forward(&self, x: Tensor) -> Tensor {
        // A split value is no module's input.
        x + self.down(self.up(x))
    }
}

fn main() {}
