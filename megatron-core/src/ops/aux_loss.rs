//! An auxiliary loss beside the language model's: multi-token prediction's per-depth losses
//! (Megatron-LM's `MTPLossAutoScaler` and `MTPLossLoggingHelper`).
//!
//! The loss rides on a value the model computes anyway: [`aux_loss`] returns that value
//! unchanged, and its backward passes the value's gradient through and starts the auxiliary
//! loss's own backward, with the gradient of `weight · Σ(mask · losses) / Σ mask` (the mean over
//! the microbatch's counted tokens, Megatron-LM's `mtp_loss_scale · mtp_loss / num_tokens`)
//! times the main loss's backward scale ([`Cx::token_loss_scale`]: the loss scale over the
//! microbatches, as Megatron-LM's schedules set it; with `--calculate-per-token-loss`, times the
//! micro-batch's counted tokens over the step's, as Megatron-LM weighs the depths then). The backward records the mean, unweighted,
//! under the loss's name in the context's [`AuxLossLog`]: once per microbatch, whatever
//! recomputation reruns.

use std::collections::BTreeMap;
use std::sync::Mutex;

use crate::backend;
use crate::error::Result;
use crate::invalid;
use crate::module::{Cx, Site};
use crate::tensor::{DType, Tensor};

/// What [`aux_loss`] keeps for its backward.
#[derive(Debug, Clone)]
pub struct AuxLossSaved {
    /// The loss's name in the log.
    name: String,
    /// The mask's weights over the counted tokens, `weight · mask / Σ mask` (zeros when no
    /// token counts), on the host.
    grad: Vec<f32>,
    /// The shape of the per-token losses.
    shape: Vec<usize>,
    /// The microbatch's mean, unweighted.
    mean: f64,
    /// A tensor on the losses' device.
    like: Tensor,
}

/// `x` unchanged, carrying the auxiliary loss `weight · Σ(mask · losses) / Σ mask` of the
/// per-token `losses` (f32) and the 0/1 `mask` of the same shape, logged as `name`.
pub fn aux_loss(
    cx: &Cx,
    _site: Site,
    name: &str,
    x: &Tensor,
    (losses, mask): (&Tensor, &Tensor),
    weight: f32,
) -> Result<(Tensor, AuxLossSaved)> {
    if losses.shape() != mask.shape() {
        return invalid!(
            "the auxiliary loss `{name}`: per-token losses {} and their mask {} differ in shape",
            losses.shape(),
            mask.shape()
        );
    }
    if !weight.is_finite() {
        return invalid!("the auxiliary loss `{name}`: its weight {weight} is not finite");
    }
    let values = losses.to_vec_f32()?;
    let mask_values = mask.to_vec_f32()?;
    let mut tokens: f64 = mask_values.iter().map(|&m| f64::from(m)).sum();
    let mut sum: f64 = values
        .iter()
        .zip(&mask_values)
        .map(|(&l, &m)| f64::from(l) * f64::from(m))
        .sum();
    // With context parallelism each rank holds chunks of the sequence: the mean is over the
    // whole sequence's counted tokens (Megatron-LM's `roll_tensor` sums them over the group).
    if cx.parallel().groups().config().cp > 1 {
        let group = cx.parallel().comm(crate::parallel::GroupKind::Cp);
        let both = group.place(&Tensor::from_vec(vec![sum as f32, tokens as f32], [2])?)?;
        group.all_reduce(&both, crate::comm::ReduceOp::Sum)?;
        let both = both.to_vec_f32()?;
        (sum, tokens) = (f64::from(both[0]), f64::from(both[1]));
    }
    let (mean, per_token) = match tokens > 0.0 {
        true => (sum / tokens, (f64::from(weight) / tokens) as f32),
        false => (0.0, 0.0),
    };
    Ok((
        x.clone(),
        AuxLossSaved {
            name: name.to_string(),
            grad: mask_values.iter().map(|&m| m * per_token).collect(),
            shape: losses.dims().to_vec(),
            mean,
            like: losses.clone(),
        },
    ))
}

/// The backward of [`aux_loss`]: `x`'s gradient as it came, and the per-token losses' gradient
/// (the mask's weights times the main loss's backward scale).
pub fn aux_loss_backward(
    cx: &Cx,
    _site: Site,
    saved: AuxLossSaved,
    dx: &Tensor,
) -> Result<(Tensor, Tensor)> {
    if let Some(log) = cx.aux_loss_log() {
        log.record(&saved.name, saved.mean);
    }
    let scale = cx.token_loss_scale();
    let grad: Vec<f32> = saved.grad.iter().map(|&g| g * scale).collect();
    let grad = Tensor::from_vec(grad, saved.shape)?;
    let grad = backend::of(&saved.like).place(&grad)?;
    let grad = match saved.like.dtype() {
        DType::F32 => grad,
        dtype => grad.to_dtype(dtype)?,
    };
    Ok((dx.clone(), grad))
}

/// The auxiliary losses of a step, by name: the sum of the microbatches' means and how many
/// there were (Megatron-LM's tracker, before its reduction over ranks).
#[derive(Debug, Default)]
pub struct AuxLossLog {
    totals: Mutex<BTreeMap<String, (f64, usize)>>,
}

