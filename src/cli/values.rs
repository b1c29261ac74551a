//! The value parsers every command shares: each numeric flag is read by one of these, so a value
//! that cannot work (0 ranks, a NaN rate, a loss scale that is infinite in f32, a size past
//! [`megatron::limits`]) is refused while the command line is parsed, with the flag named by
//! clap (`error: invalid value '0' for '--tp <TP>': must be at least 1`).

use megatron::limits::{
    MAX_BATCH, MAX_DIM, MAX_EXPERTS, MAX_LAYERS, MAX_RANKS, MAX_SCHEDULE_PASSES, MAX_VOCAB,
};

/// The most steps (and step counts: warm-up, decay, intervals) a run takes: 2^40.
const MAX_STEPS: u64 = 1 << 40;

/// The most elements a gradient bucket takes: 2^40.
const MAX_ELEMENTS: usize = 1 << 40;

/// A whole number in `min..=max`, `max` standing for `what`.
fn whole(s: &str, min: u64, max: u64, what: &str) -> Result<u64, String> {
    let v: u64 = match s.trim().parse::<u64>() {
        Ok(v) => v,
        Err(_) if s.trim().starts_with('-') => return Err(format!("must be at least {min}")),
        Err(_) if !s.trim().is_empty() && s.trim().bytes().all(|b| b.is_ascii_digit()) => {
            return Err(format!("must be at most {max} ({what})"));
        }
        Err(_) => return Err("not a whole number".to_string()),
    };
    if v < min {
        return Err(format!("must be at least {min}"));
    }
    if v > max {
        return Err(format!("must be at most {max} ({what})"));
    }
    Ok(v)
}

/// [`whole`] as a `usize`.
fn whole_usize(s: &str, min: usize, max: usize, what: &str) -> Result<usize, String> {
    // Every bound is far below usize::MAX on the 64-bit targets megatron-rs builds for.
    whole(s, min as u64, max as u64, what).map(|v| v as usize)
}

/// A parallel size (tp, pp, dp, ep, etp, cp, vpp) or a world size: 1 to 2^20 ranks.
pub fn ranks(s: &str) -> Result<usize, String> {
    whole_usize(s, 1, MAX_RANKS, "the ranks of a job")
}

/// A number of transformer layers: 1 to 2^14.
pub fn layers(s: &str) -> Result<usize, String> {
    whole_usize(s, 1, MAX_LAYERS, "a model's layers")
}

/// A model dimension (hidden size, MLP width, heads, positions, padding unit): 1 to 2^24.
pub fn dim(s: &str) -> Result<usize, String> {
    whole_usize(s, 1, MAX_DIM, "a model dimension")
}

/// A vocabulary size: 1 to 2^24 tokens.
pub fn vocab(s: &str) -> Result<usize, String> {
    whole_usize(s, 1, MAX_VOCAB, "a vocabulary's tokens")
}

/// A number of tokens of a vocabulary where 0 means all of them (`--top-k`): 0 to 2^24.
pub fn vocab_or_all(s: &str) -> Result<usize, String> {
    whole_usize(s, 0, MAX_VOCAB, "a vocabulary's tokens")
}

/// A number of experts (or of experts per token): 1 to 2^16.
pub fn experts(s: &str) -> Result<usize, String> {
    whole_usize(s, 1, MAX_EXPERTS, "experts per MoE layer")
}

/// Tokens per sample, samples per batch, batches per evaluation: 1 to 2^30.
pub fn batch(s: &str) -> Result<usize, String> {
    whole_usize(s, 1, MAX_BATCH, "tokens or samples of a batch")
}

/// Microbatches per step: 1 to 2^18.
pub fn microbatches(s: &str) -> Result<usize, String> {
    whole_usize(s, 1, MAX_SCHEDULE_PASSES, "forward passes per step")
}

