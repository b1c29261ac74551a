//! GPT's mixture-of-experts MLP, written with the DSL: `#[expert_parallel]` is the whole
//! expert-parallel plan. The macros insert the dispatcher's all-to-alls over the
//! expert-parallel group around the local experts, and the combine's back; the router's gate
//! is a dense parameter (reduced over data parallelism), the experts' weights are split over
//! expert parallelism (reduced over expert data parallelism).
//!
//! [`Ffn`] is a layer's feed-forward block, dense or MoE (`--moe-layer-freq` mixes them in one
//! stack).

use megatron_core::Result;
use megatron_core::cuda_graphs::{self, GraphScope};
use megatron_core::module::{Builder, Cx, Module, Param, Site};
use megatron_core::moe::RoutedExperts;
use megatron_core::prelude::*;
use megatron_macros::module;

use crate::gpt::{GatedMlp, GatedMlpSaved, GatedMlpSpec, Mlp, MlpSaved, MlpSpec};

/// A MoE MLP: the router sends each token to its top-k experts, split over expert parallelism.
#[module]
pub struct MoeMlp {
    /// The router and the routed experts; graph scopes `moe_router` and `moe_preprocess`
    /// capture the router.
    #[expert_parallel]
    #[graph_scope(moe_router, moe_preprocess)]
    pub experts: RoutedExperts,
}

#[module]
impl MoeMlp {
    fn forward(&self, x: Tensor) -> Tensor {
        self.experts(x)
    }
}

/// A MoE MLP with shared experts: a dense MLP every token goes through, added to the routed
/// experts' output (Megatron-LM's `--moe-shared-expert-intermediate-size`).
#[module]
pub struct SharedMoeMlp {
    /// The router and the routed experts (graph scopes as [`MoeMlp`]'s).
    #[expert_parallel]
    #[graph_scope(moe_router, moe_preprocess)]
    pub experts: RoutedExperts,
    /// The shared experts, tensor-parallel as a dense MLP (gated with `--swiglu`).
    pub shared: DenseMlp,
}

/// A dense MLP, plain or gated, under no graph scope of its own (the shared experts): each
/// variant's forward and backward are its module's.
pub enum DenseMlp {
    /// GeLU.
    Plain(Mlp),
    /// SwiGLU.
    Gated(GatedMlp),
}

/// What a [`DenseMlp`] is built from.
#[derive(Debug, Clone)]
pub enum DenseMlpSpec {
    /// A GeLU MLP.
    Plain(MlpSpec),
    /// A SwiGLU MLP.
    Gated(GatedMlpSpec),
}

/// What [`DenseMlp::forward`] keeps: its variant's.
#[derive(Clone)]
pub enum DenseMlpSaved {
    /// The GeLU MLP's.
    Plain(MlpSaved),
    /// The SwiGLU MLP's.
    Gated(GatedMlpSaved),
}

impl Module for DenseMlp {
    type Spec = DenseMlpSpec;
    type Saved = DenseMlpSaved;
    const GRADIENT_FEEDS_PRODUCTS: bool = <Mlp as Module>::GRADIENT_FEEDS_PRODUCTS;

    fn build(spec: &DenseMlpSpec, b: &mut Builder) -> Result<Self> {
        Ok(match spec {
            DenseMlpSpec::Plain(s) => DenseMlp::Plain(Mlp::build(s, b)?),
            DenseMlpSpec::Gated(s) => DenseMlp::Gated(GatedMlp::build(s, b)?),
        })
    }

    fn visit_params<'s>(&'s self, f: &mut dyn FnMut(&'s Param)) {
        match self {
            DenseMlp::Plain(m) => m.visit_params(f),
            DenseMlp::Gated(m) => m.visit_params(f),
        }
    }

    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        match self {
            DenseMlp::Plain(m) => m.visit_params_mut(f),
            DenseMlp::Gated(m) => m.visit_params_mut(f),
        }
    }
}

impl DenseMlp {
    /// Runs the variant.
    pub fn forward(&self, cx: &Cx, site: Site, x: &Tensor) -> Result<(Tensor, DenseMlpSaved)> {
        Ok(match self {
            DenseMlp::Plain(m) => {
                let (y, s) = m.forward(cx, site, x)?;
                (y, DenseMlpSaved::Plain(s))
            }
            DenseMlp::Gated(m) => {
                let (y, s) = m.forward(cx, site, x)?;
                (y, DenseMlpSaved::Gated(s))
            }
        })
    }

