//! Adam and AdamW parameter updates on flat f32 buffers (one parameter bucket or a shard of one).

use rayon::prelude::*;

use super::isa::{Isa, versioned};
use super::parallel;
use super::{KernelError, check_len};

/// Hyper-parameters of one [`adam_step`]; scalars are f64 (as in PyTorch) and rounded to f32 per step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamConfig {
    /// Learning rate of this step.
    pub lr: f64,
    /// Decay of the first moment, in `[0, 1)`.
    pub beta1: f64,
    /// Decay of the second moment, in `[0, 1)`.
    pub beta2: f64,
    /// Added to the bias-corrected `√v` in the denominator.
    pub eps: f64,
    /// Weight decay coefficient (decoupled for AdamW, added to the gradient otherwise).
    pub weight_decay: f64,
    /// 1-based number of this step, for the bias corrections `1 − βᵗ`.
    pub step: u64,
    /// `true`: AdamW (`param ← param·(1 − lr·wd)` before the update); `false`: L2 (`grad + wd·param`).
    pub decoupled: bool,
    /// Multiplies every gradient before the update: gradient clipping's coefficient (1 without
    /// clipping), applied here so that the gradients are read once (apex `FusedAdam`'s scale).
    pub grad_scale: f64,
}

impl AdamConfig {
    /// Checks every hyper-parameter's range.
    fn validate(&self, kernel: &'static str) -> Result<(), KernelError> {
        let bad = |message: String| Err(KernelError::Invalid { kernel, message });
        if self.step == 0 {
            return bad("step is 1-based, got 0".into());
        }
        for (name, b) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            if !(0.0..1.0).contains(&b) {
                return bad(format!("{name} must be in [0, 1), got {b}"));
            }
        }
        for (name, v) in [
            ("lr", self.lr),
            ("eps", self.eps),
            ("weight_decay", self.weight_decay),
            ("grad_scale", self.grad_scale),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return bad(format!("{name} must be finite and non-negative, got {v}"));
            }
        }
        Ok(())
    }
}

/// The f32 scalars of one step, computed once from an [`AdamConfig`]: what the CPU loop and the
/// CUDA kernel take, so both round the f64 hyper-parameters the same way.
#[derive(Debug, Clone, Copy)]
pub struct AdamScalars {
    /// β₁.
    pub b1: f32,
    /// β₂.
    pub b2: f32,
    /// 1 − β₁.
    pub omb1: f32,
    /// 1 − β₂.
    pub omb2: f32,
    /// ε.
    pub eps: f32,
    /// lr / (1 − β₁ᵗ).
    pub step_size: f32,
    /// 1 / √(1 − β₂ᵗ).
    pub inv_sqrt_bc2: f32,
    /// AdamW's 1 − lr·wd (1 for Adam).
    pub decay: f32,
    /// Adam's L2 coefficient wd (0 for AdamW).
    pub l2: f32,
    /// The gradients' multiplier.
    pub grad_scale: f32,
}

impl AdamScalars {
    /// The scalars of `c`'s step: bias corrections in f64, each rounded once to f32.
    pub fn of(c: &AdamConfig) -> AdamScalars {
        // powi needs an i32 exponent; beyond that the corrections are 1 to f64 precision anyway.
        let t = i32::try_from(c.step).unwrap_or(i32::MAX);
        let bc1 = 1.0 - c.beta1.powi(t);
        let bc2 = 1.0 - c.beta2.powi(t);
        let (decay, l2) = if c.decoupled {
            ((1.0 - c.lr * c.weight_decay) as f32, 0.0f32)
        } else {
            (1.0f32, c.weight_decay as f32)
        };
        AdamScalars {
            b1: c.beta1 as f32,
            b2: c.beta2 as f32,
            omb1: (1.0 - c.beta1) as f32,
            omb2: (1.0 - c.beta2) as f32,
            eps: c.eps as f32,
            step_size: (c.lr / bc1) as f32,
            inv_sqrt_bc2: (1.0 / bc2.sqrt()) as f32,
            decay,
            l2,
            grad_scale: c.grad_scale as f32,
        }
    }
}

