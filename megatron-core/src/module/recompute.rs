//! Activation recompute, as Megatron-LM's `--recompute-granularity`, `--recompute-method` and
//! `--recompute-num-layers` mean it.
//!
//! - `full` recomputes whole layers of a stack (the layers a `Vec` field of a module loops
//!   over: a pipeline stage's chunk of transformer layers). A recomputed group of layers keeps
//!   only its input; its backward reruns the group's forward from that input (the same sites,
//!   so the same dropout masks: they are counter-based) to get what the layers save, then runs
//!   their backwards. `uniform` cuts a stack into groups of `n` layers, all recomputed;
//!   `block` recomputes the first `n` layers of the stack, one at a time, and keeps the rest.
//! - `selective` recomputes the core attention only: attention keeps its queries, keys and
//!   values and recomputes its weights (the `b·heads·s²` tensor that dominates activation
//!   memory at long sequences) in its backward.
//!
//! The generated code of a stack calls [`stack_forward`] and [`stack_backward`]; recompute
//! changes what is kept, never what is computed, so gradients are bit-identical.

use std::ops::Range;

use thiserror::Error;

use super::Cx;
use crate::error::Result;
use crate::tensor::Tensor;

/// Which activations are recomputed in the backward instead of kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Recompute {
    /// Nothing: every activation is kept.
    #[default]
    Off,
    /// `full`, `uniform`: every layer of a stack, in groups of `n` that keep only their input.
    Uniform(usize),
    /// `full`, `block`: the first `n` layers of each stack, each keeping only its input.
    Block(usize),
    /// `selective`: the core attention's weights.
    Selective,
}

/// Megatron-LM's checks of the recompute flags, with the numbers.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum RecomputeError {
    /// A granularity or method Megatron-LM does not know.
    #[error("--{flag} {value:?}: use {allowed}")]
    Unknown {
        /// The flag.
        flag: &'static str,
        /// What was given.
        value: String,
        /// What it takes.
        allowed: &'static str,
    },
    /// `full` without a method.
    #[error("--recompute-granularity full needs --recompute-method uniform or block")]
    NoMethod,
    /// `full` without a number of layers, or 0.
    #[error(
        "--recompute-granularity full needs --recompute-num-layers between 1 and the layers per \
         pipeline stage ({per_stage})"
    )]
    NoLayers {
        /// Layers per pipeline stage.
        per_stage: usize,
    },
    /// More layers than a stage holds.
    #[error(
        "--recompute-num-layers {layers} is more than the {per_stage} layers of a pipeline \
         stage{chunk}"
    )]
    TooManyLayers {
        /// Layers asked for.
        layers: usize,
        /// Layers per stage (or chunk).
        per_stage: usize,
        /// ", chunk" with virtual stages.
        chunk: &'static str,
    },
    /// `selective` with a number of layers or a method.
    #[error("--recompute-granularity selective takes no --recompute-{what}")]
    SelectiveWith {
        /// `num-layers` or `method`.
        what: &'static str,
    },
    /// A method or number of layers without a granularity.
    #[error("--recompute-{what} needs --recompute-granularity full")]
    NoGranularity {
        /// `num-layers` or `method`.
        what: &'static str,
    },
}

impl Recompute {
    /// The setting Megatron-LM's flags give, checked against the layers each stack holds (a
    /// pipeline stage's, or with virtual stages a chunk's: `per_stage`, `chunk`).
    pub fn from_flags(
        granularity: Option<&str>,
        method: Option<&str>,
        num_layers: Option<usize>,
        per_stage: usize,
        chunk: bool,
    ) -> std::result::Result<Recompute, RecomputeError> {
        let Some(granularity) = granularity else {
            return match (method, num_layers) {
                (Some(_), _) => Err(RecomputeError::NoGranularity { what: "method" }),
                (_, Some(_)) => Err(RecomputeError::NoGranularity { what: "num-layers" }),
                _ => Ok(Recompute::Off),
            };
        };
        match granularity {
            "selective" => match (method, num_layers) {
                (_, Some(_)) => Err(RecomputeError::SelectiveWith { what: "num-layers" }),
                (Some(_), _) => Err(RecomputeError::SelectiveWith { what: "method" }),
                _ => Ok(Recompute::Selective),
            },
            "full" => {
                let method = method.ok_or(RecomputeError::NoMethod)?;
                let n = match num_layers {
                    Some(n) if n > 0 => n,
                    _ => return Err(RecomputeError::NoLayers { per_stage }),
                };
                if n > per_stage {
                    return Err(RecomputeError::TooManyLayers {
                        layers: n,
                        per_stage,
                        chunk: if chunk { ", chunk" } else { "" },
                    });
                }
                match method {
                    "uniform" => Ok(Recompute::Uniform(n)),
                    "block" => Ok(Recompute::Block(n)),
                    other => Err(RecomputeError::Unknown {
                        flag: "recompute-method",
                        value: other.to_string(),
                        allowed: "uniform or block",
                    }),
                }
            }
            other => Err(RecomputeError::Unknown {
                flag: "recompute-granularity",
                value: other.to_string(),
                allowed: "full or selective",
            }),
        }
    }

