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

use std::time::Instant;

use megatron::comm::ParallelState;
use megatron::comm::threads::launch;
use megatron::models::gpt::{Attention, AttentionSpec};
use megatron::optimizer::AdamWConfig;
use megatron::parallel::{ParallelConfig, ParallelLayout};
use megatron::pipeline_parallel::PipelineLayout;
use megatron::prelude::*;
use megatron::training::{
    BatchPlan, CarriedWidth, DecayStyle, LrSchedule, Sampler, TokenStream, TrainConfig, Trainer,
};

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
/// Bytes: the built-in corpus is megatron-rs's own sources, read as bytes.
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

/// Trains on `tp × pp` thread ranks (with sequence parallelism when `sp`); every step's loss
/// and the seconds taken.
fn train(tp: usize, sp: bool, pp: usize) -> Result<(Vec<f64>, f64)> {
    let world = tp * pp;
    let layout = ParallelLayout::new(&ParallelConfig::new(world).with_tp(tp).with_pp(pp))?;
    let stages = PipelineLayout::new(LAYERS, pp, 1, None, None)
        .map_err(|e| Error::Invalid(e.to_string()))?;
    let plan = BatchPlan {
        seq_length: 64,
        micro_batch: 2,
        global_batch: 8,
        dp: 1,
    };
    let corpus = TokenStream::from_bytes(megatron::data::default_corpus());
    let data = Sampler::windows(corpus, plan, SEED)?;
    let config = TrainConfig {
        schedule: LrSchedule {
            max_lr: 2e-3,
            min_lr: 2e-4,
            warmup_steps: 5,
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
        let parallel = ParallelState::new(&world, &layout)?.with_sequence_parallel(sp);
        let stage = stages.part(parallel.pp().index(), 0);
        let builder = Builder::for_rank(SEED, parallel.groups()).with_stage(stage);
        let model = Relu2Lm::build(&spec(), &mut builder.clone())?;
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
        .find(|(stage, tp_rank, _)| *stage == pp - 1 && *tp_rank == 0)
        .map(|(_, _, l)| l)
        .unwrap_or_default();
    Ok((losses, start.elapsed().as_secs_f64()))
}

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    println!(
        "a {LAYERS}-layer decoder with ReLU² MLPs (hidden {HIDDEN}, {HEADS} heads) on \
         megatron-rs's sources as bytes"
    );
    let mut runs = Vec::new();
    for (name, tp, sp, pp) in [
        ("one rank", 1, false, 1),
        ("TP=2", 2, false, 1),
        ("TP=2 + SP", 2, true, 1),
        ("PP=2", 1, false, 2),
    ] {
        let (losses, seconds) = train(tp, sp, pp)?;
        println!("{name:<10} {STEPS} steps in {seconds:.1} s");
        runs.push((name, losses));
    }
    println!(
        "\n step {}",
        runs.iter()
            .map(|(n, _)| format!("{n:>11}"))
            .collect::<String>()
    );
    for step in (0..STEPS as usize).step_by(10).chain([STEPS as usize - 1]) {
        let row: String = runs
            .iter()
            .map(|(_, l)| format!("{:>11.4}", l[step]))
            .collect();
        println!("{step:>5} {row}");
    }
    // Layout-invariant initial weights and data: the runs differ only by the order of f32 sums
    // (tensor parallelism's partial products, sequence shards, the gradient norm over stages).
    let single = &runs[0].1;
    for (name, losses) in &runs[1..] {
        let first = (losses[0] - single[0]).abs();
        let worst = losses
            .iter()
            .zip(single)
            .map(|(a, b)| (a - b).abs() / b)
            .fold(0.0, f64::max);
        println!("{name}: first step differs by {first:.1e}, the worst by {worst:.1e} (relative)");
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
