//! [`ExpertOps`] on the host: the grouped products of `moe::experts` on f32 host values
//! (16-bit weights widened, their gradients accumulated in f32 and rounded back).

use super::Cpu;
use crate::backend::ExpertOps;
use crate::error::Result;
use crate::invalid;
use crate::module::{Param, WeightGrad};
use crate::moe::experts::{
    ExpertShape, ExpertsSaved, experts_backward_input, experts_forward, experts_weight_grads,
};
use crate::moe::routed::{accumulate, host_f32};
use crate::tensor::Tensor;

impl ExpertOps for Cpu {
    fn experts_forward(
        &self,
        shape: &ExpertShape,
        x: &Tensor,
        rows: &[usize],
        (fc1, fc2): (&Tensor, &Tensor),
    ) -> Result<(Tensor, ExpertsSaved)> {
        let (y, kept) =
            experts_forward(shape, &host_f32(x)?, rows, &host_f32(fc1)?, &host_f32(fc2)?)?;
        let n = rows.iter().sum::<usize>();
        Ok((
            Tensor::from_vec(y, [n, shape.hidden])?,
            ExpertsSaved::Host(kept),
        ))
    }

    fn experts_backward(
        &self,
        shape: &ExpertShape,
        saved: ExpertsSaved,
        dy: &Tensor,
        (fc1, fc2): (&Param, &Param),
    ) -> Result<(Tensor, WeightGrad)> {
        let ExpertsSaved::Host(kept) = saved else {
            return invalid!("the experts' forward ran on a GPU, their backward on the host");
        };
        let weights = (
            host_f32(fc1.compute_value())?,
            host_f32(fc2.compute_value())?,
        );
        let dy = host_f32(dy)?.to_vec();
        let (dx, dpre) = experts_backward_input(shape, &kept, &dy, (&weights.0, &weights.1))?;
        let h = shape.hidden;
        let rows = dx.len() / h.max(1);
        let held = 4 * (dy.len() + dpre.len() + kept.len()) as u64;
        if fc1.is_frozen() && fc2.is_frozen() {
            return Ok((Tensor::from_vec(dx, [rows, h])?, WeightGrad::none()));
        }
        let (shape, fc1, fc2) = (*shape, fc1.clone(), fc2.clone());
        let dw = WeightGrad::new(held, move || {
            accumulate(&fc1, |dfc1| {
                accumulate(&fc2, |dfc2| {
                    experts_weight_grads(&shape, &kept, &dy, &dpre, (dfc1, dfc2))
                })
            })
        });
        Ok((Tensor::from_vec(dx, [rows, h])?, dw))
    }
}
