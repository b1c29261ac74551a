// What forward accepts: straight-line code over the struct's fields.
use megatron::prelude::*;

#[megatron::module]
pub struct Mlp {
    #[column_parallel]
    fc1: Linear,
    #[row_parallel]
    fc2: Linear,
}

#[megatron::module]
impl Mlp {
    fn forward(&self, x: Tensor) -> Tensor {
        if true {
            self.fc2(self.fc1(x))
        } else {
            x
        }
    }
}

#[megatron::module]
pub struct Unknown {
    #[column_parallel]
    fc1: Linear,
    #[row_parallel]
    fc2: Linear,
}

#[megatron::module]
impl Unknown {
    fn forward(&self, x: Tensor) -> Tensor {
        self.fc2(self.fc3(x))
    }
}

#[megatron::module]
pub struct NotTied {
    #[vocab_parallel]
    wte: Embedding,
    #[column_parallel]
    head: Linear,
}

#[megatron::module]
impl NotTied {
    fn forward(&self, tokens: Ids, targets: Ids) -> Tensor {
        cross_entropy(self.head.logits(self.wte(tokens)), targets)
    }
}

fn main() {}
