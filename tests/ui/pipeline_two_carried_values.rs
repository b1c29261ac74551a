//! A loop over the `#[pipeline]` stack that carries two values: only one goes from stage to
//! stage.

use megatron::prelude::*;

#[megatron::module]
pub struct Two {
    #[pipeline]
    blocks: Vec<LayerNorm>,
}

#[megatron::module]
impl Two {
    fn forward(&self, x: Tensor, y: Tensor) -> Tensor {
        let mut h = x;
        let mut g = y;
        for block in &self.blocks {
            h = block(h);
            g = block(g);
        }
        h + g
    }
}

fn main() {}