/// A number of steps (or steps between events): 1 to 2^40.
pub fn steps(s: &str) -> Result<u64, String> {
    whole(s, 1, MAX_STEPS, "steps of a run")
}

/// A number of steps that may be 0 (warm-up): 0 to 2^40.
pub fn steps_or_none(s: &str) -> Result<u64, String> {
    whole(s, 0, MAX_STEPS, "steps of a run")
}

/// Elements of a buffer or bucket: 1 to 2^40.
pub fn elements(s: &str) -> Result<usize, String> {
    whole_usize(s, 1, MAX_ELEMENTS, "elements of a buffer")
}

/// A data-parallel sharding strategy by Megatron-FSDP's name.
pub fn sharding_strategy(s: &str) -> Result<megatron::distributed::ShardingStrategy, String> {
    use megatron::distributed::ShardingStrategy;
    ShardingStrategy::named(s).ok_or_else(|| {
        let names: Vec<&str> = ShardingStrategy::ALL.iter().map(|(n, _)| *n).collect();
        format!(
            "{s:?} is not a sharding strategy: one of {}",
            names.join(", ")
        )
    })
}

/// The strategy `--data-parallel-sharding-strategy` and `--use-distributed-optimizer` ask
/// for together: the flag's, or `optim` with the distributed optimizer, else `no_shard`;
/// `no_shard` with the distributed optimizer is refused.
pub fn chosen_sharding(
    flag: Option<megatron::distributed::ShardingStrategy>,
    use_distributed_optimizer: bool,
) -> anyhow::Result<megatron::distributed::ShardingStrategy> {
    use megatron::distributed::ShardingStrategy;
    match (flag, use_distributed_optimizer) {
        (Some(ShardingStrategy::NoShard), true) => anyhow::bail!(
            "--data-parallel-sharding-strategy no_shard with --use-distributed-optimizer, \
             which shards the optimizer state: drop one of them"
        ),
        (Some(strategy), _) => Ok(strategy),
        (None, true) => Ok(ShardingStrategy::Optim),
        (None, false) => Ok(ShardingStrategy::NoShard),
    }
}

/// A count of timed repetitions or iterations: 1 to 10,000.
pub fn count(s: &str) -> Result<usize, String> {
    whole_usize(s, 1, 10_000, "timed repetitions")
}

/// A number of threads of this process: 1 to 1,024.
pub fn threads(s: &str) -> Result<usize, String> {
    whole_usize(
        s,
        1,
        megatron::limits::MAX_THREAD_RANKS,
        "threads of one process",
    )
}

/// Megatron-LM's `--split`: up to three non-negative shares, not all zero.
pub fn split(s: &str) -> Result<String, String> {
    s.parse::<megatron::data::SplitVector>()
        .map_err(|e| e.to_string())?;
    Ok(s.to_string())
}

/// A number in f64.
fn number(s: &str) -> Result<f64, String> {
    let v: f64 = s.trim().parse().map_err(|_| "not a number".to_string())?;
    if !v.is_finite() {
        return Err("must be a finite number".to_string());
    }
    Ok(v)
}

/// Which values of a finite number a flag takes.
#[derive(Clone, Copy)]
enum Range {
    /// `v ≥ 0`.
    NonNegative,
    /// `v > 0`.
    Positive,
    /// `0 ≤ v < 1`.
    Fraction,
}

/// `v` if it lies in `range`, else what it must be.
fn within<T: Into<f64> + Copy>(v: T, range: Range) -> Result<T, String> {
    let x: f64 = v.into();
    let (ok, must) = match range {
        Range::NonNegative => (x >= 0.0, "must be at least 0"),
        Range::Positive => (x > 0.0, "must be more than 0"),
        Range::Fraction => (
            (0.0..1.0).contains(&x),
            "must be at least 0 and less than 1",
        ),
    };
    if ok { Ok(v) } else { Err(must.to_string()) }
}

