//! `#[pipeline]` on a field that is not a `Vec` of modules.

use megatron::prelude::*;

#[megatron::module]
pub struct NotAList {
    #[pipeline]
    norm: LayerNorm,
}

fn main() {}
