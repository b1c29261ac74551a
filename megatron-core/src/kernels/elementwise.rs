//! Element-wise kernels: bias add, GeLU (tanh approximation), SwiGLU, residual adds and scaling.

use rayon::prelude::*;

use super::isa::{Isa, versioned};
use super::math;
use super::parallel;
use super::pointwise;
use super::reduce::add_column_sums;
use super::shape::numel;
use super::{KernelError, check_len};

versioned! {
    fn bias_add_rows(x: &mut [f32], bias: &[f32], cols: usize) {
        for row in x.chunks_exact_mut(cols) {
            for (v, &b) in row.iter_mut().zip(bias) {
                *v += b;
            }
        }
    }
}

/// Adds `bias[cols]` to every row of the row-major `x[rows, cols]`, in place.
pub fn bias_add_forward(
    x: &mut [f32],
    bias: &[f32],
    rows: usize,
    cols: usize,
) -> Result<(), KernelError> {
    const K: &str = "bias_add_forward";
    let n = numel(K, &[rows, cols])?;
    let dims = || format!("rows {rows} × cols {cols}");
    check_len(K, "x", x.len(), n, dims)?;
    check_len(K, "bias", bias.len(), cols, dims)?;
    if cols == 0 {
        return Ok(());
    }
    bias_add_rows(Isa::detected(), x, bias, cols);
    Ok(())
}

versioned! {
    fn column_sums(dy: &[f32], cols: usize, dbias: &mut [f32]) {
        add_column_sums(dy, dy, cols, dbias, |_| |g, _| g as f64);
    }
}

/// Accumulates the column sums of `dy[rows, cols]` into `dbias[cols]` (`+=`, summed in f64).
pub fn bias_add_backward(
    dy: &[f32],
    rows: usize,
    cols: usize,
    dbias: &mut [f32],
) -> Result<(), KernelError> {
    const K: &str = "bias_add_backward";
    let n = numel(K, &[rows, cols])?;
    let dims = || format!("rows {rows} × cols {cols}");
    check_len(K, "dy", dy.len(), n, dims)?;
    check_len(K, "dbias", dbias.len(), cols, dims)?;
    column_sums(Isa::detected(), dy, cols, dbias);
    Ok(())
}

versioned! {
    fn gelu_forward_loop(x: &[f32], y: &mut [f32]) {
        for (o, &v) in y.iter_mut().zip(x) {
            // 0.5·x·(1 + tanh u) = x·σ(2u) = x / (1 + e^(−2u)).
            *o = pointwise::gelu(v);
        }
    }
}

/// GeLU with GPT-2's tanh approximation: `y = 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`.
///
/// Computed as `x·σ(2u) = x / (1 + e^(−2u))` with `u = √(2/π)·(x + 0.044715·x³)` and the
/// vectorised [`math::exp`]: within a few f32 ulp of the formula above.
pub fn gelu_forward(x: &[f32], y: &mut [f32]) -> Result<(), KernelError> {
    const K: &str = "gelu_forward";
    check_len(K, "y", y.len(), x.len(), || format!("elements {}", x.len()))?;
    let isa = Isa::detected();
    match parallel::part_len(x.len()) {
        None => gelu_forward_loop(isa, x, y),
        Some(part) => parallel::on_pool(|| {
            y.par_chunks_mut(part)
                .zip(x.par_chunks(part))
                .for_each(|(y, x)| gelu_forward_loop(isa, x, y))
        }),
    }
    Ok(())
}

versioned! {
    fn gelu_backward_loop(x: &[f32], dy: &[f32], dx: &mut [f32]) {
        for ((o, &v), &g) in dx.iter_mut().zip(x).zip(dy) {
            *o = g * pointwise::gelu_grad(v);
        }
    }
}