impl AuxLossLog {
    /// Adds one microbatch's mean of loss `name`.
    pub fn record(&self, name: &str, mean: f64) {
        let mut totals = self
            .totals
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let entry = totals.entry(name.to_string()).or_insert((0.0, 0));
        entry.0 += mean;
        entry.1 += 1;
    }

    /// What the step recorded, emptying the log.
    pub fn take(&self) -> BTreeMap<String, (f64, usize)> {
        std::mem::take(
            &mut *self
                .totals
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::ParallelState;
    use crate::comm::threads::launch;
    use crate::parallel::{ParallelConfig, ParallelLayout};

    /// The gradient is the weighted masked mean's, against finite differences of that mean,
    /// scaled by the main loss's backward scale; `x` passes unchanged both ways; the log has the
    /// unweighted mean once per backward.
    #[test]
    fn the_gradient_is_the_masked_means_and_the_log_its_value() {
        let layout = ParallelLayout::new(&ParallelConfig::new(1)).unwrap();
        launch(1, |w| -> Result<()> {
            let ps = ParallelState::new(&w, &layout)?;
            let log = AuxLossLog::default();
            let cx = Cx::new(&ps, 1).with_aux_loss_scale(0.25);
            let cx = cx.with_aux_loss_log(&log);
            let (s, b) = (4, 2);
            let losses: Vec<f32> = (0..s * b).map(|i| 0.5 + i as f32 * 0.25).collect();
            // The last position has no target (a shifted mask), one other token is masked.
            let mask = vec![1.0f32, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0];
            let x = Tensor::from_vec(vec![1.0f32, -2.0, 3.0], [3])?;
            let (lt, mt) = (
                Tensor::from_vec(losses.clone(), [s, b])?,
                Tensor::from_vec(mask.clone(), [s, b])?,
            );
            let weight = 0.3f32;
            let (y, saved) = aux_loss(&cx, Site::ROOT, "mtp_1", &x, (&lt, &mt), weight)?;
            assert_eq!(y.to_vec::<f32>()?, x.to_vec::<f32>()?);
            let dx = Tensor::from_vec(vec![0.5f32, 0.25, -1.0], [3])?;
            let (dx_out, dl) = aux_loss_backward(&cx, Site::ROOT, saved, &dx)?;
            assert_eq!(dx_out.to_vec::<f32>()?, dx.to_vec::<f32>()?);
            let objective = |l: &[f32]| -> f64 {
                let n: f64 = mask.iter().map(|&m| f64::from(m)).sum();
                let sum: f64 = l.iter().zip(&mask).map(|(&a, &m)| f64::from(a * m)).sum();
                f64::from(weight) * sum / n
            };
            let dl = dl.to_vec::<f32>()?;
            let dl_first = dl.clone();
            for i in 0..s * b {
                let (mut up, mut down) = (losses.clone(), losses.clone());
                up[i] += 1e-2;
                down[i] -= 1e-2;
                let numeric = (objective(&up) - objective(&down)) / 2e-2 * 0.25;
                assert!(
                    (f64::from(dl[i]) - numeric).abs() < 1e-6,
                    "{i}: {} vs {numeric}",
                    dl[i]
                );
            }
            let logged = log.take();
            let mean = objective(&losses) / f64::from(weight);
            assert_eq!(logged.len(), 1);
            assert!(
                (logged["mtp_1"].0 - mean).abs() < 1e-12,
                "{logged:?} vs {mean}"
            );
            assert_eq!(logged["mtp_1"].1, 1);
            // No counted token: no loss, no gradient.
            let none = Tensor::from_vec(vec![0.0f32; s * b], [s, b])?;
            let (_, saved) = aux_loss(&cx, Site::ROOT, "mtp_2", &x, (&lt, &none), weight)?;
            let (_, dl) = aux_loss_backward(&cx, Site::ROOT, saved, &dx)?;
            assert!(dl.to_vec::<f32>()?.iter().all(|&g| g == 0.0));
            assert_eq!(log.take()["mtp_2"], (0.0, 1));
            // With per-token losses the micro-batch's share of the step's tokens scales the
            // gradient instead of the routers' scale.
            let shared = cx.with_token_share_scale(0.75);
            let (_, saved) = aux_loss(&shared, Site::ROOT, "mtp_1", &x, (&lt, &mt), weight)?;
            let (_, ds) = aux_loss_backward(&shared, Site::ROOT, saved, &dx)?;
            for (a, b) in ds.to_vec::<f32>()?.iter().zip(&dl_first) {
                assert!((a - b * 3.0).abs() < 1e-6, "{a} vs 3 × {b}");
            }
            // A mask of another shape is refused by name.
            let short = Tensor::from_vec(vec![1.0f32; s], [s])?;
            let refused = aux_loss(&cx, Site::ROOT, "mtp_3", &x, (&lt, &short), weight);
            assert!(refused.unwrap_err().to_string().contains("`mtp_3`"));
            Ok(())
        })
        .unwrap();
    }
}
