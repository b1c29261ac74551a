//! The graph scopes a run may capture (Megatron-LM's `--cuda-graph-scope`), and the checks that
//! a chosen set fits the model.

use std::fmt;
use std::str::FromStr;

use thiserror::Error;

/// A part of a transformer layer that a CUDA graph may capture: `#[graph_scope(..)]` names it
/// on the field that runs it, `--cuda-graph-scope` selects it at run time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum GraphScope {
    /// Self-attention (the QKV projection, the core attention, the output projection).
    Attn,
    /// A dense layer's MLP.
    Mlp,
    /// A MoE layer's router: the gate's product, the scores, the top-k, capacity, the counts and
    /// the auxiliary losses, forward and backward.
    MoeRouter,
    /// A MoE layer's preprocessing before the dispatch (the tokens laid out expert-major for
    /// the all-to-all), captured in the router's graph: the graph ends where the all-to-all
    /// needs host-side sizes. Unlike Megatron-LM, which reads the counts back inside its
    /// preprocessing when an expert capacity drops tokens, the device's preprocessing never
    /// reads back (the rows go to a buffer of the most the routing can send), so capacity is
    /// allowed.
    MoePreprocess,
}

impl GraphScope {
    /// Every scope, in the order Megatron-LM lists them.
    pub const ALL: [GraphScope; 4] = [
        GraphScope::Attn,
        GraphScope::Mlp,
        GraphScope::MoeRouter,
        GraphScope::MoePreprocess,
    ];

    /// The scope's name, as `--cuda-graph-scope` and `#[graph_scope(..)]` write it.
    pub fn name(self) -> &'static str {
        match self {
            GraphScope::Attn => "attn",
            GraphScope::Mlp => "mlp",
            GraphScope::MoeRouter => "moe_router",
            GraphScope::MoePreprocess => "moe_preprocess",
        }
    }

    fn bit(self) -> u8 {
        1 << (self as u8)
    }
}

impl fmt::Display for GraphScope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for GraphScope {
    type Err = ScopeError;

    fn from_str(s: &str) -> Result<Self, ScopeError> {
        GraphScope::ALL
            .into_iter()
            .find(|scope| scope.name() == s)
            .ok_or_else(|| ScopeError::Unknown {
                name: s.to_string(),
            })
    }
}

/// A selection of scopes that does not fit the model or the run; every message names the
/// scope and the numbers.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum ScopeError {
    /// A name that is no scope.
    #[error(
        "unknown CUDA graph scope `{name}`: the scopes are attn, mlp, moe_router and moe_preprocess"
    )]
    Unknown {
        /// The name given.
        name: String,
    },
    /// A MoE scope on a model without MoE layers.
    #[error(
        "--cuda-graph-scope {scope} needs MoE layers, but the model has {dense} dense layers and \
         none with experts (give --num-experts, or leave {scope} out)"
    )]
    NoMoeLayers {
        /// The scope.
        scope: GraphScope,
        /// The model's dense layers.
        dense: usize,
    },
    /// `mlp` on a model whose every layer is MoE.
    #[error(
        "--cuda-graph-scope mlp captures dense MLPs, but all {moe} layers of the model are MoE \
         layers (use moe_router, or make some layers dense with --moe-layer-freq)"
    )]
    NoDenseLayers {
        /// The model's MoE layers.
        moe: usize,
    },
    /// `moe_preprocess` without `moe_router`.
    #[error(
        "--cuda-graph-scope moe_preprocess is captured in the router's graph: give moe_router too"
    )]
    PreprocessWithoutRouter,
    /// Full activation recompute reruns whole layers in the backward.
    #[error(
        "--cuda-graph-scope {scope} with --recompute-granularity full: full recompute reruns \
         whole layers inside the backward, across the scopes' boundaries (use selective \
         recompute, or no graphs)"
    )]
    FullRecompute {
        /// The first scope chosen.
        scope: GraphScope,
    },
}

/// The scopes a run captures: a set of [`GraphScope`]s (empty: everything runs eagerly).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct ScopeSet(u8);

/// What the checks of a [`ScopeSet`] need to know of the model and the run.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ScopedModel {
    /// Layers with a dense MLP.
    pub dense_layers: usize,
    /// Layers with routed experts.
    pub moe_layers: usize,
    /// Whether whole layers are recomputed in the backward.
    pub full_recompute: bool,
}

impl ScopeSet {
    /// No scope: everything eager.
    pub const NONE: ScopeSet = ScopeSet(0);

    /// The set of `scopes`.
    pub fn of(scopes: &[GraphScope]) -> ScopeSet {
        ScopeSet(scopes.iter().fold(0, |bits, s| bits | s.bit()))
    }

