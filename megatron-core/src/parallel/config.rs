//! `ParallelConfig`: the sizes of every parallel dimension and their validation.

use std::fmt;

use serde::Serialize;
use thiserror::Error;

/// A bad parallel configuration; every message names the numbers involved.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ConfigError {
    /// A parallel size is zero.
    #[error("{name} must be at least 1, got 0")]
    Zero {
        /// The dimension, e.g. `tp`.
        name: &'static str,
    },
    /// The world size is not a multiple of the product of the model-parallel sizes.
    #[error("world size {world} is not divisible by {what} = {product} (the sizes of {flags})")]
    NotDivisible {
        /// Total number of ranks.
        world: usize,
        /// The product spelled out with its factors, e.g. `tp·cp·pp = 2·1·2`.
        what: String,
        /// The product's value.
        product: usize,
        /// The flags that give the factors.
        flags: &'static str,
    },
    /// An explicitly given data-parallel size disagrees with the world size.
    #[error(
        "world size {world} ≠ {what} = {product} (--dp {dp} was given; the world needs --dp {needed})"
    )]
    DpMismatch {
        /// Total number of ranks.
        world: usize,
        /// The product spelled out, e.g. `tp·cp·dp·pp`.
        what: &'static str,
        /// The product's value with the given dp.
        product: usize,
        /// The dp that was given.
        dp: usize,
        /// The dp the world size implies.
        needed: usize,
    },
    /// An axis of size greater than 1 is missing from the order (Megatron appends only the
    /// axes of size 1 that an order leaves out).
    #[error(
        "the size of {axis} is {size}, but the order `{order}` does not name it (Megatron-LM's \
         RankGenerator appends only the axes of size 1 an order leaves out)"
    )]
    UnorderedAxis {
        /// The axis as the layout names it, e.g. `cp`, or `ep` of the expert layout.
        axis: &'static str,
        /// Its size.
        size: usize,
        /// The order as given.
        order: String,
    },
    /// With pp not the order's last axis, the expert layout's data-parallel size must equal the
    /// dense one (Megatron-LM's assertion in `initialize_model_parallel`).
    #[error(
        "when not using pp-last rank ordering, the data parallel size of the attention and moe \
         layers must be the same: order `{order}` with pp {pp} gives dp {dp} and edp {edp}"
    )]
    PpNotLast {
        /// The order as given.
        order: String,
        /// Pipeline-parallel size.
        pp: usize,
        /// Dense data-parallel size.
        dp: usize,
        /// Expert data-parallel size.
        edp: usize,
    },
    /// The order names something that is not an axis, or names an axis twice.
    #[error(
        "order `{order}` is not a dash-separated list of distinct tp, cp, ep, dp, pp: {reason}"
    )]
    BadOrder {
        /// The order as given.
        order: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A group token names something that is not a dimension, or repeats one.
    #[error("group token `{token}` is invalid: {reason}")]
    BadToken {
        /// The token as given, e.g. `tp-xp`.
        token: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Virtual pipeline stages were asked for without a pipeline.
    #[error("virtual pipeline size {vpp} needs a pipeline of at least 2 stages, got pp = {pp}")]
    VppWithoutPipeline {
        /// Virtual stages per rank.
        vpp: usize,
        /// Pipeline stages.
        pp: usize,
    },
}

/// One parallel dimension, as named in Megatron's order string.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Axis {
    /// Tensor parallel (expert tensor parallel in the expert layout).
    Tp,
    /// Context parallel (size 1 in the expert layout).
    Cp,
    /// Expert parallel (size 1 in the dense layout).
    Ep,
    /// Data parallel (expert data parallel in the expert layout).
    Dp,
    /// Pipeline parallel.
    Pp,
}

impl Axis {
    /// All axes, in Megatron's default order.
    pub const ALL: [Axis; 5] = [Axis::Tp, Axis::Cp, Axis::Ep, Axis::Dp, Axis::Pp];

    /// The axis's short name as in order strings: `tp`, `cp`, `ep`, `dp`, `pp`.
    pub fn name(self) -> &'static str {
        match self {
            Axis::Tp => "tp",
            Axis::Cp => "cp",
            Axis::Ep => "ep",
            Axis::Dp => "dp",
            Axis::Pp => "pp",
        }
    }

    /// Parses a short name.
    pub fn from_name(name: &str) -> Option<Axis> {
        Axis::ALL.into_iter().find(|a| a.name() == name)
    }
}

impl fmt::Display for Axis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The order in which the parallel dimensions are laid over ranks; the first varies fastest.
///
/// As in Megatron-LM, an order may leave axes out: they are appended at its end, which is valid
/// only for axes of size 1 ([`ParallelConfig::validate`] checks it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Order {
    /// Every axis, the named ones first in the order given.
    axes: [Axis; 5],
    /// How many axes the order named; the rest were appended.
    named: usize,
}

