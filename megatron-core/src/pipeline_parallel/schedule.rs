//! The pipeline schedule as data: Megatron-LM's schedule table, the per-rank counts of warm-up
//! and remaining microbatches, and the per-rank order of forward and backward passes; the
//! zero-bubble schedules' orders, with weight-gradient passes, come from [`super::zero_bubble`].
//!
//! A rank with `V` model chunks (virtual stages) runs `V·M` forwards and `V·M` backwards per
//! step. Every rank walks the same *schedule table*, a list of `(microbatch, chunk)`: its n-th
//! forward is the table's n-th entry, its n-th backward the n-th entry with the chunk mirrored
//! (`V − 1 − chunk`). The *order* of a rank interleaves the two: `w` forwards of warm-up, then a
//! forward and a backward in turn, then the last `w` backwards (the cool-down), where `w` is the
//! rank's warm-up count. Megatron-LM's `convert_schedule_table_to_order` writes the entries `+k`
//! (forward of local chunk `k − 1`) and `−k` (its backward); a [`Slot`] is one such entry, or
//! a weight-gradient pass.

use thiserror::Error;

use super::executor::{Pass, Slot};
use super::zero_bubble;

/// Which schedule a pipeline runs (`--pipeline-schedule`; recorded in checkpoints by name).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum ScheduleKind {
    /// Megatron-LM's 1F1B (one chunk per rank).
    #[serde(rename = "1f1b")]
    OneFOneB,
    /// Megatron-LM's interleaved 1F1B (several chunks per rank, looped).
    #[serde(rename = "interleaved")]
    Interleaved,
    /// Zero Bubble's ZB-H1: 1F1B's memory, weight gradients deferred into the bubbles.
    #[serde(rename = "zb-h1")]
    ZbH1,
    /// Zero Bubble's ZB-H2: more warm-up forwards (twice 1F1B's memory), no bubble at equal
    /// pass times.
    #[serde(rename = "zb-h2")]
    ZbH2,
    /// Zero Bubble's ZB-V: two chunks per rank in a V, 1F1B's memory, no bubble at equal pass
    /// times.
    #[serde(rename = "zbv")]
    Zbv,
    /// DeepSeek's DualPipeV: two chunks per rank in a V, a forward of one chunk beside a
    /// backward of the other in the steady phase.
    #[serde(rename = "dualpipev")]
    DualPipeV,
}

impl ScheduleKind {
    /// Every schedule, in the order `--pipeline-schedule` lists them.
    pub const ALL: [ScheduleKind; 6] = [
        ScheduleKind::OneFOneB,
        ScheduleKind::Interleaved,
        ScheduleKind::ZbH1,
        ScheduleKind::ZbH2,
        ScheduleKind::Zbv,
        ScheduleKind::DualPipeV,
    ];

    /// Its name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            ScheduleKind::OneFOneB => "1f1b",
            ScheduleKind::Interleaved => "interleaved",
            ScheduleKind::ZbH1 => "zb-h1",
            ScheduleKind::ZbH2 => "zb-h2",
            ScheduleKind::Zbv => "zbv",
            ScheduleKind::DualPipeV => "dualpipev",
        }
    }

    /// The schedule named `name`, if any.
    pub fn parse(name: &str) -> Option<ScheduleKind> {
        ScheduleKind::ALL.into_iter().find(|k| k.name() == name)
    }

    /// Megatron-LM's default for `vpp` chunks per rank: 1F1B, or interleaved.
    pub fn default_for(vpp: usize) -> ScheduleKind {
        match vpp {
            0 | 1 => ScheduleKind::OneFOneB,
            _ => ScheduleKind::Interleaved,
        }
    }

    /// How its virtual stages sit on the ranks.
    pub fn placement(self) -> Placement {
        match self {
            ScheduleKind::Zbv | ScheduleKind::DualPipeV => Placement::Vee,
            _ => Placement::Looped,
        }
    }

    /// Whether it splits each backward into an input-gradient pass and a later weight-gradient
    /// pass.
    pub fn splits_backward(self) -> bool {
        !matches!(self, ScheduleKind::OneFOneB | ScheduleKind::Interleaved)
    }

    /// The chunks per rank it runs with `vpp` given (`None`: left out), or why not.
    pub fn chunks(self, vpp: Option<usize>) -> Result<usize, ScheduleError> {
        let wrong = |want: &'static str, vpp: Option<usize>| ScheduleError::WrongChunks {
            schedule: self.name(),
            want,
            vpp,
        };
        match (self, vpp) {
            (ScheduleKind::Interleaved, None | Some(0 | 1)) => {
                Err(wrong("at least 2 model chunks", vpp))
            }
            (ScheduleKind::Interleaved, Some(v)) => Ok(v),
            (ScheduleKind::Zbv | ScheduleKind::DualPipeV, None | Some(2)) => Ok(2),
            (ScheduleKind::Zbv | ScheduleKind::DualPipeV, Some(_)) => Err(wrong(
                "2 model chunks (its V: down the ranks and back up)",
                vpp,
            )),
            (_, None | Some(1)) => Ok(1),
            (_, Some(_)) => Err(wrong("1 model chunk", vpp)),
        }
    }
}

