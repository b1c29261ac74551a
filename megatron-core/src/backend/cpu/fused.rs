//! [`FusedOps`] on the host: the generated loop over the tensors' slices, split into parts
//! over the compute threads (each part an independent run of elements, so the bits do not
//! depend on the threads).

use rayon::prelude::*;

use super::Cpu;
use crate::backend::FusedOps;
use crate::error::Result;
use crate::kernels::parallel;
use crate::ops::FusedKernel;
use crate::tensor::{DType, Tensor};

/// One part of the elements: the inputs' slices and the outputs'.
type Part<'a> = (Vec<&'a [f32]>, Vec<&'a mut [f32]>);

impl FusedOps for Cpu {
    fn fused(
        &self,
        kernel: &'static FusedKernel,
        inputs: &[&Tensor],
        scalars: &[f32],
    ) -> Result<Vec<Tensor>> {
        let inputs = inputs
            .iter()
            .map(|t| t.to_f32_contiguous())
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let shape = inputs[0].shape().clone();
        let n = inputs[0].numel();
        let outputs: Vec<Tensor> = (0..kernel.outputs)
            .map(|_| Tensor::empty(shape.clone(), DType::F32))
            .collect();
        {
            let reads = inputs
                .iter()
                .map(|t| t.read::<f32>())
                .collect::<std::result::Result<Vec<_>, _>>()?;
            let mut writes = outputs
                .iter()
                .map(|t| t.write::<f32>())
                .collect::<std::result::Result<Vec<_>, _>>()?;
            let ins: Vec<&[f32]> = reads.iter().map(|r| &r[..]).collect();
            let mut outs: Vec<&mut [f32]> = writes.iter_mut().map(|w| &mut w[..]).collect();
            match parallel::part_len(n) {
                None => (kernel.host)(&ins, scalars, &mut outs),
                Some(part) => {
                    let mut jobs: Vec<Part<'_>> = (0..n.div_ceil(part))
                        .map(|k| {
                            let range = k * part..((k + 1) * part).min(n);
                            (ins.iter().map(|s| &s[range.clone()]).collect(), Vec::new())
                        })
                        .collect();
                    for out in outs {
                        for (k, chunk) in out.chunks_mut(part).enumerate() {
                            jobs[k].1.push(chunk);
                        }
                    }
                    parallel::on_pool(|| {
                        jobs.into_par_iter()
                            .for_each(|(ins, mut outs)| (kernel.host)(&ins, scalars, &mut outs))
                    });
                }
            }
        }
        Ok(outputs)
    }
}
