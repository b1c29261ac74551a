//! Mixed precision as Megatron-LM runs it: the model's parameters and gradients in 16 bits
//! (`--bf16`, `--fp16`), f32 main parameters (and, for 16-bit gradients, main gradients) in the
//! optimizer, and the loss scaling fp16 needs (`MegatronGradScaler`): a static scale or a
//! dynamic one that halves after overflowing steps and doubles after a window without one.

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::tensor::DType;

/// Mixed-precision settings that cannot train.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum PrecisionError {
    /// Both 16-bit formats asked for.
    #[error("--fp16 and --bf16 both given: the parameters take one 16-bit format")]
    Both16,
    /// A loss scale or bound that is not a positive number.
    #[error("--{flag} is {value}: a loss scale must be a finite number above 0")]
    NotPositive {
        /// The flag, without dashes.
        flag: &'static str,
        /// Its value.
        value: f64,
    },
    /// The dynamic scale's floor above its start.
    #[error("--min-loss-scale {min} is above --initial-loss-scale {initial}")]
    MinAboveInitial {
        /// The floor.
        min: f64,
        /// The start.
        initial: f64,
    },
    /// A window or hysteresis of zero steps.
    #[error("--{flag} is 0: it counts steps and must be at least 1")]
    ZeroSteps {
        /// The flag, without dashes.
        flag: &'static str,
    },
    /// A loss-scaling flag without 16-bit parameters.
    #[error("--{flag} scales the loss of a --fp16 or --bf16 run; this run trains in fp32")]
    ScaleWithoutHalf {
        /// The flag, without dashes.
        flag: &'static str,
    },
    /// `--grad-reduce-in-bf16` without `--bf16`.
    /// A dynamic-scaling flag where nothing scales dynamically.
    #[error("--{flag} does nothing {why}: drop it")]
    NoEffect {
        /// The flag, without its dashes.
        flag: &'static str,
        /// Why: which setting makes the flag moot.
        why: &'static str,
    },
    /// `--grad-reduce-in-bf16` without `--bf16`.
    #[error("--grad-reduce-in-bf16 needs --bf16")]
    Bf16GradsWithoutBf16,
    /// `--grad-reduce-in-bf16` together with fp32 gradients.
    #[error("--grad-reduce-in-bf16 and --accumulate-allreduce-grads-in-fp32 contradict each other")]
    Bf16GradsAndFp32,
}

/// Megatron-LM's mixed-precision flags, as a user gives them (and as a checkpoint records
/// them).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct PrecisionFlags {
    /// `--bf16`: bf16 parameters (gradients in f32 unless `grad_reduce_in_bf16`).
    pub bf16: bool,
    /// `--fp16`: fp16 parameters and gradients, with loss scaling.
    pub fp16: bool,
    /// `--loss-scale`: a static scale (dynamic when absent).
    pub loss_scale: Option<f64>,
    /// `--initial-loss-scale` (2^32 when absent).
    pub initial_loss_scale: Option<f64>,
    /// `--min-loss-scale` (1 when absent).
    pub min_loss_scale: Option<f64>,
    /// `--loss-scale-window` (1000 when absent).
    pub loss_scale_window: Option<u64>,
    /// `--hysteresis` (2 when absent).
    pub hysteresis: Option<u64>,
    /// `--accumulate-allreduce-grads-in-fp32` (or `--grad-reduce-in-fp32`): f32 gradients.
    pub grads_in_fp32: bool,
    /// `--grad-reduce-in-bf16`: bf16 gradients under `--bf16` (f32 by default there).
    pub grad_reduce_in_bf16: bool,
}

/// How the loss is scaled before the backward.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum LossScaling {
    /// Not scaled (f32, and bf16 by default).
    None,
    /// Always this scale (`--loss-scale`).
    Static(f64),
    /// Megatron-LM's dynamic scale.
    Dynamic {
        /// Starting scale (`--initial-loss-scale`).
        initial: f64,
        /// Floor (`--min-loss-scale`).
        min: f64,
        /// Steps without overflow after which the scale doubles (`--loss-scale-window`).
        window: u64,
        /// Overflowing steps, since the last growth, before each halving (`--hysteresis`).
        hysteresis: u64,
    },
}

