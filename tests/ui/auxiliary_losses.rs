// Multi-token prediction's builtins: what they refuse.
use megatron::prelude::*;

#[megatron::module]
pub struct ShiftsATensor {
    #[vocab_parallel]
    wte: Embedding,
}

#[megatron::module]
impl ShiftsATensor {
    fn forward(&self, tokens: Ids) -> Tensor {
        // Only ids and masks shift (a tensor's shift would cross sequence-parallel shards).
        shift_left(self.wte(tokens))
    }
}

#[megatron::module]
pub struct MaskOfATensor {
    #[vocab_parallel]
    wte: Embedding,
}

#[megatron::module]
impl MaskOfATensor {
    fn forward(&self, tokens: Ids, targets: Ids) -> Tensor {
        let logits = self.wte.logits(self.wte(tokens));
        let losses = cross_entropy(logits, targets);
        aux_loss(losses, losses, losses, 0.1, "mtp_1")
    }
}

#[megatron::module]
pub struct UnnamedLoss {
    #[vocab_parallel]
    wte: Embedding,
}

#[megatron::module]
impl UnnamedLoss {
    fn forward(&self, tokens: Ids, targets: Ids) -> Tensor {
        let logits = self.wte.logits(self.wte(tokens));
        let losses = cross_entropy(logits, targets);
        aux_loss(losses, losses, loss_mask(targets), 0.1, NAME)
    }
}

const NAME: &str = "mtp_1";

fn main() {}
