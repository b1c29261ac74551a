//! `LayerNorm` over the last dimension, replicated over tensor parallelism.

use crate::error::Result;
use crate::invalid;
use crate::kernels::layer_norm as ln;
use crate::module::{Builder, Cx, Init, Layer, Module, Param, Site, Split};
use crate::tensor::{DType, Tensor};

/// The logical description of a layer norm.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerNormSpec {
    /// Size of the normalised (last) dimension.
    pub hidden: usize,
    /// Added to the variance.
    pub eps: f32,
}

impl LayerNormSpec {
    /// A layer norm over `hidden` features with ε = 1e-5 (Megatron-LM's default).
    pub fn new(hidden: usize) -> Self {
        LayerNormSpec { hidden, eps: 1e-5 }
    }
}

/// `y = (x − mean) / √(var + ε) · γ + β`, per row.
#[derive(Debug, Clone)]
pub struct LayerNorm {
    gamma: Param,
    beta: Param,
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
        let gamma = b.param(
            "weight",
            [spec.hidden],
            Split::Replicated,
            Init::ONES,
            false,
        )?;
        let beta = b.param("bias", [spec.hidden], Split::Replicated, Init::ZEROS, false)?;
        Ok(LayerNorm {
            gamma,
            beta,
            eps: spec.eps,
        })
    }

    fn visit_params<'s>(&'s self, f: &mut dyn FnMut(&'s Param)) {
        f(&self.gamma);
        f(&self.beta);
    }

    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        f(&mut self.gamma);
        f(&mut self.beta);
    }
}

impl Layer for LayerNorm {
    fn forward(&self, _cx: &Cx, _site: Site, x: &Tensor) -> Result<(Tensor, LayerNormSaved)> {
        let rows = self.rows(x)?;
        let h = self.gamma.value().numel();
        let x = x.to_f32_contiguous()?;
        #[cfg(feature = "cuda")]
        if let Some(gpu) = x.gpu() {
            let (y, mean, rstd) =
                device::forward(gpu, &x, &self.gamma, &self.beta, rows, self.eps)?;
            return Ok((y, LayerNormSaved { x, mean, rstd }));
        }
        let y = Tensor::empty(x.shape().clone(), DType::F32);
        let mean = Tensor::empty([rows], DType::F32);
        let rstd = Tensor::empty([rows], DType::F32);
        let (gamma, beta) = (
            self.gamma.value().to_f32_contiguous()?,
            self.beta.value().to_f32_contiguous()?,
        );
        ln::layer_norm_forward(
            &x.read::<f32>()?,
            &gamma.read::<f32>()?,
            &beta.read::<f32>()?,
            rows,
            h,
            self.eps,
            &mut y.write::<f32>()?,
            &mut mean.write::<f32>()?,
            &mut rstd.write::<f32>()?,
        )?;
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
        #[cfg(feature = "cuda")]
        if let Some(gpu) = saved.x.gpu() {
            let params = (&self.gamma, &self.beta);
            return device::backward(gpu, &saved, &dy, plus.as_ref(), params, rows);
        }
        let dx = Tensor::empty(saved.x.shape().clone(), DType::F32);
        let gamma = self.gamma.value().to_f32_contiguous()?;
        let plus_values = plus.as_ref().map(|p| p.read::<f32>()).transpose()?;
        self.gamma.accumulate_grad(|dgamma| {
            self.beta.accumulate_grad(|dbeta| {
                Ok(ln::layer_norm_backward_plus(
                    &dy.read::<f32>()?,
                    (
                        &saved.x.read::<f32>()?,
                        &saved.mean.read::<f32>()?,
                        &saved.rstd.read::<f32>()?,
                        &gamma.read::<f32>()?,
                    ),
                    rows,
                    h,
                    plus_values.as_deref(),
                    &mut dx.write::<f32>()?,
                    &mut dgamma.write::<f32>()?,
                    &mut dbeta.write::<f32>()?,
                )?)
            })
        })?;
        Ok(dx)
    }
}

/// The layer norm on a GPU: the CUDA kernels on the device tensors, parameters included.
#[cfg(feature = "cuda")]
mod device {
    use super::LayerNormSaved;
    use crate::cuda::Gpu;
    use crate::cuda::kernels::layer_norm as ln;
    use crate::cuda::kernels::operand::with_out;
    use crate::error::Result;
    use crate::module::Param;
    use crate::ops::operand_dtype;
    use crate::tensor::{DType, Tensor};

    /// `y`, `mean` and `rstd` of a contiguous f32 `x` of `rows` rows; `y` in the products'
    /// dtype (bf16 when the GPU multiplies in bf16: the normalised rows are the next products'
    /// operand, rounded once here instead of converted by them).
    pub(super) fn forward(
        gpu: &Gpu,
        x: &Tensor,
        gamma: &Param,
        beta: &Param,
        rows: usize,
        eps: f32,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let h = gamma.value().numel();
        let y = Tensor::empty_near(x.shape().clone(), operand_dtype(x), x)?;
        let mean = Tensor::empty_near([rows], DType::F32, x)?;
        let rstd = Tensor::empty_near([rows], DType::F32, x)?;
        let (gamma, beta) = (
            gamma.value().to_f32_contiguous()?,
            beta.value().to_f32_contiguous()?,
        );
        with_out(&y, |out| {
            Ok(ln::layer_norm_forward(
                gpu,
                &x.device_read::<f32>()?.view(),
                &gamma.device_read::<f32>()?.view(),
                &beta.device_read::<f32>()?.view(),
                rows,
                h,
                eps,
                out,
                &mut mean.device_write::<f32>()?.view_mut(),
                &mut rstd.device_write::<f32>()?.view_mut(),
            )?)
        })?;
        Ok((y, mean, rstd))
    }

    /// `dx` (plus `plus` when given, f32 contiguous), accumulating the parameters' gradients
    /// (`+=`).
    pub(super) fn backward(
        gpu: &Gpu,
        saved: &LayerNormSaved,
        dy: &Tensor,
        plus: Option<&Tensor>,
        (gamma, beta): (&Param, &Param),
        rows: usize,
    ) -> Result<Tensor> {
        let h = gamma.value().numel();
        let dx = Tensor::empty_near(saved.x.shape().clone(), DType::F32, &saved.x)?;
        let gamma_value = gamma.value().to_f32_contiguous()?;
        let plus = plus.map(|p| p.device_read::<f32>()).transpose()?;
        let (x, mean) = (
            saved.x.device_read::<f32>()?,
            saved.mean.device_read::<f32>()?,
        );
        let (rstd, g) = (
            saved.rstd.device_read::<f32>()?,
            gamma_value.device_read::<f32>()?,
        );
        gamma.accumulate_grad(|dgamma| {
            beta.accumulate_grad(|dbeta| {
                Ok(ln::layer_norm_backward_plus(
                    gpu,
                    &dy.device_read::<f32>()?.view(),
                    (&x.view(), &mean.view(), &rstd.view(), &g.view()),
                    rows,
                    h,
                    plus.as_ref().map(|p| p.view()).as_ref(),
                    &mut dx.device_write::<f32>()?.view_mut(),
                    &mut dgamma.device_write::<f32>()?.view_mut(),
                    &mut dbeta.device_write::<f32>()?.view_mut(),
                )?)
            })
        })?;
        Ok(dx)
    }
}