/// The dtypes a run keeps its parameters and gradients in, and its loss scaling.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Precision {
    /// The model's parameters (what the forward reads and the data-parallel all-gather moves).
    pub params: DType,
    /// The gradients (what the backward accumulates into and the data-parallel reduction moves).
    pub grads: DType,
    /// The loss scaling.
    pub scaling: LossScaling,
}

impl Default for Precision {
    fn default() -> Self {
        Precision::FP32
    }
}

/// Megatron-LM's default initial loss scale.
pub const DEFAULT_INITIAL_LOSS_SCALE: f64 = 4_294_967_296.0;

impl Precision {
    /// Everything in f32, no scaling.
    pub const FP32: Precision = Precision {
        params: DType::F32,
        grads: DType::F32,
        scaling: LossScaling::None,
    };

    /// The precision Megatron-LM's flags mean: `--bf16` keeps f32 gradients unless
    /// `--grad-reduce-in-bf16`; `--fp16` keeps fp16 gradients unless
    /// `--accumulate-allreduce-grads-in-fp32`, and scales the loss dynamically unless
    /// `--loss-scale` is given.
    pub fn from_flags(flags: &PrecisionFlags) -> Result<Precision, PrecisionError> {
        if flags.fp16 && flags.bf16 {
            return Err(PrecisionError::Both16);
        }
        let half = flags.fp16 || flags.bf16;
        for (flag, value) in [
            ("loss-scale", flags.loss_scale),
            ("initial-loss-scale", flags.initial_loss_scale),
            ("min-loss-scale", flags.min_loss_scale),
        ] {
            if let Some(value) = value {
                if !(value.is_finite() && value > 0.0) {
                    return Err(PrecisionError::NotPositive { flag, value });
                }
                if !half {
                    return Err(PrecisionError::ScaleWithoutHalf { flag });
                }
            }
        }
        for (flag, value) in [
            ("loss-scale-window", flags.loss_scale_window),
            ("hysteresis", flags.hysteresis),
        ] {
            if value == Some(0) {
                return Err(PrecisionError::ZeroSteps { flag });
            }
            if value.is_some() && !half {
                return Err(PrecisionError::ScaleWithoutHalf { flag });
            }
        }
        // The dynamic scaler's settings act only under --fp16 without a static scale.
        if half {
            let why = if !flags.fp16 {
                Some("with --bf16, whose loss is scaled only statically (--loss-scale)")
            } else if flags.loss_scale.is_some() {
                Some("with a static --loss-scale (it sets the dynamic scaler)")
            } else {
                None
            };
            let dynamic_only = [
                ("initial-loss-scale", flags.initial_loss_scale.is_some()),
                ("min-loss-scale", flags.min_loss_scale.is_some()),
                ("loss-scale-window", flags.loss_scale_window.is_some()),
                ("hysteresis", flags.hysteresis.is_some()),
            ];
            if let (Some(why), Some((flag, _))) =
                (why, dynamic_only.iter().find(|(_, given)| *given))
            {
                return Err(PrecisionError::NoEffect { flag, why });
            }
        }
        if flags.grads_in_fp32 && !half {
            return Err(PrecisionError::NoEffect {
                flag: "accumulate-allreduce-grads-in-fp32",
                why: "in an f32 run (its gradients are f32 already)",
            });
        }
        if flags.grad_reduce_in_bf16 && !flags.bf16 {
            return Err(PrecisionError::Bf16GradsWithoutBf16);
        }
        if flags.grad_reduce_in_bf16 && flags.grads_in_fp32 {
            return Err(PrecisionError::Bf16GradsAndFp32);
        }
        let initial = flags
            .initial_loss_scale
            .unwrap_or(DEFAULT_INITIAL_LOSS_SCALE);
        let min = flags.min_loss_scale.unwrap_or(1.0);
        let scaling = match flags.loss_scale {
            Some(scale) => LossScaling::Static(scale),
            None if flags.fp16 => {
                if min > initial {
                    return Err(PrecisionError::MinAboveInitial { min, initial });
                }
                LossScaling::Dynamic {
                    initial,
                    min,
                    window: flags.loss_scale_window.unwrap_or(1000),
                    hysteresis: flags.hysteresis.unwrap_or(2),
                }
            }
            None => LossScaling::None,
        };
        let params = if flags.fp16 {
            DType::F16
        } else if flags.bf16 {
            DType::BF16
        } else {
            DType::F32
        };
        let grads = if flags.grads_in_fp32 || (flags.bf16 && !flags.grad_reduce_in_bf16) {
            DType::F32
        } else {
            params
        };
        Ok(Precision {
            params,
            grads,
            scaling,
        })
    }

