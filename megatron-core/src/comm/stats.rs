//! Counters of calls and bytes per operation kind, as one rank sees one group.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};

use super::OpKind;

/// Calls and bytes of one operation kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct OpStats {
    /// Number of calls.
    pub calls: u64,
    /// Bytes of the buffer one rank passes (NCCL's count × element size), summed over calls.
    pub bytes: u64,
}

/// A snapshot of one rank's counters on one group.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CommStats {
    /// Counters of every kind called at least once.
    pub ops: BTreeMap<super::OpKind, OpStats>,
}

impl CommStats {
    /// The counters of one kind (zero if never called).
    pub fn get(&self, kind: OpKind) -> OpStats {
        self.ops.get(&kind).copied().unwrap_or_default()
    }

    /// What happened between `earlier` and this snapshot.
    pub fn since(&self, earlier: &CommStats) -> CommStats {
        let ops = self
            .ops
            .iter()
            .filter_map(|(&kind, now)| {
                let before = earlier.get(kind);
                let delta = OpStats {
                    calls: now.calls - before.calls,
                    bytes: now.bytes - before.bytes,
                };
                (delta.calls > 0).then_some((kind, delta))
            })
            .collect();
        CommStats { ops }
    }

    /// Total bytes over every kind.
    pub fn total_bytes(&self) -> u64 {
        self.ops.values().map(|s| s.bytes).sum()
    }
}

/// Live counters, updated by the rank that owns the handle and readable from any thread.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    calls: [AtomicU64; OpKind::ALL.len()],
    bytes: [AtomicU64; OpKind::ALL.len()],
}

impl Counters {
    /// Counts one call moving `bytes`.
    pub(crate) fn record(&self, kind: OpKind, bytes: usize) {
        let i = kind as usize;
        self.calls[i].fetch_add(1, Ordering::Relaxed);
        self.bytes[i].fetch_add(bytes as u64, Ordering::Relaxed);
    }

    /// A snapshot.
    pub(crate) fn snapshot(&self) -> CommStats {
        let ops = OpKind::ALL
            .iter()
            .filter_map(|&kind| {
                let i = kind as usize;
                let calls = self.calls[i].load(Ordering::Relaxed);
                (calls > 0).then(|| {
                    (
                        kind,
                        OpStats {
                            calls,
                            bytes: self.bytes[i].load(Ordering::Relaxed),
                        },
                    )
                })
            })
            .collect();
        CommStats { ops }
    }
}
