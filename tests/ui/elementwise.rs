// Element-wise math in forward: what it refuses, and why.
use megatron::prelude::*;

#[megatron::module]
pub struct Mixed {
    #[column_parallel]
    fc1: Linear,
    #[row_parallel]
    fc2: Linear,
}

#[megatron::module]
impl Mixed {
    fn forward(&self, x: Tensor) -> Tensor {
        // A split value times a replicated one.
        let h = self.fc1(x) * x;
        self.fc2(h)
    }
}

#[megatron::module]
pub struct Bounds {
    #[column_parallel]
    fc1: Linear,
    #[row_parallel]
    fc2: Linear,
    #[config]
    scale: f32,
}

#[megatron::module]
impl Bounds {
    fn forward(&self, x: Tensor) -> Tensor {
        let h = self.fc1(x);
        // clamp's bounds are scalars; a layer is not a scalar.
        self.fc2(clamp(h, h, 1.0) * self.fc1)
    }
}

#[megatron::module]
pub struct Unknown {
    #[column_parallel]
    fc1: Linear,
    #[row_parallel]
    fc2: Linear,
}

#[megatron::module]
impl Unknown {
    fn forward(&self, x: Tensor) -> Tensor {
        self.fc2(swish(self.fc1(x)))
    }
}

fn main() {}
