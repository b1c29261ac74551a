//! Parallel state: Megatron's parallel sizes, its rank generator and the groups of each rank.
//!
//! ```
//! use megatron_core::parallel::{GroupKind, ParallelConfig, ParallelLayout};
//!
//! let layout = ParallelLayout::new(&ParallelConfig::new(16).with_tp(4).with_pp(2))?;
//! assert_eq!(layout.groups(GroupKind::Dp)[0], vec![0, 4]);
//! let rank5 = layout.rank(5)?;
//! assert_eq!(rank5.group(GroupKind::Tp).ranks, vec![4, 5, 6, 7]);
//! # Ok::<(), megatron_core::parallel::ConfigError>(())
//! ```

mod config;
mod groups;
mod rank_generator;

pub use config::{Axis, ConfigError, Order, ParallelConfig, ValidConfig};
pub use groups::{Group, GroupKind, ParallelLayout, RankGroups};
pub use rank_generator::{GroupToken, Layout, RankGenerator};
