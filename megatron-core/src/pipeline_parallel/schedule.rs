//! The pipeline schedule as data: Megatron-LM's schedule table, the per-rank counts of warm-up
//! and remaining microbatches, and the per-rank order of forward and backward passes.
//!
//! A rank with `V` model chunks (virtual stages) runs `V·M` forwards and `V·M` backwards per
//! step. Every rank walks the same *schedule table*, a list of `(microbatch, chunk)`: its n-th
//! forward is the table's n-th entry, its n-th backward the n-th entry with the chunk mirrored
//! (`V − 1 − chunk`). The *order* of a rank interleaves the two: `w` forwards of warm-up, then a
//! forward and a backward in turn, then the last `w` backwards (the cool-down), where `w` is the
//! rank's warm-up count. Entries are `+k` (forward of local chunk `k − 1`) and `−k` (its
//! backward), as Megatron-LM's `convert_schedule_table_to_order` writes them.

use thiserror::Error;

/// A schedule that Megatron-LM refuses; every message names the numbers.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ScheduleError {
    /// A size is zero.
    #[error("{what} must be at least 1, got 0")]
    Zero {
        /// Which size.
        what: &'static str,
    },
    /// Virtual stages without a pipeline.
    #[error(
        "--virtual-pipeline-model-parallel-size {vpp} needs a pipeline of at least 2 stages, got \
         --pipeline-model-parallel-size {pp} (the interleaved schedule interleaves the chunks of \
         several ranks)"
    )]
    VirtualWithoutPipeline {
        /// Virtual stages (model chunks) per rank.
        vpp: usize,
        /// Pipeline stages.
        pp: usize,
    },
    /// The schedule has more passes than megatron-rs accepts.
    #[error(transparent)]
    TooLong(#[from] crate::limits::LimitError),
    /// Too few microbatches for the interleaved schedule (the group size left at its default,
    /// pp).
    #[error(
        "the interleaved schedule needs at least pp = {pp} microbatches per step, got \
         {microbatches} (raise --global-batch-size, or lower --micro-batch-size or \
         --data-parallel-size)"
    )]
    TooFewMicrobatches {
        /// Pipeline stages.
        pp: usize,
        /// Microbatches per step.
        microbatches: usize,
    },
    /// A group size given for a schedule without virtual stages: Megatron-LM ignores it, and
    /// so does [`ScheduleConfig::validate`]; [`ScheduleConfig::check_group_used`] refuses it.
    #[error(
        "--microbatch-group-size-per-virtual-pipeline-stage {group} does nothing without \
         virtual stages (it groups the interleaved schedule's microbatches): add \
         --virtual-pipeline-model-parallel-size or drop it"
    )]
    GroupWithoutVirtualStages {
        /// The group size given.
        group: usize,
    },
    /// The group of contiguous microbatches per virtual stage is outside `[pp, M]`.
    #[error(
        "the number of contiguous microbatches in a virtual pipeline stage \
         (--microbatch-group-size-per-virtual-pipeline-stage {group}) should range in \
         [PP={pp}, M={microbatches}]"
    )]
    GroupSize {
        /// The group size given.
        group: usize,
        /// Pipeline stages.
        pp: usize,
        /// Microbatches per step.
        microbatches: usize,
    },
    /// The last group of microbatches is shorter than the pipeline.
    #[error(
        "the remainder of M={microbatches} microbatches divided by N={group} contiguous \
         microbatches per virtual stage is {remainder}: it must be 0 or at least the \
         pipeline-parallel size {pp}, else the pipeline has dependency bubbles"
    )]
    ShortLastGroup {
        /// Microbatches per step.
        microbatches: usize,
        /// The group size.
        group: usize,
        /// `M mod N`.
        remainder: usize,
        /// Pipeline stages.
        pp: usize,
    },
}