impl std::fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Where the virtual stages sit on the pipeline ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Placement {
    /// Megatron-LM's loop: chunk `k` of rank `r` is virtual stage `k·pp + r`, the stages going
    /// round the ranks once per chunk.
    Looped,
    /// A V of two chunks: chunk 0 of rank `r` is stage `r`, chunk 1 stage `2·pp − 1 − r` (down
    /// the ranks and back up, so that the last rank holds stages `pp − 1` and `pp` and the
    /// first rank both ends of the model).
    Vee,
}

/// Which virtual stage each chunk of each rank is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct StageMap {
    /// Pipeline ranks.
    pub pp: usize,
    /// Chunks per rank.
    pub chunks: usize,
    /// How the stages go round the ranks.
    pub placement: Placement,
}

impl StageMap {
    /// Megatron-LM's looped stages of `pp` ranks with `chunks` chunks each.
    pub fn looped(pp: usize, chunks: usize) -> StageMap {
        StageMap {
            pp,
            chunks,
            placement: Placement::Looped,
        }
    }

    /// The number of virtual stages.
    pub fn stages(&self) -> usize {
        self.pp * self.chunks
    }

    /// The virtual stage of chunk `chunk` of rank `rank`.
    pub fn stage(&self, rank: usize, chunk: usize) -> usize {
        match (self.placement, chunk) {
            (Placement::Vee, 1) => 2 * self.pp - 1 - rank,
            _ => chunk * self.pp + rank,
        }
    }

    /// The rank and the chunk of virtual stage `stage`.
    pub fn locate(&self, stage: usize) -> (usize, usize) {
        match self.placement {
            Placement::Vee if stage >= self.pp => (2 * self.pp - 1 - stage, 1),
            _ => (stage % self.pp, stage / self.pp),
        }
    }
}