/// Gradient of [`gelu_forward`]: `dx = dy · gelu'(x)` (overwrites `dx`).
pub fn gelu_backward(x: &[f32], dy: &[f32], dx: &mut [f32]) -> Result<(), KernelError> {
    const K: &str = "gelu_backward";
    let dims = || format!("elements {}", x.len());
    check_len(K, "dy", dy.len(), x.len(), dims)?;
    check_len(K, "dx", dx.len(), x.len(), dims)?;
    let isa = Isa::detected();
    match parallel::part_len(x.len()) {
        None => gelu_backward_loop(isa, x, dy, dx),
        Some(part) => parallel::on_pool(|| {
            dx.par_chunks_mut(part)
                .zip(x.par_chunks(part))
                .zip(dy.par_chunks(part))
                .for_each(|((dx, x), dy)| gelu_backward_loop(isa, x, dy, dx))
        }),
    }
    Ok(())
}

versioned! {
    /// Σ x² of one block in eight f64 lanes, combined in a fixed order.
    fn sum_squares_block(xs: &[f32]) -> f64 {
        let mut acc = [0.0f64; 8];
        let chunks = xs.chunks_exact(8);
        let tail = chunks.remainder();
        for c in chunks {
            for (a, &x) in acc.iter_mut().zip(c) {
                *a += f64::from(x) * f64::from(x);
            }
        }
        for &x in tail {
            acc[0] += f64::from(x) * f64::from(x);
        }
        ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))
    }
}

/// Elements per block of [`sum_of_squares`]: the unit of its fixed summation order.
const SQUARES_BLOCK: usize = 1 << 16;

/// Σ x² in f64 (gradient norms). The sum runs over fixed blocks added in order, so the result is
/// the same whatever the number of threads that computed the blocks.
pub fn sum_of_squares(xs: &[f32]) -> f64 {
    let isa = Isa::detected();
    let blocks: Vec<f64> = if parallel::part_len(xs.len()).is_some() {
        parallel::on_pool(|| {
            xs.par_chunks(SQUARES_BLOCK)
                .map(|b| sum_squares_block(isa, b))
                .collect()
        })
    } else {
        xs.chunks(SQUARES_BLOCK)
            .map(|b| sum_squares_block(isa, b))
            .collect()
    };
    blocks.iter().sum()
}

/// Sets every element to `value`.
pub fn fill(xs: &mut [f32], value: f32) {
    match parallel::part_len(xs.len()) {
        None => xs.fill(value),
        Some(part) => parallel::on_pool(|| xs.par_chunks_mut(part).for_each(|p| p.fill(value))),
    }
}

versioned! {
    fn add_loop(a: &[f32], b: &[f32], out: &mut [f32]) {
        for ((o, &p), &q) in out.iter_mut().zip(a).zip(b) {
            *o = p + q;
        }
    }
}

/// Element-wise sum `out = a + b`.
pub fn add(a: &[f32], b: &[f32], out: &mut [f32]) -> Result<(), KernelError> {
    const K: &str = "add";
    let dims = || format!("elements {}", a.len());
    check_len(K, "b", b.len(), a.len(), dims)?;
    check_len(K, "out", out.len(), a.len(), dims)?;
    let isa = Isa::detected();
    match parallel::part_len(a.len()) {
        None => add_loop(isa, a, b, out),
        Some(part) => parallel::on_pool(|| {
            out.par_chunks_mut(part)
                .zip(a.par_chunks(part))
                .zip(b.par_chunks(part))
                .for_each(|((o, a), b)| add_loop(isa, a, b, o))
        }),
    }
    Ok(())
}

versioned! {
    fn add_assign_loop(acc: &mut [f32], x: &[f32]) {
        for (a, &v) in acc.iter_mut().zip(x) {
            *a += v;
        }
    }
}

/// Accumulates `acc += x` element-wise (residual fan-in of gradients).
pub fn add_assign(acc: &mut [f32], x: &[f32]) -> Result<(), KernelError> {
    const K: &str = "add_assign";
    check_len(K, "x", x.len(), acc.len(), || {
        format!("elements {}", acc.len())
    })?;
    add_assign_loop(Isa::detected(), acc, x);
    Ok(())
}

