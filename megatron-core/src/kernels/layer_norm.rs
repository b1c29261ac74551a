//! Layer normalisation over the last dimension of a row-major `[rows, hidden]` matrix.
//!
//! Statistics use a deterministic two-pass f32 mean and variance (biased, as PyTorch);
//! the forward saves `mean` and `rstd = 1/√(var + eps)` per row for the backward.
//!
//! RMSNorm (Megatron-LM's `--normalization RMSNorm`, Llama's norm) is the same computation
//! without the mean and the bias: `y = x·rstd·gamma` with `rstd = 1/√(mean(x²) + eps)`. The
//! kernels take the bias as an option, and no bias means RMSNorm (its saved `mean` is 0).

use super::isa::{Isa, versioned};
use super::reduce::{self, LANES, add_column_sums};
use super::shape::numel;
use super::{KernelError, check_len};

/// Checks the shared dimensions and `eps`; returns `rows × hidden`.
fn check_dims(
    kernel: &'static str,
    rows: usize,
    hidden: usize,
    eps: f32,
) -> Result<usize, KernelError> {
    if hidden == 0 {
        return Err(KernelError::Invalid {
            kernel,
            message: "hidden size is 0".into(),
        });
    }
    if !(eps.is_finite() && eps >= 0.0) {
        return Err(KernelError::Invalid {
            kernel,
            message: format!("eps must be finite and non-negative, got {eps}"),
        });
    }
    numel(kernel, &[rows, hidden])
}

versioned! {
    /// The rows of [`layer_norm_forward`] (`hidden > 0`); without `beta`, of [`rms_norm_forward`].
    fn forward_rows(
        x: &[f32],
        gamma: &[f32],
        beta: Option<&[f32]>,
        hidden: usize,
        eps: f32,
        y: &mut [f32],
        mean: &mut [f32],
        rstd: &mut [f32],
    ) {
        let inv_h = 1.0 / hidden as f32;
        let rows_iter = x.chunks_exact(hidden).zip(y.chunks_exact_mut(hidden));
        for ((xr, yr), (m_out, r_out)) in rows_iter.zip(mean.iter_mut().zip(rstd.iter_mut())) {
            let m = if beta.is_some() { reduce::sum(xr) * inv_h } else { 0.0 };
            let var = reduce::sum_sq_dev(xr, m) * inv_h;
            let rs = 1.0 / (var + eps).sqrt();
            match beta {
                Some(beta) => {
                    for (((o, &v), &g), &b) in yr.iter_mut().zip(xr).zip(gamma).zip(beta) {
                        *o = (v - m) * rs * g + b;
                    }
                }
                None => {
                    for ((o, &v), &g) in yr.iter_mut().zip(xr).zip(gamma) {
                        *o = v * rs * g;
                    }
                }
            }
            *m_out = m;
            *r_out = rs;
        }
    }
}

/// The checks of [`layer_norm_forward`] on its buffers' lengths `[x, gamma, beta, y, mean,
/// rstd]` (the GPU launcher makes the same); returns `rows × hidden`.
pub(crate) fn check_forward(
    rows: usize,
    hidden: usize,
    eps: f32,
    [x, gamma, beta, y, mean, rstd]: [usize; 6],
) -> Result<usize, KernelError> {
    const K: &str = "layer_norm_forward";
    let n = check_dims(K, rows, hidden, eps)?;
    let dims = || format!("rows {rows} × hidden {hidden}");
    check_len(K, "x", x, n, dims)?;
    check_len(K, "gamma", gamma, hidden, dims)?;
    check_len(K, "beta", beta, hidden, dims)?;
    check_len(K, "y", y, n, dims)?;
    check_len(K, "mean", mean, rows, dims)?;
    check_len(K, "rstd", rstd, rows, dims)?;
    Ok(n)
}

