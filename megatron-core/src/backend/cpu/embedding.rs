//! [`EmbeddingOps`] and [`PlaceOps`] on the host.

use super::Cpu;
use crate::backend::{EmbeddingOps, PlaceOps};
use crate::error::Result;
use crate::kernels::embedding as ek;
use crate::tensor::{DType, Tensor};

impl PlaceOps for Cpu {
    /// The tensor itself: host code reads a device tensor through its own checks.
    fn place(&self, t: &Tensor) -> Result<Tensor> {
        Ok(t.clone())
    }
}

impl EmbeddingOps for Cpu {
    fn embedding_lookup(
        &self,
        ids: &Tensor,
        table: &Tensor,
        (vocab_start, local_rows): (usize, usize),
    ) -> Result<(Tensor, Tensor)> {
        let h = table.dims()[1];
        let mut dims = ids.dims().to_vec();
        dims.push(h);
        let out = Tensor::empty(dims, DType::F32);
        {
            let (tokens, mut o) = (ids.read::<i64>()?, out.write::<f32>()?);
            let (v0, rows) = (vocab_start, local_rows);
            // A 16-bit table's looked-up rows are widened, not the whole table.
            match table.dtype() {
                DType::BF16 => {
                    let t = table.read::<half::bf16>()?;
                    ek::embedding_forward(&tokens, &t, v0, rows, h, &mut o)?
                }
                DType::F16 => {
                    let t = table.read::<half::f16>()?;
                    ek::embedding_forward(&tokens, &t, v0, rows, h, &mut o)?
                }
                _ => ek::embedding_forward(&tokens, &table.read::<f32>()?, v0, rows, h, &mut o)?,
            }
        }
        Ok((out, ids.clone()))
    }

    fn embedding_lookup_backward(
        &self,
        ids: &Tensor,
        dy: &Tensor,
        (vocab_start, local_rows): (usize, usize),
        grad: &Tensor,
    ) -> Result<()> {
        let dy = dy.to_f32_contiguous()?;
        let h = grad.dims()[1];
        Ok(ek::embedding_backward(
            &ids.read::<i64>()?,
            &dy.read::<f32>()?,
            vocab_start,
            local_rows,
            h,
            &mut grad.write::<f32>()?,
        )?)
    }

    fn positions_forward(&self, table: &Tensor, seq: usize, batch: usize) -> Result<Tensor> {
        let h = table.dims()[1];
        let table = table.read::<f32>()?;
        let out = Tensor::empty([seq, batch, h], DType::F32);
        {
            let mut o = out.write::<f32>()?;
            for (i, block) in o.chunks_exact_mut(batch * h).enumerate() {
                for row in block.chunks_exact_mut(h) {
                    row.copy_from_slice(&table[i * h..(i + 1) * h]);
                }
            }
        }
        Ok(out)
    }

    fn positions_backward(
        &self,
        dy: &Tensor,
        _seq: usize,
        batch: usize,
        grad: &Tensor,
    ) -> Result<()> {
        let h = grad.dims()[1];
        let dy = dy.to_f32_contiguous()?;
        let dy = dy.read::<f32>()?;
        let mut g = grad.write::<f32>()?;
        for (i, block) in dy.chunks_exact(batch * h).enumerate() {
            let gi = &mut g[i * h..(i + 1) * h];
            for row in block.chunks_exact(h) {
                gi.iter_mut().zip(row).for_each(|(a, b)| *a += b);
            }
        }
        Ok(())
    }

    fn mask_columns(&self, x: &Tensor, cols: usize, from: usize) -> Result<()> {
        let mut x = x.write::<f32>()?;
        for row in x.chunks_exact_mut(cols) {
            row[from..].fill(f32::NEG_INFINITY);
        }
        Ok(())
    }
}
