//! A rank's local experts as grouped products (Megatron-LM's `GroupedMLP`): every expert is an
//! MLP `fc2(gelu(fc1(x)))` without biases, or with `--swiglu` the gated `fc2(swiglu(fc1(x)))`
//! (Mixtral's and Qwen3-MoE's experts, fc1 holding the gate's rows and then the up
//! projection's), its weights one slice of `fc1: [experts, ffn or 2·ffn, hidden]` and `fc2:
//! [experts, hidden, ffn]`, and each product runs for all experts at once
//! ([`crate::kernels::gemm::grouped_gemm`]) over their contiguous rows, as the dispatcher lays
//! them out. The products are in the thread's precision, as every host product is: in a `--bf16`
//! run they round their operands to bf16 and sum in f32
//! ([`crate::kernels::gemm::grouped_gemm_bf16`]), the forward's and both backward products, as
//! Megatron-LM's grouped GEMM multiplies bf16 experts.

use crate::backend::cpu_grouped_product as grouped_product;
use crate::error::Result;
use crate::invalid;
use crate::kernels::elementwise::{gelu_backward, gelu_forward, swiglu_backward, swiglu_forward};
use crate::kernels::gemm::{Group, MatMut, MatRef};
use crate::tensor::Tensor;

/// The shapes of a rank's local experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertShape {
    /// Local experts.
    pub experts: usize,
    /// The model's hidden size.
    pub hidden: usize,
    /// Each expert's hidden layer (`--moe-ffn-hidden-size`).
    pub ffn: usize,
    /// Gated experts (SwiGLU): fc1 has `2·ffn` outputs, the gate's then the up projection's.
    pub gated: bool,
}

impl ExpertShape {
    /// fc1's outputs per expert: `ffn`, or `2·ffn` for gated experts.
    pub fn fc1_rows(&self) -> usize {
        if self.gated { 2 * self.ffn } else { self.ffn }
    }
}

/// What the experts' backward needs of the forward, where the forward ran.
#[derive(Debug, Clone)]
pub enum ExpertsSaved {
    /// The host's grouped products (see [`HostKept`]).
    Host(HostKept),
    /// A GPU's: the input rows `[n, hidden]` as the products read them, fc1's output
    /// `[n, fc1 rows]` (f32) and its activation `[n, ffn]` (in the products' dtype), and each
    /// local expert's rows.
    Device {
        /// The input rows.
        x: Tensor,
        /// fc1's output.
        pre: Tensor,
        /// GeLU or SwiGLU of it.
        act: Tensor,
        /// Rows of each local expert, in order.
        rows: Vec<usize>,
    },
}

/// What [`experts_backward`] needs of [`experts_forward`] on the host.
#[derive(Debug, Clone, PartialEq)]
pub struct HostKept {
    x: Vec<f32>,
    pre: Vec<f32>,
    act: Vec<f32>,
    rows: Vec<usize>,
}

impl HostKept {
    /// The values it holds (inputs, pre-activations and activations).
    pub fn len(&self) -> usize {
        self.x.len() + self.pre.len() + self.act.len()
    }

    /// Whether it holds no values (no rows).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// `buf` cut into consecutive pieces of `rows[g] × width` elements.
fn pieces<'a>(mut buf: &'a mut [f32], rows: &[usize], width: usize) -> Vec<&'a mut [f32]> {
    let mut out = Vec::with_capacity(rows.len());
    for &r in rows {
        let (head, tail) = std::mem::take(&mut buf).split_at_mut(r * width);
        out.push(head);
        buf = tail;
    }
    out
}

/// `C_g = A_g · op(W_g)` for every expert g at once: A_g the `rows[g] × width` piece of `a`
/// after the pieces before it, W_g expert g's `w_rows × w_cols` weight (transposed with `t`),
/// C_g the matching piece of `c`.
fn rows_times_weights(
    a: &[f32],
    width: usize,
    weights: &[f32],
    (w_rows, w_cols, t): (usize, usize, bool),
    rows: &[usize],
    c: &mut [f32],
) -> Result<()> {
    let out = if t { w_rows } else { w_cols };
    let mut groups = Vec::with_capacity(rows.len());
    let mut at = 0;
    for (g, (&r, c_g)) in rows.iter().zip(pieces(c, rows, out)).enumerate() {
        let a_g = MatRef::row_major(&a[at..at + r * width], r, width)?;
        at += r * width;
        let w = MatRef::row_major(
            &weights[g * w_rows * w_cols..(g + 1) * w_rows * w_cols],
            w_rows,
            w_cols,
        )?;
        groups.push(Group {
            a: a_g,
            b: if t { w.t() } else { w },
            c: MatMut::row_major(c_g, r, out)?,
        });
    }
    grouped_product(1.0, groups, 0.0)?;
    Ok(())
}