/// What a pipeline schedule is built from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScheduleConfig {
    /// Pipeline stages (ranks of a pipeline group).
    pub pp: usize,
    /// Model chunks per rank (virtual pipeline stages); 1 is the non-interleaved 1F1B schedule.
    pub vpp: usize,
    /// Microbatches per step (`M`).
    pub microbatches: usize,
    /// Contiguous microbatches each virtual stage runs before the next chunk's turn
    /// (Megatron-LM's `microbatch_group_size_per_vp_stage`; `None` is pp).
    pub group_size: Option<usize>,
    /// Evaluation: forwards only.
    pub forward_only: bool,
    /// Megatron-LM's `overlap_moe_expert_parallel_comm`: one more warm-up forward in the
    /// interleaved schedule (so that each 1F1B step's forward and backward are independent).
    pub overlap_moe_comm: bool,
}

impl ScheduleConfig {
    /// A training schedule of `microbatches` over `pp` stages with `vpp` chunks per rank.
    pub fn new(pp: usize, vpp: usize, microbatches: usize) -> Self {
        ScheduleConfig {
            pp,
            vpp,
            microbatches,
            group_size: None,
            forward_only: false,
            overlap_moe_comm: false,
        }
    }

    /// The group size: as given, else pp.
    pub fn group(&self) -> usize {
        self.group_size.unwrap_or(self.pp)
    }

    /// Whether the schedule interleaves several chunks per rank.
    pub fn interleaved(&self) -> bool {
        self.vpp > 1
    }

    /// Refuses a group size given for a schedule without virtual stages, where it would do
    /// nothing (the command line's check: Megatron-LM ignores such a group size).
    pub fn check_group_used(&self) -> Result<(), ScheduleError> {
        match self.group_size {
            Some(group) if !self.interleaved() => {
                Err(ScheduleError::GroupWithoutVirtualStages { group })
            }
            _ => Ok(()),
        }
    }

    /// Megatron-LM's checks of a schedule.
    pub fn validate(&self) -> Result<(), ScheduleError> {
        for (what, v) in [
            ("the pipeline-parallel size", self.pp),
            ("the number of virtual stages per rank", self.vpp),
            ("the number of microbatches", self.microbatches),
            (
                "--microbatch-group-size-per-virtual-pipeline-stage",
                self.group(),
            ),
        ] {
            if v == 0 {
                return Err(ScheduleError::Zero { what });
            }
        }
        let passes = crate::limits::product(&[self.pp, self.vpp, self.microbatches]);
        crate::limits::check(
            format!(
                "a schedule of --pipeline-model-parallel-size {} × \
                 --virtual-pipeline-model-parallel-size {} × {} microbatches =",
                self.pp, self.vpp, self.microbatches
            ),
            passes,
            crate::limits::MAX_SCHEDULE_PASSES,
            "forward passes per step",
        )?;
        if self.vpp > 1 && self.pp < 2 {
            return Err(ScheduleError::VirtualWithoutPipeline {
                vpp: self.vpp,
                pp: self.pp,
            });
        }
        if self.interleaved() {
            let (g, m, pp) = (self.group(), self.microbatches, self.pp);
            if self.group_size.is_none() && m < pp {
                return Err(ScheduleError::TooFewMicrobatches {
                    pp,
                    microbatches: m,
                });
            }
            if g > m || g < pp {
                return Err(ScheduleError::GroupSize {
                    group: g,
                    pp,
                    microbatches: m,
                });
            }
            let remainder = m % g;
            if 0 < remainder && remainder < pp {
                return Err(ScheduleError::ShortLastGroup {
                    microbatches: m,
                    group: g,
                    remainder,
                    pp,
                });
            }
        }
        Ok(())
    }
}

/// One entry of the schedule table: which microbatch runs through which local chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TableEntry {
    /// The microbatch, 0-based.
    pub microbatch: usize,
    /// The local model chunk, 0-based.
    pub chunk: usize,
}

