//! Rotary position embeddings (RoPE, Su et al. 2021), as Megatron-LM's
//! `--position-embedding-type rope`: attention turns each query and key by angles that grow
//! with the token's position, so that their dot product depends on the positions' difference.
//! No parameters; on a tensor-parallel rank attention applies it to its own heads.
//!
//! The frequencies follow Megatron-LM's `RotaryEmbedding` (and Hugging Face's, the same):
//! `inv_freq[j] = 1 / base^(2j / rot)` in f32 for `rot = head_dim · rotary_percent` turned
//! dimensions, optionally rescaled as Llama 3.1 does ([`Llama3Scaling`]).

use crate::backend;
use crate::error::Result;
use crate::invalid;
use crate::kernels::rotary::RopeLayout;
use crate::tensor::Tensor;

/// Llama 3.1's frequency scaling (`--use-rope-scaling`; Hugging Face's `rope_type: llama3`):
/// long wavelengths are divided by `factor`, short ones kept, and the band between them
/// interpolated.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Llama3Scaling {
    /// `--rope-scaling-factor` (8 for Llama 3.1, 32 for Llama 3.2).
    pub factor: f32,
    /// Wavelengths above `original_max_position_embeddings / low_freq_factor` are scaled (1).
    pub low_freq_factor: f32,
    /// Wavelengths below `original_max_position_embeddings / high_freq_factor` are kept (4).
    pub high_freq_factor: f32,
    /// The context the model was first trained at (8192).
    pub original_max_position_embeddings: usize,
}

impl Llama3Scaling {
    /// Megatron-LM's fixed values with `factor`: low 1, high 4, original context 8192.
    pub fn megatron(factor: f32) -> Self {
        Llama3Scaling {
            factor,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        }
    }

    /// `inv_freq` rescaled, in f32 as Megatron-LM's `_apply_scaling` and Hugging Face's
    /// `_compute_llama3_parameters`.
    fn apply(&self, inv_freq: &mut [f32]) {
        let old = self.original_max_position_embeddings as f32;
        let (low, high) = (self.low_freq_factor, self.high_freq_factor);
        let (low_wavelen, high_wavelen) = (old / low, old / high);
        for f in inv_freq {
            let wavelen = 2.0 * std::f32::consts::PI / *f;
            let scaled = if wavelen > low_wavelen {
                *f / self.factor
            } else {
                *f
            };
            let smooth = (old / wavelen - low) / (high - low);
            let smoothed = (1.0 - smooth) * scaled / self.factor + smooth * scaled;
            let medium = wavelen >= high_wavelen && wavelen <= low_wavelen;
            *f = if medium { smoothed } else { scaled };
        }
    }
}

/// YaRN (Peng et al. 2023; `--rope-type yarn`, DeepSeek-V3's and Kimi K2's): the frequencies
/// of short wavelengths kept, those of long ones divided by `factor` and the band between
/// blended; the turned pairs scaled by `mscale(factor, mscale) / mscale(factor,
/// mscale_all_dim)`, and multi-latent attention's scores by `mscale(factor, mscale_all_dim)²`,
/// where `mscale(s, m) = 0.1·m·ln s + 1` (1 for `s ≤ 1`). As Megatron-LM's
/// `YarnRotaryEmbedding` and transformers' `_compute_yarn_parameters`.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Yarn {
    /// `--rotary-scaling-factor` (Hugging Face's `factor`: 40 for DeepSeek-V3).
    pub factor: f32,
    /// `--original-max-position-embeddings`: the context the frequencies were trained at.
    pub original_max_position_embeddings: usize,
    /// Rotations over the original context below which a frequency is interpolated (32).
    pub beta_fast: f32,
    /// Rotations over the original context above which a frequency is kept (1).
    pub beta_slow: f32,
    /// `--mscale`.
    pub mscale: f32,
    /// `--mscale-all-dim`.
    pub mscale_all_dim: f32,
}