/// `dW_g += D_gᵀ · A_g` for every expert g at once: D_g and A_g the `rows[g]`-row pieces of
/// `d` (`d_width` wide) and `a` (`a_width` wide), dW_g expert g's `d_width × a_width` slice.
fn weight_grads(
    d: &[f32],
    a: &[f32],
    rows: &[usize],
    (d_width, a_width): (usize, usize),
    dw: &mut [f32],
) -> Result<()> {
    let mut groups = Vec::with_capacity(rows.len());
    let (mut d_at, mut a_at) = (0, 0);
    for (&r, dw_g) in rows
        .iter()
        .zip(pieces(dw, &vec![d_width; rows.len()], a_width))
    {
        let d_g = MatRef::row_major(&d[d_at..d_at + r * d_width], r, d_width)?;
        let a_g = MatRef::row_major(&a[a_at..a_at + r * a_width], r, a_width)?;
        d_at += r * d_width;
        a_at += r * a_width;
        groups.push(Group {
            a: d_g.t(),
            b: a_g,
            c: MatMut::row_major(dw_g, d_width, a_width)?,
        });
    }
    grouped_product(1.0, groups, 1.0)?;
    Ok(())
}

/// Checks that `rows` has one count per local expert, that the rows fill `x_len` values and
/// that both weights (`weights`: their lengths) hold every local expert.
pub(crate) fn check(
    shape: &ExpertShape,
    rows: &[usize],
    x_len: usize,
    weights: (usize, usize),
) -> Result<()> {
    let ExpertShape {
        experts, hidden, ..
    } = *shape;
    let (fc1_rows, ffn) = (shape.fc1_rows(), shape.ffn);
    let n: usize = rows.iter().sum();
    if rows.len() != experts {
        return invalid!("{} row groups for {experts} local experts", rows.len());
    }
    if x_len != n * hidden {
        return invalid!(
            "the experts' input has {x_len} values, {n} rows × hidden {hidden} need {}",
            n * hidden
        );
    }
    for (name, len, width) in [("fc1", weights.0, fc1_rows), ("fc2", weights.1, ffn)] {
        if len != experts * hidden * width {
            return invalid!(
                "the experts' {name} has {len} values, {experts} experts × {width} × {hidden} \
                 need {}",
                experts * hidden * width
            );
        }
    }
    Ok(())
}

/// The local experts on their rows: `x` is `[rows, hidden]`, the rows of expert g the
/// `rows[g]` after those of the experts before it. Returns `[rows, hidden]`.
pub fn experts_forward(
    shape: &ExpertShape,
    x: &[f32],
    rows: &[usize],
    fc1: &[f32],
    fc2: &[f32],
) -> Result<(Vec<f32>, HostKept)> {
    check(shape, rows, x.len(), (fc1.len(), fc2.len()))?;
    let (h, f, f1) = (shape.hidden, shape.ffn, shape.fc1_rows());
    let n: usize = rows.iter().sum();
    // pre = x · fc1ᵀ, act = gelu(pre) or swiglu(pre), y = act · fc2ᵀ.
    let mut pre = vec![0.0f32; n * f1];
    rows_times_weights(x, h, fc1, (f1, h, true), rows, &mut pre)?;
    let mut act = vec![0.0f32; n * f];
    if shape.gated {
        swiglu_forward(&pre, f, &mut act)?;
    } else {
        gelu_forward(&pre, &mut act)?;
    }
    let mut y = vec![0.0f32; n * h];
    rows_times_weights(&act, f, fc2, (h, f, true), rows, &mut y)?;
    Ok((
        y,
        HostKept {
            x: x.to_vec(),
            pre,
            act,
            rows: rows.to_vec(),
        },
    ))
}

/// The backward of [`experts_forward`]: accumulates the weights' gradients into `dfc1` and
/// `dfc2` (`+=`, laid out as the weights) and returns the input's gradient `[rows, hidden]`.
pub fn experts_backward(
    shape: &ExpertShape,
    saved: &HostKept,
    dy: &[f32],
    weights: (&[f32], &[f32]),
    (dfc1, dfc2): (&mut [f32], &mut [f32]),
) -> Result<Vec<f32>> {
    let (dx, dpre) = experts_backward_input(shape, saved, dy, weights)?;
    experts_weight_grads(shape, saved, dy, &dpre, (dfc1, dfc2))?;
    Ok(dx)
}

