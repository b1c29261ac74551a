//! A MoE layer's step on host f32 (Megatron-LM's `MoELayer` with the all-to-all dispatcher and
//! grouped experts): the router's gating product and routing, the dispatch over the
//! expert-parallel group, the local experts, the weighted combine; and its backward, with the
//! router's losses added through their backward scale.

use crate::comm::Communicator;
use crate::error::Result;
use crate::invalid;
use crate::kernels::gemm::{MatMut, MatRef, gemm};
use crate::tensor::Tensor;

use super::dispatcher::{
    CombineSaved, Dispatch, combine, combine_backward, dispatch, dispatch_backward,
};
use super::experts::{ExpertShape, ExpertsSaved, experts_backward, experts_forward};
use super::{RouterConfig, Routing, route, route_backward};

/// A MoE layer's parameters on one rank: the router's gate `[experts, hidden]` (every rank
/// holds it whole) and the rank's local experts' `fc1`, `fc2` (see [`super::experts`]).
#[derive(Debug, Clone, Copy)]
pub struct MoeWeights<'a> {
    /// `[experts, hidden]`.
    pub gate: &'a [f32],
    /// `[local experts, ffn, hidden]`.
    pub fc1: &'a [f32],
    /// `[local experts, hidden, ffn]`.
    pub fc2: &'a [f32],
}

/// Gradients of [`MoeWeights`], accumulated (`+=`).
#[derive(Debug)]
pub struct MoeGrads<'a> {
    /// Of the gate.
    pub gate: &'a mut [f32],
    /// Of the local experts' fc1.
    pub fc1: &'a mut [f32],
    /// Of the local experts' fc2.
    pub fc2: &'a mut [f32],
}

/// What the layer's backward needs of its forward.
#[derive(Debug, Clone)]
pub struct MoeSaved {
    x: Vec<f32>,
    logits: Vec<f32>,
    /// The routing (probabilities, map, counts, losses).
    pub routing: Routing,
    plan: Dispatch,
    experts: ExpertsSaved,
    combined: CombineSaved,
}

/// `C = op(A) · op(B) + β·C` for row-major `A` (`am × ak`) and `B` (`bm × bk`), each
/// transposed when its flag says so.
fn product(
    a: &[f32],
    (am, ak, a_t): (usize, usize, bool),
    b: &[f32],
    (bm, bk, b_t): (usize, usize, bool),
    beta: f32,
    c: &mut [f32],
) -> Result<()> {
    let a = MatRef::row_major(a, am, ak)?;
    let b = MatRef::row_major(b, bm, bk)?;
    let (a, b) = (if a_t { a.t() } else { a }, if b_t { b.t() } else { b });
    let (m, n) = (a.rows(), b.cols());
    gemm(1.0, a, b, beta, MatMut::row_major(c, m, n)?)?;
    Ok(())
}

/// The layer on `x` (`[tokens, hidden]`, tokens in `[seq, batch]` order, sequences of `seq`):
/// returns `[tokens, hidden]`. A collective of the expert-parallel group `ep`, whose rank r
/// holds experts r·L .. (r + 1)·L.
pub fn moe_forward(
    ep: &dyn Communicator,
    config: &RouterConfig,
    shape: &ExpertShape,
    x: &[f32],
    seq: usize,
    weights: MoeWeights<'_>,
    expert_bias: Option<&[f32]>,
) -> Result<(Vec<f32>, MoeSaved)> {
    let (e, h) = (config.num_experts, shape.hidden);
    if shape.experts * ep.size() != e {
        return invalid!(
            "{} local experts on each of {} expert-parallel ranks are not --num-experts {e}",
            shape.experts,
            ep.size()
        );
    }
    if weights.gate.len() != e * h || !x.len().is_multiple_of(h) {
        return invalid!(
            "the router's gate has {} values ({e} experts × hidden {h} need {}) for an input \
             of {} values",
            weights.gate.len(),
            e * h,
            x.len()
        );
    }
    let tokens = x.len() / h;
    let mut logits = vec![0.0f32; tokens * e];
    product(
        x,
        (tokens, h, false),
        weights.gate,
        (e, h, true),
        0.0,
        &mut logits,
    )?;
    let routing = route(&logits, seq, config, expert_bias)
        .map_err(|err| crate::Error::Invalid(err.to_string()))?;
    let (rows, plan) = dispatch(ep, &Tensor::from_slice(x, [tokens, h])?, &routing)?;
    let (y, experts) = experts_forward(
        shape,
        &rows.to_vec::<f32>()?,
        &plan.rows_per_local_expert(),
        weights.fc1,
        weights.fc2,
    )?;
    let y = Tensor::from_vec(y, [plan.rows(), h])?;
    let (out, combined) = combine(ep, &plan, &y, &routing)?;
    Ok((
        out.to_vec::<f32>()?,
        MoeSaved {
            x: x.to_vec(),
            logits,
            routing,
            plan,
            experts,
            combined,
        },
    ))
}

/// The backward of [`moe_forward`] from the output's gradient `dout`: accumulates the
/// parameters' gradients into `grads` and returns the input's gradient. The router's aux and z
/// losses enter with `loss_scale` (the main loss's backward scale).
#[allow(clippy::too_many_arguments)]
pub fn moe_backward(
    ep: &dyn Communicator,
    config: &RouterConfig,
    shape: &ExpertShape,
    saved: &MoeSaved,
    dout: &[f32],
    loss_scale: f32,
    weights: MoeWeights<'_>,
    grads: MoeGrads<'_>,
) -> Result<Vec<f32>> {
    let (e, h) = (config.num_experts, shape.hidden);
    let tokens = saved.x.len() / h;
    let plan = &saved.plan;
    let (dy, dprobs) = combine_backward(
        ep,
        plan,
        &saved.combined,
        &saved.routing,
        &Tensor::from_slice(dout, [tokens, h])?,
    )?;
    let drows = experts_backward(
        shape,
        &saved.experts,
        &dy.to_vec::<f32>()?,
        (weights.fc1, weights.fc2),
        (grads.fc1, grads.fc2),
    )?;
    let dx = dispatch_backward(ep, plan, &Tensor::from_vec(drows, [plan.rows(), h])?)?;
    let mut dx = dx.to_vec::<f32>()?;
    let dlogits = route_backward(&saved.routing, &saved.logits, &dprobs, loss_scale, config)
        .map_err(|err| crate::Error::Invalid(err.to_string()))?;
    // logits = x · gateᵀ: dgate += dlogitsᵀ · x, dx += dlogits · gate.
    product(
        &dlogits,
        (tokens, e, true),
        &saved.x,
        (tokens, h, false),
        1.0,
        grads.gate,
    )?;
    product(
        &dlogits,
        (tokens, e, false),
        weights.gate,
        (e, h, false),
        1.0,
        &mut dx,
    )?;
    Ok(dx)
}
