//! Two `#[pipeline]` fields: a model has one stack that pipeline parallelism cuts.

use megatron::prelude::*;

#[megatron::module]
pub struct Twice {
    #[pipeline]
    first: Vec<LayerNorm>,
    #[pipeline]
    second: Vec<LayerNorm>,
}

fn main() {}
