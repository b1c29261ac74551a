// Shape operations along the features: what the sharding analysis refuses.
use megatron::prelude::*;

const A: usize = 4;
const B: usize = 4;

#[megatron::module]
pub struct SplitOfSplit {
    #[column_parallel]
    fc1: Linear,
    #[row_parallel]
    fc2: Linear,
}

#[megatron::module]
impl SplitOfSplit {
    fn forward(&self, x: Tensor) -> Tensor {
        // The features of a column-parallel output are cut over the ranks.
        let (a, b) = split(self.fc1(x), [A, B]);
        self.fc2(cat(a, b))
    }
}

#[megatron::module]
pub struct Counts {
    #[column_parallel]
    fc1: Linear,
    #[row_parallel]
    fc2: Linear,
}

#[megatron::module]
impl Counts {
    fn forward(&self, x: Tensor) -> Tensor {
        let (a, b) = split_heads(self.fc1(x), [A, B, 2]);
        self.fc2(cat_heads(a, b, [A, B]))
    }
}

fn main() {}
