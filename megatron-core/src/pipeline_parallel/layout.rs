//! Which layers each pipeline stage holds, as Megatron-LM assigns them.
//!
//! Chunk `k` of pipeline rank `r` is virtual stage `s = k·pp + r` (in a V, chunk 1 of rank `r`
//! is stage `2·pp − 1 − r`: [`StageMap`]); virtual stages take the layers in order, so stage `s`
//! starts where stage `s − 1` ends. A rank holds the same number
//! of layers in each of its chunks: `L / (pp·V)` in the even layout; with
//! `--decoder-first-pipeline-num-layers` (`--decoder-last-...`) the first (last) rank holds that
//! many and the other ranks share the rest evenly (Megatron-LM's `get_num_layers_to_build` and
//! `get_transformer_layer_offset`). With `--account-for-embedding-in-pipeline-split`
//! (`--account-for-loss-in-pipeline-split`) the embedding (the loss) counts as one layer of the
//! split: the layers plus those divide evenly over the virtual stages, and the first (last)
//! virtual stage builds one transformer layer fewer.

use std::ops::Range;

use thiserror::Error;

use super::schedule::{Placement, StageMap};

/// A layer assignment Megatron-LM refuses; the messages name the numbers.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum StageLayoutError {
    /// The layers do not divide over the stages.
    #[error("{layers} layers {what} do not divide over {stages}: {hint}")]
    NotDivisible {
        /// The layers to divide.
        layers: usize,
        /// Which layers, e.g. "left after the first and last stages".
        what: &'static str,
        /// What they divide over, e.g. "pp = 4 stages".
        stages: String,
        /// How to fix it.
        hint: &'static str,
    },
    /// The uneven first and last stages hold more, or other than, all the layers.
    #[error(
        "the first stage's {first} (--decoder-first-pipeline-num-layers) and the last stage's \
         {last} layers (--decoder-last-pipeline-num-layers) {relation} the model's {layers} \
         layers (--pipeline-model-parallel-size {pp})"
    )]
    UnevenEnds {
        /// Layers of the first stage.
        first: usize,
        /// Layers of the last stage.
        last: usize,
        /// How they compare.
        relation: &'static str,
        /// The model's layers.
        layers: usize,
        /// Pipeline stages.
        pp: usize,
    },
    /// The embedding or the loss counted as a layer together with uneven first or last stages.
    #[error(
        "--account-for-embedding-in-pipeline-split and --account-for-loss-in-pipeline-split \
         count the ends as layers of an even split: they do not go with \
         --decoder-first-pipeline-num-layers or --decoder-last-pipeline-num-layers"
    )]
    CountedEndsWithUneven,
    /// Uneven first or last stages with the stages in a V.
    #[error(
        "--decoder-first-pipeline-num-layers and --decoder-last-pipeline-num-layers set the first \
         and last pipeline ranks' layers; in a V (--pipeline-schedule zbv or dualpipev) the first \
         rank holds both ends of the model: give an even layout"
    )]
    UnevenVee,
}

/// What one model chunk of a pipeline rank holds of a model whose layers are a `#[pipeline]`
/// stack: a run of layers, and the parts before and after the stack when it is the first or the
/// last virtual stage.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct StagePart {
    /// The global indices of its layers.
    pub layers: Range<usize>,
    /// It is the first virtual stage: it runs what comes before the layers (the embedding).
    pub first: bool,
    /// It is the last virtual stage: it runs what comes after them (the head and the loss).
    pub last: bool,
}

impl StagePart {
    /// The whole model: every one of `layers` layers, and both ends (no pipeline).
    pub fn whole(layers: usize) -> StagePart {
        StagePart {
            layers: 0..layers,
            first: true,
            last: true,
        }
    }
}

/// How a model's layers are laid over `pp` ranks of `vpp` chunks each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PipelineLayout {
    pp: usize,
    vpp: usize,
    placement: Placement,
    /// Layers per chunk of each rank.
    per_chunk: Vec<usize>,
    /// Transformer layers the first and the last virtual stage build fewer than `per_chunk`
    /// says (1 each with the embedding, the loss, counted as a layer).
    fewer_at_ends: (usize, usize),
}