/// A schedule that Megatron-LM refuses; every message names the numbers.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ScheduleError {
    /// A size is zero.
    #[error("{what} must be at least 1, got 0")]
    Zero {
        /// Which size.
        what: &'static str,
    },
    /// A schedule given another number of chunks per rank than it runs.
    #[error(
        "--pipeline-schedule {schedule} runs {want} per rank, {}",
        match vpp {
            Some(v) => format!("got --virtual-pipeline-model-parallel-size {v}"),
            None => "and --virtual-pipeline-model-parallel-size was not given".to_string(),
        }
    )]
    WrongChunks {
        /// The schedule.
        schedule: &'static str,
        /// What it runs.
        want: &'static str,
        /// What was given (`None`: nothing).
        vpp: Option<usize>,
    },
    /// A zero-bubble schedule given one rank (a single stage runs no schedule: each
    /// microbatch's forward, then its backward).
    #[error(
        "--pipeline-schedule {schedule} needs a pipeline of at least 2 stages, got \
         --pipeline-model-parallel-size {pp}"
    )]
    NeedsPipeline {
        /// The schedule.
        schedule: &'static str,
        /// Pipeline stages.
        pp: usize,
    },
    /// DualPipeV with fewer microbatches than virtual stages.
    #[error(
        "--pipeline-schedule dualpipev needs at least 2·pp = {stages} microbatches per step (its \
         steady phase pairs a forward of one chunk with a backward of the other), got \
         {microbatches}"
    )]
    DualPipeVMicrobatches {
        /// Virtual stages, 2·pp.
        stages: usize,
        /// Microbatches per step.
        microbatches: usize,
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
        "--microbatch-group-size-per-virtual-pipeline-stage {group} does nothing with \
         --pipeline-schedule {schedule} (it groups the interleaved schedule's microbatches): \
         {}",
        if *schedule == "1f1b" {
            "add --virtual-pipeline-model-parallel-size for the interleaved schedule, or drop it"
        } else {
            "drop it"
        }
    )]
    GroupWithoutVirtualStages {
        /// The group size given.
        group: usize,
        /// The schedule it was given to.
        schedule: &'static str,
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
    /// Which schedule.
    pub kind: ScheduleKind,
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
    /// Megatron-LM's training schedule of `microbatches` over `pp` stages with `vpp` chunks
    /// per rank: 1F1B, or interleaved with several chunks.
    pub fn new(pp: usize, vpp: usize, microbatches: usize) -> Self {
        ScheduleConfig {
            kind: ScheduleKind::default_for(vpp),
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

    /// Schedule `kind`'s training schedule with `vpp` chunks per rank given (`None`: left
    /// out, the schedule's own), or why it does not run with them.
    pub fn named(
        kind: ScheduleKind,
        pp: usize,
        vpp: Option<usize>,
        microbatches: usize,
    ) -> Result<Self, ScheduleError> {
        Ok(ScheduleConfig {
            kind,
            ..ScheduleConfig::new(pp, kind.chunks(vpp)?, microbatches)
        })
    }

    /// Whether the schedule is Megatron-LM's interleaved one (several chunks per rank, looped).
    pub fn interleaved(&self) -> bool {
        self.kind == ScheduleKind::Interleaved
    }

    /// Which virtual stage each chunk of each rank is.
    pub fn stage_map(&self) -> StageMap {
        StageMap {
            pp: self.pp,
            chunks: self.vpp,
            placement: self.kind.placement(),
        }
    }

    /// Refuses a group size given for a schedule without virtual stages, where it would do
    /// nothing (the command line's check: Megatron-LM ignores such a group size).
    pub fn check_group_used(&self) -> Result<(), ScheduleError> {
        match self.group_size {
            Some(group) if !self.interleaved() => Err(ScheduleError::GroupWithoutVirtualStages {
                group,
                schedule: self.kind.name(),
            }),
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
        let want = self.kind.chunks(Some(self.vpp))?;
        debug_assert_eq!(want, self.vpp);
        if self.kind.splits_backward() && self.pp < 2 {
            return Err(ScheduleError::NeedsPipeline {
                schedule: self.kind.name(),
                pp: self.pp,
            });
        }
        if self.vpp > 1 && self.pp < 2 {
            return Err(ScheduleError::VirtualWithoutPipeline {
                vpp: self.vpp,
                pp: self.pp,
            });
        }
        if self.kind == ScheduleKind::DualPipeV
            && !self.forward_only
            && self.microbatches < 2 * self.pp
        {
            return Err(ScheduleError::DualPipeVMicrobatches {
                stages: 2 * self.pp,
                microbatches: self.microbatches,
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
    /// The counts of a rank running `order` of `total` forwards: its warm-up is the forwards
    /// before its first backward.
    pub fn of_order(order: &[Slot], total: usize) -> RankCounts {
        let warmup = order
            .iter()
            .take_while(|s| s.pass == Pass::Forward)
            .count()
            .min(total);
        RankCounts {
            total,
            warmup,
            remaining: total - warmup,
            all_in_warmup: warmup == total,
        }
    }

    /// The counts of pipeline rank `rank` under Megatron-LM's `config` (1F1B or interleaved).
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
    /// Its order: in training its forwards, backwards and (zero-bubble schedules) weight-gradient
    /// passes; in forward-only evaluation, the forwards alone.
    pub order: Vec<Slot>,
}

impl RankSchedule {
    /// The order as Megatron-LM writes it (`+k` forward, `−k` backward of chunk `k − 1`), when
    /// it has no weight-gradient passes.
    pub fn megatron_order(&self) -> Option<Vec<i32>> {
        self.order.iter().map(|s| s.megatron()).collect()
    }
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
        let (m, pp) = (config.microbatches, config.pp);
        // The V's chunks in turn, a group of pp microbatches each (its forward-only order; its
        // training orders come whole from `zero_bubble`).
        let group = match config.kind.placement() {
            Placement::Vee => pp,
            Placement::Looped => config.group(),
        };
        let table = schedule_table(m, config.vpp, group);
        let megatron = |order: Vec<i32>| -> Vec<Slot> {
            order.into_iter().filter_map(Slot::from_megatron).collect()
        };
        let ranks = (0..pp)
            .map(|rank| {
                let order = if config.forward_only {
                    table.iter().map(|s| Slot::forward(s.chunk)).collect()
                } else {
                    match config.kind {
                        ScheduleKind::OneFOneB | ScheduleKind::Interleaved => {
                            let warmup = RankCounts::of(&config, rank).warmup;
                            megatron(order_from_table(&table, config.vpp, warmup))
                        }
                        ScheduleKind::ZbH1 => zero_bubble::zb_h(pp, rank, m, 1),
                        ScheduleKind::ZbH2 => zero_bubble::zb_h(pp, rank, m, 2),
                        ScheduleKind::Zbv => zero_bubble::zbv(pp, rank, m),
                        ScheduleKind::DualPipeV => zero_bubble::dualpipev(pp, rank, m),
                    }
                };
                let counts = match config.kind {
                    ScheduleKind::OneFOneB | ScheduleKind::Interleaved => {
                        RankCounts::of(&config, rank)
                    }
                    _ => RankCounts::of_order(&order, m * config.vpp),
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
