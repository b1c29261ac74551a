// #[graph_scope] misuse: an unknown scope, and a whole expert layer under attn.
use megatron::moe::RoutedExperts;
use megatron::prelude::*;

#[megatron::module]
pub struct Unknown {
    #[graph_scope(attention)]
    attn: Linear,
}

#[megatron::module]
pub struct WholeExperts {
    #[expert_parallel]
    #[graph_scope(attn)]
    experts: RoutedExperts,
}

fn main() {}
