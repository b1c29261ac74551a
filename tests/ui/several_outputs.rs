// Modules of several outputs: the count written, who may return several, and every output used.
use megatron::prelude::*;

#[megatron::module]
pub struct Pair {
    fc: Linear,
}

#[megatron::module]
impl Pair {
    fn forward(&self, x: Tensor) -> (Tensor, Tensor) {
        // Two tensors returned, one written.
        self.fc(x)
    }
}

#[megatron::module]
pub struct Halves {
    fc: Linear,
}

#[megatron::module]
impl Halves {
    fn forward(&self, x: Tensor) -> (Tensor, Tensor) {
        let (a, b) = chunk(self.fc(x), 2);
        (a, b)
    }
}

#[megatron::module]
pub struct NotAModule {
    #[column_parallel]
    fc: Linear,
    #[row_parallel]
    out: Linear,
}

#[megatron::module]
impl NotAModule {
    fn forward(&self, x: Tensor) -> Tensor {
        // A layer returns one tensor.
        let (a, b) = self.fc(x);
        self.out(a + b)
    }
}

#[megatron::module]
pub struct OneUnused {
    halves: Halves,
}

#[megatron::module]
impl OneUnused {
    fn forward(&self, x: Tensor) -> Tensor {
        let (a, b) = self.halves(x);
        a
    }
}

#[megatron::module]
pub struct OneName {
    halves: Halves,
}

#[megatron::module]
impl OneName {
    fn forward(&self, x: Tensor) -> Tensor {
        let (a,) = self.halves(x);
        a
    }
}

#[megatron::module]
pub struct Recomputed {
    fc: Linear,
}

#[megatron::module]
impl Recomputed {
    #[recompute]
    fn forward(&self, x: Tensor) -> (Tensor, Tensor) {
        (self.fc(x), x)
    }
}

fn main() {}
