//! Global gradient-norm clipping (Megatron-LM's `clip_grad_norm_fp32`): the L2 norm of the
//! gradients with every parameter counted once over the model-parallel groups, and the
//! coefficient the update multiplies the gradients by.

use std::ops::Range;

use super::AdamW;
use crate::backend;
use crate::comm::{ParallelState, ReduceOp};
use crate::distributed::{ParamBuffers, ParamSlot, ReduceGroups, ShardRanks};
use crate::error::Result;
use crate::parallel::GroupKind;
use crate::tensor::Tensor;

/// The ranges of the gradient buffer this rank counts in the norm, merged, of the dense
/// parameters or (`experts`) of the experts'. Each parameter once over the model-parallel
/// group: tensor-parallel parts by every rank, replicated parameters by tensor-parallel rank 0
/// (`tp_rank`; for experts, expert-tensor-parallel rank 0), a copy another pipeline stage holds
/// too nowhere; and with `shard = Some(ranks)` only the parts in that rank's shards.
fn counted_ranges(
    buffers: &ParamBuffers,
    (tp_rank, etp_rank): (usize, usize),
    shard: Option<ShardRanks>,
    experts: bool,
) -> Vec<Range<usize>> {
    let counted = |slot: &ParamSlot| {
        !slot.shared_copy
            && slot.spec.is_expert() == experts
            && match slot.spec.split.group() {
                Some(GroupKind::Tp | GroupKind::Etp | GroupKind::EtpEp) => true,
                Some(GroupKind::Ep) => etp_rank == 0,
                _ => tp_rank == 0,
            }
    };
    let slots = buffers.slots();
    // A range of a slot less the elements that copy another rank's (counted there).
    let own = |slot: &ParamSlot, range: Range<usize>| -> Vec<Range<usize>> {
        let copied = slot.spec.copied();
        let copied = slot.offset + copied.start..slot.offset + copied.end;
        [
            range.start..range.end.min(copied.start),
            range.start.max(copied.end)..range.end,
        ]
        .into_iter()
        .filter(|r| !r.is_empty())
        .collect()
    };
    let mut ranges: Vec<Range<usize>> = match shard {
        Some(ranks) => buffers
            .shards(ranks)
            .into_iter()
            .flat_map(|(_, parts)| parts)
            .filter(|part| counted(&slots[part.slot]))
            .flat_map(|part| own(&slots[part.slot], part.range))
            .collect(),
        None => slots
            .iter()
            .filter(|s| counted(s))
            .flat_map(|s| own(s, s.range()))
            .collect(),
    };
    ranges.sort_by_key(|r| r.start);
    let mut merged: Vec<Range<usize>> = Vec::new();
    for r in ranges {
        match merged.last_mut() {
            Some(last) if last.end == r.start => last.end = r.end,
            _ => merged.push(r),
        }
    }
    merged
}

/// Σx² of `grads` over `ranges`, read back once on a GPU (a host wait per range would leave it
/// idle that many times a step).
fn sum_of_squares_over(grads: &Tensor, ranges: &[Range<usize>]) -> Result<f64> {
    let parts = ranges
        .iter()
        .map(|r| grads.narrow(0, r.start, r.len()))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    backend::of(grads).sum_of_squares(&parts)
}

/// The global L2 norm of the gradients (the main gradients when kept), each parameter counted
/// once: summed over this rank's parameters (see `counted_ranges`), then over the
/// model-parallel group, and with the distributed optimizer first over the data-parallel group,
/// each rank having summed its shards only. The experts' parameters are summed apart, over the
/// expert data-parallel and expert model-parallel groups, and added before the sum over the
/// pipeline (Megatron-LM's separate norm of the expert parameters, combined). `experts` says
/// whether the model has experts on any pipeline stage: a stage of dense layers only (DeepSeek's
/// first layers) then takes part in the experts' sums with none, as every stage must make the
/// same collectives.
pub fn grad_norm(
    buffers: &ParamBuffers,
    optimizer: &AdamW,
    parallel: &ParallelState,
    experts: bool,
) -> Result<f64> {
    let groups = parallel.groups();
    let ranks = (groups.tp_rank(), groups.etp_rank());
    let local_sum = |experts: bool| -> Result<Tensor> {
        let ranges = counted_ranges(buffers, ranks, optimizer.shard(), experts);
        let sum = match optimizer.main_grads() {
            Some(main) => {
                let ranges: Vec<Range<usize>> = ranges
                    .iter()
                    .map(|r| optimizer.to_moments(buffers, r))
                    .collect();
                sum_of_squares_over(main, &ranges)?
            }
            None => sum_of_squares_over(buffers.grads(), &ranges)?,
        };
        // f32 carries the partial sums across ranks, as Megatron-LM does.
        Tensor::scalar_near(sum as f32, buffers.grads())
    };
    let sharded = optimizer.shard().is_some();
    // The shards of one instance hold every gradient once (with several distributed-optimizer
    // instances, each instance holds them all).
    let shards = ReduceGroups::of(parallel);
    let total = local_sum(false)?;
    if sharded {
        shards.dense.all_reduce(&total, ReduceOp::Sum)?;
    }
    if !experts {
        parallel
            .comm(GroupKind::TpPp)
            .all_reduce(&total, ReduceOp::Sum)?;
        return Ok(f64::from(total.to_vec::<f32>()?[0]).sqrt());
    }
    parallel.tp().all_reduce(&total, ReduceOp::Sum)?;
    let experts = local_sum(true)?;
    if sharded {
        shards.expert.all_reduce(&experts, ReduceOp::Sum)?;
    }
    parallel
        .comm(GroupKind::EtpEp)
        .all_reduce(&experts, ReduceOp::Sum)?;
    let total = Tensor::scalar_near(
        total.to_vec::<f32>()?[0] + experts.to_vec::<f32>()?[0],
        buffers.grads(),
    )?;
    parallel.pp().all_reduce(&total, ReduceOp::Sum)?;
    Ok(f64::from(total.to_vec::<f32>()?[0]).sqrt())
}

/// Megatron-LM's gradient clipping coefficient: `max_norm / (norm + 1e-6)` when that is below
/// 1 (and clipping is on, `max_norm > 0`), else 1. [`AdamW::step`] multiplies the gradients by it.
pub fn clip_coefficient(norm: f64, max_norm: f64) -> f64 {
    let coeff = max_norm / (norm + 1e-6);
    if max_norm > 0.0 && coeff < 1.0 {
        coeff
    } else {
        1.0
    }
}