impl Yarn {
    /// Megatron-LM's defaults with `factor`: original context 4096, betas 32 and 1, mscale 1,
    /// mscale_all_dim 0.
    pub fn megatron(factor: f32) -> Self {
        Yarn {
            factor,
            original_max_position_embeddings: 4096,
            beta_fast: 32.0,
            beta_slow: 1.0,
            mscale: 1.0,
            mscale_all_dim: 0.0,
        }
    }

    /// `0.1·m·ln s + 1`, or 1 for `s ≤ 1` (in f64, as Python's floats).
    pub fn mscale_of(s: f32, m: f32) -> f64 {
        if s <= 1.0 {
            return 1.0;
        }
        0.1 * f64::from(m) * f64::from(s).ln() + 1.0
    }

    /// The factor on the turned pairs' cosines and sines.
    pub fn amplitude(&self) -> f32 {
        (Self::mscale_of(self.factor, self.mscale)
            / Self::mscale_of(self.factor, self.mscale_all_dim)) as f32
    }

    /// The factor multi-latent attention's softmax scale takes: `mscale(factor,
    /// mscale_all_dim)²`.
    pub fn softmax_factor(&self) -> f64 {
        Self::mscale_of(self.factor, self.mscale_all_dim).powi(2)
    }

    /// The band `[low, high]` of frequency indices blended, for `rot` turned dimensions of
    /// base `base`: where a frequency turns `beta_fast` and `beta_slow` times over the original
    /// context, rounded out and clamped to the frequencies.
    fn band(&self, rot: usize, base: f32) -> (f64, f64) {
        let dim_at = |rotations: f32| {
            let context = self.original_max_position_embeddings as f64;
            rot as f64 * (context / (f64::from(rotations) * 2.0 * std::f64::consts::PI)).ln()
                / (2.0 * f64::from(base).ln())
        };
        let low = dim_at(self.beta_fast).floor().max(0.0);
        let high = dim_at(self.beta_slow).ceil().min(rot as f64 - 1.0);
        (low, high)
    }

    /// `inv_freq` (the plain frequencies of `rot` dimensions of base `base`) blended: in f32,
    /// `inter·(1 − mask) + extra·mask` with `inter = 1/(factor·base^(2j/rot))` and `mask` one
    /// minus the ramp from `low` to `high`.
    fn apply(&self, inv_freq: &mut [f32], rot: usize, base: f32) {
        let (low, high) = self.band(rot, base);
        let high = if low == high { high + 0.001 } else { high };
        for (j, f) in inv_freq.iter_mut().enumerate() {
            let pos = base.powf((2 * j) as f32 / rot as f32);
            let inter = 1.0 / (self.factor * pos);
            let ramp = ((j as f32 - low as f32) / (high as f32 - low as f32)).clamp(0.0, 1.0);
            let mask = 1.0 - ramp;
            *f = inter * (1.0 - mask) + *f * mask;
        }
    }
}

/// Rotary position embeddings' settings (Megatron-LM's `--rotary-*` flags).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Rotary {
    /// `--rotary-base` (Hugging Face's `rope_theta`): 10000 by default, 500000 for Llama 3.
    pub base: f32,
    /// `--rotary-percent`: the fraction of each head turned (its first dimensions).
    pub percent: f32,
    /// `--rotary-interleaved`: pairs `(2j, 2j + 1)` instead of rotate-half's `(j, j + rot/2)`.
    pub interleaved: bool,
    /// Llama 3.1's frequency scaling, if any.
    pub scaling: Option<Llama3Scaling>,
    /// YaRN's (`--rope-type yarn`), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub yarn: Option<Yarn>,
}

impl Default for Rotary {
    /// Megatron-LM's defaults: base 10000, every dimension turned, rotate-half, no scaling.
    fn default() -> Self {
        Rotary {
            base: 10000.0,
            percent: 1.0,
            interleaved: false,
            scaling: None,
            yarn: None,
        }
    }
}

