//! Rotary position embeddings (RoPE) on a fused attention projection.
//!
//! A row of the projection (one token of one sequence) is `groups` blocks of `parts` heads of
//! `head_dim` elements each: Megatron-LM's fused QKV, laid out per query group as the query
//! heads, the key and the value (`parts = queries per group + 2`; multi-head attention is one
//! query per group). The first `rotated` heads of a block (queries and key) have their first
//! `rot` elements turned by position-dependent angles; everything else is copied.
//!
//! At position `p`, frequency `j` turns the pair `(x_a, x_b)` by `θ = p·inv_freq[j]` (in f32,
//! as Megatron-LM and Hugging Face compute it): `(x_a·cos θ − x_b·sin θ, x_b·cos θ + x_a·sin θ)`.
//! The pairs are `(j, j + rot/2)` (rotate-half, Megatron-LM's default and Hugging Face's) or
//! `(2j, 2j + 1)` (`--rotary-interleaved`). The inverse turns by `−θ`: it is the backward (a
//! rotation's transpose is its inverse).

use super::{KernelError, check_len};

/// Where RoPE applies in a fused projection and how.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeLayout {
    /// Tokens of a sequence (the projection is `[seq, batch, row]`).
    pub seq: usize,
    /// Sequences.
    pub batch: usize,
    /// Blocks in a row (query groups on this rank).
    pub groups: usize,
    /// Heads in a block.
    pub parts: usize,
    /// Heads turned at the start of each block (the queries and the key).
    pub rotated: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Elements turned at the start of each turned head (even, at most `head_dim`).
    pub rot: usize,
    /// Pairs `(2j, 2j + 1)` instead of `(j, j + rot/2)`.
    pub interleaved: bool,
    /// The position of the first token (0 for training; the cached length when generating).
    pub offset: usize,
    /// The factor on the cosines and sines (YaRN's; 1 otherwise).
    pub amplitude: f32,
}

impl RopeLayout {
    /// Elements of one token's row.
    pub fn row(&self) -> usize {
        self.groups * self.parts * self.head_dim
    }

