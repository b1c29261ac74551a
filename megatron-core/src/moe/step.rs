//! What MoE layers add to a training step (the trainer calls these at the end of a step's
//! backward and knows nothing else of MoE): the routers' statistics summed over the ranks
//! (Megatron-LM's MoE metrics tracker) and the aux-loss-free expert-bias update (Megatron-LM's
//! `_update_router_expert_bias` in `finalize_model_grads`).

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Mutex;

use super::{PlacedRouting, update_expert_bias};
use crate::comm::{ParallelState, ReduceOp};
use crate::distributed::{ParamBuffers, ReduceGroups};
use crate::error::Result;
use crate::invalid;
use crate::tensor::{DType, Tensor};

/// What the MoE layers' routers did, summed over the layers and micro-batches of a step (what
/// Megatron-LM's MoE metrics tracker logs).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RoutingTotals {
    /// Routings recorded (MoE layers × micro-batches).
    pub routings: usize,
    /// Sum of their load-balancing losses (coefficient included).
    pub aux_loss: f64,
    /// Sum of their z losses (coefficient included).
    pub z_loss: f64,
    /// Tokens each expert received.
    pub tokens_per_expert: Vec<u64>,
    /// Token-expert pairs the top-k chose.
    pub chosen: u64,
    /// Of which capacity dropped.
    pub dropped: u64,
}

impl RoutingTotals {
    /// The mean load-balancing loss per routing.
    pub fn mean_aux_loss(&self) -> f64 {
        self.aux_loss / self.routings.max(1) as f64
    }

    /// The mean z loss per routing.
    pub fn mean_z_loss(&self) -> f64 {
        self.z_loss / self.routings.max(1) as f64
    }

    /// The fraction of chosen token-expert pairs that capacity dropped.
    pub fn dropped_fraction(&self) -> f64 {
        self.dropped as f64 / self.chosen.max(1) as f64
    }

    /// The fewest, mean and most tokens an expert received.
    pub fn tokens_min_mean_max(&self) -> (u64, f64, u64) {
        let t = &self.tokens_per_expert;
        let mean = t.iter().sum::<u64>() as f64 / t.len().max(1) as f64;
        (
            t.iter().copied().min().unwrap_or(0),
            mean,
            t.iter().copied().max().unwrap_or(0),
        )
    }
}

/// Collects the routings of a step (the trainer hands it to the context; each MoE layer
/// records its routing once, in its backward, so a recomputed forward is not counted twice).
#[derive(Debug, Default)]
pub struct RoutingLog {
    totals: Mutex<RoutingTotals>,
    /// Each biased router's tokens per expert over the step, by its bias parameter's name,
    /// with its update rate.
    loads: Mutex<BTreeMap<String, (Vec<f64>, f32)>>,
}

impl RoutingLog {
    /// Adds one routing of top-`topk` experts.
    pub fn record(&self, routing: &PlacedRouting, topk: usize) {
        let mut t = self
            .totals
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        t.routings += 1;
        t.aux_loss += f64::from(routing.aux_loss);
        t.z_loss += f64::from(routing.z_loss);
        if t.tokens_per_expert.len() < routing.experts {
            t.tokens_per_expert.resize(routing.experts, 0);
        }
        for (a, &b) in t
            .tokens_per_expert
            .iter_mut()
            .zip(&routing.tokens_per_expert)
        {
            *a += b as u64;
        }
        t.chosen += (routing.tokens * topk) as u64;
        t.dropped += routing.dropped as u64;
    }

    /// Adds one routing's tokens per expert to the load of the router whose expert bias is the
    /// parameter `bias` (moved by `rate` at the step's end).
    pub fn record_load(&self, bias: &str, tokens_per_expert: &[usize], rate: f32) {
        let mut loads = self
            .loads
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let (load, r) = loads
            .entry(bias.to_string())
            .or_insert_with(|| (vec![0.0; tokens_per_expert.len()], rate));
        *r = rate;
        for (l, &n) in load.iter_mut().zip(tokens_per_expert) {
            *l += n as f64;
        }
    }