impl Rotary {
    /// The dimensions turned in a head of `head_dim`: `⌊head_dim · percent⌋` (Megatron-LM's),
    /// which must be even and at least 2.
    pub fn dims(&self, head_dim: usize) -> Result<usize> {
        if !(self.percent > 0.0 && self.percent <= 1.0) {
            return invalid!("--rotary-percent must be in (0, 1], got {}", self.percent);
        }
        if !(self.base.is_finite() && self.base > 1.0) {
            return invalid!("--rotary-base must be above 1, got {}", self.base);
        }
        let rot = (head_dim as f64 * self.percent as f64) as usize;
        if rot < 2 || !rot.is_multiple_of(2) {
            return invalid!(
                "rotary embeddings turn pairs of dimensions: {rot} of a head of {head_dim} \
                 (--rotary-percent {}) is not an even number of at least 2",
                self.percent
            );
        }
        Ok(rot)
    }

    /// The `rot / 2` frequencies for heads of `head_dim`.
    pub fn inv_freq(&self, head_dim: usize) -> Result<Vec<f32>> {
        let rot = self.dims(head_dim)?;
        let mut f: Vec<f32> = (0..rot / 2)
            .map(|j| 1.0 / self.base.powf((2 * j) as f32 / rot as f32))
            .collect();
        if let Some(s) = &self.scaling {
            s.apply(&mut f);
        }
        if let Some(y) = &self.yarn {
            y.apply(&mut f, rot, self.base);
        }
        Ok(f)
    }