impl PipelineLayout {
    /// The layout of `layers` layers over `pp` ranks of `vpp` chunks, the first (last) rank
    /// holding `first` (`last`) layers when given.
    pub fn new(
        layers: usize,
        pp: usize,
        vpp: usize,
        first: Option<usize>,
        last: Option<usize>,
    ) -> Result<PipelineLayout, StageLayoutError> {
        let (pp, vpp) = (pp.max(1), vpp.max(1));
        let mut per_rank = vec![0usize; pp];
        if first.is_none() && last.is_none() {
            if !layers.is_multiple_of(pp) {
                return Err(StageLayoutError::NotDivisible {
                    layers,
                    what: "of the model",
                    stages: format!("--pipeline-model-parallel-size {pp} stages"),
                    hint: "give a multiple of pp, or uneven ends with \
                           --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers",
                });
            }
            per_rank.fill(layers / pp);
        } else {
            let (f, l) = (first.unwrap_or(0), last.unwrap_or(0));
            let ends = usize::from(first.is_some()) + usize::from(last.is_some());
            let middle_stages = pp.saturating_sub(ends);
            if f + l > layers {
                return Err(StageLayoutError::UnevenEnds {
                    first: f,
                    last: l,
                    relation: "exceed",
                    layers,
                    pp,
                });
            }
            let middle = layers - f - l;
            if middle_stages == 0 {
                if middle != 0 {
                    return Err(StageLayoutError::UnevenEnds {
                        first: f,
                        last: l,
                        relation: "do not add up to",
                        layers,
                        pp,
                    });
                }
            } else if !middle.is_multiple_of(middle_stages) {
                return Err(StageLayoutError::NotDivisible {
                    layers: middle,
                    what: "left after the uneven first and last stages",
                    stages: format!("the {middle_stages} other stages"),
                    hint: "with uneven pipelining (--decoder-first/last-pipeline-num-layers) \
                           the left-over layers must divide over the left-over stages",
                });
            }
            let each = middle.checked_div(middle_stages).unwrap_or(0);
            per_rank.fill(each);
            if let Some(f) = first {
                per_rank[0] = f;
            }
            if let Some(l) = last {
                per_rank[pp - 1] = l;
            }
        }
        if vpp > 1
            && let Some(&bad) = per_rank.iter().find(|n| !n.is_multiple_of(vpp))
        {
            return Err(StageLayoutError::NotDivisible {
                layers: bad,
                what: "of a pipeline rank",
                stages: format!("its {vpp} model chunks"),
                hint: "each rank's layers must divide over its model chunks \
                       (--virtual-pipeline-model-parallel-size, or the 2 of zbv's and \
                       dualpipev's V; pp·chunks must divide the layers in the even layout)",
            });
        }
        Ok(PipelineLayout {
            pp,
            vpp,
            placement: Placement::Looped,
            per_chunk: per_rank.iter().map(|n| n / vpp).collect(),
            fewer_at_ends: (0, 0),
        })
    }

    /// The even layout of `layers` layers with the embedding (`embedding`) and the loss
    /// (`loss`) each counted as one more layer (Megatron-LM's
    /// `--account-for-embedding-in-pipeline-split`, `--account-for-loss-in-pipeline-split`): the
    /// first and the last virtual stage, which also run those, build one transformer layer
    /// fewer.
    pub fn with_ends_counted(
        layers: usize,
        pp: usize,
        vpp: usize,
        embedding: bool,
        loss: bool,
    ) -> Result<PipelineLayout, StageLayoutError> {
        let (e, l) = (usize::from(embedding), usize::from(loss));
        let what = match (embedding, loss) {
            (true, true) => "with the embedding and the loss counted",
            (true, false) => "with the embedding counted",
            (false, true) => "with the loss counted",
            (false, false) => return PipelineLayout::new(layers, pp, vpp, None, None),
        };
        let counted = layers + e + l;
        let mut layout =
            PipelineLayout::new(counted, pp, vpp, None, None).map_err(|e| match e {
                StageLayoutError::NotDivisible { stages, .. } => StageLayoutError::NotDivisible {
                    layers: counted,
                    what,
                    stages,
                    hint: "the layers and the ends counted as layers must divide over the virtual \
                       stages (Megatron-LM's rule)",
                },
                other => other,
            })?;
        // Every virtual stage holds at least one layer of the counted split (they divide
        // evenly and number at least one), so the ends always have one to give up.
        layout.fewer_at_ends = (e, l);
        Ok(layout)
    }

    /// Pipeline ranks.
    pub fn pp(&self) -> usize {
        self.pp
    }

    /// Chunks per rank.
    pub fn vpp(&self) -> usize {
        self.vpp
    }

    /// The same layout with the stages placed by `placement` (a V needs two chunks per rank,
    /// which [`super::ScheduleConfig::validate`] checks, and an even layout).
    pub fn placed(self, placement: Placement) -> Result<PipelineLayout, StageLayoutError> {
        let uneven = self.per_chunk.iter().any(|&n| n != self.per_chunk[0]);
        if placement == Placement::Vee && uneven {
            return Err(StageLayoutError::UnevenVee);
        }
        Ok(PipelineLayout { placement, ..self })
    }

    /// Which virtual stage each chunk of each rank is.
    pub fn stage_map(&self) -> StageMap {
        StageMap {
            pp: self.pp,
            chunks: self.vpp,
            placement: self.placement,
        }
    }

    /// The virtual stage of chunk `chunk` of rank `rank`: `chunk·pp + rank`, or in a V.
    pub fn virtual_stage(&self, rank: usize, chunk: usize) -> usize {
        self.stage_map().stage(rank, chunk)
    }

    /// The transformer layers virtual stage `stage` holds.
    fn stage_layers(&self, stage: usize) -> usize {
        let map = self.stage_map();
        let mut n = self.per_chunk[map.locate(stage).0];
        if stage == 0 {
            n -= self.fewer_at_ends.0;
        }
        if stage + 1 == map.stages() {
            n -= self.fewer_at_ends.1;
        }
        n
    }

    /// What chunk `chunk` of rank `rank` holds.
    pub fn part(&self, rank: usize, chunk: usize) -> StagePart {
        let map = self.stage_map();
        let stage = map.stage(rank, chunk);
        let start: usize = (0..stage).map(|s| self.stage_layers(s)).sum();
        StagePart {
            layers: start..start + self.stage_layers(stage),
            first: stage == 0,
            last: stage + 1 == self.pp * self.vpp,
        }
    }
}
