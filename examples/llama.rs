//! A Llama written with the DSL, trained on tensor parallelism 2 × pipeline parallelism 2, on
//! tensor parallelism 2 × context parallelism 2 (four thread ranks each; each context-parallel
//! rank holds two chunks of every sequence) and on one rank, to show that the parallel runs
//! compute the same thing.
//!
//! The model is Llama's decoder as its paper and Hugging Face's `LlamaForCausalLM` lay it out:
//! RMSNorm before attention and before the MLP, grouped-query attention with rotary position
//! embeddings, a SwiGLU MLP, no biases, and an output layer of its own. The blocks come from
//! megatron-core (`LayerNorm` with `Normalization::RmsNorm`, `CausalSelfAttention` with
//! `Rotary` and query groups, the `swiglu` builtin over a gated column-parallel layer, an untied
//! `Embedding`); the field attributes are the whole parallel plan, `#[pipeline]` cuts the stack
//! of layers into stages.
//!
//! ```sh
//! cargo run --release --example llama
//! ```

use std::time::Instant;

use megatron::comm::ParallelState;
use megatron::comm::threads::launch;
use megatron::optimizer::AdamWConfig;
use megatron::parallel::{ParallelConfig, ParallelLayout};
use megatron::pipeline_parallel::PipelineLayout;
use megatron::prelude::*;
use megatron::tensor_parallel::{Normalization, Rotary};
use megatron::training::{
    BatchPlan, CarriedWidth, DecayStyle, LrSchedule, Sampler, TokenStream, TrainConfig, Trainer,
};

/// Grouped-query attention with rotary embeddings: the fused QKV projection per query group,
/// column-parallel (each rank whole groups), the output projection row-parallel.
#[megatron::module]
pub struct LlamaAttention {
    #[column_parallel]
    qkv: Linear,
    /// The one field context parallelism changes: on a rank's chunks of the sequence, keys
    /// and values exchanged over the context-parallel group.
    #[context_parallel]
    core: CausalSelfAttention,
    #[row_parallel]
    o_proj: Linear,
}

#[megatron::module]
impl LlamaAttention {
    fn forward(&self, x: Tensor) -> Tensor {
        self.o_proj(self.core(self.qkv(x)))
    }
}

/// The SwiGLU MLP: the gate's and the up projection's rows in one gated column-parallel layer.
#[megatron::module]
pub struct LlamaMlp {
    #[column_parallel]
    gate_up: Linear,
    #[row_parallel]
    down: Linear,
}

#[megatron::module]
impl LlamaMlp {
    fn forward(&self, x: Tensor) -> Tensor {
        self.down(swiglu(self.gate_up(x)))
    }
}

/// A decoder layer: pre-norm attention and MLP, each added to the residual stream.
#[megatron::module]
pub struct LlamaLayer {
    input_norm: LayerNorm,
    attn: LlamaAttention,
    post_attention_norm: LayerNorm,
    mlp: LlamaMlp,
}

#[megatron::module]
impl LlamaLayer {
    fn forward(&self, x: Tensor) -> Tensor {
        let h = x + self.attn(self.input_norm(x));
        h + self.mlp(self.post_attention_norm(h))
    }
}

/// The language model: a vocabulary-parallel embedding with an output table of its own, the
/// layers (cut into pipeline stages), the final norm and the fused cross-entropy.
#[megatron::module]
pub struct Llama {
    #[vocab_parallel]
    embed: Embedding,
    #[pipeline]
    layers: Vec<LlamaLayer>,
    norm: LayerNorm,
}

#[megatron::module]
impl Llama {
    fn forward(&self, tokens: Ids, targets: Ids) -> Tensor {
        let mut h = self.embed(tokens);
        for layer in &self.layers {
            h = layer(h);
        }
        let h = self.norm(h);
        cross_entropy(self.embed.logits(h), targets)
    }
}

impl CarriedWidth for Llama {
    fn carried_width(&self) -> usize {
        self.norm.hidden()
    }
}

const HIDDEN: usize = 128;
const HEADS: usize = 4;
const GROUPS: usize = 2;
const FFN: usize = 320;
const LAYERS: usize = 4;
/// Bytes: the examples' frozen corpus (examples/data) is read as bytes.
const VOCAB: usize = 256;
const STEPS: u64 = 40;
const SEED: u64 = 1234;

