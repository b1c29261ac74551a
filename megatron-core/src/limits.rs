//! The largest sizes megatron-rs accepts. Each bound is far above any machine built or model
//! trained (so no real run meets it) and low enough that every product of sizes the code forms
//! fits a `usize`, and that the describing commands (`schedule`, `layout`, `graphs`, `inspect`,
//! `groups`) answer any size they accept in seconds: a value past a bound is refused, naming
//! it, before anything is allocated.

use thiserror::Error;

/// Ranks of one job, and so any parallel size (tp, pp, dp, cp, ep, etp): 2^20, about a
/// million. The largest clusters built hold a few hundred thousand GPUs.
pub const MAX_RANKS: usize = 1 << 20;

/// Forward passes of one pipeline step over all its stages, pp × vpp × microbatches: 2^18
/// (262,144; 16 stages × 8 chunks × 2,048 microbatches). Megatron-LM's largest published
/// schedules run tens of thousands.
pub const MAX_SCHEDULE_PASSES: usize = 1 << 18;

/// Transformer layers of a model: 2^14 (the largest trained models have about 120).
pub const MAX_LAYERS: usize = 1 << 14;

/// A model dimension (hidden size, MLP width, heads, positions): 2^24 (16,777,216; GPT-3's
/// hidden size is 12,288).
pub const MAX_DIM: usize = 1 << 24;

/// Experts per MoE layer: 2^16 (DeepSeek-V3 has 256).
pub const MAX_EXPERTS: usize = 1 << 16;

/// Tokens of a vocabulary: 2^24 (the largest in use have a few hundred thousand).
pub const MAX_VOCAB: usize = 1 << 24;

/// Parameters of a model: 2^50, about 10^15 (a thousand times the largest models trained).
pub const MAX_PARAMS: usize = 1 << 50;

/// Tokens per sample, samples per microbatch, samples per global batch: 2^30.
pub const MAX_BATCH: usize = 1 << 30;

/// Thread ranks of one process (`--backend threads`): 1,024. More ranks than that run as
/// processes (`--backend mpi`).
pub const MAX_THREAD_RANKS: usize = 1 << 10;

/// The memory this machine has available now, in bytes (`MemAvailable` of `/proc/meminfo`;
/// `None` where it cannot be read).
pub fn available_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib.saturating_mul(1024))
}

/// Refuses work that needs about `bytes` of memory when this machine has less available, so
/// that it stops with a message instead of an allocation failure or the kernel's OOM killer;
/// `what` names the work and the flags that size it.
pub fn check_memory(what: &str, bytes: u128) -> Result<(), MemoryError> {
    match available_memory() {
        Some(available) if bytes > u128::from(available) => Err(MemoryError {
            what: what.to_string(),
            needed_gib: bytes as f64 / (1u64 << 30) as f64,
            available_gib: available as f64 / (1u64 << 30) as f64,
        }),
        _ => Ok(()),
    }
}

/// Work that needs more memory than the machine has.
#[derive(Debug, Clone, PartialEq, Error)]
#[error(
    "{what} needs about {needed_gib:.1} GiB of memory, more than the {available_gib:.1} GiB this \
     machine has available"
)]
pub struct MemoryError {
    /// The work and the flags that size it.
    pub what: String,
    /// What it needs, in GiB.
    pub needed_gib: f64,
    /// What the machine has, in GiB.
    pub available_gib: f64,
}

/// A value past one of the bounds above.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{what} {value} is more than megatron-rs accepts (at most {limit}: {why})")]
pub struct LimitError {
    /// The flag or quantity, e.g. `--pipeline-model-parallel-size`.
    pub what: String,
    /// The value given (or computed).
    pub value: u128,
    /// The bound.
    pub limit: usize,
    /// What the bound stands for.
    pub why: &'static str,
}

/// Checks `value` of `what` against `limit`, which stands for `why`.
pub fn check(
    what: impl Into<String>,
    value: u128,
    limit: usize,
    why: &'static str,
) -> Result<(), LimitError> {
    if value > limit as u128 {
        return Err(LimitError {
            what: what.into(),
            value,
            limit,
            why,
        });
    }
    Ok(())
}

/// The product of `factors`, exact (in u128, where no product of bounded sizes overflows).
pub fn product(factors: &[usize]) -> u128 {
    factors
        .iter()
        .fold(1u128, |p, &f| p.saturating_mul(f as u128))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_value_past_its_bound_is_named_with_the_bound() {
        assert!(check("--tp", 8, MAX_RANKS, "ranks").is_ok());
        let err = check("--tp", u64::MAX.into(), MAX_RANKS, "ranks of a job").unwrap_err();
        assert_eq!(
            err.to_string(),
            "--tp 18446744073709551615 is more than megatron-rs accepts (at most 1048576: \
             ranks of a job)"
        );
        assert_eq!(product(&[usize::MAX, usize::MAX, 2]), u128::MAX);
        assert_eq!(product(&[1 << 20, 1 << 20]), 1 << 40);
        assert!(check_memory("nothing", 0).is_ok());
        let err = check_memory("a bench of --elements 2^70", 1 << 70).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("a bench of --elements 2^70 needs about"),
            "{err}"
        );
    }
}