/// The checks of [`layer_norm_backward`] on its buffers' lengths `[dy, x, mean, rstd, gamma, dx,
/// dgamma, dbeta]`; returns `rows × hidden`.
pub(crate) fn check_backward(
    rows: usize,
    hidden: usize,
    [dy, x, mean, rstd, gamma, dx, dgamma, dbeta]: [usize; 8],
) -> Result<usize, KernelError> {
    const K: &str = "layer_norm_backward";
    let n = check_dims(K, rows, hidden, 0.0)?;
    let dims = || format!("rows {rows} × hidden {hidden}");
    check_len(K, "dy", dy, n, dims)?;
    check_len(K, "x", x, n, dims)?;
    check_len(K, "mean", mean, rows, dims)?;
    check_len(K, "rstd", rstd, rows, dims)?;
    check_len(K, "gamma", gamma, hidden, dims)?;
    check_len(K, "dx", dx, n, dims)?;
    check_len(K, "dgamma", dgamma, hidden, dims)?;
    check_len(K, "dbeta", dbeta, hidden, dims)?;
    Ok(n)
}

/// `y = (x − mean)·rstd·gamma + beta` per row of `x[rows, hidden]`, saving `mean[rows]` and `rstd[rows]`.
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_forward(
    x: &[f32],
    gamma: &[f32],
    beta: &[f32],
    rows: usize,
    hidden: usize,
    eps: f32,
    y: &mut [f32],
    mean: &mut [f32],
    rstd: &mut [f32],
) -> Result<(), KernelError> {
    check_forward(
        rows,
        hidden,
        eps,
        [
            x.len(),
            gamma.len(),
            beta.len(),
            y.len(),
            mean.len(),
            rstd.len(),
        ],
    )?;
    forward_rows(
        Isa::detected(),
        x,
        gamma,
        Some(beta),
        hidden,
        eps,
        y,
        mean,
        rstd,
    );
    Ok(())
}

/// RMSNorm: `y = x·rstd·gamma` per row of `x[rows, hidden]` with `rstd = 1/√(mean(x²) + eps)`,
/// saving `rstd[rows]` (and `mean[rows]`, all 0, for the shared backward).
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_forward(
    x: &[f32],
    gamma: &[f32],
    rows: usize,
    hidden: usize,
    eps: f32,
    y: &mut [f32],
    mean: &mut [f32],
    rstd: &mut [f32],
) -> Result<(), KernelError> {
    check_forward(
        rows,
        hidden,
        eps,
        [
            x.len(),
            gamma.len(),
            hidden,
            y.len(),
            mean.len(),
            rstd.len(),
        ],
    )?;
    forward_rows(Isa::detected(), x, gamma, None, hidden, eps, y, mean, rstd);
    Ok(())
}

/// `(Σ dy·gamma, Σ dy·gamma·(x − m))` over one row, with lane-parallel f32 partial sums.
#[inline(always)]
fn row_sums(dy: &[f32], gamma: &[f32], x: &[f32], m: f32) -> (f32, f32) {
    let mut s1 = [0.0f32; LANES];
    let mut s2 = [0.0f32; LANES];
    let (cd, cg, cx) = (
        dy.chunks_exact(LANES),
        gamma.chunks_exact(LANES),
        x.chunks_exact(LANES),
    );
    let (td, tg, tx) = (cd.remainder(), cg.remainder(), cx.remainder());
    for ((d, g), v) in cd.zip(cg).zip(cx) {
        for i in 0..LANES {
            let dg = d[i] * g[i];
            s1[i] += dg;
            s2[i] += dg * (v[i] - m);
        }
    }
    for ((&d, &g), &v) in td.iter().zip(tg).zip(tx) {
        let dg = d * g;
        s1[0] += dg;
        s2[0] += dg * (v - m);
    }
    (reduce::combine(s1), reduce::combine(s2))
}

