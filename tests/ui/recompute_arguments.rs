//! `#[recompute]` with an argument: which layers recompute is chosen at run time.

use megatron::prelude::*;

#[megatron::module]
pub struct Norm {
    ln: LayerNorm,
}

#[megatron::module]
impl Norm {
    #[recompute(layers = 2)]
    fn forward(&self, x: Tensor) -> Tensor {
        self.ln(x)
    }
}

fn main() {}