    /// Whether the parameters are 16-bit, so that the optimizer keeps f32 main parameters.
    pub fn mixed(&self) -> bool {
        self.params != DType::F32
    }

    /// The loss scaler this precision starts with (`None` without scaling).
    pub fn grad_scaler(&self) -> Option<GradScaler> {
        match self.scaling {
            LossScaling::None => None,
            LossScaling::Static(scale) => Some(GradScaler::new_static(scale)),
            LossScaling::Dynamic {
                initial,
                min,
                window,
                hysteresis,
            } => Some(GradScaler::new_dynamic(initial, min, window, hysteresis)),
        }
    }
}

/// The loss scale and its trackers (Megatron-LM's `ConstantGradScaler` and
/// `DynamicGradScaler`, growth ×2 and backoff ×½).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct GradScaler {
    /// The current scale (f32, as Megatron-LM keeps it).
    pub scale: f32,
    /// Whether the scale moves.
    pub dynamic: bool,
    /// The floor of a dynamic scale.
    pub min: f32,
    /// Steps without overflow before a growth.
    pub window: u64,
    /// Overflows before each backoff.
    pub hysteresis: u64,
    /// Steps without overflow since the last growth or overflow.
    pub growth_tracker: u64,
    /// Overflows left before the next backoff.
    pub hysteresis_tracker: i64,
}

impl GradScaler {
    /// A scale that never moves.
    pub fn new_static(scale: f64) -> GradScaler {
        GradScaler {
            scale: scale as f32,
            dynamic: false,
            min: scale as f32,
            window: 0,
            hysteresis: 0,
            growth_tracker: 0,
            hysteresis_tracker: 0,
        }
    }

    /// Megatron-LM's dynamic scale.
    pub fn new_dynamic(initial: f64, min: f64, window: u64, hysteresis: u64) -> GradScaler {
        GradScaler {
            scale: initial as f32,
            dynamic: true,
            min: min as f32,
            window,
            hysteresis,
            growth_tracker: 0,
            hysteresis_tracker: hysteresis as i64,
        }
    }

    /// 1 / scale, computed in f64 and rounded to f32 as Megatron-LM does.
    pub fn inv_scale(&self) -> f32 {
        (1.0 / f64::from(self.scale)) as f32
    }

