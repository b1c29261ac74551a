//! [`SelfAttention`]: a transformer layer's attention, the fused-projection [`Attention`] of GPT
//! and the Llama family, or multi-latent attention ([`LatentAttention`],
//! [`LatentKvAttention`]; `--multi-latent-attention`). Written by hand as [`crate::moe::Ffn`]
//! is (the DSL's modules are structs): each variant's forward and backward are its module's,
//! and its parameters are named as the variant's own (`attn.qkv`, or `attn.kv_down`, ...).

use megatron_core::Result;
use megatron_core::module::{Builder, Cx, Module, Param, Site};
use megatron_core::prelude::*;

use crate::gpt::{Attention, AttentionSaved, AttentionSpec};
use crate::mla::{
    LatentAttention, LatentAttentionSaved, LatentAttentionSpec, LatentKvAttention,
    LatentKvAttentionSaved, LatentKvAttentionSpec,
};

/// A layer's attention.
pub enum SelfAttention {
    /// Multi-head (or grouped-query) attention on a fused `[q | k | v]` projection.
    Fused(Box<Attention>),
    /// Multi-latent attention with a query latent.
    Latent(Box<LatentAttention>),
    /// Multi-latent attention with queries projected directly.
    LatentKv(Box<LatentKvAttention>),
}

/// What a [`SelfAttention`] is built from.
#[derive(Debug, Clone)]
pub enum SelfAttentionSpec {
    /// The fused projection's attention.
    Fused(AttentionSpec),
    /// MLA with a query latent.
    Latent(LatentAttentionSpec),
    /// MLA without one.
    LatentKv(LatentKvAttentionSpec),
}

/// What [`SelfAttention::forward`] keeps: its variant's.
#[derive(Clone)]
pub enum SelfAttentionSaved {
    /// The fused projection's attention's.
    Fused(Box<AttentionSaved>),
    /// MLA's with a query latent.
    Latent(Box<LatentAttentionSaved>),
    /// MLA's without one.
    LatentKv(Box<LatentKvAttentionSaved>),
    /// Nothing: a decoding forward of MLA (its compressed cache holds what later steps read;
    /// there is no backward).
    Decoded,
}

impl Module for SelfAttention {
    type Spec = SelfAttentionSpec;
    type Saved = SelfAttentionSaved;
    /// Every variant ends in its row-parallel output projection.
    const GRADIENT_FEEDS_PRODUCTS: bool = <Attention as Module>::GRADIENT_FEEDS_PRODUCTS
        && <LatentAttention as Module>::GRADIENT_FEEDS_PRODUCTS
        && <LatentKvAttention as Module>::GRADIENT_FEEDS_PRODUCTS;
    const CAPTURABLE: bool = <Attention as Module>::CAPTURABLE
        && <LatentAttention as Module>::CAPTURABLE
        && <LatentKvAttention as Module>::CAPTURABLE;

    fn build(spec: &SelfAttentionSpec, b: &mut Builder) -> Result<Self> {
        Ok(match spec {
            SelfAttentionSpec::Fused(s) => SelfAttention::Fused(Box::new(Attention::build(s, b)?)),
            SelfAttentionSpec::Latent(s) => {
                SelfAttention::Latent(Box::new(LatentAttention::build(s, b)?))
            }
            SelfAttentionSpec::LatentKv(s) => {
                SelfAttention::LatentKv(Box::new(LatentKvAttention::build(s, b)?))
            }
        })
    }

    fn visit_params<'s>(&'s self, f: &mut dyn FnMut(&'s Param)) {
        match self {
            SelfAttention::Fused(m) => m.visit_params(f),
            SelfAttention::Latent(m) => m.visit_params(f),
            SelfAttention::LatentKv(m) => m.visit_params(f),
        }
    }

    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        match self {
            SelfAttention::Fused(m) => m.visit_params_mut(f),
            SelfAttention::Latent(m) => m.visit_params_mut(f),
            SelfAttention::LatentKv(m) => m.visit_params_mut(f),
        }
    }
}

impl SelfAttentionSpec {
    /// The output projection's spec, whichever the variant.
    pub fn proj(&self) -> &LinearSpec {
        match self {
            SelfAttentionSpec::Fused(s) => &s.proj,
            SelfAttentionSpec::Latent(s) => &s.proj,
            SelfAttentionSpec::LatentKv(s) => &s.proj,
        }
    }

    /// The fused projection's attention's spec, if the layer has it.
    pub fn fused(&self) -> Option<&AttentionSpec> {
        match self {
            SelfAttentionSpec::Fused(s) => Some(s),
            _ => None,
        }
    }
}

impl SelfAttention {
    /// The fused projection's attention, if the layer has it.
    pub fn fused(&self) -> Option<&Attention> {
        match self {
            SelfAttention::Fused(m) => Some(m),
            _ => None,
        }
    }

    /// Runs the variant; decoding with a KV cache, multi-latent attention keeps its compressed
    /// cache ([`crate::mla_decode`]).
    pub fn forward(&self, cx: &Cx, site: Site, x: &Tensor) -> Result<(Tensor, SelfAttentionSaved)> {
        if cx.kv_cache().is_some() {
            match self {
                SelfAttention::Latent(m) => {
                    return Ok((m.decode(cx, site, x)?, SelfAttentionSaved::Decoded));
                }
                SelfAttention::LatentKv(m) => {
                    return Ok((m.decode(cx, site, x)?, SelfAttentionSaved::Decoded));
                }
                SelfAttention::Fused(_) => {}
            }
        }
        Ok(match self {
            SelfAttention::Fused(m) => {
                let (y, s) = m.forward(cx, site, x)?;
                (y, SelfAttentionSaved::Fused(Box::new(s)))
            }
            SelfAttention::Latent(m) => {
                let (y, s) = m.forward(cx, site, x)?;
                (y, SelfAttentionSaved::Latent(Box::new(s)))
            }
            SelfAttention::LatentKv(m) => {
                let (y, s) = m.forward(cx, site, x)?;
                (y, SelfAttentionSaved::LatentKv(Box::new(s)))
            }
        })
    }

    /// The backward of [`SelfAttention::forward`].
    pub fn backward(
        &self,
        cx: &Cx,
        site: Site,
        saved: SelfAttentionSaved,
        dy: &Tensor,
    ) -> Result<Tensor> {
        match (self, saved) {
            (SelfAttention::Fused(m), SelfAttentionSaved::Fused(s)) => m.backward(cx, site, *s, dy),
            (SelfAttention::Latent(m), SelfAttentionSaved::Latent(s)) => {
                m.backward(cx, site, *s, dy)
            }
            (SelfAttention::LatentKv(m), SelfAttentionSaved::LatentKv(s)) => {
                m.backward(cx, site, *s, dy)
            }
            (_, SelfAttentionSaved::Decoded) => {
                megatron_core::invalid!("a decoding forward has no backward")
            }
            _ => megatron_core::invalid!(
                "a SelfAttention backward got what another variant's forward saved"
            ),
        }
    }

    /// [`SelfAttention::backward`] plus `plus`, another gradient of the input.
    pub fn backward_plus(
        &self,
        cx: &Cx,
        site: Site,
        saved: SelfAttentionSaved,
        dy: &Tensor,
        plus: &Tensor,
    ) -> Result<Tensor> {
        let dx = self.backward(cx, site, saved, dy)?;
        megatron_core::ops::add(plus, &dx)
    }
}
