// Sharding over tensor parallelism that does not fit: the value, where it came from, the fix.
use megatron::prelude::*;

#[megatron::module]
pub struct RowFedReplicated {
    ln: LayerNorm,
    #[row_parallel]
    fc2: Linear,
}

#[megatron::module]
impl RowFedReplicated {
    fn forward(&self, x: Tensor) -> Tensor {
        let h = self.ln(x);
        self.fc2(h)
    }
}

#[megatron::module]
pub struct ColumnFedSplit {
    #[column_parallel]
    fc1: Linear,
    #[column_parallel]
    fc2: Linear,
    #[row_parallel]
    fc3: Linear,
}

#[megatron::module]
impl ColumnFedSplit {
    fn forward(&self, x: Tensor) -> Tensor {
        let h = gelu(self.fc1(x));
        self.fc3(self.fc2(h))
    }
}

#[megatron::module]
pub struct MixedSum {
    #[column_parallel]
    fc1: Linear,
    #[row_parallel(input_is_parallel = false)]
    fc2: Linear,
}

#[megatron::module]
impl MixedSum {
    fn forward(&self, x: Tensor) -> Tensor {
        let h = self.fc1(x);
        self.fc2(x + h)
    }
}

#[megatron::module]
pub struct ReturnsSplit {
    ln: LayerNorm,
    #[column_parallel]
    fc1: Linear,
}

#[megatron::module]
impl ReturnsSplit {
    fn forward(&self, x: Tensor) -> Tensor {
        let logits = self.fc1(self.ln(x));
        logits
    }
}

fn main() {}
