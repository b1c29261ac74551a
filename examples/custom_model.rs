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
//! follows the one-rank run.
//!
//! ```sh
//! cargo run --release --example custom_model
//! ```

use std::time::Instant;

use megatron::comm::ParallelState;
use megatron::comm::threads::launch;
use megatron::optimizer::AdamWConfig;
use megatron::parallel::{ParallelConfig, ParallelLayout};
use megatron::pipeline_parallel::PipelineLayout;
use megatron::prelude::*;
use megatron::training::{
    BatchPlan, CarriedWidth, DecayStyle, LrSchedule, Sampler, TokenStream, TrainConfig, Trainer,
};

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

const HIDDEN: usize = 128;
const HEADS: usize = 4;
const LAYERS: usize = 2;
/// Bytes: the built-in corpus is megatron-rs's own sources, read as bytes.
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

/// A layout: tensor, data and pipeline parallel sizes, and sequence parallelism.
#[derive(Clone, Copy)]
struct Layout {
    tp: usize,
    dp: usize,
    pp: usize,
    sp: bool,
}

/// Trains on `tp × dp × pp` thread ranks; returns every step's loss and the seconds taken.
fn train(l: Layout) -> Result<(Vec<f64>, f64)> {
    let world = l.tp * l.dp * l.pp;
    let layout = ParallelLayout::new(&ParallelConfig::new(world).with_tp(l.tp).with_pp(l.pp))?;
    let stages = PipelineLayout::new(LAYERS, l.pp, 1, None, None)
        .map_err(|e| Error::Invalid(e.to_string()))?;
    let plan = BatchPlan {
        seq_length: 64,
        micro_batch: 4,
        global_batch: 16,
        dp: l.dp,
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
    let per_rank = launch(world, |world| -> Result<(usize, usize, Vec<f64>)> {
        let parallel = ParallelState::new(&world, &layout)?.with_sequence_parallel(l.sp);
        let stage = stages.part(parallel.pp().index(), 0);
        let builder = Builder::for_rank(SEED, parallel.groups()).with_stage(stage);
        let model = ParallelLm::build(&spec(), &mut builder.clone())?;
        let mut trainer = Trainer::pipelined(vec![model], &parallel, data.clone(), config, None)?;
        let losses = (0..STEPS)
            .map(|step| Ok(trainer.step(&parallel, step)?.loss))
            .collect::<Result<Vec<f64>>>()?;
        Ok((parallel.pp().index(), parallel.groups().tp_rank(), losses))
    })
    .map_err(|e| Error::Invalid(e.to_string()))?;
    // The loss is known on the last stage.
    let losses = per_rank
        .into_iter()
        .find(|(stage, tp_rank, _)| *stage == l.pp - 1 && *tp_rank == 0)
        .map(|(_, _, l)| l)
        .unwrap_or_default();
    Ok((losses, start.elapsed().as_secs_f64()))
}

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    println!(
        "a {LAYERS}-layer parallel-block decoder (hidden {HIDDEN}, {HEADS} heads, no position \
         embedding) on megatron-rs's sources as bytes"
    );
    let one = Layout {
        tp: 1,
        dp: 1,
        pp: 1,
        sp: false,
    };
    let mut runs = Vec::new();
    for (name, l) in [
        ("one rank", one),
        (
            "TP=2 × DP=2",
            Layout {
                tp: 2,
                dp: 2,
                ..one
            },
        ),
        (
            "TP=2 + SP",
            Layout {
                tp: 2,
                sp: true,
                ..one
            },
        ),
        ("PP=2", Layout { pp: 2, ..one }),
    ] {
        let (losses, seconds) = train(l)?;
        println!("{name:<12} {STEPS} steps in {seconds:.1} s");
        runs.push((name, losses));
    }
    println!(
        "\n step {}",
        runs.iter()
            .map(|(n, _)| format!("{n:>13}"))
            .collect::<String>()
    );
    for step in (0..STEPS as usize).step_by(30).chain([STEPS as usize - 1]) {
        let row: String = runs
            .iter()
            .map(|(_, l)| format!("{:>13.4}", l[step]))
            .collect();
        println!("{step:>5} {row}");
    }
    // Every layout reproduces the single-rank run (the same initial weights, data and dropout
    // masks whatever the layout), up to the order of f32 sums, which compounds over training.
    let single = &runs[0].1;
    for (name, losses) in &runs[1..] {
        let first = (losses[0] - single[0]).abs();
        let worst = losses
            .iter()
            .zip(single)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        println!("{name}: first step differs by {first:.1e}, the worst of {STEPS} by {worst:.1e}");
        if losses.len() != STEPS as usize || first > 1e-5 || worst > 1e-3 {
            return Err(format!("{name} does not reproduce one rank: {first:e}, {worst:e}").into());
        }
    }
    let (from, to) = (single[0], single[single.len() - 1]);
    if to > from - 1.0 {
        return Err(format!("the loss did not fall: {from:.3} → {to:.3}").into());
    }
    println!("the loss fell from {from:.3} to {to:.3}");
    Ok(())
}
