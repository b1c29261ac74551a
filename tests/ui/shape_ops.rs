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

#[megatron::module]
pub struct ChunkOfSplit {
    #[column_parallel]
    fc1: Linear,
    #[row_parallel]
    fc2: Linear,
}

#[megatron::module]
impl ChunkOfSplit {
    fn forward(&self, x: Tensor) -> Tensor {
        // Equal parts of a column-parallel output are not each rank's halves.
        let (a, b) = chunk(self.fc1(x), 2);
        self.fc2(a * b)
    }
}

#[megatron::module]
pub struct ChunkCounts {
    fc: Linear,
}

#[megatron::module]
impl ChunkCounts {
    fn forward(&self, x: Tensor) -> Tensor {
        let (a, b) = chunk(self.fc(x), 3);
        let (c, d) = chunk(a, N);
        a + b + c + d
    }
}

const N: usize = 2;

fn main() {}