/// A finite f64 ≥ 0 (rates, decay, clipping).
pub fn non_negative(s: &str) -> Result<f64, String> {
    within(number(s)?, Range::NonNegative)
}

/// A finite f64 > 0 (Adam's ε).
pub fn positive(s: &str) -> Result<f64, String> {
    within(number(s)?, Range::Positive)
}

/// An f64 in [0, 1) (Adam's β).
pub fn fraction(s: &str) -> Result<f64, String> {
    within(number(s)?, Range::Fraction)
}

/// A probability above 0 and at most 1 (nucleus sampling's top-p).
pub fn probability(s: &str) -> Result<f64, String> {
    let v = number(s)?;
    if v > 0.0 && v <= 1.0 {
        Ok(v)
    } else {
        Err("must be more than 0 and at most 1".to_string())
    }
}

/// A number that is finite as an f32, where the value is used.
fn number_f32(s: &str) -> Result<f32, String> {
    let v = number(s)?;
    let single = v as f32;
    if !single.is_finite() {
        return Err(format!(
            "{v:e} is infinite in f32 (at most {:e}), the precision it is used in",
            f32::MAX
        ));
    }
    if v != 0.0 && single == 0.0 {
        return Err(format!(
            "{v:e} is 0 in f32 (at least {:e}), the precision it is used in",
            f32::from_bits(1)
        ));
    }
    Ok(single)
}

/// A finite f32 > 0 (a loss scale, a capacity factor, a scaling factor).
pub fn positive_f32(s: &str) -> Result<f32, String> {
    within(number_f32(s)?, Range::Positive)
}

/// A finite f32 ≥ 0 (a loss coefficient, an update rate, an initialisation's deviation).
pub fn non_negative_f32(s: &str) -> Result<f32, String> {
    within(number_f32(s)?, Range::NonNegative)
}

/// A loss scale given in f64 that must be finite and positive in f32.
pub fn loss_scale(s: &str) -> Result<f64, String> {
    positive_f32(s).map(f64::from)
}

/// A probability of dropping, in [0, 1).
pub fn dropout(s: &str) -> Result<f32, String> {
    within(number_f32(s)?, Range::Fraction)
}

/// A pipeline schedule's name (`--pipeline-schedule`).
pub fn schedule(s: &str) -> Result<megatron::pipeline_parallel::ScheduleKind, String> {
    use megatron::pipeline_parallel::ScheduleKind;
    ScheduleKind::parse(s).ok_or_else(|| {
        let names: Vec<&str> = ScheduleKind::ALL.iter().map(|k| k.name()).collect();
        format!("unknown pipeline schedule; one of {}", names.join(", "))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_parser_names_what_is_wrong() {
        assert_eq!(ranks("8"), Ok(8));
        assert_eq!(ranks("0"), Err("must be at least 1".to_string()));
        assert_eq!(ranks("-3"), Err("must be at least 1".to_string()));
        assert_eq!(
            ranks("18446744073709551616"),
            Err("must be at most 1048576 (the ranks of a job)".to_string())
        );
        assert_eq!(ranks("2x"), Err("not a whole number".to_string()));
        assert_eq!(steps_or_none("0"), Ok(0));
        assert_eq!(
            non_negative("NaN"),
            Err("must be a finite number".to_string())
        );
        assert_eq!(
            non_negative("-inf"),
            Err("must be a finite number".to_string())
        );
        assert!(loss_scale("1e300").unwrap_err().contains("infinite in f32"));
        assert!(loss_scale("1e39").unwrap_err().contains("infinite in f32"));
        assert_eq!(loss_scale("65536"), Ok(65536.0));
        assert_eq!(loss_scale("0"), Err("must be more than 0".to_string()));
        assert!(positive_f32("1e-50").unwrap_err().contains("is 0 in f32"));
        assert_eq!(
            dropout("1"),
            Err("must be at least 0 and less than 1".to_string())
        );
        assert_eq!(fraction("0.95"), Ok(0.95));
    }
}