impl Order {
    /// Megatron's default, `tp-cp-ep-dp-pp`.
    pub const DEFAULT: Order = Order {
        axes: Axis::ALL,
        named: 5,
    };

    /// Parses an order such as `tp-cp-ep-pp-dp` or `tp-dp-pp`; the axes it leaves out are
    /// appended in Megatron's order (tp, pp, dp, ep, cp).
    pub fn parse(order: &str) -> Result<Order, ConfigError> {
        let bad = |reason: String| ConfigError::BadOrder {
            order: order.to_string(),
            reason,
        };
        let mut axes = Vec::with_capacity(5);
        for part in order.split('-') {
            let axis = Axis::from_name(part.trim())
                .ok_or_else(|| bad(format!("`{part}` is not one of tp, cp, ep, dp, pp")))?;
            if axes.contains(&axis) {
                return Err(bad(format!("`{axis}` appears twice")));
            }
            axes.push(axis);
        }
        let named = axes.len();
        // Megatron's RankGenerator walks its sizes in this order when it appends.
        for axis in [Axis::Tp, Axis::Pp, Axis::Dp, Axis::Ep, Axis::Cp] {
            if !axes.contains(&axis) {
                axes.push(axis);
            }
        }
        Ok(Order {
            axes: [axes[0], axes[1], axes[2], axes[3], axes[4]],
            named,
        })
    }

    /// Every axis, fastest-varying first.
    pub fn axes(&self) -> [Axis; 5] {
        self.axes
    }

    /// The axes the order string named.
    pub fn named(&self) -> &[Axis] {
        &self.axes[..self.named]
    }

    /// The axes appended because the order string left them out.
    pub fn appended(&self) -> &[Axis] {
        &self.axes[self.named..]
    }

    /// Position of `axis` in the order.
    pub fn position(&self, axis: Axis) -> usize {
        self.axes
            .iter()
            .position(|a| *a == axis)
            .expect("an order holds every axis")
    }

    /// The order as given (the named axes only).
    fn given(&self) -> String {
        let names: Vec<&str> = self.named().iter().map(|a| a.name()).collect();
        names.join("-")
    }
}

impl Default for Order {
    fn default() -> Self {
        Order::DEFAULT
    }
}

impl fmt::Display for Order {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = self.axes.iter().map(|a| a.name()).collect();
        f.write_str(&names.join("-"))
    }
}

/// Sizes of every parallel dimension of a run, as Megatron's `initialize_model_parallel` takes them.
///
/// The dense layout covers the world with tp·cp·dp·pp; the expert (MoE) layout folds the same
/// ranks as etp·ep·edp·pp, with edp derived. Build one with [`ParallelConfig::new`] and the
/// `with_*` setters, then [`ParallelConfig::validate`] it (the setters do not validate).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParallelConfig {
    /// Total number of ranks.
    pub world_size: usize,
    /// Tensor-parallel size.
    pub tp: usize,
    /// Context-parallel size.
    pub cp: usize,
    /// Expert-parallel size.
    pub ep: usize,
    /// Expert tensor-parallel size; `None` means the same as `tp`, as in Megatron.
    pub etp: Option<usize>,
    /// Data-parallel size; `None` derives it from the world size.
    pub dp: Option<usize>,
    /// Pipeline-parallel size.
    pub pp: usize,
    /// Virtual pipeline stages per rank (interleaved schedule); 1 means none.
    pub vpp: usize,
    /// Layout order of the axes over ranks.
    pub order: Order,
}

impl ParallelConfig {
    /// A world of `world_size` ranks with every parallel size 1 (pure data parallelism).
    pub fn new(world_size: usize) -> Self {
        ParallelConfig {
            world_size,
            tp: 1,
            cp: 1,
            ep: 1,
            etp: None,
            dp: None,
            pp: 1,
            vpp: 1,
            order: Order::DEFAULT,
        }
    }

    /// Sets the tensor-parallel size.
    pub fn with_tp(mut self, tp: usize) -> Self {
        self.tp = tp;
        self
    }

    /// Sets the context-parallel size.
    pub fn with_cp(mut self, cp: usize) -> Self {
        self.cp = cp;
        self
    }

    /// Sets the expert-parallel size.
    pub fn with_ep(mut self, ep: usize) -> Self {
        self.ep = ep;
        self
    }

    /// Sets the expert tensor-parallel size.
    pub fn with_etp(mut self, etp: usize) -> Self {
        self.etp = Some(etp);
        self
    }

    /// Sets the data-parallel size explicitly (it must agree with the world size).
    pub fn with_dp(mut self, dp: usize) -> Self {
        self.dp = Some(dp);
        self
    }

