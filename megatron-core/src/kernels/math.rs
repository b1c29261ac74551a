//! Vectorisable f32 elementary functions for the kernels (no libm calls).
//!
//! A call to libm's `expf` or `tanhf` per element stops a loop from vectorising and costs tens
//! of cycles; [`exp`] is a handful of multiplies and adds with no branch and no table, so a loop
//! that calls it vectorises as wide as the instruction set allows (see [`super::isa`]).
//! It uses only IEEE-rounded `+ − × /`, never a fused multiply-add, so its result is the same on
//! every machine and in every compiled version.

/// `log2(e)`, rounded to f32.
const LOG2_E: f32 = std::f32::consts::LOG2_E;
/// `1.5·2²³`: adding it rounds an f32 of magnitude below 2²² to an integer (round to nearest even),
/// which then sits in the low mantissa bits.
const ROUND_SHIFTER: f32 = 12_582_912.0;
/// `ln 2` split in two (Cody–Waite): `LN2_HI = 355/512` has 9 significant bits, so `n·LN2_HI` is
/// exact for every `|n| ≤ 2¹⁵`;
const LN2_HI: f32 = 355.0 / 512.0;
/// … and `LN2_LO` is `ln 2 − LN2_HI` rounded to f32.
const LN2_LO: f32 = -2.121_944_4e-4;
/// Arguments are clamped to `[EXP_LO, EXP_HI]` first. `exp(−104) < 2⁻¹⁵⁰` rounds to 0, so every
/// argument below gives exactly 0 (−∞ included); `exp(88.8) > f32::MAX` overflows to +∞.
const EXP_LO: f32 = -104.0;
/// See [`EXP_LO`].
const EXP_HI: f32 = 88.8;
/// `(exp(r) − 1 − r)/r² ≈ P0 + P1·r + P2·r² + P3·r³ + P4·r⁴` on `|r| ≤ 0.3501`: a minimax fit of
/// the relative error of `exp` (Lawson's iteration, then rounded to f32), at most `4.7·10⁻⁹`,
/// about 0.08 ulp, well below the rounding of the evaluation itself.
const P0: f32 = 4.999_999_4e-1;
/// See [`P0`].
const P1: f32 = 1.666_651_5e-1;
/// See [`P0`].
const P2: f32 = 4.166_845_6e-2;
/// See [`P0`].
const P3: f32 = 8.369_424e-3;
/// See [`P0`].
const P4: f32 = 1.381_313_3e-3;

/// `eˣ` in f32, vectorisable, within 1 ulp of the exact value (0.98 ulp measured over every f32).
///
/// `x = n·ln 2 + r` with `n = round(x·log₂e)` and `|r| ≤ ln 2/2` (Cody–Waite reduction with a
/// two-part `ln 2`); `eʳ = 1 + r + r²·P(r)` with a degree-4 minimax `P`; then `eˣ = eʳ·2ⁿ`, the
/// power of two built from its exponent bits in two halves `2^⌊n/2⌋·2^(n−⌊n/2⌋)`, so that results
/// in the subnormal range are rounded once and correctly scaled rather than flushed.
///
/// Special values: `exp(−∞) = 0` exactly, and so is every `x < −103.97` (where `eˣ` rounds to 0);
/// subnormal results for `−103.97 ≤ x < −87.34` (absolute error within 1 subnormal ulp,
/// `2⁻¹⁴⁹`); `+∞` for `x > 88.7228` (`ln f32::MAX`) and for `+∞`; NaN for NaN.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    // `clamp` keeps NaN (and only the clamped range reaches the bit tricks below).
    let x = x.clamp(EXP_LO, EXP_HI);
    // n = round(x·log₂e), as a float and as an integer in [−150, 128].
    let t = x * LOG2_E + ROUND_SHIFTER;
    let n = t - ROUND_SHIFTER;
    let ni = (t.to_bits() as i32).wrapping_sub(ROUND_SHIFTER.to_bits() as i32);
    // r = x − n·ln 2, |r| ≤ 0.3466 (plus the rounding of x·log₂e).
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let p = (((P4 * r + P3) * r + P2) * r + P1) * r + P0;
    let er = 1.0 + (r + (r * r) * p);
    // 2ⁿ = 2^n1 · 2^n2 with n1, n2 ∈ [−75, 64]: both factors are normal floats, and er·2^n1 is
    // exact, so only the last product rounds (or overflows to +∞).
    let n1 = ni >> 1;
    let n2 = ni.wrapping_sub(n1);
    er * pow2i(n1) * pow2i(n2)
}