    /// Moves the scale after a step: an overflow (`found_inf`) uses up one hysteresis count and,
    /// once none is left, halves the scale (not below the floor); `window` steps in a row
    /// without one double it and restore the hysteresis.
    pub fn update(&mut self, found_inf: bool) {
        if !self.dynamic {
            return;
        }
        if found_inf {
            self.growth_tracker = 0;
            self.hysteresis_tracker -= 1;
            if self.hysteresis_tracker <= 0 {
                self.scale = (self.scale * 0.5).max(self.min);
            }
        } else {
            self.growth_tracker += 1;
            if self.growth_tracker == self.window {
                self.growth_tracker = 0;
                self.hysteresis_tracker = self.hysteresis as i64;
                self.scale *= 2.0;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flags() -> PrecisionFlags {
        PrecisionFlags::default()
    }

    #[test]
    fn flags_mean_what_megatron_means() {
        let p = Precision::from_flags(&flags()).unwrap();
        assert_eq!(p, Precision::FP32);
        let bf16 = Precision::from_flags(&PrecisionFlags {
            bf16: true,
            ..flags()
        })
        .unwrap();
        assert_eq!((bf16.params, bf16.grads), (DType::BF16, DType::F32));
        assert_eq!(bf16.scaling, LossScaling::None);
        let bf16_grads = Precision::from_flags(&PrecisionFlags {
            bf16: true,
            grad_reduce_in_bf16: true,
            ..flags()
        })
        .unwrap();
        assert_eq!(bf16_grads.grads, DType::BF16);
        let fp16 = Precision::from_flags(&PrecisionFlags {
            fp16: true,
            ..flags()
        })
        .unwrap();
        assert_eq!((fp16.params, fp16.grads), (DType::F16, DType::F16));
        assert_eq!(
            fp16.scaling,
            LossScaling::Dynamic {
                initial: 4294967296.0,
                min: 1.0,
                window: 1000,
                hysteresis: 2
            }
        );
        let fp16_static = Precision::from_flags(&PrecisionFlags {
            fp16: true,
            loss_scale: Some(128.0),
            grads_in_fp32: true,
            ..flags()
        })
        .unwrap();
        assert_eq!(fp16_static.grads, DType::F32);
        assert_eq!(fp16_static.scaling, LossScaling::Static(128.0));
    }

    #[test]
    fn bad_flags_are_named() {
        let err = |f: PrecisionFlags| Precision::from_flags(&f).unwrap_err().to_string();
        assert!(
            err(PrecisionFlags {
                fp16: true,
                bf16: true,
                ..flags()
            })
            .contains("--fp16 and --bf16")
        );
        for bad in [0.0, -1.0, f64::NAN] {
            let e = err(PrecisionFlags {
                fp16: true,
                loss_scale: Some(bad),
                ..flags()
            });
            assert!(
                e.contains("--loss-scale is") && e.contains("above 0"),
                "{e}"
            );
        }
        assert!(
            err(PrecisionFlags {
                fp16: true,
                initial_loss_scale: Some(4.0),
                min_loss_scale: Some(8.0),
                ..flags()
            })
            .contains("--min-loss-scale 8 is above --initial-loss-scale 4")
        );
        assert!(
            err(PrecisionFlags {
                fp16: true,
                hysteresis: Some(0),
                ..flags()
            })
            .contains("--hysteresis is 0")
        );
        assert!(
            err(PrecisionFlags {
                loss_scale: Some(8.0),
                ..flags()
            })
            .contains("this run trains in fp32")
        );
        assert!(
            err(PrecisionFlags {
                fp16: true,
                grad_reduce_in_bf16: true,
                ..flags()
            })
            .contains("needs --bf16")
        );
    }

    #[test]
    fn the_dynamic_scale_moves_as_megatron_moves_it() {
        // Megatron-LM's DynamicGradScaler.update, traced by hand: hysteresis 2, window 3.
        let mut s = GradScaler::new_dynamic(1024.0, 1.0, 3, 2);
        s.update(true); // one overflow left before a backoff
        assert_eq!((s.scale, s.hysteresis_tracker), (1024.0, 1));
        s.update(true);
        assert_eq!((s.scale, s.hysteresis_tracker), (512.0, 0));
        s.update(true); // out of hysteresis: every overflow halves
        assert_eq!(s.scale, 256.0);
        s.update(false);
        s.update(false);
        assert_eq!((s.scale, s.growth_tracker), (256.0, 2));
        s.update(true); // an overflow resets the growth count
        assert_eq!((s.scale, s.growth_tracker), (128.0, 0));
        for _ in 0..3 {
            s.update(false);
        }
        assert_eq!(
            (s.scale, s.hysteresis_tracker, s.growth_tracker),
            (256.0, 2, 0)
        );
        let mut floor = GradScaler::new_dynamic(2.0, 1.0, 1000, 1);
        for _ in 0..5 {
            floor.update(true);
        }
        assert_eq!(floor.scale, 1.0);
        assert_eq!(GradScaler::new_dynamic(8.0, 1.0, 10, 2).inv_scale(), 0.125);
        let mut fixed = GradScaler::new_static(64.0);
        fixed.update(true);
        assert_eq!(fixed.scale, 64.0);
    }
}
