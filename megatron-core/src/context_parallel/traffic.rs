//! What context-parallel attention sends, as a pure function of the layer's sizes: the bytes
//! one rank puts on the wire for one attention layer and one microbatch, forward and backward,
//! for each comm type (the messages are f32).
//!
//! With `L = s / cp` positions on a rank, `b` sequences, `g` key/value groups and `g·p` query
//! heads of `d` on its tensor-parallel rank: its keys and values are `K = 2·L·b·g·d` elements,
//! its fused projection `Q = L·b·g·(p + 2)·d`, its context `O = L·b·g·p·d`. Over a group of
//! `n` ranks an all-gather or a reduce-scatter sends `(n − 1)` times a rank's part, an
//! all-to-all `(n − 1)/n` of a rank's buffer, a ring step one block:
//! - `all_gather`: forward `(n − 1)·K` (the keys and values gathered); backward `2·(n − 1)·K`
//!   (gathered again, their gradients reduce-scattered).
//! - `p2p`: forward `(n − 1)·K` (the blocks go round, the last one not sent on); backward
//!   `(2n − 1)·K` (each step the block with its gradients so far, the gradients alone after
//!   the last).
//! - `a2a` over `a = cp`: forward `(a − 1)/a·(Q + O)` (the projection out, the context back);
//!   backward the same (the context's gradient out, the projection's back).
//! - `a2a+p2p` with sizes `a × n`: the all-to-all's part over `a` plus the ring's over `n`
//!   (after the all-to-all a rank holds `a·L` positions of `g/a` groups: still `K`).

use super::CpCommType;
use crate::comm::{CommStats, OpKind};

/// One layer's sizes on one rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerSizes {
    /// Positions of the whole sequence.
    pub seq: usize,
    /// Sequences per microbatch.
    pub batch: usize,
    /// Key/value groups on the tensor-parallel rank.
    pub groups: usize,
    /// Query heads per group.
    pub per_group: usize,
    /// Elements per head.
    pub head_dim: usize,
}

/// Bytes one rank sends for one attention layer and microbatch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct Traffic {
    /// In the forward.
    pub forward: u64,
    /// In the backward.
    pub backward: u64,
}

impl Traffic {
    /// Forward and backward.
    pub fn total(&self) -> u64 {
        self.forward + self.backward
    }
}

/// What `kind` sends at context-parallel size `cp` for a layer of `sizes` (the formulas of
/// the module's header).
pub fn traffic(kind: CpCommType, cp: usize, sizes: LayerSizes) -> Traffic {
    let LayerSizes {
        seq,
        batch,
        groups,
        per_group,
        head_dim,
    } = sizes;
    let local = (seq / cp.max(1) * batch * groups * head_dim) as u64;
    let (kv, qkv, out) = (
        2 * local,
        local * (per_group as u64 + 2),
        local * per_group as u64,
    );
    let all_to_all = |a: u64| Traffic {
        forward: (a - 1) * (qkv + out) / a,
        backward: (a - 1) * (out + qkv) / a,
    };
    let ring = |n: u64| Traffic {
        forward: (n - 1) * kv,
        backward: (2 * n - 1) * kv,
    };
    let n = cp.max(1) as u64;
    let elements = match kind {
        _ if n == 1 => Traffic::default(),
        CpCommType::AllGather => Traffic {
            forward: (n - 1) * kv,
            backward: 2 * (n - 1) * kv,
        },
        CpCommType::P2p => ring(n),
        CpCommType::A2a => all_to_all(n),
        CpCommType::A2aP2p { a2a, p2p } => {
            let (a, r) = (all_to_all(a2a as u64), ring(p2p as u64));
            let r = if p2p > 1 { r } else { Traffic::default() };
            Traffic {
                forward: a.forward + r.forward,
                backward: a.backward + r.backward,
            }
        }
    };
    Traffic {
        forward: 4 * elements.forward,
        backward: 4 * elements.backward,
    }
}

/// The bytes a rank put on the wire in `stats` (its counters on a group of `size` ranks, as
/// [`CommStats`] counts them: a collective's buffer, a send's message): an all-gather or
/// reduce-scatter's part `size − 1` times, an all-to-all's buffer less the rank's own part, a
/// send once; receives and all-reduces (none here) not counted.
pub fn sent(size: usize, stats: &CommStats) -> u64 {
    let n = size.max(1) as u64;
    stats
        .ops
        .iter()
        .map(|(kind, op)| match kind {
            OpKind::AllGather | OpKind::ReduceScatter => (n - 1) * op.bytes,
            OpKind::AllToAll => (n - 1) * op.bytes / n,
            OpKind::Send => op.bytes,
            _ => 0,
        })
        .sum()
}