/// `2ⁿ` for `n ∈ [−126, 127]`, from its exponent bits.
#[inline(always)]
fn pow2i(n: i32) -> f32 {
    f32::from_bits((n.wrapping_add(127) as u32) << 23)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The error of `got` against the exact `want`, in units of the last place of `want` in f32
    /// (subnormal spacing `2⁻¹⁴⁹` below the normal range).
    fn ulps(got: f32, want: f64) -> f64 {
        if got as f64 == want {
            return 0.0;
        }
        let exponent = if want == 0.0 {
            -149
        } else {
            (want.abs().log2().floor() as i32 - 23).max(-149)
        };
        (got as f64 - want).abs() / 2f64.powi(exponent)
    }

    /// Max error over the f32s whose bit patterns are `from, from + step, ..` up to `to`.
    fn max_error(from: u32, to: u32, step: u32) -> (f64, f32) {
        let mut worst = (0.0, 0.0);
        let mut bits = from;
        while bits <= to {
            let x = f32::from_bits(bits);
            let want = (x as f64).exp();
            let got = exp(x);
            if want > f32::MAX as f64 * (1.0 + f32::EPSILON as f64 / 2.0) {
                assert_eq!(got, f32::INFINITY, "exp({x:e})");
            } else {
                let e = ulps(got, want);
                if e > worst.0 {
                    worst = (e, x);
                }
            }
            bits = match bits.checked_add(step) {
                Some(b) => b,
                None => break,
            };
        }
        worst
    }

    #[test]
    fn within_two_ulp_over_a_dense_sweep() {
        // Every 29th f32 with 2⁻¹² ≤ |x| ≤ 128 (where eˣ is neither 1 nor 0 nor +∞; 11 M
        // arguments), every 4099th elsewhere, and every f32 in [−1.25, −1].
        let (two_m12, big) = (2f32.powi(-12).to_bits(), 128f32.to_bits());
        let sign = 0x8000_0000;
        let worst = [
            max_error(two_m12, big, 29),
            max_error(sign | two_m12, sign | big, 29),
            max_error(0, f32::INFINITY.to_bits(), 4099),
            max_error(sign, f32::NEG_INFINITY.to_bits(), 4099),
            max_error((-1f32).to_bits(), (-1.25f32).to_bits(), 1),
        ];
        for (e, at) in worst {
            assert!(e <= 2.0, "{e} ulp at {at:e}");
        }
    }

    /// Every f32 (2.5 minutes in release; measured max 0.98 ulp):
    /// `cargo test --release -p megatron-core exp_every -- --ignored --nocapture`.
    #[test]
    #[ignore = "exhaustive sweep of every f32, 2.5 minutes in release; the regular test sweeps 11M values"]
    fn exp_every_f32() {
        let (pos, at_pos) = max_error(0, f32::INFINITY.to_bits(), 1);
        let (neg, at_neg) = max_error(0x8000_0000, f32::NEG_INFINITY.to_bits(), 1);
        println!("max error: {pos} ulp at {at_pos:e} (x ≥ 0), {neg} ulp at {at_neg:e} (x ≤ 0)");
        assert!(pos.max(neg) <= 2.0);
    }

    #[test]
    fn edge_cases() {
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-0.0), 1.0);
        assert_eq!(exp(f32::NEG_INFINITY).to_bits(), 0);
        assert_eq!(exp(-1e30).to_bits(), 0);
        assert_eq!(exp(-104.0).to_bits(), 0);
        assert_eq!(exp(f32::MIN).to_bits(), 0);
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp(f32::MAX), f32::INFINITY);
        assert_eq!(exp(88.723), f32::INFINITY);
        assert_eq!(exp(89.0), f32::INFINITY);
        assert!(exp(88.72283).is_finite()); // just below ln f32::MAX
        assert!(exp(f32::NAN).is_nan());
        assert!(exp(-f32::NAN).is_nan());
        // Tiny arguments: 1 + x rounded.
        assert_eq!(exp(1e-10), 1.0);
        assert_eq!(exp(-1e-10), 1.0);
        assert_eq!(exp(f32::EPSILON), 1.0 + f32::EPSILON);
        // The subnormal range: smallest positive results, and the normal boundary.
        let tiny = exp(-103.28); // e^−103.28 ≈ 1.39·10⁻⁴⁵ ≈ 2⁻¹⁴⁹
        assert_eq!(tiny.to_bits(), 1);
        for x in [-87.0f32, -87.5, -90.0, -100.0, -103.0] {
            let (got, want) = (exp(x), (x as f64).exp());
            assert!(ulps(got, want) <= 2.0, "exp({x}) = {got:e}, want {want:e}");
            assert!(got > 0.0);
        }
        // Integers: e^n for every n whose result is normal.
        for n in -87..=88 {
            let want = (n as f64).exp();
            assert!(ulps(exp(n as f32), want) <= 2.0, "exp({n})");
        }
        // Monotone around the overflow and underflow thresholds and around 0.
        for start in [88.7f32, -87.4, -0.01, -103.9] {
            let mut prev = exp(start);
            let mut x = start;
            for _ in 0..10_000 {
                x = f32::from_bits(if x > 0.0 {
                    x.to_bits() + 1
                } else {
                    x.to_bits() - 1
                });
                let y = exp(x);
                assert!(y >= prev, "exp not monotone at {x:e}");
                prev = y;
            }
        }
    }
}
