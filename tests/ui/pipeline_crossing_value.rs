//! A value computed before the `#[pipeline]` loop (on the first stage) used after it (on the
//! last stage).

use megatron::prelude::*;

#[megatron::module]
pub struct Skip {
    ln: LayerNorm,
    #[pipeline]
    blocks: Vec<LayerNorm>,
}

#[megatron::module]
impl Skip {
    fn forward(&self, x: Tensor) -> Tensor {
        let e = self.ln(x);
        let mut h = e;
        for block in &self.blocks {
            h = block(h);
        }
        h + e
    }
}

fn main() {}
