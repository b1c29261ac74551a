// Loops of several statements: what they refuse.
use megatron::prelude::*;

#[megatron::module]
pub struct Depth {
    ln: LayerNorm,
}

#[megatron::module]
impl Depth {
    fn forward(&self, h: Tensor) -> Tensor {
        self.ln(h)
    }
}

#[megatron::module]
pub struct NotMutable {
    #[vocab_parallel]
    wte: Embedding,
    depths: Vec<Depth>,
}

#[megatron::module]
impl NotMutable {
    fn forward(&self, tokens: Ids) -> Tensor {
        let h = self.wte(tokens);
        let mut ids = tokens;
        for depth in &self.depths {
            ids = shift_left(ids);
            h = depth(h);
        }
        h
    }
}

#[megatron::module]
pub struct ChangesKind {
    #[vocab_parallel]
    wte: Embedding,
    depths: Vec<Depth>,
}

#[megatron::module]
impl ChangesKind {
    fn forward(&self, tokens: Ids) -> Tensor {
        let mut h = self.wte(tokens);
        let mut ids = tokens;
        for depth in &self.depths {
            h = depth(h);
            ids = h;
        }
        h
    }
}

#[megatron::module]
pub struct IdsBecomeATensor {
    #[vocab_parallel]
    wte: Embedding,
    depths: Vec<Depth>,
}

#[megatron::module]
impl IdsBecomeATensor {
    fn forward(&self, tokens: Ids) -> Tensor {
        let mut h = self.wte(tokens);
        let mut x = tokens;
        for depth in &self.depths {
            h = depth(h);
            x = self.wte(x);
        }
        h
    }
}

fn main() {}
