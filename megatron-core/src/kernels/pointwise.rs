//! The element-wise functions a `#[megatron::module]` forward may call (`relu`, `silu`, `exp`,
//! ...), one scalar function each, with the derivative its backward uses.
//!
//! The macros fuse each chain of element-wise operations into one loop over the tensors' slices
//! that calls these (and the same functions of `cuda/cu/pointwise.cuh` on a GPU): see
//! [`crate::ops::fused()`]. A derivative named `*_grad` is `f'(x)`; functions whose derivative is
//! cheaper from their output (`sigmoid`, `tanh`, `exp`, `sqrt`, `rsqrt`) have it written by the
//! macros from the output. Every function keeps NaN as NaN.

use super::math;

/// √(2/π), the GeLU tanh-approximation constant.
const GELU_K: f32 = 0.797_884_6;
/// Cubic coefficient of the GeLU tanh approximation.
const GELU_C: f32 = 0.044_715;
/// GeLU's `−2u = x·(GELU_A + GELU_B·x²)`: `GELU_A = −2·√(2/π)`, …
pub(crate) const GELU_A: f32 = -2.0 * GELU_K;
/// … `GELU_B = −2·√(2/π)·0.044715`.
pub(crate) const GELU_B: f32 = GELU_A * GELU_C;
/// `d(−2u)/dx = GELU_A + GELU_3B·x²`.
pub(crate) const GELU_3B: f32 = 3.0 * GELU_B;
/// 1/√2.
const FRAC_1_SQRT_2: f32 = std::f32::consts::FRAC_1_SQRT_2;
/// 1/√(2π).
const FRAC_1_SQRT_2PI: f32 = 0.398_942_3;
/// Above this, softplus is its argument (PyTorch's threshold).
const SOFTPLUS_THRESHOLD: f32 = 20.0;

/// `max(x, 0)`.
#[inline(always)]
pub fn relu(x: f32) -> f32 {
    if x < 0.0 { 0.0 } else { x }
}

/// `relu'(x)`: 1 where `x > 0`, else 0.
#[inline(always)]
pub fn relu_grad(x: f32) -> f32 {
    if x > 0.0 { 1.0 } else { 0.0 }
}

/// `1 / (1 + e^(−x))`.
#[inline(always)]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + math::exp(-x))
}

/// `x·σ(x)` (SiLU, Swish), computed as `x / (1 + e^(−x))` like SwiGLU's gate.
#[inline(always)]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + math::exp(-x))
}

/// `silu'(x) = σ(x)·(1 + x·(1 − σ(x)))`.
#[inline(always)]
pub fn silu_grad(x: f32) -> f32 {
    let s = sigmoid(x);
    s + x * s * (1.0 - s)
}

/// GeLU with GPT-2's tanh approximation, `x·σ(2u)` with `u = √(2/π)·(x + 0.044715·x³)`: the same
/// bits as the `gelu` builtin.
#[inline(always)]
pub fn gelu(x: f32) -> f32 {
    let e = math::exp(x * (GELU_A + GELU_B * (x * x)));
    x / (1.0 + e)
}

/// `gelu'(x)` of [`gelu`]: with `s = σ(2u)`, `s + x·s·(1 − s)·2u'` (`1 − s` as `e·s`, at most 1
/// once `e` overflows), as the `gelu` builtin's backward.
#[inline(always)]
pub fn gelu_grad(x: f32) -> f32 {
    let x2 = x * x;
    let e = math::exp(x * (GELU_A + GELU_B * x2));
    let s = 1.0 / (1.0 + e);
    let one_minus_s = (e * s).min(1.0);
    let dz = GELU_A + GELU_3B * x2;
    s - (x * s) * (one_minus_s * dz)
}

/// The exact GeLU, `x·Φ(x) = ½·x·(1 + erf(x/√2))` (PyTorch's default `gelu`).
#[inline(always)]
pub fn gelu_erf(x: f32) -> f32 {
    0.5 * x * (1.0 + libm::erff(x * FRAC_1_SQRT_2))
}

/// `gelu_erf'(x) = Φ(x) + x·φ(x)`.
#[inline(always)]
pub fn gelu_erf_grad(x: f32) -> f32 {
    let cdf = 0.5 * (1.0 + libm::erff(x * FRAC_1_SQRT_2));
    cdf + x * FRAC_1_SQRT_2PI * math::exp(-0.5 * x * x)
}

/// `ln(1 + eˣ)`, and `x` itself above 20 (PyTorch's threshold).
#[inline(always)]
pub fn softplus(x: f32) -> f32 {
    if x > SOFTPLUS_THRESHOLD {
        x
    } else {
        math::exp(x).ln_1p()
    }
}

