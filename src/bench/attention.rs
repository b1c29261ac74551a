//! `megatron bench attention`: the time of one causal self-attention layer (the op between the
//! QKV and output projections), forward and forward + backward, with dropout, in each way this
//! build can run it: the CPU kernels, and on a GPU the unfused kernels (batched cuBLAS products
//! with fused softmax/dropout kernels, bf16) and the flash kernels, from bf16 inputs as the
//! model's layers hand them over; with `--documents N`, a sequence of N packed documents each
//! attended alone (the work is the documents' squares, not the sequence's). Without dropout, the general attention too
//! (`ops::DotProductAttention` over queries, keys and values given apart, which packs them per
//! head as the fused projection and runs the same kernels): the price of the packing. Throughput
//! counts the
//! products a causal layer needs (half the `s × s` ones, FlashAttention's convention: 4·b·h·s²·d
//! FLOPs forward ×½, backward 2.5× the forward).

use std::time::Instant;

use anyhow::{Result, bail};
use megatron_core::comm::ParallelState;
use megatron_core::documents::Documents;
use megatron_core::module::{Cx, MultiOp, Op, Site};
use megatron_core::ops::{DotProductAttention, ShapeOp, shape};
use megatron_core::tensor::Tensor;
use megatron_core::tensor_parallel::CausalSelfAttention;

/// The layer's sizes and the measurement's settings.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct AttentionBench {
    /// Sequence length.
    pub seq: usize,
    /// Batch entries.
    pub batch: usize,
    /// Heads.
    pub heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Attention dropout.
    pub dropout: f32,
    /// Packed documents per sequence, attended apart (equal lengths, the last taking the
    /// rest; 1: one document).
    pub documents: usize,
    /// Timed runs (the median is reported).
    pub repeats: usize,
}

impl AttentionBench {
    /// Causal forward FLOPs: q·kᵀ and p·v over the visible half of each document's
    /// `L × L` weights.
    pub fn forward_flops(&self) -> f64 {
        let squares: f64 = self.lengths().iter().map(|&l| (l * l) as f64).sum();
        2.0 * (self.batch * self.heads * self.head_dim) as f64 * squares
    }

    /// The documents' lengths.
    pub fn lengths(&self) -> Vec<usize> {
        let n = self.documents.clamp(1, self.seq.max(1));
        let each = self.seq / n;
        (0..n)
            .map(|i| {
                if i + 1 == n {
                    self.seq - each * (n - 1)
                } else {
                    each
                }
            })
            .collect()
    }

    /// The documents as the model's context carries them (`None` for one).
    pub(crate) fn packed(&self) -> Result<Option<Documents>> {
        let lengths = self.lengths();
        if lengths.len() < 2 {
            return Ok(None);
        }
        let starts: Vec<usize> = lengths
            .iter()
            .scan(0, |at, &l| {
                *at += l;
                Some(*at)
            })
            .take(lengths.len() - 1)
            .collect();
        Ok(Some(Documents::from_starts(
            self.seq,
            vec![starts; self.batch],
            true,
            true,
        )?))
    }

    pub(crate) fn check(&self) -> Result<()> {
        if self.seq == 0 || self.batch == 0 || self.heads == 0 || self.head_dim == 0 {
            bail!(
                "attention sizes must be at least 1: seq {}, batch {}, heads {}, head dim {}",
                self.seq,
                self.batch,
                self.heads,
                self.head_dim
            );
        }
        if !(0.0..1.0).contains(&self.dropout) {
            bail!("--dropout must be in [0, 1), got {}", self.dropout);
        }
        if self.documents == 0 || self.documents > self.seq {
            bail!(
                "--documents {}: a sequence of {} positions holds 1 to {} documents",
                self.documents,
                self.seq,
                self.seq
            );
        }
        Ok(())
    }
}

/// One way of running the layer, measured.
#[derive(Debug, Clone, serde::Serialize)]
pub struct AttentionResult {
    /// `cpu`, `cuda unfused` or `cuda flash`; `general` after it for `DotProductAttention`.
    pub backend: String,
    /// Median forward time, milliseconds.
    pub forward_ms: f64,
    /// Median forward + backward time, milliseconds.
    pub forward_backward_ms: f64,
    /// Forward TFLOP/s (causal FLOPs).
    pub forward_tflops: f64,
    /// Forward + backward TFLOP/s (causal FLOPs, backward 2.5× the forward).
    pub forward_backward_tflops: f64,
}

/// The whole report.
#[derive(Debug, Clone, serde::Serialize)]
pub struct AttentionReport {
    /// The settings.
    pub bench: AttentionBench,
    /// Where it ran (the GPU's name, or `CPU`).
    pub device: String,
    /// One entry per way of running it.
    pub results: Vec<AttentionResult>,
}

