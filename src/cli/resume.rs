//! What a checkpoint records of how its run trained, beyond the architecture, the layout and the
//! data: the mixed-precision and loss-scaler flags, the expert-parallel sizes, the MoE token
//! dispatcher, the pipeline schedule and context parallelism (`run.training` in `meta.json`). A resumed run takes
//! each from the checkpoint unless a flag gives it, and lists what it took; a precision flag
//! that contradicts the checkpoint's is refused by name.

use anyhow::{Result, bail};
use megatron::job::PipelineSettings;
use megatron::optimizer::PrecisionFlags;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// What `run.training` of a checkpoint holds (each part absent in checkpoints saved before
/// it was recorded).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Recorded {
    /// The mixed-precision flags.
    pub precision: Option<PrecisionFlags>,
    /// `--expert-model-parallel-size`.
    pub ep: Option<usize>,
    /// `--expert-tensor-parallel-size`.
    pub etp: Option<usize>,
    /// `--moe-token-dispatcher-type` (MoE models).
    pub moe_token_dispatcher_type: Option<String>,
    /// The pipeline schedule.
    pub pipeline: Option<PipelineSettings>,
    /// Context parallelism: `--context-parallel-size`, `--cp-comm-type` and
    /// `--hierarchical-context-parallel-sizes`.
    pub context_parallel: Option<ContextParallelSettings>,
}

/// A run's context-parallel flags, as a checkpoint records them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContextParallelSettings {
    /// `--context-parallel-size`.
    pub cp: usize,
    /// `--cp-comm-type`.
    pub comm_type: String,
    /// `--hierarchical-context-parallel-sizes` (empty without a2a+p2p).
    #[serde(default)]
    pub hierarchical: Vec<usize>,
}

impl ContextParallelSettings {
    /// The settings of `cp` ranks exchanging as `kind`.
    pub fn new(cp: usize, kind: megatron::context_parallel::CpCommType) -> Self {
        use megatron::context_parallel::CpCommType;
        ContextParallelSettings {
            cp,
            comm_type: kind.name().to_string(),
            hierarchical: match kind {
                CpCommType::A2aP2p { a2a, p2p } => vec![a2a, p2p],
                _ => Vec::new(),
            },
        }
    }
}

impl Recorded {
    /// The record in a checkpoint's `run` facts (empty when there is none).
    pub fn from_run(run: &Value) -> Recorded {
        serde_json::from_value(run["training"].clone()).unwrap_or_default()
    }

    /// The record as `run.training` holds it.
    pub fn to_value(&self) -> Value {
        serde_json::to_value(self).unwrap_or(Value::Null)
    }
}

/// The precision flags of a resumed run: `given`, with what the checkpoint recorded where no
/// flag says otherwise (`had_scaler`: the checkpoint holds a loss scaler's state, which only an
/// fp16 run saves). Each flag taken is added to `taken`. A 16-bit flag other than the
/// checkpoint's format is refused.
pub fn precision(
    given: PrecisionFlags,
    recorded: Option<PrecisionFlags>,
    had_scaler: bool,
    taken: &mut Vec<String>,
) -> Result<PrecisionFlags> {
    let recorded = match recorded {
        Some(r) => r,
        // Saved before the flags were recorded: a loss scaler's state means --fp16.
        None if had_scaler => PrecisionFlags {
            fp16: true,
            ..PrecisionFlags::default()
        },
        None => return Ok(given),
    };
    let name = |f: &PrecisionFlags| match (f.fp16, f.bf16) {
        (true, _) => "--fp16",
        (_, true) => "--bf16",
        _ => "f32 (neither --fp16 nor --bf16)",
    };
    let mut flags = given;
    if given.fp16 || given.bf16 {
        if (given.fp16, given.bf16) != (recorded.fp16, recorded.bf16) {
            bail!(
                "{} contradicts the checkpoint, which trained in {}: drop the flag (a resumed \
                 run keeps its checkpoint's precision and loss scaler)",
                name(&given),
                name(&recorded)
            );
        }
    } else if recorded.fp16 || recorded.bf16 {
        flags.fp16 = recorded.fp16;
        flags.bf16 = recorded.bf16;
        taken.push(name(&recorded).to_string());
    }
    let mut take_f64 = |flag: &str, mine: &mut Option<f64>, theirs: Option<f64>| {
        if mine.is_none()
            && let Some(v) = theirs
        {
            *mine = Some(v);
            taken.push(format!("--{flag} {v}"));
        }
    };
    take_f64("loss-scale", &mut flags.loss_scale, recorded.loss_scale);
    take_f64(
        "initial-loss-scale",
        &mut flags.initial_loss_scale,
        recorded.initial_loss_scale,
    );
    take_f64(
        "min-loss-scale",
        &mut flags.min_loss_scale,
        recorded.min_loss_scale,
    );
    for (flag, mine, theirs) in [
        (
            "loss-scale-window",
            &mut flags.loss_scale_window,
            recorded.loss_scale_window,
        ),
        ("hysteresis", &mut flags.hysteresis, recorded.hysteresis),
    ] {
        if mine.is_none()
            && let Some(v) = theirs
        {
            *mine = Some(v);
            taken.push(format!("--{flag} {v}"));
        }
    }
    for (flag, mine, theirs) in [
        (
            "accumulate-allreduce-grads-in-fp32",
            &mut flags.grads_in_fp32,
            recorded.grads_in_fp32,
        ),
        (
            "grad-reduce-in-bf16",
            &mut flags.grad_reduce_in_bf16,
            recorded.grad_reduce_in_bf16,
        ),
    ] {
        if !*mine && theirs {
            *mine = true;
            taken.push(format!("--{flag}"));
        }
    }
    Ok(flags)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_resumed_run_keeps_its_precision_unless_told_otherwise() {
        let fp16 = PrecisionFlags {
            fp16: true,
            loss_scale_window: Some(100),
            ..PrecisionFlags::default()
        };
        let mut taken = Vec::new();
        let got = precision(PrecisionFlags::default(), Some(fp16), true, &mut taken).unwrap();
        assert_eq!(got, fp16);
        assert_eq!(taken, ["--fp16", "--loss-scale-window 100"]);
        // A flag given wins over the record of the same setting.
        let mut taken = Vec::new();
        let given = PrecisionFlags {
            fp16: true,
            loss_scale_window: Some(10),
            ..PrecisionFlags::default()
        };
        assert_eq!(
            precision(given, Some(fp16), true, &mut taken).unwrap(),
            given
        );
        assert!(taken.is_empty());
        // Another format is refused by name.
        let bf16 = PrecisionFlags {
            bf16: true,
            ..PrecisionFlags::default()
        };
        let err = precision(bf16, Some(fp16), true, &mut Vec::new()).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("--bf16 contradicts the checkpoint, which trained in --fp16"),
            "{err}"
        );
        let err = precision(
            bf16,
            Some(PrecisionFlags::default()),
            false,
            &mut Vec::new(),
        )
        .unwrap_err();
        assert!(err.to_string().contains("trained in f32"), "{err}");
        // A checkpoint that records nothing but holds a scaler's state was an fp16 run.
        let mut taken = Vec::new();
        let got = precision(PrecisionFlags::default(), None, true, &mut taken).unwrap();
        assert!(got.fp16 && taken == ["--fp16"]);
        assert_eq!(
            precision(PrecisionFlags::default(), None, false, &mut Vec::new()).unwrap(),
            PrecisionFlags::default()
        );
    }
}