versioned! {
    /// The rows of [`layer_norm_backward`] (`hidden > 0`); without `dbeta`, of RMSNorm's
    /// (no mean: `mean(g)` is not subtracted).
    fn backward_rows(
        dy: &[f32],
        x: &[f32],
        mean: &[f32],
        rstd: &[f32],
        gamma: &[f32],
        hidden: usize,
        plus: Option<&[f32]>,
        dx: &mut [f32],
        dgamma: &mut [f32],
        dbeta: Option<&mut [f32]>,
    ) {
        let inv_h = 1.0 / hidden as f32;
        let centered = dbeta.is_some();
        let rows_iter = dy.chunks_exact(hidden).zip(x.chunks_exact(hidden));
        let rows_iter = rows_iter.zip(dx.chunks_exact_mut(hidden)).enumerate();
        for ((r, ((dyr, xr), dxr)), (&m, &rs)) in rows_iter.zip(mean.iter().zip(rstd)) {
            let (sum_g, sum_gxc) = row_sums(dyr, gamma, xr, m);
            let a = if centered { sum_g * inv_h } else { 0.0 };
            // mean(g·x̂) = rstd·mean(g·(x − m)).
            let b = sum_gxc * rs * inv_h;
            let row = dxr.iter_mut().zip(dyr).zip(gamma).zip(xr);
            match plus {
                None => {
                    for (((o, &d), &g), &v) in row {
                        let xhat = (v - m) * rs;
                        *o = rs * (d * g - a - xhat * b);
                    }
                }
                Some(plus) => {
                    for ((((o, &d), &g), &v), &p) in row.zip(&plus[r * hidden..]) {
                        let xhat = (v - m) * rs;
                        *o = p + rs * (d * g - a - xhat * b);
                    }
                }
            }
        }
        add_column_sums(dy, x, hidden, dgamma, |r| {
            let (m, rs) = (mean[r], rstd[r]);
            move |d, v| d as f64 * ((v - m) * rs) as f64
        });
        if let Some(dbeta) = dbeta {
            add_column_sums(dy, dy, hidden, dbeta, |_| |d, _| d as f64);
        }
    }
}

/// Gradients of [`layer_norm_forward`]: overwrites `dx[rows, hidden]`, accumulates `dgamma` and `dbeta` (`+=`).
///
/// With `x̂ = (x − mean)·rstd` and `g = dy·gamma`: `dx = rstd·(g − mean(g) − x̂·mean(g·x̂))`,
/// `dgamma += Σ_rows dy·x̂`, `dbeta += Σ_rows dy` (parameter sums in f64, rows in order).
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_backward(
    dy: &[f32],
    x: &[f32],
    mean: &[f32],
    rstd: &[f32],
    gamma: &[f32],
    rows: usize,
    hidden: usize,
    dx: &mut [f32],
    dgamma: &mut [f32],
    dbeta: &mut [f32],
) -> Result<(), KernelError> {
    let x_rows = (x, mean, rstd, gamma);
    layer_norm_backward_plus(dy, x_rows, rows, hidden, None, dx, dgamma, dbeta)
}

/// [`layer_norm_backward`] with another gradient of the same input added to `dx` in the same
/// pass: `dx = plus + ∂loss/∂x`. A residual stream's input is used twice, by the norm and by the residual connection; its two gradients are summed here
/// instead of by a separate pass. The result is, bit for bit, `plus + dx` of
/// [`layer_norm_backward`]'s `dx`.
///
/// `(x, mean, rstd, gamma)` are the forward's input, its saved row statistics and the weight.
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_backward_plus(
    dy: &[f32],
    (x, mean, rstd, gamma): (&[f32], &[f32], &[f32], &[f32]),
    rows: usize,
    hidden: usize,
    plus: Option<&[f32]>,
    dx: &mut [f32],
    dgamma: &mut [f32],
    dbeta: &mut [f32],
) -> Result<(), KernelError> {
    let n = check_backward(
        rows,
        hidden,
        [
            dy.len(),
            x.len(),
            mean.len(),
            rstd.len(),
            gamma.len(),
            dx.len(),
            dgamma.len(),
            dbeta.len(),
        ],
    )?;
    if let Some(p) = plus {
        let dims = || format!("rows {rows} × hidden {hidden}");
        check_len("layer_norm_backward", "plus", p.len(), n, dims)?;
    }
    backward_rows(
        Isa::detected(),
        dy,
        x,
        mean,
        rstd,
        gamma,
        hidden,
        plus,
        dx,
        dgamma,
        Some(dbeta),
    );
    Ok(())
}

