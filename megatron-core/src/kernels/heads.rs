//! Grouped-query attention's fused projection as multi-head attention reads it, and back.
//!
//! Megatron-LM lays the fused QKV projection out per query group: a row (one token) is
//! `groups` blocks of `per_group` query heads, the group's key and its value, `head_dim` each.
//! Multi-head attention reads `[q | k | v]` per head. [`expand_groups`] writes each query head
//! with its group's key and value (Hugging Face's `repeat_kv`); [`reduce_groups`] is its
//! backward: the query heads' gradients copied, each group's key and value gradients summed
//! over its query heads, in head order.

use super::{KernelError, check_len};

/// The sizes of one call: `rows` tokens of `groups` groups of `per_group` query heads of
/// `head_dim`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupedHeads {
    /// Tokens (sequence × batch).
    pub rows: usize,
    /// Query groups (on this rank).
    pub groups: usize,
    /// Query heads per group.
    pub per_group: usize,
    /// Elements per head.
    pub head_dim: usize,
}

impl GroupedHeads {
    /// Elements of a grouped row: `groups · (per_group + 2) · head_dim`.
    pub fn grouped(&self) -> usize {
        self.groups * (self.per_group + 2) * self.head_dim
    }

    /// Elements of a per-head row: `groups · per_group · 3 · head_dim`.
    pub fn per_head(&self) -> usize {
        self.groups * self.per_group * 3 * self.head_dim
    }

    /// Checks `grouped` and `per_head` buffers' lengths (the GPU launchers make the same).
    pub fn check(
        &self,
        kernel: &'static str,
        grouped: (&'static str, usize),
        per_head: (&'static str, usize),
    ) -> Result<(), KernelError> {
        let n = |row: usize| {
            self.rows
                .checked_mul(row)
                .ok_or_else(|| KernelError::Invalid {
                    kernel,
                    message: format!("{self:?} overflows"),
                })
        };
        let dims = || format!("{self:?}");
        check_len(kernel, grouped.0, grouped.1, n(self.grouped())?, dims)?;
        check_len(kernel, per_head.0, per_head.1, n(self.per_head())?, dims)
    }

    /// Where per-head element `(head j of group g, part p, k)` of a row comes from in the
    /// grouped row: query `j` of the group, or the group's key (p = 1) or value (p = 2).
    #[inline(always)]
    pub fn source(&self, g: usize, j: usize, part: usize, k: usize) -> usize {
        let block = g * (self.per_group + 2) * self.head_dim;
        match part {
            0 => block + j * self.head_dim + k,
            p => block + (self.per_group + p - 1) * self.head_dim + k,
        }
    }
}

/// `y[rows, per_head]` = each query head of `x[rows, grouped]` with its group's key and value.
pub fn expand_groups(x: &[f32], y: &mut [f32], sh: GroupedHeads) -> Result<(), KernelError> {
    sh.check("expand_groups", ("x", x.len()), ("y", y.len()))?;
    let (gr, hr, d) = (sh.grouped(), sh.per_head(), sh.head_dim);
    for (xr, yr) in x.chunks_exact(gr.max(1)).zip(y.chunks_exact_mut(hr.max(1))) {
        for g in 0..sh.groups {
            for j in 0..sh.per_group {
                for part in 0..3 {
                    let at = ((g * sh.per_group + j) * 3 + part) * d;
                    let from = sh.source(g, j, part, 0);
                    yr[at..at + d].copy_from_slice(&xr[from..from + d]);
                }
            }
        }
    }
    Ok(())
}

/// The backward of [`expand_groups`]: `dx[rows, grouped]` from `dy[rows, per_head]`, each
/// group's key and value gradients summed over its query heads in order (overwrites `dx`).
pub fn reduce_groups(dy: &[f32], dx: &mut [f32], sh: GroupedHeads) -> Result<(), KernelError> {
    sh.check("reduce_groups", ("dx", dx.len()), ("dy", dy.len()))?;
    let (gr, hr, d) = (sh.grouped(), sh.per_head(), sh.head_dim);
    for (dxr, dyr) in dx
        .chunks_exact_mut(gr.max(1))
        .zip(dy.chunks_exact(hr.max(1)))
    {
        for g in 0..sh.groups {
            for part in 0..3 {
                for k in 0..d {
                    if part == 0 {
                        for j in 0..sh.per_group {
                            dxr[sh.source(g, j, 0, k)] = dyr[((g * sh.per_group + j) * 3) * d + k];
                        }
                    } else {
                        let mut sum = 0.0f32;
                        for j in 0..sh.per_group {
                            sum += dyr[((g * sh.per_group + j) * 3 + part) * d + k];
                        }
                        dxr[sh.source(g, 0, part, k)] = sum;
                    }
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queries_get_their_groups_key_and_value_and_the_backward_sums_them() {
        let sh = GroupedHeads {
            rows: 2,
            groups: 2,
            per_group: 3,
            head_dim: 2,
        };
        // Row r, group g, slot s (0..3 queries, 3 key, 4 value), element k: 1000r + 100g + 10s + k.
        let x: Vec<f32> = (0..sh.rows)
            .flat_map(|r| {
                (0..2).flat_map(move |g| {
                    (0..5).flat_map(move |s| {
                        (0..2).map(move |k| (1000 * r + 100 * g + 10 * s + k) as f32)
                    })
                })
            })
            .collect();
        let mut y = vec![f32::NAN; sh.rows * sh.per_head()];
        expand_groups(&x, &mut y, sh).unwrap();
        for r in 0..2 {
            for g in 0..2 {
                for j in 0..3 {
                    for (part, slot) in [(0, j), (1, 3), (2, 4)] {
                        for k in 0..2 {
                            let got = y[r * sh.per_head() + ((g * 3 + j) * 3 + part) * 2 + k];
                            assert_eq!(got, (1000 * r + 100 * g + 10 * slot + k) as f32);
                        }
                    }
                }
            }
        }
        let dy: Vec<f32> = (0..y.len()).map(|i| i as f32).collect();
        let mut dx = vec![f32::NAN; x.len()];
        reduce_groups(&dy, &mut dx, sh).unwrap();
        // The adjoint of the copy: ⟨expand(x), dy⟩ = ⟨x, reduce(dy)⟩.
        let lhs: f64 = y.iter().zip(&dy).map(|(a, b)| *a as f64 * *b as f64).sum();
        let rhs: f64 = x.iter().zip(&dx).map(|(a, b)| *a as f64 * *b as f64).sum();
        assert_eq!(lhs, rhs);
        let err = expand_groups(&x[1..], &mut y, sh).unwrap_err().to_string();
        assert!(err.contains("`x` has 39 elements, expected 40"), "{err}");
    }
}
