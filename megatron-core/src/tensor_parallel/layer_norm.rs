//! `LayerNorm` over the last dimension, replicated over tensor parallelism; with
//! [`Normalization::RmsNorm`], RMSNorm (Megatron-LM's `--normalization RMSNorm`, Llama's).

use crate::backend;
use crate::error::Result;
use crate::invalid;
use crate::module::{Builder, Cx, Init, Layer, Module, Param, Site, Split};
use crate::tensor::{DType, Tensor};

/// Which normalisation (Megatron-LM's `--normalization`, and its spelling in files).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum Normalization {
    /// `(x − mean) / √(var + ε) · γ + β` (GPT-2).
    #[default]
    LayerNorm,
    /// `x / √(mean(x²) + ε) · γ`: no mean, no bias (Llama, Mistral, Qwen, Mixtral).
    #[serde(rename = "RMSNorm")]
    RmsNorm,
}

/// The logical description of a layer norm.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerNormSpec {
    /// Size of the normalised (last) dimension.
    pub hidden: usize,
    /// Added to the variance (Megatron-LM's `--norm-epsilon`).
    pub eps: f32,
    /// LayerNorm or RMSNorm.
    pub kind: Normalization,
}

impl LayerNormSpec {
    /// A layer norm over `hidden` features with ε = 1e-5 (Megatron-LM's default).
    pub fn new(hidden: usize) -> Self {
        LayerNormSpec {
            hidden,
            eps: 1e-5,
            kind: Normalization::LayerNorm,
        }
    }

    /// The same with normalisation `kind`.
    pub fn with_kind(mut self, kind: Normalization) -> Self {
        self.kind = kind;
        self
    }
}

/// `y = (x − mean) / √(var + ε) · γ + β`, per row; RMSNorm, `y = x / √(mean(x²) + ε) · γ`,
/// when built without a bias ([`Normalization::RmsNorm`]).
#[derive(Debug, Clone)]
pub struct LayerNorm {
    gamma: Param,
    beta: Option<Param>,
    eps: f32,
}

/// What a layer norm keeps: its input and per-row statistics.
#[derive(Debug, Clone)]
pub struct LayerNormSaved {
    x: Tensor,
    mean: Tensor,
    rstd: Tensor,
}

impl LayerNorm {
    /// The width it normalises (its input's last dimension).
    pub fn hidden(&self) -> usize {
        self.gamma.spec().logical.numel()
    }

    fn rows(&self, x: &Tensor) -> Result<usize> {
        let h = self.gamma.value().numel();
        if x.dims().last() != Some(&h) {
            return invalid!(
                "layer norm {}: input of shape {} does not end in {h}",
                self.gamma.spec().name,
                x.shape()
            );
        }
        Ok(x.numel() / h)
    }
}

impl Module for LayerNorm {
    type Spec = LayerNormSpec;
    type Saved = LayerNormSaved;

    fn build(spec: &LayerNormSpec, b: &mut Builder) -> Result<Self> {
        // Norms run on the sequence shards with sequence parallelism: their gradients are
        // summed over tp (Megatron-LM's `sequence_parallel` parameters).
        let gamma = b
            .param(
                "weight",
                [spec.hidden],
                Split::Replicated,
                Init::ONES,
                false,
            )?
            .in_sequence_parallel_region()?;
        let beta = match spec.kind {
            Normalization::LayerNorm => Some(
                b.param("bias", [spec.hidden], Split::Replicated, Init::ZEROS, false)?
                    .in_sequence_parallel_region()?,
            ),
            Normalization::RmsNorm => None,
        };
        Ok(LayerNorm {
            gamma,
            beta,
            eps: spec.eps,
        })
    }

    fn visit_params<'s>(&'s self, f: &mut dyn FnMut(&'s Param)) {
        f(&self.gamma);
        if let Some(beta) = &self.beta {
            f(beta);
        }
    }

    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        f(&mut self.gamma);
        if let Some(beta) = &mut self.beta {
            f(beta);
        }
    }
}

impl Layer for LayerNorm {
    fn forward(&self, _cx: &Cx, _site: Site, x: &Tensor) -> Result<(Tensor, LayerNormSaved)> {
        let rows = self.rows(x)?;
        let h = self.gamma.value().numel();
        let x = x.to_f32_contiguous()?;
        let gamma = self.gamma.value().to_f32_contiguous()?;
        let beta = match &self.beta {
            Some(beta) => Some(beta.value().to_f32_contiguous()?),
            None => None,
        };
        let ops = backend::of(&x);
        let (y, mean, rstd) = ops.layer_norm(&x, &gamma, beta.as_ref(), rows, h, self.eps)?;
        Ok((y, LayerNormSaved { x, mean, rstd }))
    }

    fn backward(
        &self,
        _cx: &Cx,
        _site: Site,
        saved: LayerNormSaved,
        dy: &Tensor,
    ) -> Result<Tensor> {
        self.input_gradient(saved, dy, None)
    }

    /// The sum in the input-gradient kernel's pass: the residual stream's gradient reaches a
    /// pre-norm block's input by the norm and by the residual connection.
    fn backward_plus(
        &self,
        _cx: &Cx,
        _site: Site,
        saved: LayerNormSaved,
        dy: &Tensor,
        plus: &Tensor,
    ) -> Result<Tensor> {
        self.input_gradient(saved, dy, Some(plus))
    }
}

impl LayerNorm {
    /// The input gradient (plus `plus` when given), accumulating the parameters' gradients.
    fn input_gradient(
        &self,
        saved: LayerNormSaved,
        dy: &Tensor,
        plus: Option<&Tensor>,
    ) -> Result<Tensor> {
        let rows = self.rows(&saved.x)?;
        let h = self.gamma.value().numel();
        let dy = dy.to_f32_contiguous()?;
        let plus = match plus {
            Some(p) if p.shape() != saved.x.shape() => {
                return invalid!(
                    "layer norm: the gradient to add, of shape {}, is not the input's {}",
                    p.shape(),
                    saved.x.shape()
                );
            }
            Some(p) => Some(p.to_f32_contiguous()?),
            None => None,
        };
        let dx = Tensor::empty_near(saved.x.shape().clone(), DType::F32, &saved.x)?;
        let gamma = self.gamma.value().to_f32_contiguous()?;
        let ops = backend::of(&saved.x);
        let kept = (&saved.x, &saved.mean, &saved.rstd, &gamma);
        // One pass computes dx with dγ and dβ: it runs even when the norm is frozen.
        self.gamma
            .accumulate_grad_or_scratch(|dgamma| match &self.beta {
                Some(beta) => beta.accumulate_grad_or_scratch(|dbeta| {
                    let grads = (&dx, dgamma, Some(dbeta));
                    ops.layer_norm_backward(&dy, kept, plus.as_ref(), rows, h, grads)
                }),
                None => {
                    let grads = (&dx, dgamma, None);
                    ops.layer_norm_backward(&dy, kept, plus.as_ref(), rows, h, grads)
                }
            })?;
        Ok(dx)
    }
}