versioned! {
    /// The element loop of [`adam_step`].
    fn adam_loop(
        param: &mut [f32],
        grad: &[f32],
        exp_avg: &mut [f32],
        exp_avg_sq: &mut [f32],
        c: &AdamScalars,
    ) {
        let c = *c;
        let state = exp_avg.iter_mut().zip(exp_avg_sq.iter_mut());
        for ((p, &g), (m, v)) in param.iter_mut().zip(grad).zip(state) {
            let g = g * c.grad_scale + c.l2 * *p;
            *m = c.b1 * *m + c.omb1 * g;
            *v = c.b2 * *v + c.omb2 * g * g;
            let denom = v.sqrt() * c.inv_sqrt_bc2 + c.eps;
            *p = *p * c.decay - c.step_size * *m / denom;
        }
    }
}

/// The checks of [`adam_step`]: the hyper-parameters, and `[grad, exp_avg, exp_avg_sq]` of
/// `n` elements each, like the parameters (the GPU launcher makes the same).
pub(crate) fn check_step(
    config: &AdamConfig,
    n: usize,
    [grad, exp_avg, exp_avg_sq]: [usize; 3],
) -> Result<(), KernelError> {
    const K: &str = "adam_step";
    config.validate(K)?;
    let dims = || format!("elements {n}");
    check_len(K, "grad", grad, n, dims)?;
    check_len(K, "exp_avg", exp_avg, n, dims)?;
    check_len(K, "exp_avg_sq", exp_avg_sq, n, dims)
}

