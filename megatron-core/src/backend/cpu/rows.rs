//! [`RowOps`] on the host: the MoE dispatcher's and combine's loops over rows.

use super::Cpu;
use crate::backend::RowOps;
use crate::error::Result;
use crate::tensor::{DType, Tensor};

/// `out += a · x`.
fn axpy(out: &mut [f32], a: f32, x: &[f32]) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o += a * v;
    }
}

impl RowOps for Cpu {
    fn gather_rows(&self, rows: &Tensor, hidden: usize, index: &[usize]) -> Result<Tensor> {
        let rows = rows.to_f32_contiguous()?;
        let rows = rows.read::<f32>()?;
        let out = Tensor::empty([index.len(), hidden], DType::F32);
        let mut o = out.write::<f32>()?;
        for (to, &from) in index.iter().enumerate() {
            o[to * hidden..(to + 1) * hidden]
                .copy_from_slice(&rows[from * hidden..(from + 1) * hidden]);
        }
        drop(o);
        Ok(out)
    }

    fn sum_rows(
        &self,
        rows: &Tensor,
        hidden: usize,
        entries: &[(usize, f32)],
        tokens: usize,
    ) -> Result<Tensor> {
        let rows = rows.to_f32_contiguous()?;
        let rows = rows.read::<f32>()?;
        let out = Tensor::zeros([tokens, hidden], DType::F32);
        let mut o = out.write::<f32>()?;
        for (i, &(t, p)) in entries.iter().enumerate() {
            axpy(
                &mut o[t * hidden..(t + 1) * hidden],
                p,
                &rows[i * hidden..(i + 1) * hidden],
            );
        }
        drop(o);
        Ok(out)
    }

    fn row_dots(
        &self,
        d: &Tensor,
        rows: &Tensor,
        hidden: usize,
        token: &[usize],
    ) -> Result<Vec<f32>> {
        let (d, rows) = (d.to_f32_contiguous()?, rows.to_f32_contiguous()?);
        let (d, rows) = (d.read::<f32>()?, rows.read::<f32>()?);
        Ok(token
            .iter()
            .enumerate()
            .map(|(i, &t)| {
                let (a, b) = (
                    &d[t * hidden..(t + 1) * hidden],
                    &rows[i * hidden..(i + 1) * hidden],
                );
                a.iter().zip(b).map(|(x, y)| x * y).sum()
            })
            .collect())
    }

    fn scale_rows(&self, d: &Tensor, hidden: usize, entries: &[(usize, f32)]) -> Result<Tensor> {
        let d = d.to_f32_contiguous()?;
        let d = d.read::<f32>()?;
        let out = Tensor::zeros([entries.len(), hidden], DType::F32);
        let mut o = out.write::<f32>()?;
        for (i, &(t, p)) in entries.iter().enumerate() {
            axpy(
                &mut o[i * hidden..(i + 1) * hidden],
                p,
                &d[t * hidden..(t + 1) * hidden],
            );
        }
        drop(o);
        Ok(out)
    }
}
