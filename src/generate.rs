//! Text generation from a checkpoint: greedy or sampled (temperature, top-k, top-p), with tensor
//! parallelism too. Every rank computes the same logits (gathered over the vocabulary) and draws
//! the same token from the same seed, so the ranks stay in step without communicating choices.
//! A KV cache keeps each attention layer's keys and values: the prompt runs once (the
//! prefill), then each step runs the model on the one new token.

use std::path::Path;

use anyhow::{Context, Result, bail};
use megatron_core::checkpoint::{load_params, open_checkpoint};
use megatron_core::comm::threads::launch;
use megatron_core::comm::{ParallelState, World};
use megatron_core::inference::KvCache;
use megatron_core::module::{Builder, Cx, Module};
use megatron_core::parallel::{ParallelConfig, ParallelLayout};
use megatron_core::rng::splitmix64_mix;
use megatron_core::tensor::{DType, Tensor};
use megatron_models::gpt::Gpt;
use megatron_models::{GptConfig, PositionEmbeddingType};

/// How to pick each next token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// Softmax temperature; 0 picks the most likely token (greedy).
    pub temperature: f64,
    /// Only the `top_k` most likely tokens are candidates (0: all).
    pub top_k: usize,
    /// Nucleus sampling: the most likely tokens while the probability above each is below
    /// `top_p` (transformers' `TopPLogitsWarper`, after temperature and top-k; 1: all).
    pub top_p: f64,
    /// Seed of the draws.
    pub seed: u64,
}

/// What runs the model: its tensor-parallel thread ranks, and its precision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Compute {
    /// Tensor-parallel thread ranks.
    pub tp: usize,
    /// bf16 weights (converted from the checkpoint's values, half the bytes a step reads) and
    /// products of bf16 operands summed in f32, as a `--bf16` run's forward; f32 otherwise.
    pub bf16: bool,
}

impl Compute {
    /// `tp` thread ranks in f32.
    pub fn f32(tp: usize) -> Compute {
        Compute { tp, bf16: false }
    }
}

/// Index of the token to emit from `logits`, drawing with `uniform` in [0, 1).
pub fn pick(logits: &[f32], sampling: &Sampling, uniform: f64) -> usize {
    let argmax = || {
        logits
            .iter()
            .enumerate()
            .fold(0, |best, (i, &l)| if l > logits[best] { i } else { best })
    };
    if sampling.temperature <= 0.0 || logits.is_empty() {
        return argmax();
    }
    let mut order: Vec<usize> = (0..logits.len())
        .filter(|&i| logits[i].is_finite())
        .collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    if sampling.top_k > 0 {
        order.truncate(sampling.top_k);
    }
    let Some(&first) = order.first() else {
        return argmax();
    };
    let max = f64::from(logits[first]);
    let mut weights: Vec<f64> = order
        .iter()
        .map(|&i| ((f64::from(logits[i]) - max) / sampling.temperature).exp())
        .collect();
    if sampling.top_p < 1.0 {
        // Keep a token while the mass of the more likely ones is below top_p (the first always).
        let total: f64 = weights.iter().sum();
        let mut above = 0.0;
        let kept = weights
            .iter()
            .take_while(|w| {
                let keep = above / total < sampling.top_p;
                above += **w;
                keep
            })
            .count()
            .max(1);
        order.truncate(kept);
        weights.truncate(kept);
    }
    let total: f64 = weights.iter().sum();
    let mut target = uniform * total;
    for (&i, w) in order.iter().zip(&weights) {
        if target < *w {
            return i;
        }
        target -= w;
    }
    order[order.len() - 1]
}

/// The most tokens the model of checkpoint `ckpt` holds at once (its positions): the prompt
/// and the new tokens together.
pub fn context_length(ckpt: &Path) -> Result<usize> {
    Ok(checkpoint_config(ckpt)?.max_position_embeddings)
}

/// Bytes of weights one decoding step of checkpoint `ckpt`'s model reads, in f32 (in bf16, half
/// of it): every parameter a token uses (each MoE layer's top-k experts), less the tables it
/// only looks a row up in (the input embedding when untied from the output layer, learned
/// positions).
pub fn weights_read_per_token(ckpt: &Path, bf16: bool) -> Result<u64> {
    let config = checkpoint_config(ckpt)?;
    let hidden = config.hidden_size as u64;
    let mut lookups = 0;
    if config.untie_embeddings_and_output_weights {
        lookups += config.padded_vocab_size(1) as u64 * hidden;
    }
    if config.position_embedding_type == PositionEmbeddingType::LearnedAbsolute {
        lookups += config.max_position_embeddings as u64 * hidden;
    }
    let bytes = if bf16 { 2 } else { 4 };
    Ok((config.active_params(1) as u64).saturating_sub(lookups) * bytes)
}

