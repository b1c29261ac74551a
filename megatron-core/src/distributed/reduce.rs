//! Data parallelism's collectives on the flat buffers: the gradients' reduction bucket by bucket
//! (an all-reduce, or with the distributed optimizer a reduce-scatter), the parameters'
//! all-gather after the update of each rank's shard, and the tied embedding's gradient sum over
//! Megatron-LM's embedding group.

use super::{ParamBuffers, ReduceGroups};
use crate::comm::{ParallelState, ReduceOp};
use crate::error::Result;
use crate::module::{Module, Pipelined, Split};
use crate::parallel::GroupKind;
use crate::tensor::Tensor;

/// Sums the gradient buffer over the data-parallel groups, bucket by bucket (the buffer's front
/// holds the last layers; dense buckets over data parallelism, the experts' over expert data
/// parallelism): an all-reduce of each bucket, or for a sharded bucket (the distributed
/// optimizer) a reduce-scatter that leaves each rank the sum of its shard. With several
/// distributed-optimizer instances the reduce-scatter runs within the rank's instance and the
/// shard is then all-reduced across instances (Megatron-LM's order).
pub fn reduce_gradients(buffers: &ParamBuffers, groups: ReduceGroups<'_>) -> Result<()> {
    let grads = buffers.grads();
    for bucket in buffers.buckets() {
        let group = groups.of_bucket(bucket);
        let whole = grads.narrow(0, bucket.range.start, bucket.range.len())?;
        match bucket.shard(group.index()) {
            Some((shard, _)) => {
                let mine = grads.narrow(0, shard.start, shard.len())?;
                if group.size() > 1 {
                    group.reduce_scatter(&whole, &mine, ReduceOp::Sum)?;
                }
                if let Some(across) = groups.across_bucket(bucket) {
                    across.all_reduce(&mine, ReduceOp::Sum)?;
                }
            }
            None if group.size() > 1 => group.all_reduce(&whole, ReduceOp::Sum)?,
            None => {}
        }
    }
    Ok(())
}

/// With the distributed optimizer, gives every data-parallel rank the parameters the others
/// updated: an all-gather of each bucket's shards over its group. Then refreshes the compute
/// copies.
pub fn gather_parameters(buffers: &ParamBuffers, groups: ReduceGroups<'_>) -> Result<()> {
    // Sharded parameters (`optim_grads_params`) are gathered by their units, when read.
    if !buffers.sharded() || buffers.sharded_values().is_some() {
        return Ok(());
    }
    let values = buffers.values();
    for bucket in buffers.buckets() {
        let group = groups.of_bucket(bucket);
        if group.size() == 1 {
            continue;
        }
        if let Some((shard, _)) = bucket.shard(group.index()) {
            let whole = values.narrow(0, bucket.range.start, bucket.range.len())?;
            let mine = values.narrow(0, shard.start, shard.len())?;
            group.all_gather(&mine, &whole)?;
        }
    }
    buffers.refresh_compute_copies()
}

/// Sums the gradients of the parameters the first and the last stage both hold over the
/// embedding group (a collective of the two stages' ranks, in visit order). Where one rank
/// holds both stages (the first rank of a V), the sum is local and the group's other rank,
/// holding neither, takes no part.
pub fn sum_shared_gradients<M: Pipelined>(chunks: &[M], parallel: &ParallelState) -> Result<()> {
    let shared_of = |end: fn(&M) -> bool| {
        let mut grads = Vec::new();
        for chunk in chunks.iter().filter(|c| end(c)) {
            chunk.visit_shared_params(&mut |p| {
                if !p.is_frozen() {
                    grads.push(p.grad().clone())
                }
            });
        }
        grads
    };
    let first = shared_of(|c| c.stage().first && !c.stage().last);
    let last = shared_of(|c| c.stage().last && !c.stage().first);
    if !first.is_empty() && !last.is_empty() {
        for (a, b) in first.iter().zip(&last) {
            let sum = crate::ops::add(a, b)?;
            a.copy_from(&sum)?;
            b.copy_from(&sum)?;
        }
        return Ok(());
    }
    let Some(group) = parallel.get(GroupKind::Embedding) else {
        return Ok(());
    };
    if group.size() < 2 {
        return Ok(());
    }
    let mut grads = Vec::new();
    for chunk in chunks {
        chunk.visit_shared_params(&mut |p| {
            if !p.is_frozen() {
                grads.push(p.grad().clone())
            }
        });
    }
    for g in &grads {
        group.all_reduce(g, ReduceOp::Sum)?;
    }
    Ok(())
}

