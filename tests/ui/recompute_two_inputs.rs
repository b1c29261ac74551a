//! `#[recompute]` on a forward of two inputs: it keeps one `Tensor` input and reruns from it.

use megatron::prelude::*;

#[megatron::module]
pub struct Mix {
    ln: LayerNorm,
}

#[megatron::module]
impl Mix {
    #[recompute]
    fn forward(&self, x: Tensor, y: Tensor) -> Tensor {
        self.ln(x + y)
    }
}

fn main() {}