/// Gradients of [`rms_norm_forward`]: `dx = plus + rstd·(g − x̂·mean(g·x̂))` with `x̂ = x·rstd`
/// and `g = dy·gamma` (`plus` as in [`layer_norm_backward_plus`]), `dgamma += Σ_rows dy·x̂`.
/// `(x, mean, rstd, gamma)` are as the forward left them (`mean` all 0).
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_backward_plus(
    dy: &[f32],
    (x, mean, rstd, gamma): (&[f32], &[f32], &[f32], &[f32]),
    rows: usize,
    hidden: usize,
    plus: Option<&[f32]>,
    dx: &mut [f32],
    dgamma: &mut [f32],
) -> Result<(), KernelError> {
    let lens = [
        dy.len(),
        x.len(),
        mean.len(),
        rstd.len(),
        gamma.len(),
        dx.len(),
        dgamma.len(),
        hidden,
    ];
    let n = check_backward(rows, hidden, lens)?;
    if let Some(p) = plus {
        let dims = || format!("rows {rows} × hidden {hidden}");
        check_len("rms_norm_backward", "plus", p.len(), n, dims)?;
    }
    let isa = Isa::detected();
    backward_rows(
        isa, dy, x, mean, rstd, gamma, hidden, plus, dx, dgamma, None,
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::test_util::{Rng, check_directional, weighted_sum};
    use super::*;

    struct Case {
        rows: usize,
        hidden: usize,
        x: Vec<f32>,
        gamma: Vec<f32>,
        beta: Vec<f32>,
    }

    fn case(seed: u64, rows: usize, hidden: usize) -> Case {
        let mut rng = Rng::new(seed);
        let x = (0..rows * hidden)
            .map(|i| rng.uniform(-1.0, 1.0) * (1 + i % 3) as f32 + (i / hidden) as f32)
            .collect();
        Case {
            rows,
            hidden,
            x,
            gamma: rng.vec(hidden, 0.5, 1.5),
            beta: rng.vec(hidden, -0.5, 0.5),
        }
    }

    fn forward(c: &Case, x: &[f32], gamma: &[f32], beta: &[f32]) -> Vec<f32> {
        let mut y = vec![0.0; c.rows * c.hidden];
        let (mut m, mut r) = (vec![0.0; c.rows], vec![0.0; c.rows]);
        layer_norm_forward(
            x, gamma, beta, c.rows, c.hidden, 1e-5, &mut y, &mut m, &mut r,
        )
        .unwrap();
        y
    }

    #[test]
    fn forward_matches_f64_reference() {
        for (rows, hidden) in [(4, 64), (3, 13), (1, 1), (2, 100)] {
            let c = case(10 + hidden as u64, rows, hidden);
            let eps = 1e-5;
            let mut y = vec![f32::NAN; rows * hidden];
            let (mut mean, mut rstd) = (vec![f32::NAN; rows], vec![f32::NAN; rows]);
            layer_norm_forward(
                &c.x, &c.gamma, &c.beta, rows, hidden, eps, &mut y, &mut mean, &mut rstd,
            )
            .unwrap();
            for r in 0..rows {
                let xr: Vec<f64> = c.x[r * hidden..(r + 1) * hidden]
                    .iter()
                    .map(|&v| v as f64)
                    .collect();
                let m = xr.iter().sum::<f64>() / hidden as f64;
                let var = xr.iter().map(|v| (v - m) * (v - m)).sum::<f64>() / hidden as f64;
                let rs = 1.0 / (var + eps as f64).sqrt();
                assert!((mean[r] as f64 - m).abs() < 1e-5 * (1.0 + m.abs()));
                assert!((rstd[r] as f64 - rs).abs() < 1e-4 * rs);
                for j in 0..hidden {
                    let want = (xr[j] - m) * rs * c.gamma[j] as f64 + c.beta[j] as f64;
                    let got = y[r * hidden + j] as f64;
                    assert!(
                        (got - want).abs() < 1e-4,
                        "row {r} col {j}: {got} vs {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn backward_matches_finite_differences() {
        let c = case(20, 6, 37);
        let n = c.rows * c.hidden;
        let mut rng = Rng::new(21);
        let w = rng.vec(n, -1.0, 1.0);
        let mut y = vec![0.0; n];
        let (mut mean, mut rstd) = (vec![0.0; c.rows], vec![0.0; c.rows]);
        layer_norm_forward(
            &c.x, &c.gamma, &c.beta, c.rows, c.hidden, 1e-5, &mut y, &mut mean, &mut rstd,
        )
        .unwrap();
        let mut dx = vec![f32::NAN; n];
        // Parameter gradients start non-zero to check accumulation.
        let g0 = rng.vec(c.hidden, -1.0, 1.0);
        let b0 = rng.vec(c.hidden, -1.0, 1.0);
        let (mut dgamma, mut dbeta) = (g0.clone(), b0.clone());
        layer_norm_backward(
            &w,
            &c.x,
            &mean,
            &rstd,
            &c.gamma,
            c.rows,
            c.hidden,
            &mut dx,
            &mut dgamma,
            &mut dbeta,
        )
        .unwrap();
        let dgamma: Vec<f32> = dgamma.iter().zip(&g0).map(|(a, b)| a - b).collect();
        let dbeta: Vec<f32> = dbeta.iter().zip(&b0).map(|(a, b)| a - b).collect();

        let d = rng.vec(n, -1.0, 1.0);
        check_directional("layer norm dx", &c.x, &d, 1e-2, &dx, 2e-3, |x| {
            weighted_sum(&w, &forward(&c, x, &c.gamma, &c.beta))
        });
        let d = rng.vec(c.hidden, -1.0, 1.0);
        check_directional(
            "layer norm dgamma",
            &c.gamma,
            &d,
            1e-2,
            &dgamma,
            2e-3,
            |g| weighted_sum(&w, &forward(&c, &c.x, g, &c.beta)),
        );
        check_directional("layer norm dbeta", &c.beta, &d, 1e-2, &dbeta, 2e-3, |b| {
            weighted_sum(&w, &forward(&c, &c.x, &c.gamma, b))
        });
    }

    fn rms(c: &Case, x: &[f32], gamma: &[f32]) -> Vec<f32> {
        let mut y = vec![0.0; c.rows * c.hidden];
        let (mut m, mut r) = (vec![0.0; c.rows], vec![0.0; c.rows]);
        rms_norm_forward(x, gamma, c.rows, c.hidden, 1e-5, &mut y, &mut m, &mut r).unwrap();
        y
    }

    #[test]
    fn rms_norm_matches_f64_reference_and_finite_differences() {
        for (rows, hidden) in [(4, 64), (3, 13), (1, 1)] {
            let c = case(30 + hidden as u64, rows, hidden);
            let y = rms(&c, &c.x, &c.gamma);
            for r in 0..rows {
                let xr = &c.x[r * hidden..(r + 1) * hidden];
                let ms = xr.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / hidden as f64;
                let rs = 1.0 / (ms + 1e-5).sqrt();
                for k in 0..hidden {
                    let want = xr[k] as f64 * rs * c.gamma[k] as f64;
                    let got = y[r * hidden + k] as f64;
                    assert!(
                        (got - want).abs() <= 1e-5 * want.abs().max(1.0),
                        "{got} vs {want}"
                    );
                }
            }
        }
        let c = case(40, 6, 37);
        let n = c.rows * c.hidden;
        let mut rng = Rng::new(41);
        let w = rng.vec(n, -1.0, 1.0);
        let mut y = vec![0.0; n];
        let (mut mean, mut rstd) = (vec![f32::NAN; c.rows], vec![0.0; c.rows]);
        rms_norm_forward(
            &c.x, &c.gamma, c.rows, c.hidden, 1e-5, &mut y, &mut mean, &mut rstd,
        )
        .unwrap();
        assert!(mean.iter().all(|&m| m == 0.0));
        let plus = rng.vec(n, -1.0, 1.0);
        let g0 = rng.vec(c.hidden, -1.0, 1.0);
        let (mut dx, mut dgamma) = (vec![f32::NAN; n], g0.clone());
        let kept = (&c.x[..], &mean[..], &rstd[..], &c.gamma[..]);
        rms_norm_backward_plus(
            &w,
            kept,
            c.rows,
            c.hidden,
            Some(&plus),
            &mut dx,
            &mut dgamma,
        )
        .unwrap();
        let dx: Vec<f32> = dx.iter().zip(&plus).map(|(a, p)| a - p).collect();
        let dgamma: Vec<f32> = dgamma.iter().zip(&g0).map(|(a, b)| a - b).collect();
        let d = rng.vec(n, -1.0, 1.0);
        check_directional("rms norm dx", &c.x, &d, 1e-2, &dx, 2e-3, |x| {
            weighted_sum(&w, &rms(&c, x, &c.gamma))
        });
        let d = rng.vec(c.hidden, -1.0, 1.0);
        check_directional("rms norm dgamma", &c.gamma, &d, 1e-2, &dgamma, 2e-3, |g| {
            weighted_sum(&w, &rms(&c, &c.x, g))
        });
    }

    #[test]
    fn every_compiled_version_gives_the_same_bits() {
        let c = case(31, 9, 77);
        let (rows, hidden) = (c.rows, c.hidden);
        let mut rng = Rng::new(32);
        let dy = rng.vec(rows * hidden, -1.0, 1.0);
        let run = |isa: Isa| {
            let mut y = vec![0.0f32; rows * hidden];
            let (mut m, mut r) = (vec![0.0f32; rows], vec![0.0f32; rows]);
            forward_rows(
                isa,
                &c.x,
                &c.gamma,
                Some(&c.beta),
                hidden,
                1e-5,
                &mut y,
                &mut m,
                &mut r,
            );
            // dx alone, and with another gradient of x added (bit for bit the sum).
            let (mut dg, mut db) = (c.gamma.clone(), c.beta.clone());
            let mut input_gradient = |plus: Option<&[f32]>| {
                let mut dx = vec![0.0f32; rows * hidden];
                let (x, m, r, g) = (&c.x[..], &m[..], &r[..], &c.gamma[..]);
                backward_rows(
                    isa,
                    &dy,
                    x,
                    m,
                    r,
                    g,
                    hidden,
                    plus,
                    &mut dx,
                    &mut dg,
                    Some(&mut db),
                );
                dx
            };
            let dx = input_gradient(None);
            let summed: Vec<f32> = dy.iter().zip(&dx).map(|(p, d)| p + d).collect();
            assert_eq!(input_gradient(Some(&dy)), summed, "{}", isa.name());
            [y, m, r, dx, dg, db].map(|v| v.into_iter().map(f32::to_bits).collect::<Vec<_>>())
        };
        let want = run(Isa::BASELINE);
        for isa in Isa::supported() {
            assert!(run(isa) == want, "{}", isa.name());
        }
    }

    #[test]
    fn the_gradient_with_plus_is_the_sum_and_plus_is_checked() {
        let c = case(33, 5, 24);
        let (rows, hidden, n) = (c.rows, c.hidden, c.rows * c.hidden);
        let mut rng = Rng::new(34);
        let (dy, plus) = (rng.vec(n, -1.0, 1.0), rng.vec(n, -3.0, 3.0));
        let (mut y, mut m, mut r) = (vec![0.0; n], vec![0.0; rows], vec![0.0; rows]);
        let (x, gamma, beta) = (&c.x, &c.gamma, &c.beta);
        layer_norm_forward(x, gamma, beta, rows, hidden, 1e-5, &mut y, &mut m, &mut r).unwrap();
        let run = |plus: Option<&[f32]>| {
            let mut dx = vec![f32::NAN; n];
            let (mut dg, mut db) = (vec![0.5; hidden], vec![0.25; hidden]);
            let saved = (&x[..], &m[..], &r[..], &gamma[..]);
            layer_norm_backward_plus(&dy, saved, rows, hidden, plus, &mut dx, &mut dg, &mut db)
                .map(|()| (dx, dg, db))
        };
        let (dx, dg, db) = run(None).unwrap();
        let (dx_plus, dg_plus, db_plus) = run(Some(&plus)).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let summed: Vec<f32> = plus.iter().zip(&dx).map(|(p, d)| p + d).collect();
        assert_eq!(bits(&dx_plus), bits(&summed));
        // The parameters' gradients do not see it.
        assert_eq!((bits(&dg_plus), bits(&db_plus)), (bits(&dg), bits(&db)));
        let e = run(Some(&plus[1..])).unwrap_err();
        assert!(matches!(
            e,
            KernelError::Length {
                buffer: "plus",
                expected,
                actual,
                ..
            } if expected == n && actual == n - 1
        ));
    }

    #[test]
    fn errors_name_buffers_and_arguments() {
        let c = case(30, 2, 4);
        let (mut y, mut m, mut r) = (vec![0.0; 8], vec![0.0; 2], vec![0.0; 2]);
        let e = layer_norm_forward(
            &c.x,
            &c.gamma[..3],
            &c.beta,
            2,
            4,
            1e-5,
            &mut y,
            &mut m,
            &mut r,
        )
        .unwrap_err();
        assert!(matches!(
            e,
            KernelError::Length {
                buffer: "gamma",
                expected: 4,
                actual: 3,
                ..
            }
        ));
        let e = layer_norm_forward(
            &c.x,
            &c.gamma,
            &c.beta,
            2,
            4,
            1e-5,
            &mut y,
            &mut m[..1],
            &mut r,
        )
        .unwrap_err();
        assert!(matches!(e, KernelError::Length { buffer: "mean", .. }));
        let e = layer_norm_forward(&c.x, &c.gamma, &c.beta, 2, 4, -1.0, &mut y, &mut m, &mut r)
            .unwrap_err();
        assert!(matches!(e, KernelError::Invalid { .. }));
        let e = layer_norm_forward(&[], &[], &[], 2, 0, 1e-5, &mut [], &mut m, &mut r).unwrap_err();
        assert!(matches!(e, KernelError::Invalid { .. }));
        let (mut dx, mut dg, mut db) = (vec![0.0; 8], vec![0.0; 4], vec![0.0; 3]);
        let e = layer_norm_backward(&y, &c.x, &m, &r, &c.gamma, 2, 4, &mut dx, &mut dg, &mut db)
            .unwrap_err();
        assert!(matches!(
            e,
            KernelError::Length {
                buffer: "dbeta",
                ..
            }
        ));
        let e = layer_norm_backward(
            &y[..7],
            &c.x,
            &m,
            &r,
            &c.gamma,
            2,
            4,
            &mut dx,
            &mut dg,
            &mut db,
        )
        .unwrap_err();
        assert!(matches!(e, KernelError::Length { buffer: "dy", .. }));
    }
}
