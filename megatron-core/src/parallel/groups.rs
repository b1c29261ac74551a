//! The named group families of a world and the groups one rank belongs to.

use std::fmt;

use serde::Serialize;

use super::config::{Axis, ConfigError, ParallelConfig, ValidConfig};
use super::rank_generator::{GroupToken, Layout, RankGenerator};

/// A family of groups a rank belongs to, named as in Megatron-Core's parallel state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub enum GroupKind {
    /// Every rank.
    World,
    /// Tensor parallel.
    Tp,
    /// Context parallel.
    Cp,
    /// Data parallel (without context parallel).
    Dp,
    /// Pipeline parallel.
    Pp,
    /// Data parallel with context parallel: where dense gradients are reduced.
    DpCp,
    /// Tensor and context parallel.
    TpCp,
    /// Model parallel: tensor and pipeline.
    TpPp,
    /// Tensor, data and context parallel.
    TpDpCp,
    /// Expert parallel.
    Ep,
    /// Expert tensor parallel.
    Etp,
    /// Expert data parallel: where expert gradients are reduced.
    Edp,
    /// Expert model parallel: expert tensor and expert parallel.
    EtpEp,
    /// First and last pipeline stage of one pipeline: where tied embeddings are synchronised.
    Embedding,
}

impl GroupKind {
    /// Every family.
    pub const ALL: [GroupKind; 14] = [
        GroupKind::World,
        GroupKind::Tp,
        GroupKind::Cp,
        GroupKind::Dp,
        GroupKind::Pp,
        GroupKind::DpCp,
        GroupKind::TpCp,
        GroupKind::TpPp,
        GroupKind::TpDpCp,
        GroupKind::Ep,
        GroupKind::Etp,
        GroupKind::Edp,
        GroupKind::EtpEp,
        GroupKind::Embedding,
    ];

    /// The family's token, e.g. `tp`, `dp-cp`, `etp-ep`, `embedding`.
    pub fn name(self) -> &'static str {
        match self {
            GroupKind::World => "world",
            GroupKind::Tp => "tp",
            GroupKind::Cp => "cp",
            GroupKind::Dp => "dp",
            GroupKind::Pp => "pp",
            GroupKind::DpCp => "dp-cp",
            GroupKind::TpCp => "tp-cp",
            GroupKind::TpPp => "tp-pp",
            GroupKind::TpDpCp => "tp-dp-cp",
            GroupKind::Ep => "ep",
            GroupKind::Etp => "etp",
            GroupKind::Edp => "edp",
            GroupKind::EtpEp => "etp-ep",
            GroupKind::Embedding => "embedding",
        }
    }

    /// The layout and axes of a family built by a rank generator (`None` for world and embedding).
    fn spec(self) -> Option<(Layout, &'static [Axis])> {
        use Axis::*;
        let dense = Layout::Dense;
        let expert = Layout::Expert;
        Some(match self {
            GroupKind::World | GroupKind::Embedding => return None,
            GroupKind::Tp => (dense, &[Tp]),
            GroupKind::Cp => (dense, &[Cp]),
            GroupKind::Dp => (dense, &[Dp]),
            GroupKind::Pp => (dense, &[Pp]),
            GroupKind::DpCp => (dense, &[Dp, Cp]),
            GroupKind::TpCp => (dense, &[Tp, Cp]),
            GroupKind::TpPp => (dense, &[Tp, Pp]),
            GroupKind::TpDpCp => (dense, &[Tp, Dp, Cp]),
            GroupKind::Ep => (expert, &[Ep]),
            GroupKind::Etp => (expert, &[Tp]),
            GroupKind::Edp => (expert, &[Dp]),
            GroupKind::EtpEp => (expert, &[Tp, Ep]),
        })
    }
}

impl fmt::Display for GroupKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One group: its family, its members (global ranks, in Megatron's order) and a rank's index in it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
pub struct Group {
    /// The family.
    pub kind: GroupKind,
    /// Global ranks of the members; a member's index in this list is its rank in the group.
    pub ranks: Vec<usize>,
    /// The owning rank's index in `ranks`.
    pub index: usize,
}

impl Group {
    /// Number of members.
    pub fn size(&self) -> usize {
        self.ranks.len()
    }

    /// Whether the owning rank is the group's first member.
    pub fn is_first(&self) -> bool {
        self.index == 0
    }

    /// Whether the owning rank is the group's last member.
    pub fn is_last(&self) -> bool {
        self.index + 1 == self.ranks.len()
    }
}

/// The dense and expert layouts of a world, built from a validated [`ParallelConfig`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParallelLayout {
    config: ValidConfig,
    dense: RankGenerator,
    expert: RankGenerator,
}