/// The depths of multi-token prediction the model of checkpoint `ckpt` trained with (0 for
/// none). Generation does not use them, as transformers does not: each token comes from the
/// model's own output layer (no speculative decoding with the depths).
pub fn mtp_depths(ckpt: &Path) -> Result<usize> {
    Ok(checkpoint_config(ckpt)?.mtp_depths())
}

/// The model config checkpoint `ckpt` records.
fn checkpoint_config(ckpt: &Path) -> Result<GptConfig> {
    let meta = megatron_core::checkpoint::read_meta(ckpt)?;
    serde_json::from_value(meta.model).context("the checkpoint's model config")
}

/// Continues `prompt` (token ids) by up to `max_new_tokens` tokens with the model of checkpoint
/// `ckpt` on `tp` thread ranks; stops early at `stop` when given. Returns the new tokens.
pub fn generate(
    ckpt: &Path,
    tp: usize,
    prompt: &[u32],
    max_new_tokens: usize,
    sampling: Sampling,
    stop: Option<u32>,
) -> Result<Vec<u32>> {
    generate_streaming(
        ckpt,
        Compute::f32(tp),
        prompt,
        max_new_tokens,
        sampling,
        stop,
        &|_| Ok(()),
    )
}

/// [`generate`] on `compute`, handing each new token to `on_token` as soon as it is drawn (on
/// one rank, in order; the stop token too): a caller prints text as it is produced, or times
/// each step. An error from `on_token` stops generation with it. The prompt and the new tokens
/// together must fit the model's positions (Megatron-LM's rule): more is refused, naming the
/// numbers.
pub fn generate_streaming(
    ckpt: &Path,
    compute: Compute,
    prompt: &[u32],
    max_new_tokens: usize,
    sampling: Sampling,
    stop: Option<u32>,
    on_token: &(dyn Fn(u32) -> Result<()> + Sync),
) -> Result<Vec<u32>> {
    if prompt.is_empty() {
        bail!("the prompt has no tokens");
    }
    if !(sampling.top_p > 0.0 && sampling.top_p <= 1.0) {
        bail!("top-p must be in (0, 1], got {}", sampling.top_p);
    }
    if !sampling.temperature.is_finite() || sampling.temperature < 0.0 {
        bail!(
            "the temperature must be a finite number ≥ 0 (0 is greedy), got {}",
            sampling.temperature
        );
    }
    let tp = compute.tp;
    let meta = megatron_core::checkpoint::read_meta(ckpt)?;
    let config: GptConfig =
        serde_json::from_value(meta.model).context("the checkpoint's model config")?;
    config.validate(tp)?;
    let positions = config.max_position_embeddings;
    if prompt.len().saturating_add(max_new_tokens) > positions {
        bail!(
            "the prompt's {} tokens and {max_new_tokens} new ones are more than the model's \
             {positions} positions (--max-position-embeddings), which hold them together",
            prompt.len()
        );
    }
    if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= config.vocab_size) {
        bail!(
            "prompt token {bad} is outside the model's vocabulary of {}",
            config.vocab_size
        );
    }
    let layout = ParallelLayout::new(&ParallelConfig::new(tp).with_tp(tp))?;
    let spec = config.spec();
    let out = launch(tp, |w| -> Result<Vec<u32>> {
        let ps = ParallelState::new(&w, &layout)?;
        let mut model = Gpt::build(
            &spec,
            &mut config.adapters(Builder::for_rank(0, ps.groups()).meta()),
        )?;
        load_params(&model, &open_checkpoint(&ps, ckpt)?)?;
        let _products = megatron_core::ops::cpu_bf16_products(compute.bf16);
        if compute.bf16 {
            in_bf16(&mut model)?;
        }
        let cx = Cx::new(&ps, sampling.seed).eval();
        let cache = KvCache::new();
        let decode = cx.with_kv_cache(&cache);
        let mut feed: Vec<u32> = prompt.to_vec();
        let mut new = Vec::new();
        for n in 0..max_new_tokens {
            let ids = Tensor::from_vec(
                feed.iter().map(|&t| i64::from(t)).collect::<Vec<_>>(),
                [feed.len(), 1],
            )?;
            let logits = logits(&model, &decode, &ids)?.to_vec::<f32>()?;
            cache.advance(feed.len());
            let last = &logits[logits.len() - config.vocab_size..];
            let draw = splitmix64_mix(sampling.seed ^ splitmix64_mix(n as u64 + 1));
            let uniform = (draw >> 11) as f64 / (1u64 << 53) as f64;
            let next = pick(last, &sampling, uniform) as u32;
            new.push(next);
            if w.rank() == 0 {
                on_token(next)?;
            }
            feed = vec![next];
            if Some(next) == stop {
                break;
            }
        }
        Ok(new)
    })
    .map_err(anyhow::Error::msg)?;
    Ok(out.into_iter().next().unwrap_or_default())
}