    /// Checks the layout against `inv_freq` and buffers of `len` elements (the GPU launcher
    /// makes the same checks).
    pub fn check(
        &self,
        kernel: &'static str,
        inv_freq: usize,
        lens: &[(&'static str, usize)],
    ) -> Result<(), KernelError> {
        let invalid = |message: String| Err(KernelError::Invalid { kernel, message });
        if self.rot == 0 || !self.rot.is_multiple_of(2) || self.rot > self.head_dim {
            return invalid(format!(
                "{} rotary dimensions of a head of {}: must be even, at least 2 and at most the head",
                self.rot, self.head_dim
            ));
        }
        if self.rotated > self.parts {
            return invalid(format!(
                "{} turned heads of blocks of {}",
                self.rotated, self.parts
            ));
        }
        if inv_freq != self.rot / 2 {
            return invalid(format!(
                "{inv_freq} frequencies for {} rotary dimensions",
                self.rot
            ));
        }
        let n = [self.seq, self.batch, self.row()]
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or_else(|| KernelError::Invalid {
                kernel,
                message: format!("{self:?} overflows"),
            })?;
        for &(name, len) in lens {
            check_len(kernel, name, len, n, || format!("{self:?}"))?;
        }
        Ok(())
    }

    /// Element `k` of a turned head's pair partner, and whether `k` is the pair's first.
    #[inline(always)]
    pub fn partner(&self, k: usize) -> (usize, usize, bool) {
        if self.interleaved {
            (k ^ 1, k / 2, k.is_multiple_of(2))
        } else {
            let half = self.rot / 2;
            if k < half {
                (k + half, k, true)
            } else {
                (k - half, k - half, false)
            }
        }
    }
}

/// `y` = `x` with RoPE applied (`inverse`: turned back, the backward); `inv_freq` holds the
/// `rot/2` frequencies. `x` and `y` are `[seq, batch, row]` of `layout`.
pub fn rope(
    x: &[f32],
    y: &mut [f32],
    layout: RopeLayout,
    inv_freq: &[f32],
    inverse: bool,
) -> Result<(), KernelError> {
    layout.check("rope", inv_freq.len(), &[("x", x.len()), ("y", y.len())])?;
    let (d, row) = (layout.head_dim, layout.row());
    let mut angles = vec![(0f32, 0f32); inv_freq.len()];
    for s in 0..layout.seq {
        let p = (layout.offset + s) as f32;
        for (a, &f) in angles.iter_mut().zip(inv_freq) {
            let (sin, cos) = (p * f).sin_cos();
            let (sin, cos) = (sin * layout.amplitude, cos * layout.amplitude);
            *a = (if inverse { -sin } else { sin }, cos);
        }
        for b in 0..layout.batch {
            let start = (s * layout.batch + b) * row;
            let (xr, yr) = (&x[start..start + row], &mut y[start..start + row]);
            yr.copy_from_slice(xr);
            for g in 0..layout.groups {
                for part in 0..layout.rotated {
                    let h = (g * layout.parts + part) * d;
                    let (xh, yh) = (&xr[h..h + d], &mut yr[h..h + d]);
                    for k in 0..layout.rot {
                        let (other, j, first) = layout.partner(k);
                        let (sin, cos) = angles[j];
                        yh[k] = if first {
                            xh[k] * cos - xh[other] * sin
                        } else {
                            xh[k] * cos + xh[other] * sin
                        };
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

    fn layout(interleaved: bool) -> RopeLayout {
        RopeLayout {
            seq: 5,
            batch: 2,
            groups: 2,
            parts: 4,
            rotated: 3,
            head_dim: 6,
            rot: 4,
            interleaved,
            offset: 3,
            amplitude: 1.0,
        }
    }

    /// The closed form: each pair turned by p·f in f64 and scaled by the amplitude, heads past
    /// `rotated` and elements past `rot` copied; the inverse (the transpose) undoes the turn and
    /// scales again.
    #[test]
    fn rope_turns_pairs_by_position_times_frequency() {
        let inv_freq = [1.0f32, 0.1];
        for (interleaved, amplitude) in [(false, 1.0), (true, 1.0), (false, 1.25), (true, 0.75)] {
            let l = RopeLayout {
                amplitude,
                ..layout(interleaved)
            };
            let a = f64::from(amplitude);
            let n = l.seq * l.batch * l.row();
            let x: Vec<f32> = (0..n).map(|i| ((i * 7) % 11) as f32 - 5.0).collect();
            let mut y = vec![f32::NAN; n];
            rope(&x, &mut y, l, &inv_freq, false).unwrap();
            for s in 0..l.seq {
                let p = (l.offset + s) as f64;
                for b in 0..l.batch {
                    for g in 0..l.groups {
                        for part in 0..l.parts {
                            let at = ((s * l.batch + b) * l.row()) + (g * l.parts + part) * 6;
                            for k in 0..6 {
                                let want = if part < l.rotated && k < 4 {
                                    let (other, j, first) = l.partner(k);
                                    let t = p * inv_freq[j] as f64;
                                    let (xa, xb) = (x[at + k] as f64, x[at + other] as f64);
                                    a * if first {
                                        xa * t.cos() - xb * t.sin()
                                    } else {
                                        xa * t.cos() + xb * t.sin()
                                    }
                                } else {
                                    x[at + k] as f64
                                };
                                let got = y[at + k] as f64;
                                assert!((got - want).abs() < 1e-5, "{interleaved} {s} {part} {k}");
                            }
                        }
                    }
                }
            }
            let mut back = vec![f32::NAN; n];
            rope(&y, &mut back, l, &inv_freq, true).unwrap();
            for (k, (got, x)) in back.iter().zip(&x).enumerate() {
                let e = k % l.row() % 6;
                let turned = (k % l.row() / 6) % l.parts < l.rotated && e < 4;
                let want = if turned {
                    a * a * f64::from(*x)
                } else {
                    f64::from(*x)
                };
                assert!((f64::from(*got) - want).abs() < 1e-5, "{got} vs {want}");
            }
        }
    }

    #[test]
    fn bad_layouts_are_named() {
        let mut l = layout(false);
        l.rot = 5;
        let x = vec![0.0; l.seq * l.batch * l.row()];
        let err = rope(&x, &mut x.clone(), l, &[1.0, 1.0], false).unwrap_err();
        assert!(
            err.to_string()
                .contains("5 rotary dimensions of a head of 6"),
            "{err}"
        );
        let l = layout(false);
        let err = rope(&x, &mut x.clone(), l, &[1.0], false).unwrap_err();
        assert!(
            err.to_string().contains("1 frequencies for 4 rotary"),
            "{err}"
        );
        let err = rope(&x[1..], &mut x.clone(), l, &[1.0, 1.0], false).unwrap_err();
        assert!(err.to_string().contains("`x` has"), "{err}");
    }
}
