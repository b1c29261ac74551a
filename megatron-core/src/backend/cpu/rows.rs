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

/// An i64 index table's values as they index (negative: none).
fn table(t: &Tensor) -> Result<Vec<i64>> {
    Ok(t.to_vec::<i64>()?)
}

/// `[tokens, k]` of a slot table whose rows are `k` long.
fn slot_dims(slots: &Tensor) -> (usize, usize) {
    match slots.dims() {
        [tokens, k] => (*tokens, *k),
        _ => (slots.numel(), 1),
    }
}

impl RowOps for Cpu {
    fn gather_rows(&self, rows: &Tensor, hidden: usize, index: &Tensor) -> Result<Tensor> {
        let rows = rows.to_f32_contiguous()?;
        let rows = rows.read::<f32>()?;
        let index = table(index)?;
        let out = Tensor::zeros([index.len(), hidden], DType::F32);
        let mut o = out.write::<f32>()?;
        for (to, &from) in index.iter().enumerate() {
            if let Ok(from) = usize::try_from(from) {
                o[to * hidden..(to + 1) * hidden]
                    .copy_from_slice(&rows[from * hidden..(from + 1) * hidden]);
            }
        }
        drop(o);
        Ok(out)
    }

    fn sum_rows(
        &self,
        rows: &Tensor,
        hidden: usize,
        slots: &Tensor,
        weights: Option<&Tensor>,
    ) -> Result<Tensor> {
        let rows = rows.to_f32_contiguous()?;
        let rows = rows.read::<f32>()?;
        let (tokens, _) = slot_dims(slots);
        let slots = table(slots)?;
        let weights = weights.map(Tensor::to_vec_f32).transpose()?;
        let out = Tensor::zeros([tokens, hidden], DType::F32);
        let mut o = out.write::<f32>()?;
        let k = slots.len() / tokens.max(1);
        for (p, &slot) in slots.iter().enumerate() {
            let Ok(row) = usize::try_from(slot) else {
                continue;
            };
            let (t, w) = (p / k, weights.as_ref().map_or(1.0, |w| w[p]));
            axpy(
                &mut o[t * hidden..(t + 1) * hidden],
                w,
                &rows[row * hidden..(row + 1) * hidden],
            );
        }
        drop(o);
        Ok(out)
    }

    fn row_dots(&self, d: &Tensor, rows: &Tensor, hidden: usize, slots: &Tensor) -> Result<Tensor> {
        let (d, rows) = (d.to_f32_contiguous()?, rows.to_f32_contiguous()?);
        let (d, rows) = (d.read::<f32>()?, rows.read::<f32>()?);
        let (tokens, k) = slot_dims(slots);
        let dots: Vec<f32> = table(slots)?
            .iter()
            .enumerate()
            .map(|(p, &slot)| match usize::try_from(slot) {
                Ok(row) => {
                    let t = p / k;
                    let (a, b) = (
                        &d[t * hidden..(t + 1) * hidden],
                        &rows[row * hidden..(row + 1) * hidden],
                    );
                    a.iter().zip(b).map(|(x, y)| x * y).sum()
                }
                Err(_) => 0.0,
            })
            .collect();
        Ok(Tensor::from_vec(dots, [tokens, k])?)
    }

    fn scale_rows(
        &self,
        d: &Tensor,
        hidden: usize,
        slots: &Tensor,
        weights: &Tensor,
        rows: usize,
    ) -> Result<Tensor> {
        let d = d.to_f32_contiguous()?;
        let d = d.read::<f32>()?;
        let (_, k) = slot_dims(slots);
        let weights = weights.to_vec_f32()?;
        let out = Tensor::zeros([rows, hidden], DType::F32);
        let mut o = out.write::<f32>()?;
        for (p, &slot) in table(slots)?.iter().enumerate() {
            let Ok(row) = usize::try_from(slot) else {
                continue;
            };
            let t = p / k;
            axpy(
                &mut o[row * hidden..(row + 1) * hidden],
                weights[p],
                &d[t * hidden..(t + 1) * hidden],
            );
        }
        drop(o);
        Ok(out)
    }

    fn expert_slots(
        &self,
        map: &Tensor,
        experts: std::ops::Range<usize>,
        rows: usize,
    ) -> Result<(Tensor, Tensor)> {
        let (tokens, all) = slot_dims(map);
        let map = table(map)?;
        let mut slots = vec![-1i64; tokens * all];
        let mut source = vec![-1i64; rows];
        let mut at = 0;
        for e in experts {
            for t in 0..tokens {
                if map[t * all + e] != 0 && at < rows {
                    slots[t * all + e] = at as i64;
                    source[at] = t as i64;
                    at += 1;
                }
            }
        }
        Ok((
            Tensor::from_vec(slots, [tokens, all])?,
            Tensor::from_vec(source, [rows])?,
        ))
    }

    fn column_counts(&self, map: &Tensor, experts: std::ops::Range<usize>) -> Result<Tensor> {
        let (tokens, all) = slot_dims(map);
        let map = table(map)?;
        let counts: Vec<i64> = experts
            .clone()
            .map(|e| (0..tokens).filter(|&t| map[t * all + e] != 0).count() as i64)
            .collect();
        Ok(Tensor::from_vec(counts, [experts.len()])?)
    }

    fn chunk_order(
        &self,
        counts: &Tensor,
        local: usize,
        rows: usize,
        inverse: bool,
    ) -> Result<Tensor> {
        let counts: Vec<usize> = table(counts)?.iter().map(|&c| c.max(0) as usize).collect();
        let ranks = counts.len() / local.max(1);
        let mut start = vec![0usize; counts.len()];
        let mut at = 0;
        for (s, &c) in start.iter_mut().zip(&counts) {
            *s = at;
            at += c;
        }
        let mut index = vec![0i64; rows.max(at)];
        let mut sorted = 0;
        for le in 0..local {
            for r in 0..ranks {
                let (received, n) = (start[r * local + le], counts[r * local + le]);
                for j in 0..n {
                    if inverse {
                        index[received + j] = (sorted + j) as i64;
                    } else {
                        index[sorted + j] = (received + j) as i64;
                    }
                }
                sorted += n;
            }
        }
        index.truncate(rows);
        Ok(Tensor::from_vec(index, [rows])?)
    }

    fn affine_index(&self, n: usize, (m, a, b): (usize, usize, usize)) -> Result<Tensor> {
        let m = m.max(1);
        let index: Vec<i64> = (0..n).map(|i| ((i % m) * a + (i / m) * b) as i64).collect();
        Ok(Tensor::from_vec(index, [n])?)
    }
}