    /// The backward of [`DenseMlp::forward`].
    pub fn backward(
        &self,
        cx: &Cx,
        site: Site,
        saved: DenseMlpSaved,
        dy: &Tensor,
    ) -> Result<Tensor> {
        match (self, saved) {
            (DenseMlp::Plain(m), DenseMlpSaved::Plain(s)) => m.backward(cx, site, s, dy),
            (DenseMlp::Gated(m), DenseMlpSaved::Gated(s)) => m.backward(cx, site, s, dy),
            _ => megatron_core::invalid!(
                "a DenseMlp backward got what another variant's forward saved"
            ),
        }
    }

    /// [`DenseMlp::backward`] plus `plus`, another gradient of the input.
    pub fn backward_plus(
        &self,
        cx: &Cx,
        site: Site,
        saved: DenseMlpSaved,
        dy: &Tensor,
        plus: &Tensor,
    ) -> Result<Tensor> {
        match (self, saved) {
            (DenseMlp::Plain(m), DenseMlpSaved::Plain(s)) => m.backward_plus(cx, site, s, dy, plus),
            (DenseMlp::Gated(m), DenseMlpSaved::Gated(s)) => m.backward_plus(cx, site, s, dy, plus),
            _ => megatron_core::invalid!(
                "a DenseMlp backward got what another variant's forward saved"
            ),
        }
    }
}

#[module]
impl SharedMoeMlp {
    fn forward(&self, x: Tensor) -> Tensor {
        self.experts(x) + self.shared(x)
    }
}

/// A transformer layer's feed-forward block: dense, or mixture of experts with or without
/// shared experts. Written by hand (the DSL's modules are structs): each variant's forward and
/// backward are its module's.
pub enum Ffn {
    /// The dense MLP.
    Dense(Mlp),
    /// The dense gated MLP (SwiGLU).
    Gated(GatedMlp),
    /// Routed experts.
    Moe(MoeMlp),
    /// Routed and shared experts (boxed: the largest by far).
    SharedMoe(Box<SharedMoeMlp>),
}

/// What an [`Ffn`] is built from.
#[derive(Debug, Clone)]
pub enum FfnSpec {
    /// A dense MLP.
    Dense(MlpSpec),
    /// A dense gated MLP.
    Gated(GatedMlpSpec),
    /// Routed experts.
    Moe(MoeMlpSpec),
    /// Routed and shared experts.
    SharedMoe(SharedMoeMlpSpec),
}

/// What [`Ffn::forward`] keeps for [`Ffn::backward`]: its variant's.
#[derive(Clone)]
pub enum FfnSaved {
    /// The dense MLP's.
    Dense(MlpSaved),
    /// The gated MLP's.
    Gated(GatedMlpSaved),
    /// The MoE MLP's.
    Moe(Box<MoeMlpSaved>),
    /// The MoE MLP with shared experts'.
    SharedMoe(Box<SharedMoeMlpSaved>),
}

impl Module for Ffn {
    type Spec = FfnSpec;
    type Saved = FfnSaved;
    /// The dense MLP's (a MoE block widens a narrower gradient itself).
    const GRADIENT_FEEDS_PRODUCTS: bool = <Mlp as Module>::GRADIENT_FEEDS_PRODUCTS;
    /// A MoE variant dispatches with run-time sizes: the dense one is graph scope `mlp` inside.
    const CAPTURABLE: bool = false;

    fn build(spec: &FfnSpec, b: &mut Builder) -> Result<Self> {
        Ok(match spec {
            FfnSpec::Dense(s) => Ffn::Dense(Mlp::build(s, b)?),
            FfnSpec::Gated(s) => Ffn::Gated(GatedMlp::build(s, b)?),
            FfnSpec::Moe(s) => Ffn::Moe(MoeMlp::build(s, b)?),
            FfnSpec::SharedMoe(s) => Ffn::SharedMoe(Box::new(SharedMoeMlp::build(s, b)?)),
        })
    }