/// One Adam/AdamW step in place on `param`, `exp_avg` and `exp_avg_sq`, from `grad` (all the same length).
///
/// Per element, with `g = grad_scale·grad` (plus `wd·param` when not decoupled):
/// `m ← β₁m + (1−β₁)g`, `v ← β₂v + (1−β₂)g²`,
/// `param ← param − (lr/(1−β₁ᵗ))·m / (√v/√(1−β₂ᵗ) + eps)`,
/// after `param ← param·(1 − lr·wd)` when decoupled (PyTorch `AdamW`, apex `FusedAdam` with
/// `adam_w_mode`); otherwise it matches PyTorch `Adam` with `weight_decay`.
pub fn adam_step(
    param: &mut [f32],
    grad: &[f32],
    exp_avg: &mut [f32],
    exp_avg_sq: &mut [f32],
    config: &AdamConfig,
) -> Result<(), KernelError> {
    let n = param.len();
    check_step(config, n, [grad.len(), exp_avg.len(), exp_avg_sq.len()])?;
    let scalars = AdamScalars::of(config);
    let isa = Isa::detected();
    match parallel::part_len(n) {
        None => adam_loop(isa, param, grad, exp_avg, exp_avg_sq, &scalars),
        Some(part) => parallel::on_pool(|| {
            param
                .par_chunks_mut(part)
                .zip(grad.par_chunks(part))
                .zip(exp_avg.par_chunks_mut(part))
                .zip(exp_avg_sq.par_chunks_mut(part))
                .for_each(|(((p, g), m), v)| adam_loop(isa, p, g, m, v, &scalars))
        }),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::test_util::Rng;
    use super::*;

    fn config(decoupled: bool, step: u64) -> AdamConfig {
        AdamConfig {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.1,
            step,
            decoupled,
            grad_scale: 1.0,
        }
    }

    /// Straightforward f64 Adam/AdamW (PyTorch's formulation).
    fn reference(p: &mut [f64], g: &[f64], m: &mut [f64], v: &mut [f64], c: &AdamConfig) {
        let t = c.step as i32;
        for i in 0..p.len() {
            let mut gi = g[i] * c.grad_scale;
            if c.decoupled {
                p[i] *= 1.0 - c.lr * c.weight_decay;
            } else {
                gi += c.weight_decay * p[i];
            }
            m[i] = c.beta1 * m[i] + (1.0 - c.beta1) * gi;
            v[i] = c.beta2 * v[i] + (1.0 - c.beta2) * gi * gi;
            let m_hat = m[i] / (1.0 - c.beta1.powi(t));
            let v_hat = v[i] / (1.0 - c.beta2.powi(t));
            p[i] -= c.lr * m_hat / (v_hat.sqrt() + c.eps);
        }
    }

    #[test]
    fn first_step_by_hand() {
        // Step 1: m̂ = g and v̂ = g², so the update is lr·g/(|g| + eps).
        let c = AdamConfig {
            lr: 0.1,
            weight_decay: 0.01,
            ..config(true, 1)
        };
        let (mut p, mut m, mut v) = ([1.0f32], [0.0f32], [0.0f32]);
        adam_step(&mut p, &[0.5], &mut m, &mut v, &c).unwrap();
        assert!((m[0] - 0.05).abs() < 1e-8);
        assert!((v[0] - 0.000_25).abs() < 1e-10);
        // AdamW: 1 − 0.1·0.01·1 − 0.1·0.5/(0.5 + 1e-8) = 0.899.
        assert!((p[0] - 0.899).abs() < 1e-6, "{}", p[0]);
        // L2: g = 0.5 + 0.01·1 = 0.51, p = 1 − 0.1·0.51/(0.51 + 1e-8) = 0.9.
        let c = AdamConfig {
            decoupled: false,
            ..c
        };
        let (mut p, mut m, mut v) = ([1.0f32], [0.0f32], [0.0f32]);
        adam_step(&mut p, &[0.5], &mut m, &mut v, &c).unwrap();
        assert!((m[0] - 0.051).abs() < 1e-7);
        assert!((p[0] - 0.9).abs() < 1e-6, "{}", p[0]);
        // Negative gradient moves the parameter up by lr.
        let c = AdamConfig {
            weight_decay: 0.0,
            ..c
        };
        let (mut p, mut m, mut v) = ([2.0f32], [0.0f32], [0.0f32]);
        adam_step(&mut p, &[-3.0], &mut m, &mut v, &c).unwrap();
        assert!((p[0] - 2.1).abs() < 1e-6);
    }

    #[test]
    fn matches_f64_reference_over_several_steps() {
        let mut rng = Rng::new(80);
        let n = 101;
        for decoupled in [true, false] {
            let mut p = rng.vec(n, -1.0, 1.0);
            let (mut m, mut v) = (vec![0.0f32; n], vec![0.0f32; n]);
            let mut pr: Vec<f64> = p.iter().map(|&x| x as f64).collect();
            let (mut mr, mut vr) = (vec![0.0f64; n], vec![0.0f64; n]);
            for step in 1..=6 {
                let g = rng.vec(n, -1.0, 1.0);
                let gr: Vec<f64> = g.iter().map(|&x| x as f64).collect();
                let c = config(decoupled, step);
                adam_step(&mut p, &g, &mut m, &mut v, &c).unwrap();
                reference(&mut pr, &gr, &mut mr, &mut vr, &c);
                for i in 0..n {
                    assert!(
                        (p[i] as f64 - pr[i]).abs() < 2e-6,
                        "decoupled {decoupled} step {step} param {i}"
                    );
                    assert!((m[i] as f64 - mr[i]).abs() < 1e-6);
                    assert!((v[i] as f64 - vr[i]).abs() < 1e-7);
                }
            }
        }
    }

    #[test]
    fn a_gradient_scale_is_the_step_on_gradients_scaled_first() {
        // What gradient clipping did before the update (g ← g·c in f32, then the step) is what
        // the step's own scale does, bit for bit; a scale of 1 changes nothing.
        let mut rng = Rng::new(82);
        let n = 257;
        let (p0, g) = (rng.vec(n, -1.0, 1.0), rng.vec(n, -3.0, 3.0));
        let (m0, v0) = (rng.vec(n, -0.1, 0.1), rng.vec(n, 0.0, 0.01));
        for (decoupled, scale) in [(true, 0.37f64), (false, 0.37), (true, 1.0)] {
            let c = AdamConfig {
                grad_scale: scale,
                ..config(decoupled, 3)
            };
            let (mut p, mut m, mut v) = (p0.clone(), m0.clone(), v0.clone());
            adam_step(&mut p, &g, &mut m, &mut v, &c).unwrap();
            let scaled: Vec<f32> = g.iter().map(|&x| x * scale as f32).collect();
            let first = AdamConfig {
                grad_scale: 1.0,
                ..c
            };
            let (mut pw, mut mw, mut vw) = (p0.clone(), m0.clone(), v0.clone());
            adam_step(&mut pw, &scaled, &mut mw, &mut vw, &first).unwrap();
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&p), bits(&pw), "scale {scale} decoupled {decoupled}");
            assert_eq!(bits(&m), bits(&mw));
            assert_eq!(bits(&v), bits(&vw));
        }
    }

    #[test]
    fn every_compiled_version_gives_the_same_bits() {
        let mut rng = Rng::new(81);
        let n = 1001;
        let (p0, g) = (rng.vec(n, -1.0, 1.0), rng.vec(n, -1.0, 1.0));
        let (m0, v0) = (rng.vec(n, -0.1, 0.1), rng.vec(n, 0.0, 0.01));
        let scalars = AdamScalars {
            b1: 0.9,
            b2: 0.95,
            omb1: 0.1,
            omb2: 0.05,
            eps: 1e-8,
            step_size: 1e-3,
            inv_sqrt_bc2: 1.3,
            decay: 0.9999,
            l2: 0.01,
            grad_scale: 0.7,
        };
        let run = |isa: Isa| {
            let (mut p, mut m, mut v) = (p0.clone(), m0.clone(), v0.clone());
            adam_loop(isa, &mut p, &g, &mut m, &mut v, &scalars);
            [p, m, v].map(|x| x.into_iter().map(f32::to_bits).collect::<Vec<_>>())
        };
        let want = run(Isa::BASELINE);
        for isa in Isa::supported() {
            assert!(run(isa) == want, "{}", isa.name());
        }
    }

    #[test]
    fn errors() {
        let (mut p, mut m, mut v) = ([0.0f32; 3], [0.0f32; 3], [0.0f32; 3]);
        let e = adam_step(&mut p, &[0.0; 2], &mut m, &mut v, &config(true, 1)).unwrap_err();
        assert!(matches!(
            e,
            KernelError::Length {
                buffer: "grad",
                expected: 3,
                actual: 2,
                ..
            }
        ));
        let e = adam_step(&mut p, &[0.0; 3], &mut m[..2], &mut v, &config(true, 1)).unwrap_err();
        assert!(matches!(
            e,
            KernelError::Length {
                buffer: "exp_avg",
                ..
            }
        ));
        let e = adam_step(&mut p, &[0.0; 3], &mut m, &mut v[..1], &config(true, 1)).unwrap_err();
        assert!(matches!(
            e,
            KernelError::Length {
                buffer: "exp_avg_sq",
                ..
            }
        ));
        for bad in [
            config(true, 0),
            AdamConfig {
                beta1: 1.0,
                ..config(true, 1)
            },
            AdamConfig {
                beta2: -0.1,
                ..config(true, 1)
            },
            AdamConfig {
                lr: f64::NAN,
                ..config(true, 1)
            },
            AdamConfig {
                eps: -1.0,
                ..config(true, 1)
            },
            AdamConfig {
                weight_decay: f64::INFINITY,
                ..config(true, 1)
            },
            AdamConfig {
                grad_scale: -0.5,
                ..config(true, 1)
            },
        ] {
            let e = adam_step(&mut p, &[0.0; 3], &mut m, &mut v, &bad).unwrap_err();
            assert!(
                matches!(
                    e,
                    KernelError::Invalid {
                        kernel: "adam_step",
                        ..
                    }
                ),
                "{bad:?}"
            );
        }
    }
}
