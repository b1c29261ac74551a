//! Element-wise kernels: bias add, GeLU (tanh approximation), residual adds and scaling.

use super::reduce::add_column_sums;
use super::shape::numel;
use super::{KernelError, check_len};

/// √(2/π), the GeLU tanh-approximation constant.
const GELU_K: f32 = 0.797_884_6;
/// Cubic coefficient of the GeLU tanh approximation.
const GELU_C: f32 = 0.044_715;

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
    for row in x.chunks_exact_mut(cols) {
        for (v, &b) in row.iter_mut().zip(bias) {
            *v += b;
        }
    }
    Ok(())
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
    add_column_sums(dy, dy, cols, dbias, |_| |g, _| g as f64);
    Ok(())
}

/// GeLU with GPT-2's tanh approximation: `y = 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`.
pub fn gelu_forward(x: &[f32], y: &mut [f32]) -> Result<(), KernelError> {
    const K: &str = "gelu_forward";
    check_len(K, "y", y.len(), x.len(), || format!("elements {}", x.len()))?;
    for (o, &v) in y.iter_mut().zip(x) {
        let u = GELU_K * (v + GELU_C * v * v * v);
        *o = 0.5 * v * (1.0 + u.tanh());
    }
    Ok(())
}

/// Gradient of [`gelu_forward`]: `dx = dy · gelu'(x)` (overwrites `dx`).
pub fn gelu_backward(x: &[f32], dy: &[f32], dx: &mut [f32]) -> Result<(), KernelError> {
    const K: &str = "gelu_backward";
    let dims = || format!("elements {}", x.len());
    check_len(K, "dy", dy.len(), x.len(), dims)?;
    check_len(K, "dx", dx.len(), x.len(), dims)?;
    for ((o, &v), &g) in dx.iter_mut().zip(x).zip(dy) {
        let v2 = v * v;
        let t = (GELU_K * (v + GELU_C * v2 * v)).tanh();
        let du = GELU_K * (1.0 + 3.0 * GELU_C * v2);
        *o = g * (0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * du);
    }
    Ok(())
}

/// Element-wise sum `out = a + b`.
pub fn add(a: &[f32], b: &[f32], out: &mut [f32]) -> Result<(), KernelError> {
    const K: &str = "add";
    let dims = || format!("elements {}", a.len());
    check_len(K, "b", b.len(), a.len(), dims)?;
    check_len(K, "out", out.len(), a.len(), dims)?;
    for ((o, &p), &q) in out.iter_mut().zip(a).zip(b) {
        *o = p + q;
    }
    Ok(())
}

/// Accumulates `acc += x` element-wise (residual fan-in of gradients).
pub fn add_assign(acc: &mut [f32], x: &[f32]) -> Result<(), KernelError> {
    const K: &str = "add_assign";
    check_len(K, "x", x.len(), acc.len(), || {
        format!("elements {}", acc.len())
    })?;
    for (a, &v) in acc.iter_mut().zip(x) {
        *a += v;
    }
    Ok(())
}

/// Multiplies every element of `x` by `alpha`, in place.
pub fn scale(x: &mut [f32], alpha: f32) {
    for v in x.iter_mut() {
        *v *= alpha;
    }
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
