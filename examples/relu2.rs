//! A new activation in the DSL alone: modded-nanogpt's ReLU² MLP (`relu(x)²` between the two
//! projections), written as element-wise math in forward. `#[megatron::module]` fuses the ReLU
//! and the square into one generated kernel each way (a host loop, and CUDA C for a GPU; see
//! docs/expanded-elementwise.md): no hand-written layer, no hand-written backward.
//!
//! A small decoder with these MLPs is trained on one rank, at tensor parallelism 2, at tensor
//! parallelism 2 with sequence parallelism, and at pipeline parallelism 2 (thread ranks), and
//! every layout follows the one-rank run.
//!
//! ```sh
//! cargo run --release --example relu2
//! ```

mod common;

use common::{Layout, ONE, Run};
use megatron::models::gpt::{Attention, AttentionSpec};
use megatron::prelude::*;
use megatron::training::CarriedWidth;

/// The MLP with a squared ReLU: the activation is two element-wise operations, fused.
#[megatron::module]
pub struct Relu2Mlp {
    #[column_parallel]
    fc1: Linear,
    #[row_parallel]
    fc2: Linear,
}

#[megatron::module]
impl Relu2Mlp {
    fn forward(&self, x: Tensor) -> Tensor {
        let h = relu(self.fc1(x));
        self.fc2(h * h)
    }
}

/// A pre-norm decoder layer around it (attention from `megatron-models`' GPT).
#[megatron::module]
pub struct Relu2Layer {
    ln_1: LayerNorm,
    attn: Attention,
    ln_2: LayerNorm,
    mlp: Relu2Mlp,
}

#[megatron::module]
impl Relu2Layer {
    fn forward(&self, x: Tensor) -> Tensor {
        let h = x + self.attn(self.ln_1(x));
        h + self.mlp(self.ln_2(h))
    }
}

/// The language model: tied vocabulary-parallel embedding, the layers cut into pipeline
/// stages, the final norm and the fused vocabulary-parallel cross-entropy.
#[megatron::module]
pub struct Relu2Lm {
    #[vocab_parallel]
    wte: Embedding,
    #[pipeline]
    layers: Vec<Relu2Layer>,
    ln_f: LayerNorm,
}

#[megatron::module]
impl Relu2Lm {
    fn forward(&self, tokens: Ids, targets: Ids) -> Tensor {
        let mut h = self.wte(tokens);
        for layer in &self.layers {
            h = layer(h);
        }
        cross_entropy(self.wte.logits(self.ln_f(h)), targets)
    }
}

impl CarriedWidth for Relu2Lm {
    fn carried_width(&self) -> usize {
        self.ln_f.hidden()
    }
}

const HIDDEN: usize = 96;
const HEADS: usize = 4;
const LAYERS: usize = 4;
/// Bytes: the examples' frozen corpus (examples/data) is read as bytes.
const VOCAB: usize = 256;
const STEPS: u64 = 40;
const SEED: u64 = 1234;

fn spec() -> Relu2LmSpec {
    let layer = Relu2LayerSpec {
        ln_1: LayerNormSpec::new(HIDDEN),
        attn: AttentionSpec {
            qkv: LinearSpec::new(HIDDEN, 3 * HIDDEN),
            qk_norm: QkNormSpec::Off,
            core: CausalSelfAttention::new(HEADS, 0.0),
            proj: LinearSpec::new(HIDDEN, HIDDEN),
        },
        ln_2: LayerNormSpec::new(HIDDEN),
        mlp: Relu2MlpSpec {
            fc1: LinearSpec::new(HIDDEN, 4 * HIDDEN),
            fc2: LinearSpec::new(4 * HIDDEN, HIDDEN),
        },
    };
    Relu2LmSpec {
        wte: EmbeddingSpec::new(VOCAB, HIDDEN),
        layers: vec![layer; LAYERS],
        ln_f: LayerNormSpec::new(HIDDEN),
    }
}

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    println!(
        "a {LAYERS}-layer decoder with ReLU² MLPs (hidden {HIDDEN}, {HEADS} heads) on \
         the examples' corpus (the guide and the model sources) as bytes"
    );
    let run = Run {
        steps: STEPS,
        layers: LAYERS,
        seq_length: 64,
        micro_batch: 2,
        global_batch: 8,
        max_lr: 2e-3,
        seed: SEED,
    };
    common::train_and_compare::<Relu2Lm>(
        &spec(),
        run,
        &[
            ("one rank", ONE),
            ("TP=2", Layout { tp: 2, ..ONE }),
            (
                "TP=2 + SP",
                Layout {
                    tp: 2,
                    sp: true,
                    ..ONE
                },
            ),
            ("PP=2", Layout { pp: 2, ..ONE }),
        ],
        (1e-5, 1e-3),
    )
}
