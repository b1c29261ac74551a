//! `megatron bench generate`: greedy generation's speed from a checkpoint with the KV cache, the
//! prefill of the prompt and the new tokens a second after it, so that it can stand next to
//! transformers' `generate` on the same weights (`tools/bench/hf_generate.py`).
//!
//! Two runs of the same prompt: one new token, then `new_tokens`; both load the checkpoint and
//! read the prompt, so their difference is the time of the `new_tokens − 1` decoding steps
//! alone. The greedy tokens are reported too: the same weights give transformers' tokens.

use std::path::Path;
use std::time::Instant;

use anyhow::{Result, bail};

use crate::generate::{Sampling, generate};

/// What a generation benchmark measured.
#[derive(Debug, Clone, serde::Serialize)]
pub struct GenerateReport {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// New tokens of the long run.
    pub new_tokens: usize,
    /// Tensor-parallel thread ranks.
    pub tp: usize,
    /// Compute threads of the kernels.
    pub threads: usize,
    /// Seconds of the run with one new token (loading, the prefill, one token).
    pub first_token_s: f64,
    /// New tokens per second after the first (decoding steps with the cache).
    pub decode_tokens_per_s: f64,
    /// The greedy continuation.
    pub tokens: Vec<u32>,
}

impl std::fmt::Display for GenerateReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "greedy generation, {} prompt tokens, {} new, tp {}, {} threads",
            self.prompt_tokens, self.new_tokens, self.tp, self.threads
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
    tp: usize,
    prompt_tokens: usize,
    new_tokens: usize,
    threads: usize,
) -> Result<GenerateReport> {
    if new_tokens < 2 {
        bail!("--new-tokens must be at least 2 (the rate is of the tokens after the first)");
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
    let timed = |n: usize| -> Result<(f64, Vec<u32>)> {
        let start = Instant::now();
        let tokens = generate(ckpt, tp, &prompt, n, greedy, None)?;
        Ok((start.elapsed().as_secs_f64(), tokens))
    };
    // A warm-up run (the page cache, the compute pool), then the two timed ones.
    timed(1)?;
    let (first, _) = timed(1)?;
    let (all, tokens) = timed(new_tokens)?;
    Ok(GenerateReport {
        prompt_tokens,
        new_tokens,
        tp,
        threads,
        first_token_s: first,
        decode_tokens_per_s: (new_tokens - 1) as f64 / (all - first).max(1e-9),
        tokens,
    })
}