/// The input-gradient half of [`experts_backward`]: the input's gradient `[rows, hidden]` and
/// the activation's input gradient `dpre` (`[rows, fc1 rows]`), which the weight-gradient half
/// reads.
pub fn experts_backward_input(
    shape: &ExpertShape,
    saved: &HostKept,
    dy: &[f32],
    (fc1, fc2): (&[f32], &[f32]),
) -> Result<(Vec<f32>, Vec<f32>)> {
    let rows = &saved.rows;
    check(shape, rows, dy.len(), (fc1.len(), fc2.len()))?;
    let (h, f, f1) = (shape.hidden, shape.ffn, shape.fc1_rows());
    let n: usize = rows.iter().sum();
    // dact = dy · fc2; dpre = the activation's backward of dact; dx = dpre · fc1.
    let mut dact = vec![0.0f32; n * f];
    rows_times_weights(dy, h, fc2, (h, f, false), rows, &mut dact)?;
    let mut dpre = vec![0.0f32; n * f1];
    if shape.gated {
        swiglu_backward(&saved.pre, &dact, f, &mut dpre)?;
    } else {
        gelu_backward(&saved.pre, &dact, &mut dpre)?;
    }
    let mut dx = vec![0.0f32; n * h];
    rows_times_weights(&dpre, f1, fc1, (f1, h, false), rows, &mut dx)?;
    Ok((dx, dpre))
}