/// With sequence parallelism, sums over the tensor-parallel group the gradients of the
/// parameters that live in the sequence-parallel region (norms, the position table, the MoE
/// router: each rank's gradient comes from its shard of the sequence), packed into one
/// all-reduce (Megatron-LM's `_allreduce_non_tensor_model_parallel_grads`, after the
/// data-parallel reduction as there); and, with or without sequence parallelism, those of
/// `#[local]` layers (the qk-layernorm: each rank's gradient comes from its heads); and the
/// key and value rows of a fused QKV split over more ranks than key/value groups
/// ([`crate::module::Split::QueryGroups`]), over the ranks sharing each group (each rank's
/// gradient comes from its share of the group's queries). Nothing when there are none.
pub fn sum_sequence_parallel_gradients<M: Module>(
    chunks: &[M],
    parallel: &ParallelState,
) -> Result<()> {
    let tp = parallel.tp();
    if tp.size() < 2 {
        return Ok(());
    }
    let sequence_parallel = parallel.sequence_parallel();
    let mut pieces: Vec<Piece> = Vec::new();
    let mut failure = None;
    for chunk in chunks {
        chunk.visit_trainable_params(&mut |p| {
            let Some((summed, group, groups)) = summed_over_tp(p.spec(), sequence_parallel, tp)
            else {
                return;
            };
            let grad = p.grad();
            let piece = grad
                .reshape([grad.numel()])
                .and_then(|flat| flat.narrow(0, summed.start, summed.len()));
            match piece {
                Ok(grad) => pieces.push(Piece {
                    grad,
                    group,
                    groups,
                }),
                Err(e) => {
                    failure.get_or_insert(e);
                }
            }
        });
    }
    if let Some(e) = failure {
        return Err(e.into());
    }
    all_reduce_packed(tp, &pieces)
}

/// [`sum_sequence_parallel_gradients`] with sharded gradients (`optim_grads`): the same sums
/// over the tensor-parallel group, of the parts of those parameters in this rank's shards of
/// the main gradients (every tensor-parallel rank of a data-parallel rank holds the same
/// parts: their buffers are laid out alike).
pub fn sum_sequence_parallel_shards(
    buffers: &ParamBuffers,
    optimizer: &crate::optimizer::AdamW,
    parallel: &ParallelState,
) -> Result<()> {
    let tp = parallel.tp();
    let (Some(ranks), Some(main)) = (optimizer.shard(), optimizer.main_grads()) else {
        return crate::invalid!(
            "sharded gradients need the distributed optimizer's main gradients"
        );
    };
    if tp.size() < 2 {
        return Ok(());
    }
    let sequence_parallel = parallel.sequence_parallel();
    let slots = buffers.slots();
    let mut parts: Vec<super::SlotPart> = buffers
        .shards(ranks)
        .into_iter()
        .flat_map(|(_, parts)| parts)
        .collect();
    // In the parameters' visit order, as every tensor-parallel rank visits them.
    parts.sort_by_key(|part| part.slot);
    let mut pieces = Vec::new();
    for part in parts {
        let slot = &slots[part.slot];
        let Some((summed, group, groups)) = summed_over_tp(&slot.spec, sequence_parallel, tp)
        else {
            continue;
        };
        if slot.spec.is_expert() {
            return crate::invalid!(
                "sharded gradients: the expert parameter {} is summed over tensor parallelism, \
                 and its shards are cut over expert data parallelism",
                slot.spec.name
            );
        }
        let start = part.range.start.max(slot.offset + summed.start);
        let end = part.range.end.min(slot.offset + summed.end);
        if start < end {
            let moments = optimizer.to_moments(buffers, &(start..end));
            pieces.push(Piece {
                grad: main.narrow(0, moments.start, moments.len())?,
                group,
                groups,
            });
        }
    }
    all_reduce_packed(tp, &pieces)
}

/// A gradient's elements summed over tensor parallelism, and which of `groups` equal slots of
/// the packed buffer they take (the others stay 0 on this rank).
struct Piece {
    grad: Tensor,
    group: usize,
    groups: usize,
}

/// Which elements of a parameter's gradient (flat) are summed over tensor parallelism, and
/// their slot of how many (see [`sum_sequence_parallel_gradients`]); `None`: none are.
fn summed_over_tp(
    spec: &crate::module::ParamSpec,
    sequence_parallel: bool,
    tp: &dyn crate::comm::Communicator,
) -> Option<(std::ops::Range<usize>, usize, usize)> {
    let n = spec.local.numel();
    match spec.split {
        Split::QueryGroups {
            groups, head_dim, ..
        } => {
            // The key and value rows: the last two heads' rows of the local part.
            let kv = n / spec.local.dims()[0].max(1) * 2 * head_dim;
            let group = tp.index() / (tp.size() / groups.max(1)).max(1);
            Some((n - kv..n, group, groups))
        }
        _ if (sequence_parallel && spec.sequence_parallel) || spec.tensor_parallel_partial => {
            Some((0..n, 0, 1))
        }
        _ => None,
    }
}

/// Sums `pieces` over `tp` in one all-reduce of a packed buffer.
fn all_reduce_packed(tp: &dyn crate::comm::Communicator, pieces: &[Piece]) -> Result<()> {
    let Some(first) = pieces.first() else {
        return Ok(());
    };
    let total = pieces
        .iter()
        .map(|p| p.grad.numel() * p.groups)
        .sum::<usize>();
    let packed = Tensor::zeros_near([total], first.grad.dtype(), &first.grad)?;
    let mut at = 0;
    for p in pieces {
        let n = p.grad.numel();
        packed.narrow(0, at + p.group * n, n)?.copy_from(&p.grad)?;
        at += n * p.groups;
    }
    tp.all_reduce(&packed, ReduceOp::Sum)?;
    let mut at = 0;
    for p in pieces {
        let n = p.grad.numel();
        p.grad.copy_from(&packed.narrow(0, at + p.group * n, n)?)?;
        at += n * p.groups;
    }
    Ok(())
}