    /// The groups a stack of `len` layers runs in, each with whether it is recomputed.
    pub fn groups(&self, len: usize) -> Vec<(Range<usize>, bool)> {
        match *self {
            Recompute::Uniform(n) => {
                let n = n.max(1);
                (0..len)
                    .step_by(n)
                    .map(|start| (start..(start + n).min(len), true))
                    .collect()
            }
            Recompute::Block(n) => (0..len).map(|i| (i..i + 1, i < n)).collect(),
            Recompute::Off | Recompute::Selective => (0..len).map(|i| (i..i + 1, false)).collect(),
        }
    }
}

/// What a stack keeps for its backward: per group of layers, what each layer saved, or for a
/// recomputed group its input.
#[derive(Debug, Clone)]
pub struct StackSaved<S> {
    groups: Vec<Group<S>>,
}

#[derive(Debug, Clone)]
enum Group<S> {
    Kept(usize, Vec<S>),
    Input(Range<usize>, Tensor),
}

impl<S> StackSaved<S> {
    /// Layers whose saved values are kept (the others keep only their group's input).
    pub fn kept_layers(&self) -> usize {
        self.groups
            .iter()
            .map(|g| match g {
                Group::Kept(_, s) => s.len(),
                Group::Input(..) => 0,
            })
            .sum()
    }
}

/// Runs a stack of `len` layers forward from `x` (`forward(i, x)`: layer `i`'s forward),
/// keeping what `cx`'s recompute setting says.
pub fn stack_forward<S>(
    cx: &Cx,
    len: usize,
    mut x: Tensor,
    mut forward: impl FnMut(usize, &Tensor) -> Result<(Tensor, S)>,
) -> Result<(Tensor, StackSaved<S>)> {
    let mut groups = Vec::new();
    for (range, recompute) in cx.recompute().groups(len) {
        if recompute && cx.training() {
            let input = x.clone();
            for i in range.clone() {
                x = forward(i, &x)?.0;
            }
            groups.push(Group::Input(range, input));
        } else {
            for i in range {
                let (y, saved) = forward(i, &x)?;
                x = y;
                groups.push(Group::Kept(i, vec![saved]));
            }
        }
    }
    Ok((x, StackSaved { groups }))
}

/// Runs a stack backward from `dy`, last layer first (`backward(i, saved, dy)`: layer `i`'s
/// backward), first rerunning each recomputed group's forward from its input.
pub fn stack_backward<S>(
    saved: StackSaved<S>,
    mut dy: Tensor,
    mut forward: impl FnMut(usize, &Tensor) -> Result<(Tensor, S)>,
    mut backward: impl FnMut(usize, S, &Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    for group in saved.groups.into_iter().rev() {
        let (first, layers) = match group {
            Group::Kept(i, s) => (i, s),
            Group::Input(range, mut x) => {
                let mut layers = Vec::with_capacity(range.len());
                for i in range.clone() {
                    let (y, s) = forward(i, &x)?;
                    layers.push(s);
                    x = y;
                }
                (range.start, layers)
            }
        };
        for (k, s) in layers.into_iter().enumerate().rev() {
            dy = backward(first + k, s, &dy)?;
        }
    }
    Ok(dy)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_follow_megatrons_methods() {
        assert_eq!(
            Recompute::Uniform(2).groups(5),
            [(0..2, true), (2..4, true), (4..5, true)]
        );
        assert_eq!(
            Recompute::Block(2).groups(4),
            [(0..1, true), (1..2, true), (2..3, false), (3..4, false)]
        );
        assert_eq!(Recompute::Off.groups(2), [(0..1, false), (1..2, false)]);
        assert_eq!(Recompute::Selective.groups(1), [(0..1, false)]);
    }

    #[test]
    fn the_flags_are_checked_as_megatron_does() {
        let f = |g, m, n| Recompute::from_flags(g, m, n, 4, false);
        assert_eq!(
            f(Some("full"), Some("uniform"), Some(2)),
            Ok(Recompute::Uniform(2))
        );
        assert_eq!(
            f(Some("full"), Some("block"), Some(4)),
            Ok(Recompute::Block(4))
        );
        assert_eq!(f(Some("selective"), None, None), Ok(Recompute::Selective));
        assert_eq!(f(None, None, None), Ok(Recompute::Off));
        assert_eq!(
            f(Some("full"), None, Some(2)),
            Err(RecomputeError::NoMethod)
        );
        assert_eq!(
            f(Some("full"), Some("block"), Some(5))
                .unwrap_err()
                .to_string(),
            "--recompute-num-layers 5 is more than the 4 layers of a pipeline stage"
        );
        assert_eq!(
            f(Some("full"), Some("block"), None),
            Err(RecomputeError::NoLayers { per_stage: 4 })
        );
        assert!(f(Some("selective"), None, Some(1)).is_err());
        assert!(f(Some("partial"), None, None).is_err());
        assert!(f(None, Some("block"), None).is_err());
    }
}
