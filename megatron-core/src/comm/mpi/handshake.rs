//! The handshake before every collective: each member tells every other what it is about to
//! call, so that disagreeing calls become a [`CommError::Mismatch`] on every rank and members that
//! never come a [`CommError::Timeout`] naming them, before any data moves.
//!
//! A call is described in a few 64-bit words: sequence number, kind, dtype, count, reduction,
//! peer, and for all-to-all both split vectors (which may differ between ranks, as long as what
//! rank i sends to j is what j expects from i).

use crate::comm::{CallDesc, CommError, OpKind, ReduceOp, Result};
use crate::tensor::DType;

const NONE: u64 = u64::MAX;

/// A dtype's number on the wire.
pub(super) fn dtype_code(d: DType) -> u64 {
    DType::ALL.iter().position(|&x| x == d).unwrap_or(0) as u64
}

/// The dtype of a wire number.
pub(super) fn dtype_of(code: u64) -> Option<DType> {
    DType::ALL.get(usize::try_from(code).ok()?).copied()
}

const OPS: [ReduceOp; 3] = [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min];

/// One member's announced call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Announce {
    /// How many collectives this member called on the group before this one.
    pub seq: u64,
    /// The call.
    pub desc: CallDesc,
    /// All-to-all only: elements sent to each member, and expected from each.
    pub splits: Option<(Vec<usize>, Vec<usize>)>,
}

impl Announce {
    /// The wire form.
    pub fn encode(&self) -> Vec<u64> {
        let d = &self.desc;
        let mut words = vec![
            self.seq,
            d.kind as u64,
            dtype_code(d.dtype),
            d.count as u64,
            d.op.map_or(NONE, |op| {
                OPS.iter().position(|&o| o == op).unwrap_or(0) as u64
            }),
            d.peer.map_or(NONE, |p| p as u64),
        ];
        if let Some((send, recv)) = &self.splits {
            words.extend(send.iter().chain(recv).map(|&n| n as u64));
        }
        words
    }

    /// Reads the wire form of a group of `members`; `None` if it is not one.
    pub fn decode(words: &[u64], members: usize) -> Option<Announce> {
        let [seq, kind, dtype, count, op, peer, rest @ ..] = words else {
            return None;
        };
        let kind = *OpKind::ALL.get(usize::try_from(*kind).ok()?)?;
        let desc = CallDesc {
            kind,
            dtype: dtype_of(*dtype)?,
            count: usize::try_from(*count).ok()?,
            op: match *op {
                NONE => None,
                i => Some(*OPS.get(usize::try_from(i).ok()?)?),
            },
            peer: match *peer {
                NONE => None,
                p => Some(usize::try_from(p).ok()?),
            },
        };
        let splits = match rest.len() {
            0 => None,
            n if n == 2 * members => {
                let v: Vec<usize> = rest.iter().map(|&w| w as usize).collect();
                Some((v[..members].to_vec(), v[members..].to_vec()))
            }
            _ => return None,
        };
        Some(Announce {
            seq: *seq,
            desc,
            splits,
        })
    }

    /// The call as errors show it, with its position in the group's sequence.
    fn show(&self) -> String {
        format!("{} (call #{})", self.desc, self.seq + 1)
    }

    /// Whether two members' calls agree (all-to-all counts may differ).
    fn agrees(&self, other: &Announce) -> bool {
        let (a, b) = (&self.desc, &other.desc);
        self.seq == other.seq
            && a.kind == b.kind
            && a.dtype == b.dtype
            && a.op == b.op
            && a.peer == b.peer
            && (a.kind == OpKind::AllToAll || a.count == b.count)
            && self.splits.is_some() == other.splits.is_some()
    }
}

/// Checks every member's announcement (in group order; `ranks` are their global ranks): the
/// same verdict on every member, since each holds all of them.
pub(super) fn verify(group: &str, ranks: &[usize], all: &[Announce]) -> Result<()> {
    let first = &all[0];
    if let Some(j) = all.iter().position(|a| !a.agrees(first)) {
        return Err(CommError::Mismatch {
            group: group.to_string(),
            rank_a: ranks[0],
            call_a: first.show(),
            rank_b: ranks[j],
            call_b: all[j].show(),
        });
    }
    if first.desc.kind != OpKind::AllToAll {
        return Ok(());
    }
    for (i, a) in all.iter().enumerate() {
        for (j, b) in all.iter().enumerate() {
            let (Some((send, _)), Some((_, recv))) = (&a.splits, &b.splits) else {
                continue;
            };
            if send[j] != recv[i] {
                return Err(CommError::Invalid {
                    group: group.to_string(),
                    message: format!(
                        "all_to_all: rank {} sends {} elements to rank {}, which expects {}",
                        ranks[i], send[j], ranks[j], recv[i]
                    ),
                });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn announce(kind: OpKind, count: usize, splits: Option<(Vec<usize>, Vec<usize>)>) -> Announce {
        Announce {
            seq: 3,
            desc: CallDesc {
                kind,
                dtype: DType::BF16,
                count,
                op: (kind == OpKind::AllReduce).then_some(ReduceOp::Max),
                peer: None,
            },
            splits,
        }
    }

    #[test]
    fn announcements_survive_the_wire() {
        for a in [
            announce(OpKind::AllReduce, 7, None),
            announce(OpKind::AllToAll, 5, Some((vec![2, 3], vec![1, 4]))),
        ] {
            assert_eq!(Announce::decode(&a.encode(), 2), Some(a));
        }
        assert_eq!(Announce::decode(&[1, 2, 3], 2), None);
    }

    #[test]
    fn disagreements_name_both_calls_and_bad_splits_name_the_pair() {
        let ranks = [4, 6];
        let a = announce(OpKind::AllReduce, 7, None);
        let b = announce(OpKind::AllReduce, 8, None);
        let err = verify("tp", &ranks, &[a.clone(), b])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("rank 4 called all_reduce(max, bf16 × 7)"),
            "{err}"
        );
        assert!(
            err.contains("rank 6 called all_reduce(max, bf16 × 8)"),
            "{err}"
        );
        assert!(verify("tp", &ranks, &[a.clone(), a]).is_ok());

        let x = announce(OpKind::AllToAll, 5, Some((vec![2, 3], vec![2, 1])));
        let y = announce(OpKind::AllToAll, 4, Some((vec![1, 3], vec![3, 3])));
        assert!(verify("ep", &ranks, &[x.clone(), y]).is_ok());
        let y = announce(OpKind::AllToAll, 4, Some((vec![2, 2], vec![3, 3])));
        let err = verify("ep", &ranks, &[x, y]).unwrap_err().to_string();
        assert!(
            err.contains("rank 6 sends 2 elements to rank 4, which expects 1"),
            "{err}"
        );
    }
}
