//! [`ExpertOps`] on a GPU: each local expert's products on cuBLAS over its rows (views of the
//! expert-major rows and of the stacked weights, nothing copied), GeLU or SwiGLU and their
//! backwards as the dense MLPs' kernels. The weights and their gradients stay on the device.

use super::on_gpu;
use crate::backend::{ElementwiseOps, ExpertOps};
use crate::cuda::Gpu;
use crate::error::Result;
use crate::invalid;
use crate::module::{Param, WeightGrad, weight_grad::bytes_of};
use crate::moe::experts::{ExpertShape, ExpertsSaved, check};
use crate::ops::{as_operand, matmul_into};
use crate::tensor::{DType, Tensor};

/// Expert `g`'s `[a, b]` matrix of stacked weights `[experts, a, b]`.
fn expert(w: &Tensor, g: usize) -> Result<Tensor> {
    let (a, b) = (w.dims()[1], w.dims()[2]);
    Ok(w.narrow(0, g, 1)?.reshape([a, b])?)
}

/// Calls `f(g, first row, rows)` for every local expert with rows.
fn each_expert(rows: &[usize], mut f: impl FnMut(usize, usize, usize) -> Result<()>) -> Result<()> {
    let mut at = 0;
    for (g, &r) in rows.iter().enumerate() {
        if r > 0 {
            f(g, at, r)?;
        }
        at += r;
    }
    Ok(())
}

impl ExpertOps for Gpu {
    fn experts_forward(
        &self,
        shape: &ExpertShape,
        x: &Tensor,
        rows: &[usize],
        (fc1, fc2): (&Tensor, &Tensor),
    ) -> Result<(Tensor, ExpertsSaved)> {
        check(shape, rows, x.numel(), (fc1.numel(), fc2.numel()))?;
        let (h, f, f1) = (shape.hidden, shape.ffn, shape.fc1_rows());
        let n: usize = rows.iter().sum();
        // The rows are read by fc1's product now and by fc1's weight gradient later: in the
        // products' dtype, converted once.
        let x = as_operand(&on_gpu(self, x)?)?.reshape([n, h])?;
        let (fc1, fc2) = (
            fc1.reshape([shape.experts, f1, h])?,
            fc2.reshape([shape.experts, h, f])?,
        );
        // pre = x · fc1ᵀ, act = gelu(pre) or swiglu(pre), y = act · fc2ᵀ, expert by expert.
        let pre = Tensor::empty_on([n, f1], DType::F32, self)?;
        each_expert(rows, |g, at, r| {
            let w = expert(&fc1, g)?;
            Ok(matmul_into(
                1.0,
                &x.narrow(0, at, r)?,
                &w.t()?,
                0.0,
                &pre.narrow(0, at, r)?,
            )?)
        })?;
        let y = Tensor::empty_on([n, h], DType::F32, self)?;
        if n == 0 {
            let act = Tensor::empty_on([0, f], DType::F32, self)?;
            let rows = rows.to_vec();
            return Ok((y, ExpertsSaved::Device { x, pre, act, rows }));
        }
        let (act, pre) = match shape.gated {
            true => self.swiglu(&pre, f)?,
            false => self.gelu(&pre)?,
        };
        each_expert(rows, |g, at, r| {
            let w = expert(&fc2, g)?;
            Ok(matmul_into(
                1.0,
                &act.narrow(0, at, r)?,
                &w.t()?,
                0.0,
                &y.narrow(0, at, r)?,
            )?)
        })?;
        let rows = rows.to_vec();
        Ok((y, ExpertsSaved::Device { x, pre, act, rows }))
    }

    fn experts_backward(
        &self,
        shape: &ExpertShape,
        saved: ExpertsSaved,
        dy: &Tensor,
        (fc1, fc2): (&Param, &Param),
    ) -> Result<(Tensor, WeightGrad)> {
        let ExpertsSaved::Device { x, pre, act, rows } = saved else {
            return invalid!("the experts' forward ran on the host, their backward on a GPU");
        };
        let (e, h, f, f1) = (shape.experts, shape.hidden, shape.ffn, shape.fc1_rows());
        let n: usize = rows.iter().sum();
        check(
            shape,
            &rows,
            dy.numel(),
            (fc1.value().numel(), fc2.value().numel()),
        )?;
        if n == 0 {
            let none = WeightGrad::new(0, || Ok(()));
            return Ok((Tensor::zeros_on([0, h], DType::F32, self)?, none));
        }
        // Every row belongs to one expert: written in full below.
        let dx = Tensor::empty_on([n, h], DType::F32, self)?;
        // dy is read by fc2's input and weight gradients: converted once.
        let dy = as_operand(&on_gpu(self, dy)?)?.reshape([n, h])?;
        let w1 = fc1.compute_value().reshape([e, f1, h])?;
        let w2 = fc2.compute_value().reshape([e, h, f])?;
        // dact = dy · fc2.
        let dact = Tensor::empty_on([n, f], DType::F32, self)?;
        each_expert(&rows, |g, at, r| {
            let w = expert(&w2, g)?;
            Ok(matmul_into(
                1.0,
                &dy.narrow(0, at, r)?,
                &w,
                0.0,
                &dact.narrow(0, at, r)?,
            )?)
        })?;
        // dpre = the activation's backward of dact, dx = dpre · fc1.
        let dpre = match shape.gated {
            true => self.swiglu_backward(&pre, &dact, f)?,
            false => self.gelu_backward(&pre, &dact)?,
        };
        each_expert(&rows, |g, at, r| {
            let w = expert(&w1, g)?;
            Ok(matmul_into(
                1.0,
                &dpre.narrow(0, at, r)?,
                &w,
                0.0,
                &dx.narrow(0, at, r)?,
            )?)
        })?;
        // The weight gradients: dfc2 += dyᵀ · act, dfc1 += dpreᵀ · x, per expert.
        let held = bytes_of(&[&dy, &act, &dpre, &x]);
        let (fc1, fc2) = (fc1.clone(), fc2.clone());
        let dw = WeightGrad::new(held, move || {
            let products = |grad: &Tensor, d: &Tensor, a: &Tensor| {
                each_expert(&rows, |g, at, r| {
                    let (d_g, a_g) = (d.narrow(0, at, r)?, a.narrow(0, at, r)?);
                    Ok(matmul_into(1.0, &d_g.t()?, &a_g, 1.0, &expert(grad, g)?)?)
                })
            };
            fc2.accumulate_grad(|grad| products(&grad.reshape([e, h, f])?, &dy, &act))?;
            fc1.accumulate_grad(|grad| products(&grad.reshape([e, f1, h])?, &dpre, &x))
        });
        Ok((dx, dw))
    }
}
