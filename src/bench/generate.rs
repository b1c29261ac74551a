//! `megatron bench generate`: greedy generation's speed from a checkpoint with the KV cache, the
//! prefill of the prompt and the new tokens a second after it, so that it can stand next to
//! transformers' `generate` on the same weights (`tools/bench/hf_generate.py`).
//!
//! One timed run after a warm-up: each new token's time is taken as it is drawn, so the
//! `new_tokens − 1` decoding steps are timed directly, from the first token to the last; the
//! first token's time includes loading the checkpoint and the prefill. The greedy tokens are
//! reported too: the same weights give transformers' tokens.

use std::path::Path;
use std::time::Instant;

use anyhow::{Result, bail};

use std::sync::Mutex;

use crate::generate::{
    Compute, Sampling, context_length, generate_streaming, weights_read_per_token,
};

/// What a generation benchmark measured.
#[derive(Debug, Clone, serde::Serialize)]
pub struct GenerateReport {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// New tokens of the long run.
    pub new_tokens: usize,
    /// Tensor-parallel thread ranks.
    pub tp: usize,
    /// Whether the weights and products were bf16 (`--bf16`).
    pub bf16: bool,
    /// Compute threads of the kernels.
    pub threads: usize,
    /// Seconds of the run with one new token (loading, the prefill, one token).
    pub first_token_s: f64,
    /// New tokens per second after the first (decoding steps with the cache).
    pub decode_tokens_per_s: f64,
    /// Bytes of weights a decoding step reads (every product's weight once; f32, or bf16 with
    /// `--bf16`).
    pub weight_bytes_per_token: u64,
    /// The weights read per second while decoding, GB/s.
    pub weights_gbs: f64,
    /// The memory's read bandwidth on the same threads, GB/s (a read pass over 256 MiB).
    pub memory_gbs: f64,
    /// The greedy continuation.
    pub tokens: Vec<u32>,
}

impl std::fmt::Display for GenerateReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "greedy generation, {} prompt tokens, {} new, tp {}, {} threads, {} weights",
            self.prompt_tokens,
            self.new_tokens,
            self.tp,
            self.threads,
            if self.bf16 { "bf16" } else { "f32" }
        )?;
        writeln!(
            f,
            "  load + prefill + first token  {:.3} s",
            self.first_token_s
        )?;
        writeln!(
            f,
            "  decoding with the KV cache    {:.1} new tokens/s",
            self.decode_tokens_per_s
        )?;
        writeln!(
            f,
            "  weights read                  {:.1} MB a token: {:.1} GB/s, {:.0}% of the memory's \
             {:.1} GB/s (a read pass on the same threads)",
            self.weight_bytes_per_token as f64 / 1e6,
            self.weights_gbs,
            100.0 * self.weights_gbs / self.memory_gbs,
            self.memory_gbs
        )?;
        write!(f, "  tokens {:?}", self.tokens)
    }
}

/// The benchmark's prompt: `n` token ids spread over the vocabulary, deterministic.
pub fn prompt(n: usize, vocab: usize) -> Vec<u32> {
    (0..n)
        .map(|i| ((i * 7919 + 13) % vocab.max(1)) as u32)
        .collect()
}

/// Times greedy generation from checkpoint `ckpt` (see the module's documentation).
pub fn run(
    ckpt: &Path,
    compute: Compute,
    prompt_tokens: usize,
    new_tokens: usize,
    threads: usize,
) -> Result<GenerateReport> {
    if new_tokens < 2 {
        bail!("--new-tokens must be at least 2 (the rate is of the tokens after the first)");
    }
    let context = context_length(ckpt)?;
    if prompt_tokens.saturating_add(new_tokens) > context {
        bail!(
            "--prompt-tokens {prompt_tokens} and --new-tokens {new_tokens} are more than the \
             model's {context} positions (its --max-position-embeddings), which hold them \
             together"
        );
    }
    let meta = megatron_core::checkpoint::read_meta(ckpt)?;
    let vocab = meta.model["vocab_size"].as_u64().unwrap_or(256) as usize;
    let prompt = prompt(prompt_tokens, vocab);
    let greedy = Sampling {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        seed: 0,
    };
    // A warm-up run (the page cache, the compute pool), then the timed one.
    generate_streaming(ckpt, compute, &prompt, 1, greedy, None, &|_| Ok(()))?;
    let start = Instant::now();
    let times = Mutex::new(Vec::with_capacity(new_tokens));
    let tokens = generate_streaming(ckpt, compute, &prompt, new_tokens, greedy, None, &|_| {
        times
            .lock()
            .map_err(|_| anyhow::anyhow!("the token times"))?
            .push(start.elapsed().as_secs_f64());
        Ok(())
    })?;
    let times = times
        .into_inner()
        .map_err(|_| anyhow::anyhow!("the token times"))?;
    let (first, last) = match (times.first(), times.last()) {
        (Some(&first), Some(&last)) if times.len() == new_tokens => (first, last),
        _ => bail!(
            "generation gave {} tokens of the {new_tokens} asked",
            times.len()
        ),
    };
    let decode_tokens_per_s = (new_tokens - 1) as f64 / (last - first);
    let weight_bytes_per_token = weights_read_per_token(ckpt, compute.bf16)?;
    Ok(GenerateReport {
        prompt_tokens,
        new_tokens,
        tp: compute.tp,
        bf16: compute.bf16,
        threads,
        first_token_s: first,
        decode_tokens_per_s,
        weight_bytes_per_token,
        weights_gbs: weight_bytes_per_token as f64 * decode_tokens_per_s / 1e9,
        memory_gbs: super::machine::read_bandwidth(threads, 5),
        tokens,
    })
}
