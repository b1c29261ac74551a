//! [`VocabLossOps`] on a GPU: each local step one kernel of
//! [`crate::cuda::kernels::vocab_parallel`], nothing read back.

use super::{ids_on_gpu, on_gpu};
use crate::backend::{VocabLossOps, check_targets};
use crate::cuda::Gpu;
use crate::cuda::kernels::operand::with_out;
use crate::cuda::kernels::vocab_parallel as gvp;
use crate::error::Result;
use crate::tensor::{DType, Tensor};

impl VocabLossOps for Gpu {
    /// Host targets are checked as on the CPU and uploaded; device targets are not checked
    /// (that would read them back): a target outside the vocabulary gives a NaN loss.
    fn vocab_ce_local(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        start: usize,
        total: usize,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let (local, rows) = (logits.last_dim(), targets.numel());
        if targets.gpu().is_none() {
            check_targets(&targets.contiguous()?.read::<i64>()?, total)?;
        }
        let targets = ids_on_gpu(targets, self)?;
        let max = Tensor::zeros_on([rows], DType::F32, self)?;
        let target_logit = Tensor::zeros_on([rows], DType::F32, self)?;
        gvp::cross_entropy_local(
            self,
            &logits.device_read::<f32>()?.view(),
            &targets.device_read::<i64>()?.view(),
            rows,
            local,
            start,
            &mut max.device_write::<f32>()?.view_mut(),
            &mut target_logit.device_write::<f32>()?.view_mut(),
        )?;
        Ok((targets, max, target_logit))
    }

    fn vocab_ce_sum_exp(&self, logits: &Tensor, max: &Tensor) -> Result<Tensor> {
        let rows = max.numel();
        let sum = Tensor::zeros_on([rows], DType::F32, self)?;
        gvp::cross_entropy_sum_exp(
            self,
            &logits.device_read::<f32>()?.view(),
            &max.device_read::<f32>()?.view(),
            rows,
            logits.last_dim(),
            &mut sum.device_write::<f32>()?.view_mut(),
        )?;
        Ok(sum)
    }

    fn vocab_ce_finish(
        &self,
        (max, sum, target_logit): (&Tensor, &Tensor, &Tensor),
        targets: &Tensor,
        total: usize,
    ) -> Result<(Tensor, Tensor)> {
        let losses = Tensor::zeros_on(targets.shape().clone(), DType::F32, self)?;
        let logsumexp = Tensor::zeros_on([max.numel()], DType::F32, self)?;
        gvp::cross_entropy_finish(
            self,
            &max.device_read::<f32>()?.view(),
            &sum.device_read::<f32>()?.view(),
            &target_logit.device_read::<f32>()?.view(),
            &targets.device_read::<i64>()?.view(),
            total,
            &mut losses.device_write::<f32>()?.view_mut(),
            &mut logsumexp.device_write::<f32>()?.view_mut(),
        )?;
        Ok((losses, logsumexp))
    }

    /// One kernel, no communication.
    fn vocab_ce_backward(
        &self,
        (logits, targets, logsumexp): (&Tensor, &Tensor, &Tensor),
        dloss: &Tensor,
        start: usize,
        dtype: DType,
    ) -> Result<Tensor> {
        let local = logits.last_dim();
        let dloss = on_gpu(self, dloss)?;
        let dlogits = Tensor::empty_on(logits.shape().clone(), dtype, self)?;
        let (logits, targets) = (logits.device_read::<f32>()?, targets.device_read::<i64>()?);
        let (lse, dloss) = (logsumexp.device_read::<f32>()?, dloss.device_read::<f32>()?);
        with_out(&dlogits, |out| {
            let (l, t, s, d) = (logits.view(), targets.view(), lse.view(), dloss.view());
            Ok(gvp::cross_entropy_backward(
                self, &l, &t, &s, &d, local, start, out,
            )?)
        })?;
        drop((logits, targets, lse, dloss));
        Ok(dlogits)
    }
}