impl ParallelLayout {
    /// Validates `config` and builds both rank generators.
    ///
    /// Like Megatron, the pipeline groups of both layouts must coincide (a rank's pipeline stage
    /// cannot depend on whether it runs attention or experts).
    pub fn new(config: &ParallelConfig) -> Result<Self, ConfigError> {
        let c = config.validate()?;
        let dense = RankGenerator::new(c.order, |axis| match axis {
            Axis::Tp => c.tp,
            Axis::Cp => c.cp,
            Axis::Ep => 1,
            Axis::Dp => c.dp,
            Axis::Pp => c.pp,
        });
        let expert = RankGenerator::new(c.order, |axis| match axis {
            Axis::Tp => c.etp,
            Axis::Cp => 1,
            Axis::Ep => c.ep,
            Axis::Dp => c.edp,
            Axis::Pp => c.pp,
        });
        if dense.groups(&[Axis::Pp]) != expert.groups(&[Axis::Pp]) {
            return Err(ConfigError::BadOrder {
                order: c.order.to_string(),
                reason: format!(
                    "the pipeline groups of the dense layout (tp {} · cp {} · dp {} · pp {}) and the \
                     expert layout (etp {} · ep {} · edp {} · pp {}) differ; with pp not last, \
                     the axes before it must have the same product in both",
                    c.tp, c.cp, c.dp, c.pp, c.etp, c.ep, c.edp, c.pp
                ),
            });
        }
        Ok(ParallelLayout {
            config: c,
            dense,
            expert,
        })
    }

    /// The validated sizes.
    pub fn config(&self) -> &ValidConfig {
        &self.config
    }

    /// The generator of one layout.
    pub fn generator(&self, layout: Layout) -> &RankGenerator {
        match layout {
            Layout::Dense => &self.dense,
            Layout::Expert => &self.expert,
        }
    }

    /// Every group of a token's axes, in Megatron's order.
    pub fn token_groups(&self, token: &GroupToken) -> Vec<Vec<usize>> {
        self.generator(token.layout).groups(&token.axes)
    }

    /// Every group of one family, in Megatron's order.
    pub fn groups(&self, kind: GroupKind) -> Vec<Vec<usize>> {
        match kind.spec() {
            Some((layout, axes)) => self.generator(layout).groups(axes),
            None if kind == GroupKind::World => vec![(0..self.config.world_size).collect()],
            None => self
                .dense
                .groups(&[Axis::Pp])
                .into_iter()
                .map(embedding_members)
                .collect(),
        }
    }

    /// The groups of one rank.
    pub fn rank(&self, rank: usize) -> Result<RankGroups, ConfigError> {
        let world = self.config.world_size;
        if rank >= world {
            return Err(ConfigError::BadToken {
                token: format!("rank {rank}"),
                reason: format!("the world has ranks 0..{world}"),
            });
        }
        let groups = GroupKind::ALL
            .iter()
            .filter_map(|&kind| {
                let (ranks, index) = match kind.spec() {
                    Some((layout, axes)) => self.generator(layout).group_of(rank, axes),
                    None if kind == GroupKind::World => ((0..world).collect(), rank),
                    None => {
                        let (pipeline, _) = self.dense.group_of(rank, &[Axis::Pp]);
                        let members = embedding_members(pipeline);
                        let index = members.iter().position(|&r| r == rank)?;
                        (members, index)
                    }
                };
                Some(Group { kind, ranks, index })
            })
            .collect();
        Ok(RankGroups {
            rank,
            config: self.config,
            groups,
        })
    }
}

/// The embedding group of one pipeline: its first and last stage (one rank without pipelining).
fn embedding_members(pipeline: Vec<usize>) -> Vec<usize> {
    match (pipeline.first(), pipeline.last()) {
        (Some(&first), Some(&last)) if first != last => vec![first, last],
        _ => pipeline,
    }
}

/// Every group one rank belongs to, by family, with its coordinates on each axis.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankGroups {
    rank: usize,
    config: ValidConfig,
    groups: Vec<Group>,
}

impl RankGroups {
    /// The global rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The validated sizes of the world.
    pub fn config(&self) -> &ValidConfig {
        &self.config
    }

    /// The rank's group of a family; `None` only for the embedding group of a middle stage.
    pub fn get(&self, kind: GroupKind) -> Option<&Group> {
        self.groups.iter().find(|g| g.kind == kind)
    }

    /// Every group the rank belongs to.
    pub fn iter(&self) -> impl Iterator<Item = &Group> {
        self.groups.iter()
    }

    /// The rank's group of a family that every rank belongs to (all but `Embedding`).
    pub fn group(&self, kind: GroupKind) -> &Group {
        self.get(kind)
            .unwrap_or_else(|| panic!("rank {} has no {kind} group", self.rank))
    }

    /// Tensor-parallel rank.
    pub fn tp_rank(&self) -> usize {
        self.group(GroupKind::Tp).index
    }

    /// Context-parallel rank.
    pub fn cp_rank(&self) -> usize {
        self.group(GroupKind::Cp).index
    }

    /// Data-parallel rank.
    pub fn dp_rank(&self) -> usize {
        self.group(GroupKind::Dp).index
    }

    /// Pipeline stage.
    pub fn pp_rank(&self) -> usize {
        self.group(GroupKind::Pp).index
    }

    /// Expert-parallel rank.
    pub fn ep_rank(&self) -> usize {
        self.group(GroupKind::Ep).index
    }

    /// Expert tensor-parallel rank.
    pub fn etp_rank(&self) -> usize {
        self.group(GroupKind::Etp).index
    }

    /// Expert data-parallel rank.
    pub fn edp_rank(&self) -> usize {
        self.group(GroupKind::Edp).index
    }
}
