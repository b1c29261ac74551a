// Field attributes: one kind per field, known options only.
use megatron::prelude::*;

#[megatron::module]
pub struct TwoKinds {
    #[column_parallel]
    #[row_parallel]
    fc: Linear,
}

#[megatron::module]
pub struct UnknownOption {
    #[column_parallel(gather = true)]
    fc: Linear,
}

fn main() {}