    /// The biased routers' loads since the last take, by bias parameter name, leaving none.
    pub fn take_loads(&self) -> BTreeMap<String, (Vec<f64>, f32)> {
        std::mem::take(
            &mut *self
                .loads
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }

    /// What was recorded since the last take, leaving the log empty.
    pub fn take(&self) -> RoutingTotals {
        std::mem::take(
            &mut *self
                .totals
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }
}

impl RoutingLog {
    /// What the MoE layers' routers did in the step just run (over `experts` experts per
    /// layer), summed over the data-parallel ranks and the pipeline stages, and with sequence
    /// parallelism over the tensor-parallel ranks' shards (a collective of those groups,
    /// through `like`'s device); `None` without MoE layers (`experts` 0). Takes what was
    /// recorded.
    pub fn totals(
        &self,
        parallel: &ParallelState,
        experts: usize,
        like: &Tensor,
    ) -> Result<Option<RoutingTotals>> {
        let mine = self.take();
        if experts == 0 {
            return Ok(None);
        }
        let mut row = vec![
            mine.routings as f64,
            mine.aux_loss,
            mine.z_loss,
            mine.chosen as f64,
            mine.dropped as f64,
        ];
        row.extend((0..experts).map(|e| mine.tokens_per_expert.get(e).map_or(0.0, |&t| t as f64)));
        // f32 holds the counts exactly up to 2^24 tokens per expert and step.
        let host = Tensor::from_vec(
            row.iter().map(|&v| v as f32).collect::<Vec<_>>(),
            [row.len()],
        )?;
        let t = Tensor::zeros_near([row.len()], DType::F32, like)?;
        t.copy_from(&host)?;
        if let Some(split) = parallel.token_split() {
            // Each rank of the split routed its part of the sequences: their counts and
            // losses add up (a rank's aux loss is its part of the sequence's, its z loss its
            // share of the mean), the routings are the same ones.
            if split.index() != 0 {
                t.narrow(0, 0, 1)?
                    .copy_from(&Tensor::from_vec(vec![0.0f32], [1])?)?;
            }
        }
        if parallel.sequence_parallel() {
            parallel.tp().all_reduce(&t, ReduceOp::Sum)?;
        }
        // With context parallelism the data-parallel group is dp×cp: the context-parallel
        // ranks' parts are summed here.
        parallel.dp().all_reduce(&t, ReduceOp::Sum)?;
        parallel.pp().all_reduce(&t, ReduceOp::Sum)?;
        let v = t.to_vec::<f32>()?;
        Ok(Some(RoutingTotals {
            routings: v[0] as usize,
            aux_loss: f64::from(v[1]),
            z_loss: f64::from(v[2]),
            chosen: v[3] as u64,
            dropped: v[4] as u64,
            tokens_per_expert: v[5..].iter().map(|&c| c as u64).collect(),
        }))
    }

    /// Megatron-LM's aux-loss-free balancing, at the end of a step's backward (before the
    /// update, skipped steps included): each biased router's expert bias moved by its rate
    /// towards the mean load of the step's tokens, summed over the data-parallel ranks (a
    /// collective of dp, with biased routers only). Returns each bias's range in `buffers` and
    /// its new values, for the optimizer to set; takes the recorded loads.
    pub fn expert_bias_updates(
        &self,
        parallel: &ParallelState,
        buffers: &ParamBuffers,
    ) -> Result<Vec<(Range<usize>, Vec<f32>)>> {
        let loads = self.take_loads();
        if loads.is_empty() {
            return Ok(Vec::new());
        }
        // f32 holds the counts exactly up to 2^24 tokens per expert and step.
        let row: Vec<f32> = loads
            .values()
            .flat_map(|(load, _)| load.iter().map(|&n| n as f32))
            .collect();
        let total = Tensor::zeros_near([row.len()], DType::F32, buffers.grads())?;
        total.copy_from(&Tensor::from_vec(row, [total.numel()])?)?;
        parallel.dp().all_reduce(&total, ReduceOp::Sum)?;
        if parallel.sequence_parallel() {
            // Each tensor-parallel rank routed its shard of the sequence (Megatron-LM sums the
            // counts over tp·dp·cp).
            parallel.tp().all_reduce(&total, ReduceOp::Sum)?;
        }
        let total = total.to_vec::<f32>()?;
        let mut at = 0;
        let mut updates = Vec::with_capacity(loads.len());
        for (name, (load, rate)) in &loads {
            let experts = load.len();
            let Some(slot) = buffers.slots().iter().find(|s| &s.spec.name == name) else {
                return invalid!("the expert bias {name} is not among the trained parameters");
            };
            let range = slot.range();
            let mut bias = buffers
                .gathered_values(range.clone(), ReduceGroups::of(parallel))?
                .to_vec_f32()?;
            update_expert_bias(&mut bias, &total[at..at + experts], *rate);
            updates.push((range, bias));
            at += experts;
        }
        Ok(updates)
    }
}
