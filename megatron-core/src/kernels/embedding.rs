//! Embedding lookup and its scatter-add gradient, for a full or vocab-parallel table shard.
//!
//! A shard holds rows `vocab_start .. vocab_start + v_local` of the logical `[vocab, hidden]`
//! table. Tokens whose id falls outside the shard produce zero rows (the tensor-parallel all-reduce
//! then sums the shards' outputs) and contribute nothing to the shard's gradient. Validating ids
//! against the full vocabulary is the caller's job.

use super::shape::numel;
use super::{KernelError, check_len};

/// Row of the local shard holding token `id`, if the shard holds it.
#[inline]
fn local_row(id: i64, vocab_start: usize, v_local: usize) -> Option<usize> {
    let id = u64::try_from(id).ok()?;
    let row = id.checked_sub(vocab_start as u64)?;
    (row < v_local as u64).then_some(row as usize)
}

/// Looks up `out[n, hidden]` rows of `table[v_local, hidden]` for `ids[n]`; ids outside the shard give zero rows.
/// A 16-bit table's rows are widened to f32 as they are copied (the rest of the table is not read).
pub fn embedding_forward<T: Copy + Into<f32>>(
    ids: &[i64],
    table: &[T],
    vocab_start: usize,
    v_local: usize,
    hidden: usize,
    out: &mut [f32],
) -> Result<(), KernelError> {
    const K: &str = "embedding_forward";
    let n = ids.len();
    let dims =
        || format!("tokens {n} × hidden {hidden}, shard of {v_local} rows from {vocab_start}");
    check_len(K, "table", table.len(), numel(K, &[v_local, hidden])?, dims)?;
    check_len(K, "out", out.len(), numel(K, &[n, hidden])?, dims)?;
    if hidden == 0 {
        return Ok(());
    }
    for (&id, row) in ids.iter().zip(out.chunks_exact_mut(hidden)) {
        match local_row(id, vocab_start, v_local) {
            Some(r) => {
                for (o, &v) in row.iter_mut().zip(&table[r * hidden..(r + 1) * hidden]) {
                    *o = v.into();
                }
            }
            None => row.fill(0.0),
        }
    }
    Ok(())
}