/// Megatron-LM's `get_schedule_table`: for each group of `group` consecutive microbatches (the
/// last group takes the rest), every chunk in turn runs the whole group.
pub fn schedule_table(microbatches: usize, chunks: usize, group: usize) -> Vec<TableEntry> {
    let group = group.max(1);
    let mut table = Vec::with_capacity(microbatches * chunks);
    let mut first = 0;
    while first < microbatches {
        let end = if first + group >= microbatches {
            microbatches
        } else {
            first + group
        };
        for chunk in 0..chunks {
            table.extend((first..end).map(|microbatch| TableEntry { microbatch, chunk }));
        }
        first += group;
    }
    table
}

/// Megatron-LM's `get_pp_rank_microbatches` for one pipeline rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankCounts {
    /// Forwards (and, in training, backwards) the rank runs: `M·V`.
    pub total: usize,
    /// Forwards before the first backward.
    pub warmup: usize,
    /// Forward-and-backward pairs of the steady phase: `total − warmup`.
    pub remaining: usize,
    /// Whether the warm-up takes every microbatch (no steady phase).
    pub all_in_warmup: bool,
}

impl RankCounts {
    /// The counts of pipeline rank `rank` under `config`.
    pub fn of(config: &ScheduleConfig, rank: usize) -> RankCounts {
        let total = config.microbatches * config.vpp;
        let mut warmup = if config.forward_only {
            total
        } else if config.pp > 1 {
            let later = config.pp.saturating_sub(rank + 1);
            if config.interleaved() {
                later * 2 + (config.vpp - 1) * config.group() + usize::from(config.overlap_moe_comm)
            } else {
                later
            }
        } else {
            0
        };
        let mut all_in_warmup = false;
        if warmup >= total {
            warmup = total;
            all_in_warmup = true;
        }
        RankCounts {
            total,
            warmup,
            remaining: total - warmup,
            all_in_warmup,
        }
    }
}

/// Megatron-LM's `convert_schedule_table_to_order` for a rank with `warmup` warm-up forwards
/// and `chunks` chunks: `+k` is a forward of chunk `k − 1`, `−k` a backward of chunk `k − 1`.
pub fn order_from_table(table: &[TableEntry], chunks: usize, warmup: usize) -> Vec<i32> {
    let warmup = warmup.min(table.len());
    let forward = |slot: &TableEntry| slot.chunk as i32 + 1;
    // The n-th backward runs the n-th entry's mirrored chunk: −(chunks − chunk).
    let backward = |slot: &TableEntry| slot.chunk as i32 - chunks as i32;
    let mut order: Vec<i32> = table[..warmup].iter().map(forward).collect();
    for i in warmup..table.len() {
        order.push(forward(&table[i]));
        order.push(backward(&table[i - warmup]));
    }
    order.extend(table[table.len() - warmup..].iter().map(backward));
    order
}

/// The schedule of one pipeline rank: its counts and its order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankSchedule {
    /// The pipeline rank.
    pub rank: usize,
    /// Its counts.
    pub counts: RankCounts,
    /// Its order: in training Megatron-LM's (`+k` forward, `−k` backward of chunk `k − 1`); in
    /// forward-only evaluation, the forwards alone.
    pub order: Vec<i32>,
}

/// The whole schedule: the table every rank walks and each rank's order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    /// What it was built from (validated).
    pub config: ScheduleConfig,
    /// The schedule table.
    pub table: Vec<TableEntry>,
    /// Every pipeline rank's schedule, by rank.
    pub ranks: Vec<RankSchedule>,
}

impl Schedule {
    /// Builds and checks the schedule of `config`.
    pub fn new(config: ScheduleConfig) -> Result<Schedule, ScheduleError> {
        config.validate()?;
        let table = schedule_table(config.microbatches, config.vpp, config.group());
        let ranks = (0..config.pp)
            .map(|rank| {
                let counts = RankCounts::of(&config, rank);
                let order = if config.forward_only {
                    table.iter().map(|s| s.chunk as i32 + 1).collect()
                } else {
                    order_from_table(&table, config.vpp, counts.warmup)
                };
                RankSchedule {
                    rank,
                    counts,
                    order,
                }
            })
            .collect();
        Ok(Schedule {
            config,
            table,
            ranks,
        })
    }
}