    /// Sets the pipeline-parallel size.
    pub fn with_pp(mut self, pp: usize) -> Self {
        self.pp = pp;
        self
    }

    /// Sets the number of virtual pipeline stages per rank.
    pub fn with_vpp(mut self, vpp: usize) -> Self {
        self.vpp = vpp;
        self
    }

    /// Sets the layout order.
    pub fn with_order(mut self, order: Order) -> Self {
        self.order = order;
        self
    }

    /// Checks every size and derives dp and edp; the result is what rank generators consume.
    pub fn validate(&self) -> Result<ValidConfig, ConfigError> {
        let etp = self.etp.unwrap_or(self.tp);
        for (name, value) in [
            ("world size", self.world_size),
            ("tp", self.tp),
            ("cp", self.cp),
            ("ep", self.ep),
            ("etp", etp),
            ("pp", self.pp),
            ("vpp", self.vpp),
        ] {
            if value == 0 {
                return Err(ConfigError::Zero { name });
            }
        }
        if self.dp == Some(0) {
            return Err(ConfigError::Zero { name: "dp" });
        }
        let world = self.world_size;
        let dense_mp = self.tp * self.cp * self.pp;
        if !world.is_multiple_of(dense_mp) {
            return Err(ConfigError::NotDivisible {
                world,
                what: format!("tp·cp·pp = {}·{}·{}", self.tp, self.cp, self.pp),
                product: dense_mp,
                flags: "--tp, --cp and --pp",
            });
        }
        let dp = world / dense_mp;
        if let Some(given) = self.dp
            && given != dp
        {
            return Err(ConfigError::DpMismatch {
                world,
                what: "tp·cp·dp·pp",
                product: dense_mp * given,
                dp: given,
                needed: dp,
            });
        }
        let expert_mp = etp * self.ep * self.pp;
        if !world.is_multiple_of(expert_mp) {
            return Err(ConfigError::NotDivisible {
                world,
                what: format!("etp·ep·pp = {etp}·{}·{}", self.ep, self.pp),
                product: expert_mp,
                flags: "--etp, --ep and --pp",
            });
        }
        let edp = world / expert_mp;
        // Megatron's two RankGenerators: the dense one has no ep, the expert one no cp.
        let layouts: [[(Axis, &'static str, usize); 5]; 2] = [
            [
                (Axis::Tp, "tp", self.tp),
                (Axis::Cp, "cp", self.cp),
                (Axis::Ep, "ep", 1),
                (Axis::Dp, "dp", dp),
                (Axis::Pp, "pp", self.pp),
            ],
            [
                (Axis::Tp, "etp (tp of the expert layout)", etp),
                (Axis::Cp, "cp", 1),
                (Axis::Ep, "ep", self.ep),
                (Axis::Dp, "edp (dp of the expert layout)", edp),
                (Axis::Pp, "pp", self.pp),
            ],
        ];
        for sizes in layouts {
            if let Some(&(_, axis, size)) = sizes
                .iter()
                .find(|(a, _, size)| *size != 1 && self.order.appended().contains(a))
            {
                return Err(ConfigError::UnorderedAxis {
                    axis,
                    size,
                    order: self.order.given(),
                });
            }
        }
        if self.order.named().last() != Some(&Axis::Pp) && self.pp > 1 && edp != dp {
            return Err(ConfigError::PpNotLast {
                order: self.order.given(),
                pp: self.pp,
                dp,
                edp,
            });
        }
        if self.vpp > 1 && self.pp < 2 {
            return Err(ConfigError::VppWithoutPipeline {
                vpp: self.vpp,
                pp: self.pp,
            });
        }
        Ok(ValidConfig {
            world_size: world,
            tp: self.tp,
            cp: self.cp,
            dp,
            pp: self.pp,
            ep: self.ep,
            etp,
            edp,
            vpp: self.vpp,
            order: self.order,
        })
    }
}

/// A validated configuration with every size resolved (dp and edp derived).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ValidConfig {
    /// Total number of ranks.
    pub world_size: usize,
    /// Tensor-parallel size.
    pub tp: usize,
    /// Context-parallel size.
    pub cp: usize,
    /// Data-parallel size (dense layout).
    pub dp: usize,
    /// Pipeline-parallel size.
    pub pp: usize,
    /// Expert-parallel size.
    pub ep: usize,
    /// Expert tensor-parallel size.
    pub etp: usize,
    /// Expert data-parallel size: world / (etp·ep·pp).
    pub edp: usize,
    /// Virtual pipeline stages per rank.
    pub vpp: usize,
    /// Layout order.
    #[serde(serialize_with = "serialize_order")]
    pub order: Order,
}

fn serialize_order<S: serde::Serializer>(order: &Order, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(order)
}
