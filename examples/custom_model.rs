//! A model that is not GPT, written with the DSL and trained with tensor parallelism 2 × data
//! parallelism 2 on four thread ranks, then on one rank to show that the parallel run computes
//! the same thing.
//!
//! The model is a decoder with parallel blocks (GPT-J's and PaLM's layout: attention and the
//! MLP both read the same layer norm of the residual stream, and both outputs join it in one
//! step) and no position embedding (the causal mask alone tells the tokens apart by order). The
//! field attributes are the whole tensor-parallel plan; the macros write the forward, the
//! backward and every collective. The attention and MLP branches are the modules of the GPT in
//! `megatron-models`, used as a library: generated modules compose like any other layer.
//!
//! ```sh
//! cargo run --release --example custom_model
//! ```

use std::time::Instant;

use megatron::comm::ParallelState;
use megatron::comm::threads::launch;
use megatron::models::gpt::{Attention, AttentionSpec, Mlp, MlpSpec};
use megatron::module::{Ids, Site};
use megatron::optimizer::AdamWConfig;
use megatron::parallel::{ParallelConfig, ParallelLayout};
use megatron::prelude::*;
use megatron::training::{
    BatchPlan, DecayStyle, LanguageModel, LrSchedule, Sampler, TokenStream, TrainConfig, Trainer,
};

/// A parallel block: one layer norm feeds both branches, and both add to the residual.
#[megatron::module]
pub struct ParallelBlock {
    ln: LayerNorm,
    attn: Attention,
    mlp: Mlp,
    #[config]
    dropout: f32,
}

#[megatron::module]
impl ParallelBlock {
    fn forward(&self, x: Tensor) -> Tensor {
        let n = self.ln(x);
        let h = x + dropout(self.attn(n), self.dropout);
        h + dropout(self.mlp(n), self.dropout)
    }
}

/// The language model: vocabulary-parallel embedding tied to the output layer, the blocks, a
/// final norm and the fused vocabulary-parallel cross-entropy.
#[megatron::module]
pub struct ParallelLm {
    #[vocab_parallel]
    wte: Embedding,
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

impl LanguageModel for ParallelLm {
    fn losses(&self, cx: &Cx, tokens: &Ids, targets: &Ids) -> Result<(Tensor, ParallelLmSaved)> {
        self.forward(cx, Site::ROOT, tokens, targets)
    }

    fn backward_losses(&self, cx: &Cx, saved: ParallelLmSaved, dlosses: &Tensor) -> Result<()> {
        self.backward(cx, Site::ROOT, saved, dlosses)?;
        Ok(())
    }
}

const HIDDEN: usize = 128;
const HEADS: usize = 4;
const LAYERS: usize = 2;
/// Bytes: the built-in corpus is megatron-rs's own sources, read as bytes.
const VOCAB: usize = 256;
const STEPS: u64 = 300;
const SEED: u64 = 1234;

fn spec() -> ParallelLmSpec {
    let block = ParallelBlockSpec {
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
        dropout: 0.1,
    };
    ParallelLmSpec {
        wte: EmbeddingSpec::new(VOCAB, HIDDEN),
        blocks: vec![block; LAYERS],
        ln_f: LayerNormSpec::new(HIDDEN),
    }
}

/// Trains on `tp × dp` thread ranks; returns every step's loss and the seconds taken.
fn train(tp: usize, dp: usize) -> Result<(Vec<f64>, f64)> {
    let layout = ParallelLayout::new(&ParallelConfig::new(tp * dp).with_tp(tp))?;
    let plan = BatchPlan {
        seq_length: 64,
        micro_batch: 4,
        global_batch: 16,
        dp,
    };
    let corpus = TokenStream::from_bytes(megatron::data::default_corpus());
    let data = Sampler::windows(corpus, plan, SEED)?;
    let config = TrainConfig {
        schedule: LrSchedule {
            max_lr: 2e-3,
            min_lr: 2e-4,
            warmup_steps: 10,
            decay_steps: STEPS,
            style: DecayStyle::Cosine,
        },
        adam: AdamWConfig::default(),
        clip_grad: 1.0,
        seed: SEED,
        bucket_elements: 1 << 20,
        distributed_optimizer: false,
        recompute: megatron::module::Recompute::Off,
        precision: megatron::optimizer::Precision::FP32,
        check_for_nan: true,
    };
    let start = Instant::now();
    let per_rank = launch(tp * dp, |world| -> Result<Vec<f64>> {
        let parallel = ParallelState::new(&world, &layout)?;
        let model = ParallelLm::build(&spec(), &mut Builder::for_rank(SEED, parallel.groups()))?;
        let mut trainer = Trainer::new(model, &parallel, data.clone(), config)?;
        (0..STEPS)
            .map(|step| Ok(trainer.step(&parallel, step)?.loss))
            .collect()
    })
    .map_err(|e| Error::Invalid(e.to_string()))?;
    let losses = per_rank.into_iter().next().unwrap_or_default();
    Ok((losses, start.elapsed().as_secs_f64()))
}

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    println!(
        "a {LAYERS}-layer parallel-block decoder (hidden {HIDDEN}, {HEADS} heads, no position \
         embedding) on megatron-rs's sources as bytes"
    );
    let (parallel, seconds) = train(2, 2)?;
    println!("TP=2 × DP=2 on 4 thread ranks: {STEPS} steps in {seconds:.1} s");
    let (single, seconds) = train(1, 1)?;
    println!("TP=1 × DP=1 on 1 rank:         {STEPS} steps in {seconds:.1} s");
    println!("\n step   loss (TP=2 × DP=2)   loss (TP=1)");
    for step in (0..STEPS as usize).step_by(30).chain([STEPS as usize - 1]) {
        println!(
            "{step:>5}   {:>18.4}   {:>11.4}",
            parallel[step], single[step]
        );
    }
    // The parallel run reproduces the single-rank run (the same initial weights, data and dropout
    // masks whatever the layout), up to the order of f32 sums, which compounds over training.
    let first = (parallel[0] - single[0]).abs();
    let worst = parallel
        .iter()
        .zip(&single)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    println!("\nfirst step differs by {first:.1e}, the worst of {STEPS} steps by {worst:.1e}");
    if first > 1e-6 || worst > 1e-4 {
        return Err(format!("TP=2 × DP=2 does not reproduce TP=1: {first:e}, {worst:e}").into());
    }
    let (from, to) = (parallel[0], parallel[parallel.len() - 1]);
    if to > from - 1.0 {
        return Err(format!("the loss did not fall: {from:.3} → {to:.3}").into());
    }
    println!("the loss fell from {from:.3} to {to:.3}");
    Ok(())
}