    /// Parses scope names (`attn moe_router ..`); a repeated name counts once.
    pub fn parse<S: AsRef<str>>(names: &[S]) -> Result<ScopeSet, ScopeError> {
        let scopes = names
            .iter()
            .map(|n| n.as_ref().parse())
            .collect::<Result<Vec<GraphScope>, _>>()?;
        Ok(ScopeSet::of(&scopes))
    }

    /// Whether `scope` is selected.
    pub fn contains(self, scope: GraphScope) -> bool {
        self.0 & scope.bit() != 0
    }

    /// Whether nothing is selected.
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The selected scopes, in [`GraphScope::ALL`]'s order.
    pub fn iter(self) -> impl Iterator<Item = GraphScope> {
        GraphScope::ALL
            .into_iter()
            .filter(move |s| self.contains(*s))
    }

    /// The selected names, space-separated (as the flag takes them).
    pub fn names(self) -> String {
        self.iter()
            .map(GraphScope::name)
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// Checks the selection against the model, as Megatron-LM's `TransformerConfig` does.
    pub fn validate(self, model: &ScopedModel) -> Result<(), ScopeError> {
        if self.contains(GraphScope::MoePreprocess) && !self.contains(GraphScope::MoeRouter) {
            return Err(ScopeError::PreprocessWithoutRouter);
        }
        for scope in [GraphScope::MoeRouter, GraphScope::MoePreprocess] {
            if self.contains(scope) && model.moe_layers == 0 {
                return Err(ScopeError::NoMoeLayers {
                    scope,
                    dense: model.dense_layers,
                });
            }
        }
        if self.contains(GraphScope::Mlp) && model.dense_layers == 0 {
            return Err(ScopeError::NoDenseLayers {
                moe: model.moe_layers,
            });
        }
        if model.full_recompute
            && let Some(scope) = self.iter().next()
        {
            return Err(ScopeError::FullRecompute { scope });
        }
        Ok(())
    }

    /// The graphs (each a forward and a backward) one layer captures: one for attention when
    /// `attn` is selected, and one for its MLP part: a dense MLP under `mlp`, a MoE layer's
    /// router (and preprocessing) under `moe_router`.
    pub fn graphs_per_layer(self, moe: bool) -> usize {
        let mlp = if moe {
            self.contains(GraphScope::MoeRouter)
        } else {
            self.contains(GraphScope::Mlp)
        };
        usize::from(self.contains(GraphScope::Attn)) + usize::from(mlp)
    }
}

impl fmt::Display for ScopeSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_empty() {
            f.write_str("none")
        } else {
            f.write_str(&self.names())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dense(layers: usize) -> ScopedModel {
        ScopedModel {
            dense_layers: layers,
            ..ScopedModel::default()
        }
    }

    #[test]
    fn names_round_trip_and_unknown_names_are_named() {
        for scope in GraphScope::ALL {
            assert_eq!(scope.name().parse::<GraphScope>(), Ok(scope));
        }
        let err = ScopeSet::parse(&["attn", "router"]).unwrap_err();
        assert!(err.to_string().contains("`router`"), "{err}");
        assert!(err.to_string().contains("moe_preprocess"), "{err}");
        let set = ScopeSet::parse(&["moe_router", "attn", "attn"]).unwrap();
        assert_eq!(set.names(), "attn moe_router");
    }

    #[test]
    fn scopes_are_checked_against_the_model() {
        let moe = ScopedModel {
            dense_layers: 1,
            moe_layers: 3,
            ..ScopedModel::default()
        };
        let set = |names: &[&str]| ScopeSet::parse(names).unwrap();
        assert!(set(&["attn", "mlp"]).validate(&dense(4)).is_ok());
        assert!(
            set(&["attn", "moe_router", "moe_preprocess", "mlp"])
                .validate(&moe)
                .is_ok()
        );
        let err = set(&["moe_router"]).validate(&dense(4)).unwrap_err();
        assert!(err.to_string().contains("4 dense layers"), "{err}");
        let all_moe = ScopedModel {
            dense_layers: 0,
            ..moe
        };
        let err = set(&["mlp"]).validate(&all_moe).unwrap_err();
        assert!(err.to_string().contains("all 3 layers"), "{err}");
        assert_eq!(
            set(&["moe_preprocess"]).validate(&moe),
            Err(ScopeError::PreprocessWithoutRouter)
        );
        let full = ScopedModel {
            full_recompute: true,
            ..dense(2)
        };
        assert!(set(&["attn"]).validate(&full).is_err());
        assert!(ScopeSet::NONE.validate(&full).is_ok());
    }

    #[test]
    fn a_layer_captures_one_graph_per_selected_part() {
        let set = ScopeSet::of(&[GraphScope::Attn, GraphScope::MoeRouter]);
        assert_eq!(set.graphs_per_layer(true), 2);
        assert_eq!(set.graphs_per_layer(false), 1);
        assert_eq!(ScopeSet::NONE.graphs_per_layer(true), 0);
    }
}
