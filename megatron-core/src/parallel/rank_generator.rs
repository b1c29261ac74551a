//! Megatron's rank generator: groups of ranks that differ only in a chosen set of axes.
//!
//! Ranks are laid out over the axes of an [`Order`], the first axis varying fastest, so a rank's
//! coordinate on the axis at position `i` is `(rank / stride_i) % size_i` with `stride_i` the
//! product of the sizes before it. A group token such as `dp-cp` selects ("masks") axes; the ranks
//! that agree on every other axis form one group. Groups are numbered by their coordinates on the
//! unmasked axes and members by their coordinates on the masked axes, both with the earlier axis
//! of the order varying fastest: exactly the order Megatron-Core's `RankGenerator` lists them in.

use super::config::{Axis, ConfigError, Order};

/// Generates the groups of one layout (dense or expert) of a world.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankGenerator {
    order: Order,
    /// Sizes of the axes in `order`'s sequence.
    sizes: [usize; 5],
    world_size: usize,
}

impl RankGenerator {
    /// A generator for the given size of each axis (indexed like [`Axis::ALL`]) laid out in `order`.
    pub fn new(order: Order, size_of: impl Fn(Axis) -> usize) -> Self {
        let sizes = order.axes().map(&size_of);
        let world_size = sizes.iter().product();
        RankGenerator {
            order,
            sizes,
            world_size,
        }
    }

    /// Number of ranks the layout covers.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Size of one axis.
    pub fn size(&self, axis: Axis) -> usize {
        self.sizes[self.order.position(axis)]
    }

    /// The layout order.
    pub fn order(&self) -> Order {
        self.order
    }

    /// Coordinate of `rank` on `axis`.
    pub fn coordinate(&self, rank: usize, axis: Axis) -> usize {
        let pos = self.order.position(axis);
        let stride: usize = self.sizes[..pos].iter().product();
        (rank / stride) % self.sizes[pos]
    }

    /// All groups of ranks that differ only in `axes`, in Megatron's order.
    pub fn groups(&self, axes: &[Axis]) -> Vec<Vec<usize>> {
        let mut masked = [false; 5];
        for axis in axes {
            masked[self.order.position(*axis)] = true;
        }
        let mut strides = [1usize; 5];
        for i in 1..5 {
            strides[i] = strides[i - 1] * self.sizes[i - 1];
        }
        let pick = |want_masked: bool| -> Vec<(usize, usize)> {
            (0..5)
                .filter(|&i| masked[i] == want_masked)
                .map(|i| (self.sizes[i], strides[i]))
                .collect()
        };
        let inside = pick(true);
        let outside = pick(false);
        let group_size: usize = inside.iter().map(|(s, _)| s).product();
        let group_count = self.world_size / group_size;
        (0..group_count)
            .map(|g| {
                let base = offset(g, &outside);
                (0..group_size).map(|m| base + offset(m, &inside)).collect()
            })
            .collect()
    }

    /// The group of `axes` that holds `rank`, and `rank`'s index in it.
    pub fn group_of(&self, rank: usize, axes: &[Axis]) -> (Vec<usize>, usize) {
        // The group's members share `rank`'s coordinates on every other axis; walk the masked
        // axes in order to enumerate them without building every group.
        let mut members = vec![0usize];
        let mut index = 0;
        let mut span = 1;
        let mut base = rank;
        for (pos, &axis) in self.order.axes().iter().enumerate() {
            if !axes.contains(&axis) {
                continue;
            }
            let stride: usize = self.sizes[..pos].iter().product();
            let size = self.sizes[pos];
            let coord = (rank / stride) % size;
            base -= coord * stride;
            index += coord * span;
            span *= size;
            members = (0..size)
                .flat_map(|c| members.iter().map(move |m| m + c * stride))
                .collect();
        }
        (members.into_iter().map(|m| m + base).collect(), index)
    }
}

/// Decomposes `index` over `(size, stride)` axes (first fastest) and maps it to a rank offset.
fn offset(mut index: usize, axes: &[(usize, usize)]) -> usize {
    let mut total = 0;
    for &(size, stride) in axes {
        total += (index % size) * stride;
        index /= size;
    }
    total
}

/// Which layout a group token refers to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Layout {
    /// Attention and dense layers: tp·cp·dp·pp.
    Dense,
    /// MoE expert layers: etp·ep·edp·pp.
    Expert,
}

/// A parsed group token such as `tp-dp-cp` (dense) or `ep-edp` (expert).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupToken {
    /// The layout whose generator builds the groups.
    pub layout: Layout,
    /// The axes the groups span.
    pub axes: Vec<Axis>,
}

impl GroupToken {
    /// Parses a token. Names `etp`, `ep` and `edp` select the expert layout (where `tp` and `dp`
    /// may also be spelled `etp` and `edp`); otherwise the token is dense and may use `tp`, `cp`,
    /// `dp`, `pp`.
    pub fn parse(token: &str) -> Result<GroupToken, ConfigError> {
        let bad = |reason: String| ConfigError::BadToken {
            token: token.to_string(),
            reason,
        };
        let parts: Vec<&str> = token.split('-').map(str::trim).collect();
        let expert = parts.iter().any(|p| matches!(*p, "etp" | "ep" | "edp"));
        let layout = if expert {
            Layout::Expert
        } else {
            Layout::Dense
        };
        let mut axes = Vec::new();
        for part in parts {
            let axis = match (part, layout) {
                ("tp" | "etp", Layout::Expert) | ("tp", Layout::Dense) => Axis::Tp,
                ("dp" | "edp", Layout::Expert) | ("dp", Layout::Dense) => Axis::Dp,
                ("cp", _) => Axis::Cp,
                ("pp", _) => Axis::Pp,
                ("ep", Layout::Expert) => Axis::Ep,
                _ => {
                    return Err(bad(format!(
                        "`{part}` is not an axis (dense: tp, cp, dp, pp; expert: etp, ep, edp, pp)"
                    )));
                }
            };
            if axes.contains(&axis) {
                return Err(bad(format!("`{part}` names an axis twice")));
            }
            axes.push(axis);
        }
        Ok(GroupToken { layout, axes })
    }
}
