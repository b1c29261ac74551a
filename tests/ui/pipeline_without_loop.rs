//! A `#[pipeline]` stack the forward never runs in a loop.

use megatron::prelude::*;

#[megatron::module]
pub struct NoLoop {
    ln: LayerNorm,
    #[pipeline]
    blocks: Vec<LayerNorm>,
}

#[megatron::module]
impl NoLoop {
    fn forward(&self, x: Tensor) -> Tensor {
        self.ln(x)
    }
}

fn main() {}