/// Scatter-adds `dout[n, hidden]` into `dtable[v_local, hidden]` (`+=`) for the ids the shard holds, tokens in order.
pub fn embedding_backward(
    ids: &[i64],
    dout: &[f32],
    vocab_start: usize,
    v_local: usize,
    hidden: usize,
    dtable: &mut [f32],
) -> Result<(), KernelError> {
    const K: &str = "embedding_backward";
    let n = ids.len();
    let dims =
        || format!("tokens {n} × hidden {hidden}, shard of {v_local} rows from {vocab_start}");
    check_len(K, "dout", dout.len(), numel(K, &[n, hidden])?, dims)?;
    check_len(
        K,
        "dtable",
        dtable.len(),
        numel(K, &[v_local, hidden])?,
        dims,
    )?;
    if hidden == 0 {
        return Ok(());
    }
    for (&id, g) in ids.iter().zip(dout.chunks_exact(hidden)) {
        if let Some(r) = local_row(id, vocab_start, v_local) {
            for (acc, &v) in dtable[r * hidden..(r + 1) * hidden].iter_mut().zip(g) {
                *acc += v;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::test_util::{Rng, check_directional, weighted_sum};
    use super::*;

    #[test]
    fn forward_matches_reference_and_shards_sum_to_full() {
        let mut rng = Rng::new(60);
        let (vocab, hidden) = (10, 6);
        let table = rng.vec(vocab * hidden, -1.0, 1.0);
        let ids: Vec<i64> = (0..17).map(|_| rng.below(vocab as u64) as i64).collect();
        let mut full = vec![f32::NAN; ids.len() * hidden];
        embedding_forward(&ids, &table, 0, vocab, hidden, &mut full).unwrap();
        for (t, &id) in ids.iter().enumerate() {
            let id = id as usize;
            assert_eq!(
                &full[t * hidden..(t + 1) * hidden],
                &table[id * hidden..(id + 1) * hidden]
            );
        }
        // Two uneven vocab shards: [0, 4) and [4, 10).
        let mut sum = vec![0.0; full.len()];
        for (start, len) in [(0, 4), (4, 6)] {
            let mut out = vec![f32::NAN; full.len()];
            let shard = &table[start * hidden..(start + len) * hidden];
            embedding_forward(&ids, shard, start, len, hidden, &mut out).unwrap();
            for (t, &id) in ids.iter().enumerate() {
                let held = (start as i64..(start + len) as i64).contains(&id);
                if !held {
                    assert!(out[t * hidden..(t + 1) * hidden].iter().all(|&v| v == 0.0));
                }
            }
            for (s, o) in sum.iter_mut().zip(&out) {
                *s += o;
            }
        }
        assert_eq!(sum, full);
        // Ids outside the shard (including negative ones) give zero rows.
        let mut out = vec![f32::NAN; 2 * hidden];
        embedding_forward(&[-1, i64::MAX], &table, 0, vocab, hidden, &mut out).unwrap();
        assert!(out.iter().all(|&v| v == 0.0));
    }

    #[test]
    fn backward_scatter_adds_and_matches_finite_differences() {
        let mut rng = Rng::new(61);
        let (v_local, hidden, start) = (5, 4, 3);
        let ids: Vec<i64> = vec![3, 7, 3, 0, 9, 5, 3, -2, 7];
        let n = ids.len();
        let table = rng.vec(v_local * hidden, -1.0, 1.0);
        let w = rng.vec(n * hidden, -1.0, 1.0);
        let init = rng.vec(v_local * hidden, -1.0, 1.0);
        let mut dtable = init.clone();
        embedding_backward(&ids, &w, start, v_local, hidden, &mut dtable).unwrap();
        // Reference: f64 scatter-add.
        for r in 0..v_local {
            for j in 0..hidden {
                let s: f64 = (0..n)
                    .filter(|&t| ids[t] == (start + r) as i64)
                    .map(|t| w[t * hidden + j] as f64)
                    .sum();
                let got = dtable[r * hidden + j] as f64;
                assert!((got - (init[r * hidden + j] as f64 + s)).abs() < 1e-6);
            }
        }
        let g: Vec<f32> = dtable.iter().zip(&init).map(|(a, b)| a - b).collect();
        let d = rng.vec(v_local * hidden, -1.0, 1.0);
        check_directional("embedding dtable", &table, &d, 1e-2, &g, 1e-4, |tab| {
            let mut out = vec![0.0; n * hidden];
            embedding_forward(&ids, tab, start, v_local, hidden, &mut out).unwrap();
            weighted_sum(&w, &out)
        });
    }

    #[test]
    fn errors() {
        let mut out = [0.0; 6];
        let e = embedding_forward(&[0, 1], &[0.0; 5], 0, 2, 3, &mut out).unwrap_err();
        assert!(matches!(
            e,
            KernelError::Length {
                buffer: "table",
                expected: 6,
                actual: 5,
                ..
            }
        ));
        let e = embedding_forward(&[0, 1], &[0.0; 6], 0, 2, 3, &mut out[..5]).unwrap_err();
        assert!(matches!(e, KernelError::Length { buffer: "out", .. }));
        let e = embedding_backward(&[0, 1], &[0.0; 6], 0, 2, 3, &mut out[..4]).unwrap_err();
        assert!(matches!(
            e,
            KernelError::Length {
                buffer: "dtable",
                ..
            }
        ));
        let e = embedding_backward(&[0], &[0.0; 6], 0, 2, 3, &mut out).unwrap_err();
        assert!(matches!(e, KernelError::Length { buffer: "dout", .. }));
    }
}
