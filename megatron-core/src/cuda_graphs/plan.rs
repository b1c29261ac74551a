//! How many graphs and static buffers a run captures, per pipeline rank: what `megatron graphs`
//! prints and what the runtime's counts are checked against.
//!
//! A scoped part of a layer is captured once per (layer, model chunk, in-flight slot) as a
//! forward graph and a backward graph. The forward graph reads its input from a static buffer
//! of its slot (the saved activations may alias it until the backward); the backward graph
//! reads the output gradient from a static buffer of its layer's part, shared by the slots
//! (it is consumed by the replay right after the copy); the MoE router's backward also reads
//! the routing weights' gradient and the auxiliary losses' scale. Slots follow the schedule's
//! in-flight bound ([`SlotPlan`]), so the counts do not grow with the microbatches; a graph
//! per microbatch (Megatron-LM's count in the seed) is given for comparison.

use crate::pipeline_parallel::{PipelineLayout, Schedule, WalkError};

use super::{ScopeSet, SlotPlan};

/// The graphs and static buffers of one pipeline rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankGraphs {
    /// The pipeline rank.
    pub pp_rank: usize,
    /// Layers the rank holds (all its chunks).
    pub layers: usize,
    /// Scoped parts of its layers per chunk (each captured once per slot, forward and backward).
    pub scoped_parts: Vec<usize>,
    /// In-flight slots per chunk.
    pub slots: Vec<usize>,
    /// The most microbatches in flight at once over the chunks.
    pub max_live: usize,
    /// Forward graphs captured.
    pub forward_graphs: usize,
    /// Backward graphs captured.
    pub backward_graphs: usize,
    /// Static input buffers of the forward graphs (one per graph).
    pub static_inputs: usize,
    /// Static output-gradient buffers of the backward graphs (one per scoped part).
    pub static_grads: usize,
    /// Bytes of all static buffers.
    pub static_bytes: u64,
    /// Graphs with one per microbatch instead of per slot (Megatron-LM's count:
    /// 2 × scoped parts × M).
    pub graphs_per_microbatch: usize,
}

impl RankGraphs {
    /// Forward and backward graphs.
    pub fn graphs(&self) -> usize {
        self.forward_graphs + self.backward_graphs
    }
}

/// The sizes of the scopes' static buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BufferBytes {
    /// A scope's input or its gradient: a `[seq, micro-batch, hidden]` activation.
    pub activation: u64,
    /// The routing weights' gradient, `[seq · micro-batch, experts]` f32 (the MoE router's
    /// backward graph reads it, and the auxiliary losses' scale, beside its input's gradient).
    pub probs: u64,
}

/// The graphs of every pipeline rank of `schedule` for a model laid out by `layout`, whose
/// layer `l` is a MoE layer when `is_moe(l)`, capturing `scopes`, with static buffers of
/// `bytes`.
pub fn plan_graphs(
    schedule: &Schedule,
    layout: &PipelineLayout,
    scopes: ScopeSet,
    is_moe: &dyn Fn(usize) -> bool,
    bytes: BufferBytes,
) -> Result<Vec<RankGraphs>, WalkError> {
    let config = schedule.config;
    schedule
        .ranks
        .iter()
        .map(|rank| {
            let slots = SlotPlan::new(&rank.order, config.vpp, config.microbatches)?;
            let mut graphs = RankGraphs {
                pp_rank: rank.rank,
                layers: 0,
                scoped_parts: Vec::with_capacity(config.vpp),
                slots: slots.per_chunk().to_vec(),
                max_live: slots.max_live(),
                forward_graphs: 0,
                backward_graphs: 0,
                static_inputs: 0,
                static_grads: 0,
                static_bytes: 0,
                graphs_per_microbatch: 0,
            };
            for chunk in 0..config.vpp {
                let part = layout.part(rank.rank, chunk);
                let n = slots.slots(chunk);
                graphs.layers += part.layers.len();
                let mut parts = 0;
                for l in part.layers {
                    let moe = is_moe(l);
                    let count = scopes.graphs_per_layer(moe);
                    parts += count;
                    // Each part: its input in every slot, its output gradient once.
                    graphs.static_inputs += count * n;
                    graphs.static_grads += count;
                    graphs.static_bytes += (count * (n + 1)) as u64 * bytes.activation;
                    if moe && scopes.contains(super::GraphScope::MoeRouter) {
                        // The router's backward also reads the weights' gradient and
                        // the losses' scale (one f32).
                        graphs.static_grads += 2;
                        graphs.static_bytes += bytes.probs + 4;
                    }
                }
                graphs.scoped_parts.push(parts);
                graphs.forward_graphs += parts * n;
                graphs.backward_graphs += parts * n;
                graphs.graphs_per_microbatch += 2 * parts * config.microbatches;
            }
            Ok(graphs)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda_graphs::GraphScope;
    use crate::pipeline_parallel::ScheduleConfig;

    fn plan(
        layers: usize,
        pp: usize,
        vpp: usize,
        m: usize,
        scopes: &[GraphScope],
    ) -> Vec<RankGraphs> {
        let schedule = Schedule::new(ScheduleConfig::new(pp, vpp, m)).unwrap();
        let layout = PipelineLayout::new(layers, pp, vpp, None, None).unwrap();
        let bytes = BufferBytes {
            activation: 1,
            probs: 1,
        };
        plan_graphs(&schedule, &layout, ScopeSet::of(scopes), &|_| false, bytes).unwrap()
    }

    #[test]
    fn without_a_pipeline_a_layer_has_one_graph_each_way() {
        // The seed's table, row "no PP": 2 × num_layers graphs, buffers ∝ num_layers.
        for m in [1, 8, 64] {
            let ranks = plan(12, 1, 1, m, &[GraphScope::Attn]);
            assert_eq!(ranks[0].graphs(), 2 * 12);
            assert_eq!(ranks[0].static_inputs + ranks[0].static_grads, 2 * 12);
        }
    }

    #[test]
    fn with_a_pipeline_graphs_follow_pp_not_the_microbatches() {
        // PP 4, 8 layers (2 per rank): rank r holds PP − r microbatches in flight.
        for m in [8, 16, 64] {
            let ranks = plan(8, 4, 1, m, &[GraphScope::Attn]);
            for (r, rank) in ranks.iter().enumerate() {
                assert_eq!(rank.slots, [4 - r]);
                assert_eq!(rank.graphs(), 2 * 2 * (4 - r));
                assert_eq!(rank.graphs_per_microbatch, 2 * 2 * m);
            }
            // Bounded by 2 × num_layers × PP, the seed's optimum.
            assert!(ranks.iter().all(|r| r.graphs() <= 2 * 2 * 4));
        }
    }
}