fn spec() -> LlamaSpec {
    let head_dim = HIDDEN / HEADS;
    let norm = LayerNormSpec::new(HIDDEN).with_kind(Normalization::RmsNorm);
    let linear = |i: usize, o: usize| LinearSpec::new(i, o).with_bias(false);
    let layer = LlamaLayerSpec {
        input_norm: norm.clone(),
        attn: LlamaAttentionSpec {
            qkv: linear(HIDDEN, (HEADS + 2 * GROUPS) * head_dim),
            core: CausalSelfAttention::new(HEADS, 0.0)
                .with_query_groups(GROUPS)
                .with_rotary(Some(Rotary::default())),
            o_proj: linear(HEADS * head_dim, HIDDEN),
        },
        post_attention_norm: norm.clone(),
        mlp: LlamaMlpSpec {
            gate_up: linear(HIDDEN, 2 * FFN).gated(),
            down: linear(FFN, HIDDEN),
        },
    };
    LlamaSpec {
        embed: EmbeddingSpec {
            untied: true,
            ..EmbeddingSpec::new(VOCAB, HIDDEN)
        },
        layers: vec![layer; LAYERS],
        norm,
    }
}

/// Trains on `tp × cp × pp` thread ranks (context parallelism: each rank two chunks of every
/// sequence); returns every step's loss and the seconds taken.
fn train(tp: usize, cp: usize, pp: usize) -> Result<(Vec<f64>, f64)> {
    let world = tp * cp * pp;
    let layout = ParallelLayout::new(
        &ParallelConfig::new(world)
            .with_tp(tp)
            .with_cp(cp)
            .with_pp(pp),
    )?;
    let stages = PipelineLayout::new(LAYERS, pp, 1, None, None)
        .map_err(|e| Error::Invalid(e.to_string()))?;
    let plan = BatchPlan {
        seq_length: 64,
        micro_batch: 2,
        global_batch: 16,
        dp: 1,
    };
    let corpus = TokenStream::from_bytes(include_bytes!("data/corpus.txt"));
    let data = Sampler::windows(corpus, plan, SEED)?;
    let config = TrainConfig {
        schedule: LrSchedule {
            max_lr: 1e-3,
            min_lr: 1e-4,
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
        let parallel = ParallelState::new(&world, &layout)?;
        let stage = stages.part(parallel.pp().index(), 0);
        let builder = Builder::for_rank(SEED, parallel.groups()).with_stage(stage);
        let model = Llama::build(&spec(), &mut builder.clone())?;
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
        "a {LAYERS}-layer Llama (hidden {HIDDEN}, {HEADS} heads in {GROUPS} key/value groups, \
         SwiGLU {FFN}, RMSNorm, RoPE, untied) on the examples' corpus (the guide and the model sources) as bytes"
    );
    let (parallel, seconds) = train(2, 1, 2)?;
    println!("TP=2 × PP=2 on 4 thread ranks: {STEPS} steps in {seconds:.1} s");
    let (context, seconds) = train(2, 2, 1)?;
    println!("TP=2 × CP=2 on 4 thread ranks: {STEPS} steps in {seconds:.1} s");
    let (single, seconds) = train(1, 1, 1)?;
    println!("TP=1 × PP=1 on 1 rank:         {STEPS} steps in {seconds:.1} s");
    println!("\n step   loss (TP=2 × PP=2)   loss (TP=2 × CP=2)   loss (one rank)");
    for step in (0..STEPS as usize).step_by(10).chain([STEPS as usize - 1]) {
        println!(
            "{step:>5}   {:>18.4}   {:>18.4}   {:>15.4}",
            parallel[step], context[step], single[step]
        );
    }
    // Layout-invariant initial weights and data: the runs differ only by the order of f32 sums
    // (tensor parallelism's partial products, the gradient norm over stages), which compounds.
    let first = (parallel[0] - single[0]).abs();
    let worst = parallel
        .iter()
        .zip(&single)
        .map(|(a, b)| (a - b).abs() / b)
        .fold(0.0, f64::max);
    println!(
        "\nfirst step differs by {first:.1e}, the worst of {STEPS} steps by {worst:.1e} (relative)"
    );
    if parallel.len() != STEPS as usize || first > 1e-5 || worst > 1e-3 {
        return Err(
            format!("TP=2 × PP=2 does not reproduce one rank: {first:e}, {worst:e}").into(),
        );
    }
    // Context parallelism: attention over gathered keys, the gradients over dp × cp.
    let cp_worst = context
        .iter()
        .zip(&single)
        .map(|(a, b)| (a - b).abs() / b)
        .fold(0.0, f64::max);
    println!("TP=2 × CP=2: the worst of {STEPS} steps differs by {cp_worst:.1e} (relative)");
    if context.len() != STEPS as usize || (context[0] - single[0]).abs() > 1e-5 || cp_worst > 1e-3 {
        return Err(format!("TP=2 × CP=2 does not reproduce one rank: {cp_worst:e}").into());
    }
    let (from, to) = (parallel[0], parallel[parallel.len() - 1]);
    if to > from - 1.0 {
        return Err(format!("the loss did not fall: {from:.3} → {to:.3}").into());
    }
    println!("the loss fell from {from:.3} to {to:.3}");
    Ok(())
}