    fn visit_params<'s>(&'s self, f: &mut dyn FnMut(&'s Param)) {
        match self {
            Ffn::Dense(m) => m.visit_params(f),
            Ffn::Gated(m) => m.visit_params(f),
            Ffn::Moe(m) => m.visit_params(f),
            Ffn::SharedMoe(m) => m.visit_params(f),
        }
    }

    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        match self {
            Ffn::Dense(m) => m.visit_params_mut(f),
            Ffn::Gated(m) => m.visit_params_mut(f),
            Ffn::Moe(m) => m.visit_params_mut(f),
            Ffn::SharedMoe(m) => m.visit_params_mut(f),
        }
    }
}

/// `dy` in f32: the MoE blocks read their output gradient in f32 (a caller may hand a
/// narrower one to a block whose gradient feeds products, see [`Ffn::GRADIENT_FEEDS_PRODUCTS`]).
fn f32_gradient(dy: &Tensor) -> Result<Tensor> {
    Ok(dy.to_f32_contiguous()?)
}

impl FfnSpec {
    /// The dense MLP's spec, if the block is dense.
    pub fn dense(&self) -> Option<&MlpSpec> {
        match self {
            FfnSpec::Dense(m) => Some(m),
            _ => None,
        }
    }
}

impl Ffn {
    /// The dense MLP, if the block is dense.
    pub fn dense(&self) -> Option<&Mlp> {
        match self {
            Ffn::Dense(m) => Some(m),
            _ => None,
        }
    }

    /// Runs the block's variant.
    pub fn forward(&self, cx: &Cx, site: Site, x: &Tensor) -> Result<(Tensor, FfnSaved)> {
        Ok(match self {
            // Graph scope `mlp` (dense layers only, as in Megatron-LM).
            Ffn::Dense(m) => {
                let (y, s) = cuda_graphs::forward(cx, GraphScope::Mlp, site, &[x], |cx, x| {
                    m.forward(cx, site, &x[0])
                })?;
                (y, FfnSaved::Dense(s))
            }
            Ffn::Gated(m) => {
                let (y, s) = cuda_graphs::forward(cx, GraphScope::Mlp, site, &[x], |cx, x| {
                    m.forward(cx, site, &x[0])
                })?;
                (y, FfnSaved::Gated(s))
            }
            Ffn::Moe(m) => {
                let (y, s) = m.forward(cx, site, x)?;
                (y, FfnSaved::Moe(Box::new(s)))
            }
            Ffn::SharedMoe(m) => {
                let (y, s) = m.forward(cx, site, x)?;
                (y, FfnSaved::SharedMoe(Box::new(s)))
            }
        })
    }

    /// The backward of [`Ffn::forward`].
    pub fn backward(&self, cx: &Cx, site: Site, saved: FfnSaved, dy: &Tensor) -> Result<Tensor> {
        match (self, saved) {
            (Ffn::Dense(m), FfnSaved::Dense(s)) => {
                cuda_graphs::backward(cx, GraphScope::Mlp, site, s, &[dy], |cx, s, dy| {
                    m.backward(cx, site, s, &dy[0])
                })
            }
            (Ffn::Gated(m), FfnSaved::Gated(s)) => {
                cuda_graphs::backward(cx, GraphScope::Mlp, site, s, &[dy], |cx, s, dy| {
                    m.backward(cx, site, s, &dy[0])
                })
            }
            (Ffn::Moe(m), FfnSaved::Moe(s)) => m.backward(cx, site, *s, &f32_gradient(dy)?),
            (Ffn::SharedMoe(m), FfnSaved::SharedMoe(s)) => {
                m.backward(cx, site, *s, &f32_gradient(dy)?)
            }
            _ => {
                megatron_core::invalid!("an Ffn backward got what another variant's forward saved")
            }
        }
    }

    /// [`Ffn::backward`] plus `plus`, another gradient of the input.
    pub fn backward_plus(
        &self,
        cx: &Cx,
        site: Site,
        saved: FfnSaved,
        dy: &Tensor,
        plus: &Tensor,
    ) -> Result<Tensor> {
        let dx = self.backward(cx, site, saved, dy)?;
        megatron_core::ops::add(plus, &dx)
    }
}