/// `softplus'(x) = σ(x)`, and 1 above the threshold.
#[inline(always)]
pub fn softplus_grad(x: f32) -> f32 {
    if x > SOFTPLUS_THRESHOLD {
        1.0
    } else {
        sigmoid(x)
    }
}

/// `eˣ` ([`math::exp`]: vectorisable, within 1 ulp).
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    math::exp(x)
}

/// `tanh x`.
#[inline(always)]
pub fn tanh(x: f32) -> f32 {
    x.tanh()
}

/// The natural logarithm.
#[inline(always)]
pub fn log(x: f32) -> f32 {
    x.ln()
}

/// `√x`.
#[inline(always)]
pub fn sqrt(x: f32) -> f32 {
    x.sqrt()
}

/// `1/√x`.
#[inline(always)]
pub fn rsqrt(x: f32) -> f32 {
    1.0 / x.sqrt()
}

/// `|x|`.
#[inline(always)]
pub fn abs(x: f32) -> f32 {
    x.abs()
}

/// `abs'(x)`: the sign of `x`, 0 at 0 (PyTorch's).
#[inline(always)]
pub fn abs_grad(x: f32) -> f32 {
    if x > 0.0 {
        1.0
    } else if x < 0.0 {
        -1.0
    } else {
        0.0
    }
}

/// `x` clamped to `[lo, hi]` (`min(max(x, lo), hi)`, PyTorch's `clamp`).
#[inline(always)]
pub fn clamp(x: f32, lo: f32, hi: f32) -> f32 {
    let x = if x < lo { lo } else { x };
    if x > hi { hi } else { x }
}

/// `clamp'(x)`: 1 where `lo ≤ x ≤ hi` (PyTorch's), else 0.
#[inline(always)]
pub fn clamp_grad(x: f32, lo: f32, hi: f32) -> f32 {
    if x >= lo && x <= hi { 1.0 } else { 0.0 }
}

/// `a` where `condition`, else `b` (`select(x > 0.0, a, b)` in forward).
#[inline(always)]
pub fn select(condition: bool, a: f32, b: f32) -> f32 {
    if condition { a } else { b }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The derivative of `f` at `x` by central differences in f64 of the f32 function.
    fn numeric(f: fn(f32) -> f32, x: f32) -> f64 {
        let h = 1e-3_f64;
        (f64::from(f((x as f64 + h) as f32)) - f64::from(f((x as f64 - h) as f32))) / (2.0 * h)
    }

    #[test]
    fn derivatives_match_finite_differences() {
        type Scalar = fn(f32) -> f32;
        let cases: [(&str, Scalar, Scalar); 6] = [
            ("relu", relu, relu_grad),
            ("silu", silu, silu_grad),
            ("gelu", gelu, gelu_grad),
            ("gelu_erf", gelu_erf, gelu_erf_grad),
            ("softplus", softplus, softplus_grad),
            ("abs", abs, abs_grad),
        ];
        for (name, f, d) in cases {
            for x in [-3.1_f32, -1.3, -0.4, 0.35, 0.9, 2.7] {
                let (want, got) = (numeric(f, x), f64::from(d(x)));
                assert!(
                    (want - got).abs() < 2e-3 * (1.0 + want.abs()),
                    "{name}'({x}) = {got}, finite differences give {want}"
                );
            }
        }
    }

    #[test]
    fn values_match_their_definitions() {
        for x in [-4.0_f32, -1.0, -0.25, 0.0, 0.5, 3.0] {
            let xd = f64::from(x);
            let sig = 1.0 / (1.0 + (-xd).exp());
            let close = |a: f32, b: f64| (f64::from(a) - b).abs() < 1e-6 * (1.0 + b.abs());
            assert!(close(sigmoid(x), sig));
            assert!(close(silu(x), xd * sig));
            assert!(close(softplus(x), (1.0 + xd.exp()).ln()));
            let u = (2.0 / std::f64::consts::PI).sqrt() * (xd + 0.044715 * xd.powi(3));
            assert!(close(gelu(x), 0.5 * xd * (1.0 + u.tanh())));
        }
        assert_eq!(clamp(5.0, -1.0, 2.0), 2.0);
        assert_eq!(clamp(-5.0, -1.0, 2.0), -1.0);
        assert!(relu(f32::NAN).is_nan() && sigmoid(f32::NAN).is_nan());
        // Φ(1) = 0.841344746...
        assert!((gelu_erf(1.0) - 0.841_344_7).abs() < 1e-6);
    }
}