versioned! {
    fn scale_loop(x: &mut [f32], alpha: f32) {
        for v in x.iter_mut() {
            *v *= alpha;
        }
    }
}

/// Multiplies every element of `x` by `alpha`, in place.
pub fn scale(x: &mut [f32], alpha: f32) {
    scale_loop(Isa::detected(), x, alpha);
}

/// Checks SwiGLU's buffers: `x[rows, 2·ffn]` (gate then up), the others `[rows, per_row]`
/// (name, length, per row); returns the rows (the GPU launchers make the same checks).
pub(crate) fn check_swiglu(
    kernel: &'static str,
    x: usize,
    ffn: usize,
    others: &[(&'static str, usize, usize)],
) -> Result<usize, KernelError> {
    if ffn == 0 || !x.is_multiple_of(2 * ffn) {
        return Err(KernelError::Invalid {
            kernel,
            message: format!("x has {x} elements, not rows of 2 × ffn {ffn} (gate, then up)"),
        });
    }
    let rows = x / (2 * ffn);
    for &(name, len, per_row) in others {
        check_len(kernel, name, len, rows * per_row, || {
            format!("rows {rows} × ffn {ffn}")
        })?;
    }
    Ok(rows)
}

versioned! {
    fn swiglu_forward_rows(x: &[f32], ffn: usize, y: &mut [f32]) {
        for (xr, yr) in x.chunks_exact(2 * ffn).zip(y.chunks_exact_mut(ffn)) {
            let (gate, up) = xr.split_at(ffn);
            for ((o, &g), &u) in yr.iter_mut().zip(gate).zip(up) {
                // silu(g) = g·σ(g) = g / (1 + e^(−g)).
                *o = g / (1.0 + math::exp(-g)) * u;
            }
        }
    }
}

/// SwiGLU, the gated MLP's activation (Megatron-LM's `--swiglu`, Llama's MLP): each row of
/// `x[rows, 2·ffn]` holds the gate, then the up projection; `y[rows, ffn] = silu(gate) · up`.
pub fn swiglu_forward(x: &[f32], ffn: usize, y: &mut [f32]) -> Result<(), KernelError> {
    let rows = check_swiglu("swiglu_forward", x.len(), ffn, &[("y", y.len(), ffn)])?;
    let isa = Isa::detected();
    match parallel::part_len(x.len()) {
        None => swiglu_forward_rows(isa, x, ffn, y),
        Some(part) => {
            let per = part.div_ceil(2 * ffn).clamp(1, rows.max(1));
            parallel::on_pool(|| {
                y.par_chunks_mut(per * ffn)
                    .zip(x.par_chunks(per * 2 * ffn))
                    .for_each(|(y, x)| swiglu_forward_rows(isa, x, ffn, y))
            })
        }
    }
    Ok(())
}

versioned! {
    fn swiglu_backward_rows(x: &[f32], dy: &[f32], ffn: usize, dx: &mut [f32]) {
        let rows = x.chunks_exact(2 * ffn).zip(dy.chunks_exact(ffn));
        for ((xr, dyr), dxr) in rows.zip(dx.chunks_exact_mut(2 * ffn)) {
            let (gate, up) = xr.split_at(ffn);
            let (dgate, dup) = dxr.split_at_mut(ffn);
            for ((((dg, du), &g), &u), &d) in dgate.iter_mut().zip(dup).zip(gate).zip(up).zip(dyr)
            {
                // s = σ(g); silu(g) = g·s; silu'(g) = s + g·s·(1 − s), with 1 − s = e·s.
                let e = math::exp(-g);
                let s = 1.0 / (1.0 + e);
                let one_minus_s = (e * s).min(1.0);
                *dg = d * u * (s + g * s * one_minus_s);
                *du = d * (g * s);
            }
        }
    }
}

/// Gradient of [`swiglu_forward`]: `dx[rows, 2·ffn]` (the gate's gradient, then the up
/// projection's) from `dy[rows, ffn]` and the kept input `x` (overwrites `dx`).
pub fn swiglu_backward(
    x: &[f32],
    dy: &[f32],
    ffn: usize,
    dx: &mut [f32],
) -> Result<(), KernelError> {
    let others = [("dy", dy.len(), ffn), ("dx", dx.len(), 2 * ffn)];
    let rows = check_swiglu("swiglu_backward", x.len(), ffn, &others)?;
    let isa = Isa::detected();
    match parallel::part_len(x.len()) {
        None => swiglu_backward_rows(isa, x, dy, ffn, dx),
        Some(part) => {
            let per = part.div_ceil(2 * ffn).clamp(1, rows.max(1));
            parallel::on_pool(|| {
                dx.par_chunks_mut(per * 2 * ffn)
                    .zip(x.par_chunks(per * 2 * ffn))
                    .zip(dy.par_chunks(per * ffn))
                    .for_each(|((dx, x), dy)| swiglu_backward_rows(isa, x, dy, ffn, dx))
            })
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::test_util::{Rng, check_directional, weighted_sum};
    use super::*;

    fn gelu_ref(x: f64) -> f64 {
        let k = (2.0 / std::f64::consts::PI).sqrt();
        0.5 * x * (1.0 + (k * (x + 0.044715 * x * x * x)).tanh())
    }

    #[test]
    fn bias_add_matches_reference() {
        let mut rng = Rng::new(1);
        let (rows, cols) = (5, 70);
        let x0 = rng.vec(rows * cols, -1.0, 1.0);
        let bias = rng.vec(cols, -1.0, 1.0);
        let mut x = x0.clone();
        bias_add_forward(&mut x, &bias, rows, cols).unwrap();
        for r in 0..rows {
            for c in 0..cols {
                assert_eq!(x[r * cols + c], x0[r * cols + c] + bias[c]);
            }
        }
    }

    #[test]
    fn bias_add_backward_accumulates_column_sums() {
        let mut rng = Rng::new(2);
        let (rows, cols) = (9, 67);
        let dy = rng.vec(rows * cols, -1.0, 1.0);
        let init = rng.vec(cols, -1.0, 1.0);
        let mut dbias = init.clone();
        bias_add_backward(&dy, rows, cols, &mut dbias).unwrap();
        for c in 0..cols {
            let s: f64 = (0..rows).map(|r| dy[r * cols + c] as f64).sum();
            assert!((dbias[c] as f64 - (init[c] as f64 + s)).abs() < 1e-5);
        }
        // Directional check of the bias gradient: L(b) = Σ w·(x + b).
        let x = rng.vec(rows * cols, -1.0, 1.0);
        let d = rng.vec(cols, -1.0, 1.0);
        let mut g = vec![0.0; cols];
        bias_add_backward(&dy, rows, cols, &mut g).unwrap();
        check_directional("dbias", &init, &d, 1e-2, &g, 1e-3, |b| {
            let mut y = x.clone();
            bias_add_forward(&mut y, b, rows, cols).unwrap();
            weighted_sum(&dy, &y)
        });
    }

    #[test]
    fn gelu_matches_reference() {
        let mut rng = Rng::new(3);
        let mut x = rng.vec(1000, -6.0, 6.0);
        x.extend_from_slice(&[0.0, -0.0, 1e-8, -20.0, 20.0, 1e4, -1e4]);
        let mut y = vec![0.0; x.len()];
        gelu_forward(&x, &mut y).unwrap();
        for (&v, &o) in x.iter().zip(&y) {
            let want = gelu_ref(v as f64);
            assert!(
                (o as f64 - want).abs() <= 1e-6 * (1.0 + want.abs()),
                "gelu({v}) = {o}, want {want}"
            );
        }
        // GPT-2's value at 1.0.
        assert!((gelu_ref(1.0) - 0.841_191_990_607_477).abs() < 1e-12);
    }

    #[test]
    fn gelu_backward_matches_finite_differences() {
        let mut rng = Rng::new(4);
        let n = 777;
        let x = rng.vec(n, -4.0, 4.0);
        let d = rng.vec(n, -1.0, 1.0);
        let w = rng.vec(n, -1.0, 1.0);
        let mut dx = vec![f32::NAN; n];
        gelu_backward(&x, &w, &mut dx).unwrap();
        check_directional("gelu dx", &x, &d, 1e-2, &dx, 1e-3, |x| {
            let mut y = vec![0.0; n];
            gelu_forward(x, &mut y).unwrap();
            weighted_sum(&w, &y)
        });
        // Pointwise against the f64 derivative.
        for ((&v, &g), &wi) in x.iter().zip(&dx).zip(&w).take(50) {
            let (v, h) = (v as f64, 1e-6);
            let fd = (gelu_ref(v + h) - gelu_ref(v - h)) / (2.0 * h);
            assert!((g as f64 - fd * wi as f64).abs() < 1e-5, "gelu'({v})");
        }
    }

    #[test]
    fn swiglu_matches_reference_and_finite_differences() {
        let (rows, ffn) = (3, 5);
        let x: Vec<f32> = (0..rows * 2 * ffn)
            .map(|i| (i as f32 * 0.37).sin() * 3.0)
            .collect();
        let mut y = vec![f32::NAN; rows * ffn];
        swiglu_forward(&x, ffn, &mut y).unwrap();
        for r in 0..rows {
            for j in 0..ffn {
                let (g, u) = (x[r * 2 * ffn + j] as f64, x[r * 2 * ffn + ffn + j] as f64);
                let want = g / (1.0 + (-g).exp()) * u;
                let got = y[r * ffn + j] as f64;
                assert!(
                    (got - want).abs() <= 1e-5 * want.abs().max(1.0),
                    "{got} vs {want}"
                );
            }
        }
        let w: Vec<f32> = (0..rows * ffn).map(|i| (i as f32 * 0.91).cos()).collect();
        let mut dx = vec![f32::NAN; x.len()];
        swiglu_backward(&x, &w, ffn, &mut dx).unwrap();
        let d: Vec<f32> = (0..x.len()).map(|i| (i as f32 * 1.3).sin()).collect();
        check_directional("swiglu dx", &x, &d, 1e-2, &dx, 2e-3, |x| {
            let mut y = vec![0.0; rows * ffn];
            swiglu_forward(x, ffn, &mut y).unwrap();
            weighted_sum(&w, &y)
        });
        let err = swiglu_forward(&x[..7], ffn, &mut y)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("x has 7 elements, not rows of 2 × ffn 5"),
            "{err}"
        );
    }

    #[test]
    fn gelu_at_the_extremes() {
        let x = [
            f32::NEG_INFINITY,
            -1e30,
            -1e4,
            -30.0,
            -0.0,
            0.0,
            30.0,
            1e4,
            1e30,
            f32::INFINITY,
            f32::NAN,
        ];
        let mut y = [0.0; 11];
        gelu_forward(&x, &mut y).unwrap();
        assert!(y[0].is_nan()); // −∞·0, as the tanh formula
        assert_eq!(&y[1..4], &[0.0; 3]);
        assert_eq!(&y[4..10], &x[4..10]);
        assert!(y[10].is_nan());
        let mut dx = [0.0; 11];
        gelu_backward(&x, &[1.0; 11], &mut dx).unwrap();
        // (Beyond |x| ≈ 1e19, x² overflows and the gradient is NaN, as with the tanh formula.)
        assert_eq!(&dx[2..4], &[0.0; 2]);
        assert_eq!(&dx[4..6], &[0.5, 0.5]);
        assert_eq!(&dx[6..8], &[1.0; 2]);
        assert!(dx[10].is_nan());
    }

    #[test]
    fn every_compiled_version_gives_the_same_bits() {
        let mut rng = Rng::new(5);
        let n = 1037;
        let x = rng.vec(n, -8.0, 8.0);
        let w = rng.vec(n, -1.0, 1.0);
        let (rows, cols) = (17, 61);
        let m = rng.vec(rows * cols, -1.0, 1.0);
        let run = |isa: Isa| {
            let mut out = vec![vec![0.0f32; n]; 5];
            gelu_forward_loop(isa, &x, &mut out[0]);
            gelu_backward_loop(isa, &x, &w, &mut out[1]);
            add_loop(isa, &x, &w, &mut out[2]);
            out[3].copy_from_slice(&x);
            add_assign_loop(isa, &mut out[3], &w);
            scale_loop(isa, &mut out[3], 0.3);
            out[4].copy_from_slice(&x);
            let mut mm = m.clone();
            bias_add_rows(isa, &mut mm, &w[..cols], cols);
            let mut db = w[..cols].to_vec();
            column_sums(isa, &m, cols, &mut db);
            out.push(mm);
            out.push(db);
            out.into_iter()
                .map(|v| v.into_iter().map(f32::to_bits).collect::<Vec<_>>())
                .collect::<Vec<_>>()
        };
        let want = run(Isa::BASELINE);
        for isa in Isa::supported() {
            assert_eq!(run(isa), want, "{}", isa.name());
        }
    }

    #[test]
    fn residual_adds_and_scale() {
        let a = [1.0, 2.0, 3.0];
        let b = [0.5, -2.0, 4.0];
        let mut out = [0.0; 3];
        add(&a, &b, &mut out).unwrap();
        assert_eq!(out, [1.5, 0.0, 7.0]);
        let mut acc = out;
        add_assign(&mut acc, &a).unwrap();
        assert_eq!(acc, [2.5, 2.0, 10.0]);
        scale(&mut acc, 2.0);
        assert_eq!(acc, [5.0, 4.0, 20.0]);
    }

    #[test]
    fn wrong_lengths_are_named() {
        let mut x = vec![0.0; 6];
        let e = bias_add_forward(&mut x, &[0.0; 2], 2, 3).unwrap_err();
        assert!(matches!(
            e,
            KernelError::Length {
                buffer: "bias",
                expected: 3,
                actual: 2,
                ..
            }
        ));
        let e = bias_add_forward(&mut x, &[0.0; 3], 3, 3).unwrap_err();
        assert!(matches!(
            e,
            KernelError::Length {
                buffer: "x",
                expected: 9,
                ..
            }
        ));
        let e = bias_add_backward(&x, 2, 3, &mut [0.0; 4]).unwrap_err();
        assert!(matches!(
            e,
            KernelError::Length {
                buffer: "dbias",
                ..
            }
        ));
        let e = gelu_forward(&x, &mut [0.0; 5]).unwrap_err();
        assert!(matches!(e, KernelError::Length { buffer: "y", .. }));
        let e = gelu_backward(&x, &[0.0; 6], &mut [0.0; 7]).unwrap_err();
        assert!(matches!(e, KernelError::Length { buffer: "dx", .. }));
        let e = gelu_backward(&x, &[0.0; 5], &mut [0.0; 6]).unwrap_err();
        assert!(matches!(e, KernelError::Length { buffer: "dy", .. }));
        let e = add(&x, &[0.0; 5], &mut [0.0; 6]).unwrap_err();
        assert!(matches!(e, KernelError::Length { buffer: "b", .. }));
        let e = add_assign(&mut x, &[0.0; 5]).unwrap_err();
        assert!(matches!(e, KernelError::Length { buffer: "x", .. }));
        let e = bias_add_backward(&x, usize::MAX, 2, &mut [0.0; 2]).unwrap_err();
        assert!(matches!(e, KernelError::Invalid { .. }));
        // Messages name the kernel, buffer and dimensions.
        let e = bias_add_forward(&mut x, &[0.0; 2], 2, 3).unwrap_err();
        assert_eq!(
            e.to_string(),
            "bias_add_forward: `bias` has 2 elements, expected 3 (rows 2 × cols 3)"
        );
    }
}
