//! A model that is not GPT, written with the DSL: a decoder of parallel blocks (GPT-J's and
//! PaLM's layout: attention and the MLP both read the same layer norm of the residual stream,
//! and both outputs join it in one sum), with no position embedding (the causal mask alone tells
//! the tokens apart by order). The field attributes are the whole parallel plan; the macros
//! write the forward, the backward and every collective, and since the attention's and the
//! MLP's row-parallel outputs are summed, they reduce them **once** (one all-reduce, or with
//! sequence parallelism one reduce-scatter), and the norm's output, read by two
//! column-parallel layers, passes Megatron-LM's f once (docs/expanded-parallel-block.md).
//!
//! Trained on one rank, at tensor parallelism 2 × data parallelism 2, at tensor parallelism 2
//! with sequence parallelism, and at pipeline parallelism 2 (thread ranks): every layout
//! follows the one-rank run. Then the same block with its two branches as modules of their own
//! (GPT's `Attention` and `Mlp`), `x + self.attn(n) + self.mlp(n)`: declared `#[partial_output]`,
//! each hands its last layer's partial output over and the block still reduces their sum once.
//!
//! ```sh
//! cargo run --release --example custom_model
//! ```

mod common;

use common::{Layout, ONE, Run};
use megatron::models::gpt::{Attention, AttentionSpec, Mlp, MlpSpec};
use megatron::prelude::*;
use megatron::training::CarriedWidth;

/// A parallel block: one layer norm feeds both branches, and both add to the residual.
#[megatron::module]
pub struct ParallelBlock {
    ln: LayerNorm,
    #[column_parallel]
    qkv: Linear,
    #[context_parallel]
    core: CausalSelfAttention,
    #[row_parallel]
    proj: Linear,
    #[column_parallel]
    fc1: Linear,
    #[row_parallel]
    fc2: Linear,
}

#[megatron::module]
impl ParallelBlock {
    fn forward(&self, x: Tensor) -> Tensor {
        let n = self.ln(x);
        x + self.proj(self.core(self.qkv(n))) + self.fc2(gelu(self.fc1(n)))
    }
}

/// The parallel block with its branches as sub-modules, GPT's own attention and MLP (both end in
/// a row-parallel layer): their partial outputs are summed across the module boundary and
/// reduced once.
#[megatron::module]
pub struct ModularBlock {
    ln: LayerNorm,
    #[partial_output]
    attn: Attention,
    #[partial_output]
    mlp: Mlp,
}

#[megatron::module]
impl ModularBlock {
    fn forward(&self, x: Tensor) -> Tensor {
        let n = self.ln(x);
        x + self.attn(n) + self.mlp(n)
    }
}

/// The language model: vocabulary-parallel embedding tied to the output layer, the blocks (cut
/// into pipeline stages), a final norm and the fused vocabulary-parallel cross-entropy.
#[megatron::module]
pub struct ParallelLm {
    #[vocab_parallel]
    wte: Embedding,
    #[pipeline]
    blocks: Vec<ParallelBlock>,
    ln_f: LayerNorm,
}

#[megatron::module]
impl ParallelLm {
    fn forward(&self, tokens: Ids, targets: Ids) -> Tensor {
        let mut h = self.wte(tokens);
        for block in &self.blocks {
            h = block(h);
        }
        let h = self.ln_f(h);
        cross_entropy(self.wte.logits(h), targets)
    }
}

impl CarriedWidth for ParallelLm {
    fn carried_width(&self) -> usize {
        self.ln_f.hidden()
    }
}

/// The same language model over the modular blocks.
#[megatron::module]
pub struct ModularLm {
    #[vocab_parallel]
    wte: Embedding,
    #[pipeline]
    blocks: Vec<ModularBlock>,
    ln_f: LayerNorm,
}

#[megatron::module]
impl ModularLm {
    fn forward(&self, tokens: Ids, targets: Ids) -> Tensor {
        let mut h = self.wte(tokens);
        for block in &self.blocks {
            h = block(h);
        }
        let h = self.ln_f(h);
        cross_entropy(self.wte.logits(h), targets)
    }
}

impl CarriedWidth for ModularLm {
    fn carried_width(&self) -> usize {
        self.ln_f.hidden()
    }
}

const HIDDEN: usize = 128;
const HEADS: usize = 4;
const LAYERS: usize = 2;
/// Bytes: the examples' frozen corpus (examples/data) is read as bytes.
const VOCAB: usize = 256;
const STEPS: u64 = 150;
const SEED: u64 = 1234;

fn spec() -> ParallelLmSpec {
    let block = ParallelBlockSpec {
        ln: LayerNormSpec::new(HIDDEN),
        qkv: LinearSpec::new(HIDDEN, 3 * HIDDEN),
        core: CausalSelfAttention::new(HEADS, 0.1),
        proj: LinearSpec::new(HIDDEN, HIDDEN),
        fc1: LinearSpec::new(HIDDEN, 4 * HIDDEN),
        fc2: LinearSpec::new(4 * HIDDEN, HIDDEN),
    };
    ParallelLmSpec {
        wte: EmbeddingSpec::new(VOCAB, HIDDEN),
        blocks: vec![block; LAYERS],
        ln_f: LayerNormSpec::new(HIDDEN),
    }
}

fn modular_spec() -> ModularLmSpec {
    let block = ModularBlockSpec {
        ln: LayerNormSpec::new(HIDDEN),
        attn: AttentionSpec {
            qkv: LinearSpec::new(HIDDEN, 3 * HIDDEN),
            qk_norm: QkNormSpec::Off,
            core: CausalSelfAttention::new(HEADS, 0.1),
            proj: LinearSpec::new(HIDDEN, HIDDEN),
        },
        mlp: MlpSpec {
            fc1: LinearSpec::new(HIDDEN, 4 * HIDDEN),
            fc2: LinearSpec::new(4 * HIDDEN, HIDDEN),
        },
    };
    ModularLmSpec {
        wte: EmbeddingSpec::new(VOCAB, HIDDEN),
        blocks: vec![block; LAYERS],
        ln_f: LayerNormSpec::new(HIDDEN),
    }
}

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    println!(
        "a {LAYERS}-layer parallel-block decoder (hidden {HIDDEN}, {HEADS} heads, no position \
         embedding) on the examples' corpus (the guide and the model sources) as bytes"
    );
    let run = Run {
        steps: STEPS,
        layers: LAYERS,
        seq_length: 64,
        micro_batch: 4,
        global_batch: 16,
        max_lr: 2e-3,
        seed: SEED,
    };
    common::train_and_compare::<ParallelLm>(
        &spec(),
        run,
        &[
            ("one rank", ONE),
            (
                "TP=2 × DP=2",
                Layout {
                    tp: 2,
                    dp: 2,
                    ..ONE
                },
            ),
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
    )?;
    println!("\nthe same blocks with their branches as #[partial_output] sub-modules");
    let run = Run {
        steps: STEPS / 2,
        ..run
    };
    common::train_and_compare::<ModularLm>(
        &modular_spec(),
        run,
        &[
            ("one rank", ONE),
            (
                "TP=2 + SP",
                Layout {
                    tp: 2,
                    sp: true,
                    ..ONE
                },
            ),
        ],
        (1e-5, 1e-3),
    )
}