/// Deterministic values in [−1, 1).
fn values(n: usize, mut s: u64) -> Vec<f32> {
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// The layer's inputs on the host: the fused projection and the output gradient.
pub(crate) fn inputs(b: &AttentionBench) -> Result<(Tensor, Tensor)> {
    let (s, n, h, d) = (b.seq, b.batch, b.heads, b.head_dim);
    let qkv = Tensor::from_vec(values(s * n * h * 3 * d, 1), [s, n, h * 3 * d])?;
    let dy = Tensor::from_vec(values(s * n * h * d, 2), [s, n, h * d])?;
    Ok((qkv, dy))
}

/// Median seconds of `run` over `repeats` timed runs after one warm-up; `sync` waits for the
/// device.
fn median(
    repeats: usize,
    sync: &dyn Fn() -> Result<()>,
    run: &dyn Fn() -> Result<()>,
) -> Result<f64> {
    let mut times = Vec::new();
    for round in 0..=repeats.max(1) {
        sync()?;
        let start = Instant::now();
        run()?;
        sync()?;
        if round > 0 {
            times.push(start.elapsed().as_secs_f64());
        }
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// Times the layer on `qkv`/`dy` (host or device tensors); without dropout, the general
/// attention on the same queries, keys and values given apart, after it.
pub(crate) fn measure(
    b: &AttentionBench,
    backend: &str,
    (qkv, dy): (&Tensor, &Tensor),
    sync: &dyn Fn() -> Result<()>,
) -> Result<Vec<AttentionResult>> {
    let ps = ParallelState::solo();
    let packed = b.packed()?;
    let cx = Cx::new(&ps, 1234).at(1, 0);
    let cx = match &packed {
        Some(docs) => cx.with_documents(docs),
        None => cx,
    };
    let op = CausalSelfAttention::new(b.heads, b.dropout);
    let site = Site::ROOT.child("attention");
    let result = |name: String, forward: f64, both: f64| {
        let flops = b.forward_flops();
        AttentionResult {
            backend: name,
            forward_ms: 1e3 * forward,
            forward_backward_ms: 1e3 * both,
            forward_tflops: flops / forward / 1e12,
            forward_backward_tflops: 3.5 * flops / both / 1e12,
        }
    };
    let forward = median(b.repeats, sync, &|| {
        op.forward(&cx, site, qkv)?;
        Ok(())
    })?;
    let both = median(b.repeats, sync, &|| {
        let (_, saved) = op.forward(&cx, site, qkv)?;
        op.backward(&cx, site, saved, dy)?;
        Ok(())
    })?;
    let mut results = vec![result(backend.to_string(), forward, both)];
    if b.dropout == 0.0 {
        // The queries, keys and values apart, contiguous and in the projection's dtype, as
        // three projections would hand them over.
        let d = b.head_dim;
        let part = |k| -> Result<Tensor> {
            let op = ShapeOp::HeadPart {
                sizes: vec![d, d, d],
                part: k,
            };
            Ok(shape(&cx, site, op, &[qkv])?.0.to_contiguous(qkv.dtype())?)
        };
        let (q, k, v) = (part(0)?, part(1)?, part(2)?);
        let general = DotProductAttention::new(d);
        let forward = median(b.repeats, sync, &|| {
            general.forward(&cx, site, &[&q, &k, &v])?;
            Ok(())
        })?;
        let both = median(b.repeats, sync, &|| {
            let (_, saved) = general.forward(&cx, site, &[&q, &k, &v])?;
            general.backward(&cx, site, saved, dy)?;
            Ok(())
        })?;
        results.push(result(format!("{backend} general"), forward, both));
    }
    Ok(results)
}

/// Measures the layer on the CPU.
pub fn run_cpu(b: AttentionBench) -> Result<AttentionReport> {
    b.check()?;
    let (qkv, dy) = inputs(&b)?;
    let results = measure(&b, "cpu", (&qkv, &dy), &|| Ok(()))?;
    Ok(AttentionReport {
        bench: b,
        device: "CPU".to_string(),
        results,
    })
}

impl std::fmt::Display for AttentionReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let b = &self.bench;
        let documents = match b.documents {
            1 => String::new(),
            n => format!(" in {n} documents attended apart"),
        };
        writeln!(
            f,
            "causal self-attention, seq {} × batch {} × {} heads of {}{documents}, dropout {}, on {}:",
            b.seq, b.batch, b.heads, b.head_dim, b.dropout, self.device
        )?;
        for r in &self.results {
            writeln!(
                f,
                "  {:<21} forward {:>9.3} ms {:>8.2} TFLOP/s   forward+backward {:>9.3} ms {:>8.2} TFLOP/s",
                r.backend,
                r.forward_ms,
                r.forward_tflops,
                r.forward_backward_ms,
                r.forward_backward_tflops
            )?;
        }
        Ok(())
    }
}
