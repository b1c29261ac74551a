//! [`VocabLossOps`] on the host.

use super::Cpu;
use crate::backend::{VocabLossOps, check_targets};
use crate::error::Result;
use crate::tensor::{DType, Tensor};

impl VocabLossOps for Cpu {
    fn vocab_ce_local(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        start: usize,
        total: usize,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let (local, rows) = (logits.last_dim(), targets.numel());
        let targets = targets.contiguous()?;
        let max = Tensor::empty([rows], DType::F32);
        let target_logit = Tensor::zeros([rows], DType::F32);
        {
            let l = logits.read::<f32>()?;
            let t = targets.read::<i64>()?;
            check_targets(&t, total)?;
            let mut m = max.write::<f32>()?;
            let mut tl = target_logit.write::<f32>()?;
            for (i, row) in l.chunks_exact(local).enumerate() {
                m[i] = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let target = t[i] as usize;
                if (start..start + local).contains(&target) {
                    tl[i] = row[target - start];
                }
            }
        }
        Ok((targets, max, target_logit))
    }

    fn vocab_ce_sum_exp(&self, logits: &Tensor, max: &Tensor) -> Result<Tensor> {
        let sum = Tensor::empty([max.numel()], DType::F32);
        let l = logits.read::<f32>()?;
        let m = max.read::<f32>()?;
        let mut s = sum.write::<f32>()?;
        for (i, row) in l.chunks_exact(logits.last_dim()).enumerate() {
            s[i] = row
                .iter()
                .map(|&x| f64::from((x - m[i]).exp()))
                .sum::<f64>() as f32;
        }
        drop((l, m, s));
        Ok(sum)
    }

    fn vocab_ce_finish(
        &self,
        (max, sum, target_logit): (&Tensor, &Tensor, &Tensor),
        targets: &Tensor,
        _total: usize,
    ) -> Result<(Tensor, Tensor)> {
        let rows = max.numel();
        let losses = Tensor::empty(targets.shape().clone(), DType::F32);
        let logsumexp = Tensor::empty([rows], DType::F32);
        {
            let (m, s, tl) = (
                max.read::<f32>()?,
                sum.read::<f32>()?,
                target_logit.read::<f32>()?,
            );
            let mut out = losses.write::<f32>()?;
            let mut lse = logsumexp.write::<f32>()?;
            for i in 0..rows {
                lse[i] = m[i] + s[i].ln();
                out[i] = lse[i] - tl[i];
            }
        }
        Ok((losses, logsumexp))
    }

    /// Always f32 on the host.
    fn vocab_ce_backward(
        &self,
        (logits, targets, logsumexp): (&Tensor, &Tensor, &Tensor),
        dloss: &Tensor,
        start: usize,
        _dtype: DType,
    ) -> Result<Tensor> {
        let local = logits.last_dim();
        let dlogits = Tensor::empty(logits.shape().clone(), DType::F32);
        {
            let l = logits.read::<f32>()?;
            let t = targets.read::<i64>()?;
            let lse = logsumexp.read::<f32>()?;
            let g = dloss.read::<f32>()?;
            let mut d = dlogits.write::<f32>()?;
            for (i, (row, drow)) in l
                .chunks_exact(local)
                .zip(d.chunks_exact_mut(local))
                .enumerate()
            {
                for (x, dx) in row.iter().zip(drow.iter_mut()) {
                    *dx = (x - lse[i]).exp() * g[i];
                }
                let target = t[i] as usize;
                if (start..start + local).contains(&target) {
                    drow[target - start] -= g[i];
                }
            }
        }
        Ok(dlogits)
    }
}