/// Every parameter of `model` frozen (generation computes no gradient) and its values replaced
/// by their bf16 rounding (to nearest, ties to even).
fn in_bf16(model: &mut Gpt) -> megatron_core::Result<()> {
    let mut failure = None;
    model.visit_params_mut(&mut |p| {
        if failure.is_none() {
            p.freeze();
            failure = match p.value().to_dtype(DType::BF16) {
                Ok(v) => p.rebind_frozen(v).err(),
                Err(e) => Some(e.into()),
            };
        }
    });
    failure.map_or(Ok(()), Err)
}

/// Logits over the real vocabulary, `[s, b, vocab]` on every rank, for token ids `[s, b]`: the
/// model's own forward (with the tokens as its targets; the losses are not read), whose
/// vocab-parallel cross-entropy keeps this rank's slice of the logits, gathered over tensor
/// parallelism. Run it with an evaluation context (`cx.eval()`) to turn dropout off, or a
/// decoding one (`cx.with_kv_cache`) for the positions after the cached ones.
pub fn logits(model: &Gpt, cx: &Cx, tokens: &Tensor) -> megatron_core::Result<Tensor> {
    let (_, saved) = model.forward(cx, megatron_core::module::Site::ROOT, tokens, tokens)?;
    let whole = megatron_core::tensor_parallel::gather_last_dim(cx, saved.cross_entropy.logits())?;
    let last = whole.dims().len() - 1;
    Ok(whole
        .narrow(last, 0, model.wte.vocab_size())?
        .contiguous()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// transformers' rule: with probabilities 0.5, 0.3, 0.15, 0.05, top-p 0.8 keeps the first
    /// two (0.5 above the second is below 0.8, 0.8 above the third is not), top-p 0.81 three.
    #[test]
    fn top_p_keeps_tokens_while_the_mass_above_is_below_p() {
        let logits: Vec<f32> = [0.5f32, 0.3, 0.15, 0.05].iter().map(|p| p.ln()).collect();
        let with = |top_p: f64| Sampling {
            temperature: 1.0,
            top_k: 0,
            top_p,
            seed: 0,
        };
        let reach = |top_p: f64| {
            (0..1000)
                .map(|i| pick(&logits, &with(top_p), (i as f64 + 0.5) / 1000.0))
                .max()
                .unwrap()
        };
        assert_eq!(reach(0.8), 1);
        assert_eq!(reach(0.81), 2);
        assert_eq!(reach(0.3), 0);
        assert_eq!(reach(1.0), 3);
    }

    #[test]
    fn greedy_and_top_k_sampling() {
        let logits = [0.0, 3.0, 1.0, 3.0, f32::NEG_INFINITY];
        let greedy = Sampling {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        };
        assert_eq!(pick(&logits, &greedy, 0.9), 1, "the first maximum");
        let top1 = Sampling {
            temperature: 1.0,
            top_k: 1,
            top_p: 1.0,
            seed: 0,
        };
        assert!((0..10).all(|i| pick(&logits, &top1, f64::from(i) / 10.0) == 1));
        let top2 = Sampling {
            temperature: 1.0,
            top_k: 2,
            top_p: 1.0,
            seed: 0,
        };
        assert_eq!(pick(&logits, &top2, 0.25), 1);
        assert_eq!(pick(&logits, &top2, 0.75), 3);
        let all = Sampling {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        };
        // Never the −∞ (padding) token; the small ones are reachable.
        let picks: Vec<usize> = (0..1000)
            .map(|i| pick(&logits, &all, f64::from(i) / 1000.0))
            .collect();
        assert!(!picks.contains(&4) && picks.contains(&0) && picks.contains(&2));
    }
}