/// The weight-gradient half of [`experts_backward`]: `dfc2 += dyᵀ · act`, `dfc1 += dpreᵀ · x`
/// per expert, from the output gradient `dy` and the input half's `dpre`.
pub fn experts_weight_grads(
    shape: &ExpertShape,
    saved: &HostKept,
    dy: &[f32],
    dpre: &[f32],
    (dfc1, dfc2): (&mut [f32], &mut [f32]),
) -> Result<()> {
    let rows = &saved.rows;
    check(shape, rows, saved.x.len(), (dfc1.len(), dfc2.len()))?;
    let (h, f, f1) = (shape.hidden, shape.ffn, shape.fc1_rows());
    weight_grads(dy, &saved.act, rows, (h, f), dfc2)?;
    weight_grads(dpre, &saved.x, rows, (f1, h), dfc1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::elementwise::{gelu_backward, gelu_forward};

    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9e3779b97f4a7c15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
            })
            .collect()
    }

    /// `a[r × k] · w[n × k]ᵀ` in f64, rounded.
    fn times_t(a: &[f32], w: &[f32], r: usize, k: usize, n: usize) -> Vec<f32> {
        (0..r * n)
            .map(|i| {
                let (row, col) = (i / n, i % n);
                (0..k)
                    .map(|p| f64::from(a[row * k + p]) * f64::from(w[col * k + p]))
                    .sum::<f64>() as f32
            })
            .collect()
    }

    fn transpose(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
        (0..rows * cols)
            .map(|i| x[(i % rows) * cols + i / rows])
            .collect()
    }

    fn close(got: &[f32], want: &[f32], what: &str) {
        assert_eq!(got.len(), want.len(), "{what}");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-4 * (1.0 + w.abs()),
                "{what}[{i}]: {g} vs {w}"
            );
        }
    }

    #[test]
    fn grouped_experts_are_each_experts_mlp() {
        for gated in [false, true] {
            each_expert_alone(gated);
        }
    }

    #[test]
    fn in_a_bf16_run_each_experts_products_round_their_operands() {
        // Under the thread's bf16 products the grouped experts are each expert's MLP with
        // gemm_bf16's products, bit for bit (the same tile; no group is few-rows sized), and
        // not the f32 experts'.
        use crate::kernels::gemm::gemm_bf16;
        let shape = ExpertShape {
            experts: 3,
            hidden: 24,
            ffn: 40,
            gated: false,
        };
        let (h, f) = (shape.hidden, shape.ffn);
        let rows = [5usize, 0, 37];
        let n: usize = rows.iter().sum();
        let x = values(n * h, 11);
        let fc1 = values(3 * f * h, 12);
        let fc2 = values(3 * h * f, 13);
        let (f32_y, _) = experts_forward(&shape, &x, &rows, &fc1, &fc2).unwrap();
        let _bf16 = crate::ops::cpu_bf16_products(true);
        let (y, _) = experts_forward(&shape, &x, &rows, &fc1, &fc2).unwrap();
        let times_t_bf16 = |a: &[f32], w: &[f32], r: usize, k: usize, n: usize| {
            let mut out = vec![0.0; r * n];
            let (av, wv) = (
                MatRef::row_major(a, r, k).unwrap(),
                MatRef::row_major(w, n, k).unwrap().t(),
            );
            gemm_bf16(1.0, av, wv, 0.0, MatMut::row_major(&mut out, r, n).unwrap()).unwrap();
            out
        };
        let mut at = 0;
        for (g, &r) in rows.iter().enumerate() {
            let pre = times_t_bf16(
                &x[at * h..(at + r) * h],
                &fc1[g * f * h..][..f * h],
                r,
                h,
                f,
            );
            let mut act = vec![0.0; r * f];
            gelu_forward(&pre, &mut act).unwrap();
            let want = times_t_bf16(&act, &fc2[g * h * f..][..h * f], r, f, h);
            let got = &y[at * h..(at + r) * h];
            assert!(
                got.iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "expert {g}"
            );
            at += r;
        }
        assert!(
            y.iter().zip(&f32_y).any(|(a, b)| a != b),
            "the f32 products ran"
        );
    }

    /// The grouped experts against each expert's MLP by plain loops, GeLU or SwiGLU.
    fn each_expert_alone(gated: bool) {
        let shape = ExpertShape {
            experts: 4,
            hidden: 6,
            ffn: 10,
            gated,
        };
        let (h, f, f1) = (shape.hidden, shape.ffn, shape.fc1_rows());
        let rows = [3usize, 0, 17, 1];
        let n: usize = rows.iter().sum();
        let x = values(n * h, 1);
        let fc1 = values(4 * f1 * h, 2);
        let fc2 = values(4 * h * f, 3);
        let dy = values(n * h, 4);
        let (y, saved) = experts_forward(&shape, &x, &rows, &fc1, &fc2).unwrap();
        let (mut dfc1, mut dfc2) = (vec![0.5f32; fc1.len()], vec![0.25f32; fc2.len()]);
        let dx =
            experts_backward(&shape, &saved, &dy, (&fc1, &fc2), (&mut dfc1, &mut dfc2)).unwrap();
        // Each expert on its own rows, by plain loops (SwiGLU: silu(gate) · up, written out).
        let silu = |g: f64| g / (1.0 + (-g).exp());
        let mut at = 0;
        for (g, &r) in rows.iter().enumerate() {
            let xg = &x[at * h..(at + r) * h];
            let w1 = &fc1[g * f1 * h..(g + 1) * f1 * h];
            let w2 = &fc2[g * h * f..(g + 1) * h * f];
            let pre = times_t(xg, w1, r, h, f1);
            let mut act = vec![0.0; r * f];
            if gated {
                for (i, a) in act.iter_mut().enumerate() {
                    let (row, j) = (i / f, i % f);
                    let (gate, up) = (pre[row * f1 + j], pre[row * f1 + f + j]);
                    *a = (silu(f64::from(gate)) * f64::from(up)) as f32;
                }
            } else {
                gelu_forward(&pre, &mut act).unwrap();
            }
            close(
                &y[at * h..(at + r) * h],
                &times_t(&act, w2, r, f, h),
                &format!("y {g}"),
            );
            let dyg = &dy[at * h..(at + r) * h];
            let dact = times_t(dyg, &transpose(w2, h, f), r, h, f);
            let mut dpre = vec![0.0; r * f1];
            if gated {
                for (i, &d) in dact.iter().enumerate() {
                    let (row, j) = (i / f, i % f);
                    let (gate, up) = (
                        f64::from(pre[row * f1 + j]),
                        f64::from(pre[row * f1 + f + j]),
                    );
                    let sig = 1.0 / (1.0 + (-gate).exp());
                    let dsilu = sig * (1.0 + gate * (1.0 - sig));
                    dpre[row * f1 + j] = (f64::from(d) * up * dsilu) as f32;
                    dpre[row * f1 + f + j] = (f64::from(d) * silu(gate)) as f32;
                }
            } else {
                gelu_backward(&pre, &dact, &mut dpre).unwrap();
            }
            let want_dx = times_t(&dpre, &transpose(w1, f1, h), r, f1, h);
            close(&dx[at * h..(at + r) * h], &want_dx, &format!("dx {g}"));
            // dW2 = dyᵀ·act (+ the 0.25 already there), dW1 = dpreᵀ·x (+ 0.5).
            let dw2: Vec<f32> = times_t(&transpose(dyg, r, h), &transpose(&act, r, f), h, r, f)
                .iter()
                .map(|v| v + 0.25)
                .collect();
            close(
                &dfc2[g * h * f..(g + 1) * h * f],
                &dw2,
                &format!("dfc2 {g}"),
            );
            let dw1: Vec<f32> = times_t(&transpose(&dpre, r, f1), &transpose(xg, r, h), f1, r, h)
                .iter()
                .map(|v| v + 0.5)
                .collect();
            close(
                &dfc1[g * f1 * h..(g + 1) * f1 * h],
                &dw1,
                &format!("dfc1 {g}"),
            );
            at += r;
        }
        let err = experts_forward(&shape, &x, &[3, 0, 17], &fc1, &fc2).unwrap_err();
        assert!(
            err.to_string().contains("3 row groups for 4 local experts"),
            "{err}"
        );
        let err = experts_forward(&shape, &x, &rows, &fc1[1..], &fc2).unwrap_err();
        assert!(err.to_string().contains("the experts' fc1 has"), "{err}");
    }
}