    /// `x`, a fused projection `[seq, batch, groups · parts · head_dim]` whose first `rotated`
    /// heads of each block of `parts` are the queries and the key, with RoPE applied from
    /// position `offset`; with `inverse`, the backward (the gradient turned back).
    #[allow(clippy::too_many_arguments)]
    pub fn apply(
        &self,
        x: &Tensor,
        (groups, parts, rotated): (usize, usize, usize),
        head_dim: usize,
        offset: usize,
        inverse: bool,
    ) -> Result<Tensor> {
        let [seq, batch, width] = x.dims() else {
            return invalid!(
                "rotary embeddings: expected [sequence, batch, width], got {}",
                x.shape()
            );
        };
        if *width != groups * parts * head_dim {
            return invalid!(
                "rotary embeddings: width {width} is not {groups} groups × {parts} heads × {head_dim}"
            );
        }
        let inv_freq = self.inv_freq(head_dim)?;
        let layout = RopeLayout {
            seq: *seq,
            batch: *batch,
            groups,
            parts,
            rotated,
            head_dim,
            rot: inv_freq.len() * 2,
            interleaved: self.interleaved,
            offset,
            amplitude: self.yarn.map_or(1.0, |y| y.amplitude()),
        };
        backend::of(x).rope(x, layout, &inv_freq, inverse)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frequencies_follow_the_base_and_llama3_scaling() {
        let r = Rotary::default();
        let f = r.inv_freq(8).unwrap();
        assert_eq!(f.len(), 4);
        for (j, f) in f.iter().enumerate() {
            let want = 1.0 / 10000f64.powf(2.0 * j as f64 / 8.0);
            assert!(
                (*f as f64 - want).abs() <= 1e-6 * want,
                "{j}: {f} vs {want}"
            );
        }
        // Llama 3.1 at head size 128: the closed form of the three bands.
        let r = Rotary {
            base: 500000.0,
            scaling: Some(Llama3Scaling::megatron(8.0)),
            ..Rotary::default()
        };
        let plain = Rotary { scaling: None, ..r }.inv_freq(128).unwrap();
        let scaled = r.inv_freq(128).unwrap();
        for (p, s) in plain.iter().zip(&scaled) {
            let wavelen = 2.0 * std::f64::consts::PI / *p as f64;
            let want = if wavelen < 8192.0 / 4.0 {
                *p as f64
            } else if wavelen > 8192.0 {
                *p as f64 / 8.0
            } else {
                let smooth = (8192.0 / wavelen - 1.0) / 3.0;
                (1.0 - smooth) * *p as f64 / 8.0 + smooth * *p as f64
            };
            assert!((*s as f64 - want).abs() <= 1e-5 * want, "{s} vs {want}");
        }
        assert!(scaled.iter().zip(&plain).any(|(s, p)| s < p));
    }

    /// DeepSeek-V3's YaRN (64 rotary dimensions, base 10000, factor 40, original context 4096,
    /// betas 32 and 1) against the closed form in f64: frequencies 0..=10 kept, 23.. divided
    /// by 40, the band between blended linearly; DeepSeek's mscales (1 and 1) leave the pairs
    /// unscaled and multiply the scores by (0.1·ln 40 + 1)².
    #[test]
    fn yarn_blends_the_band_between_the_corrections_and_scales_by_mscale() {
        let yarn = Yarn {
            mscale_all_dim: 1.0,
            ..Yarn::megatron(40.0)
        };
        let r = Rotary {
            yarn: Some(yarn),
            ..Rotary::default()
        };
        let got = r.inv_freq(64).unwrap();
        let correction = |rotations: f64| {
            64.0 * (4096.0 / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * 10000f64.ln())
        };
        let (low, high) = (correction(32.0).floor(), correction(1.0).ceil());
        assert_eq!((low, high), (10.0, 23.0));
        for (j, g) in got.iter().enumerate() {
            let extra = 1.0 / 10000f64.powf(2.0 * j as f64 / 64.0);
            let ramp = ((j as f64 - low) / (high - low)).clamp(0.0, 1.0);
            let want = extra / 40.0 * ramp + extra * (1.0 - ramp);
            assert!(
                (f64::from(*g) - want).abs() <= 2e-6 * want,
                "{j}: {g} vs {want}"
            );
        }
        // transformers 5.24's `ROPE_INIT_FUNCTIONS["yarn"]` on this DeepseekV3Config.
        for (j, hf) in [
            (0, 1.0),
            (11, 0.039006926119327545),
            (16, 0.005500000435858965),
            (22, 0.00017782794020604342),
            (23, 3.333803397254087e-05),
            (31, 3.3338035336782923e-06),
        ] {
            assert!(
                (f64::from(got[j]) - hf).abs() <= 1e-6 * hf,
                "{j}: {} vs {hf}",
                got[j]
            );
        }
        // Its attention factor (our amplitude) with mscale 0.7 and mscale_all_dim 1.
        let hf_factor = Yarn {
            mscale: 0.7,
            ..yarn
        }
        .amplitude();
        assert!(
            (f64::from(hf_factor) - 0.9191559952044436).abs() < 1e-7,
            "{hf_factor}"
        );
        assert_eq!(yarn.amplitude(), 1.0);
        let m = 0.1 * 40f64.ln() + 1.0;
        assert!((yarn.softmax_factor() - m * m).abs() < 1e-12);
        // Megatron-LM's default mscale_all_dim 0: the pairs scaled by mscale(40, 1), the
        // scores not.
        let plain = Yarn::megatron(40.0);
        assert!((f64::from(plain.amplitude()) - m).abs() < 1e-6);
        assert_eq!(plain.softmax_factor(), 1.0);
        // A factor of 1 is plain RoPE (to the blend's rounding).
        let one = Rotary {
            yarn: Some(Yarn::megatron(1.0)),
            ..Rotary::default()
        };
        let plain_rope = Rotary::default().inv_freq(64).unwrap();
        for (a, b) in one.inv_freq(64).unwrap().iter().zip(&plain_rope) {
            assert!((a - b).abs() <= 1e-6 * b, "{a} vs {b}");
        }
        assert_eq!(Yarn::megatron(1.0).amplitude(), 1.0);
    }

    #[test]
    fn odd_rotary_dimensions_are_refused_by_name() {
        let r = Rotary {
            percent: 0.5,
            ..Rotary::default()
        };
        let err = r.dims(6).unwrap_err().to_string();
        assert!(
            err.contains("3 of a head of 6 (--rotary-percent 0.5)"),
            "{err}"
        );
        assert_eq!(r.dims(8).unwrap(), 4);
        let err = Rotary::default().dims(3).unwrap_err().to_string();
        assert!(err.contains("3 of a head of 3"), "{err}");
    }
}
