//! The token dispatchers, on f32 tensors where the tokens are (the rows moved by the device's
//! `RowOps` (the device seam, `crate::backend`), the plans on the host); the experts are split evenly over the
//! expert-parallel group (rank r holds experts r·L .. (r + 1)·L):
//!
//! - all-to-all (Megatron-LM's `MoEAlltoAllTokenDispatcher`): a rank's tokens are permuted so
//!   that each expert's are contiguous (expert-major, token order within), the per-expert
//!   counts are exchanged over the group, the rows go to the ranks that hold their experts in
//!   one all-to-all with uneven splits, and the received chunks are sorted by local expert, so
//!   every local expert's rows are contiguous for one grouped product;
//! - all-gather (`MoEAllGatherTokenDispatcher`): every rank gathers all the group's tokens and
//!   routings and takes the rows of its local experts; the combine sums the weighted outputs
//!   into the gathered tokens and reduce-scatters them back.
//!
//! [`combine`] brings the experts' outputs back and sums each token's, weighted by its routing
//! probabilities; the backwards are the transposes.

use crate::backend::{self, Backend};
use crate::comm::{Communicator, ReduceOp};
use crate::error::Result;
use crate::invalid;
use crate::tensor::{DType, Tensor};

use super::Routing;

/// How tokens reach their experts (`--moe-token-dispatcher-type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DispatcherKind {
    /// Rows sent to their experts' ranks by all-to-alls with uneven splits.
    #[default]
    AllToAll,
    /// Every rank gathers all tokens, keeps its experts' rows; outputs reduce-scattered back.
    AllGather,
}

/// Where a micro-batch's (token, expert) pairs went: what [`combine`] and the backwards need.
#[derive(Debug, Clone, PartialEq)]
pub struct Dispatch {
    /// The tokens' shape (`[tokens, hidden]`, or `[seq, batch, hidden]`), which the combine's
    /// output and the input's gradient take.
    shape: Vec<usize>,
    tokens: usize,
    hidden: usize,
    experts: usize,
    local_experts: usize,
    route: Route,
}

/// What each dispatcher remembers.
#[derive(Debug, Clone, PartialEq)]
enum Route {
    AllToAll {
        /// The pairs in the order they were sent: (token, global expert), expert-major.
        pairs: Vec<(usize, usize)>,
        /// Rows sent to each rank of the group.
        send: Vec<usize>,
        /// Rows received from each rank.
        recv: Vec<usize>,
        /// Rows received from each rank for each local expert: `[ranks, local experts]`.
        recv_per_expert: Vec<usize>,
    },
    AllGather {
        /// The local experts' pairs, local-expert-major: (gathered token, global expert).
        pairs: Vec<(usize, usize)>,
        /// Rows of each local expert.
        per_expert: Vec<usize>,
        /// The gathered probabilities `[ranks · tokens, experts]`.
        probs: Vec<f32>,
        /// Ranks of the group.
        ranks: usize,
    },
}

impl Dispatch {
    /// Rows each local expert received (the grouped product's group sizes).
    pub fn rows_per_local_expert(&self) -> Vec<usize> {
        match &self.route {
            Route::AllToAll {
                recv,
                recv_per_expert,
                ..
            } => (0..self.local_experts)
                .map(|le| {
                    (0..recv.len())
                        .map(|r| recv_per_expert[r * self.local_experts + le])
                        .sum()
                })
                .collect(),
            Route::AllGather { per_expert, .. } => per_expert.clone(),
        }
    }

    /// Rows this rank received (all local experts).
    pub fn rows(&self) -> usize {
        match &self.route {
            Route::AllToAll { recv, .. } => recv.iter().sum(),
            Route::AllGather { pairs, .. } => pairs.len(),
        }
    }

    /// With the all-to-all dispatcher, the rows this rank sent and received, for the
    /// all-to-alls' byte counts; with the all-gather one, the tokens it sent and received.
    pub fn sent_and_received(&self) -> (usize, usize) {
        match &self.route {
            Route::AllToAll { send, .. } => (send.iter().sum(), self.rows()),
            Route::AllGather { ranks, .. } => (self.tokens, self.tokens * ranks),
        }
    }
}

/// The received rows' order after sorting by local expert (`local` of them; `recv_per_expert`
/// is `[ranks, local]`): for each position, the position it had in the all-to-all's output
/// (ranks in order, each rank's chunk expert-major).
pub(crate) fn sorted_order(recv_per_expert: &[usize], local: usize) -> Vec<usize> {
    let ranks = recv_per_expert.len() / local.max(1);
    let mut start = vec![0usize; ranks * local];
    let mut at = 0;
    for r in 0..ranks {
        for le in 0..local {
            start[r * local + le] = at;
            at += recv_per_expert[r * local + le];
        }
    }
    let mut order = Vec::with_capacity(at);
    for le in 0..local {
        for r in 0..ranks {
            let s = start[r * local + le];
            order.extend(s..s + recv_per_expert[r * local + le]);
        }
    }
    order
}

/// The inverse of the permutation `order`: `inverse[order[i]] = i`.
pub(crate) fn inverse(order: &[usize]) -> Vec<usize> {
    let mut inverse = vec![0usize; order.len()];
    for (i, &o) in order.iter().enumerate() {
        inverse[o] = i;
    }
    inverse
}

fn counts_tensor(counts: &[usize], like: &Tensor) -> Result<Tensor> {
    placed(
        Tensor::from_vec(
            counts.iter().map(|&c| c as i64).collect::<Vec<_>>(),
            [counts.len()],
        )?,
        like,
    )
}

/// `t` (on the host: counts and routing values) on `like`'s device, where the communicators of a
/// GPU run move tensors.
pub(crate) fn placed(t: Tensor, like: &Tensor) -> Result<Tensor> {
    crate::backend::of(like).place(&t)
}

/// Sends `x` (`[tokens, hidden]` or `[seq, batch, hidden]`, f32) to the experts `routing`
/// chose, by the dispatcher `kind`: returns the rows each local expert of this rank received
/// (`[rows, hidden]`, local-expert-major) and the plan. A collective of the expert-parallel
/// group `ep`. `permuted`, when given, is `x` already laid out expert-major by the device
/// (`[at least the routed rows, hidden]`, f32: [`super::RouterOutput::permuted`]), which the
/// all-to-all sends as it is.
pub fn dispatch(
    ep: &dyn Communicator,
    kind: DispatcherKind,
    x: &Tensor,
    routing: &Routing,
    permuted: Option<&Tensor>,
) -> Result<(Tensor, Dispatch)> {
    let (ranks, experts) = (ep.size(), routing.experts);
    if experts % ranks != 0 {
        return invalid!(
            "{experts} experts do not split over an expert-parallel group of {ranks} ranks"
        );
    }
    let tokens = routing.tokens;
    let shape = x.dims().to_vec();
    let hidden = shape.last().copied().unwrap_or(0);
    if shape.len() < 2 || shape[..shape.len() - 1].iter().product::<usize>() != tokens {
        return invalid!(
            "the dispatcher takes [tokens, hidden] of {tokens} tokens, got {}",
            x.shape()
        );
    }
    let local_experts = experts / ranks;
    let like = x;
    let ops = backend::of(x);
    let tokens_2d = || -> Result<Tensor> { Ok(x.to_f32_contiguous()?.reshape([tokens, hidden])?) };
    let plan = |route| Dispatch {
        shape: shape.clone(),
        tokens,
        hidden,
        experts,
        local_experts,
        route,
    };
    match kind {
        DispatcherKind::AllToAll => {
            let rows = match permuted {
                Some(p) => {
                    // Checked before any collective, so that every rank stops here alike.
                    let routed: usize = routing.tokens_per_expert.iter().sum();
                    let dims = p.dims();
                    if dims.len() != 2 || dims[1] != hidden || dims[0] < routed {
                        return invalid!(
                            "the permuted tokens are {}, the routing sends {routed} rows of \
                             {hidden}",
                            p.shape()
                        );
                    }
                    Rows::Permuted(p)
                }
                None => Rows::Tokens(tokens_2d()?),
            };
            let (rows, route) =
                all_to_all_dispatch(ep, ops, rows, hidden, routing, local_experts, like)?;
            Ok((rows, plan(route)))
        }
        DispatcherKind::AllGather => {
            let x = tokens_2d()?;
            let (rows, route) =
                all_gather_dispatch(ep, ops, &x, hidden, routing, local_experts, like)?;
            Ok((rows, plan(route)))
        }
    }
}

/// What the all-to-all dispatcher sends from: the tokens (`[tokens, hidden]`), or the rows the
/// device's router laid out expert-major.
enum Rows<'a> {
    Tokens(Tensor),
    Permuted(&'a Tensor),
}

/// The all-to-all dispatcher's forward: the rows, sorted by local expert, and its route.
fn all_to_all_dispatch(
    ep: &dyn Communicator,
    ops: &dyn Backend,
    x: Rows<'_>,
    hidden: usize,
    routing: &Routing,
    local_experts: usize,
    like: &Tensor,
) -> Result<(Tensor, Route)> {
    let (ranks, experts, tokens) = (ep.size(), routing.experts, routing.tokens);
    let mut pairs = Vec::new();
    for e in 0..experts {
        for t in 0..tokens {
            if routing.map[t * experts + e] {
                pairs.push((t, e));
            }
        }
    }
    let per_expert = &routing.tokens_per_expert;
    let send: Vec<usize> = (0..ranks)
        .map(|r| {
            per_expert[r * local_experts..(r + 1) * local_experts]
                .iter()
                .sum()
        })
        .collect();
    // The counts first: each rank learns how many rows of each of its experts come from whom.
    let counts_out = Tensor::zeros_near([ranks * local_experts], DType::I64, like)?;
    ep.all_to_all(
        &counts_tensor(per_expert, like)?,
        &vec![local_experts; ranks],
        &counts_out,
        &vec![local_experts; ranks],
    )?;
    let recv_per_expert: Vec<usize> = counts_out
        .to_vec::<i64>()?
        .iter()
        .map(|&c| c as usize)
        .collect();
    let recv: Vec<usize> = recv_per_expert
        .chunks_exact(local_experts)
        .map(|c| c.iter().sum())
        .collect();
    let permuted = match x {
        Rows::Tokens(x) => {
            let order: Vec<usize> = pairs.iter().map(|&(t, _)| t).collect();
            ops.gather_rows(&x, hidden, &order)?
                .reshape([pairs.len() * hidden])?
        }
        Rows::Permuted(rows) => rows
            .narrow(0, 0, pairs.len())?
            .reshape([pairs.len() * hidden])?,
    };
    let received = exchange_tensor(ep, &permuted, hidden, (&send, &recv), like)?;
    let sorted = ops.gather_rows(
        &received,
        hidden,
        &sorted_order(&recv_per_expert, local_experts),
    )?;
    let route = Route::AllToAll {
        pairs,
        send,
        recv,
        recv_per_expert,
    };
    Ok((sorted, route))
}

/// The all-gather dispatcher's forward: every rank's tokens and routing gathered over `ep`, the
/// rows of this rank's experts taken from them (local-expert-major, gathered-token order).
fn all_gather_dispatch(
    ep: &dyn Communicator,
    ops: &dyn Backend,
    x: &Tensor,
    hidden: usize,
    routing: &Routing,
    local_experts: usize,
    like: &Tensor,
) -> Result<(Tensor, Route)> {
    let (ranks, experts, tokens) = (ep.size(), routing.experts, routing.tokens);
    let all_x = gather_tensor(ep, &x.reshape([tokens * hidden])?, like)?;
    let all_probs = gather(ep, &routing.probs, like)?;
    let map: Vec<f32> = routing
        .map
        .iter()
        .map(|&m| f32::from(u8::from(m)))
        .collect();
    let all_map = gather(ep, &map, like)?;
    let first = ep.index() * local_experts;
    let mut pairs = Vec::new();
    let mut per_expert = Vec::with_capacity(local_experts);
    for e in first..first + local_experts {
        let before = pairs.len();
        for t in 0..ranks * tokens {
            if all_map[t * experts + e] > 0.5 {
                pairs.push((t, e));
            }
        }
        per_expert.push(pairs.len() - before);
    }
    let order: Vec<usize> = pairs.iter().map(|&(t, _)| t).collect();
    let rows = ops.gather_rows(&all_x, hidden, &order)?;
    Ok((
        rows,
        Route::AllGather {
            pairs,
            per_expert,
            probs: all_probs,
            ranks,
        },
    ))
}

/// Every rank's flat `input` (equal lengths, on `like`'s device) gathered over `ep`, in rank
/// order.
fn gather_tensor(ep: &dyn Communicator, input: &Tensor, like: &Tensor) -> Result<Tensor> {
    let output = Tensor::zeros_near([input.numel() * ep.size()], DType::F32, like)?;
    ep.all_gather(input, &output)?;
    Ok(output)
}

/// [`gather_tensor`] of host `values` (the routing), read back.
fn gather(ep: &dyn Communicator, values: &[f32], like: &Tensor) -> Result<Vec<f32>> {
    let input = placed(Tensor::from_slice(values, [values.len()])?, like)?;
    Ok(gather_tensor(ep, &input, like)?.to_vec::<f32>()?)
}

/// The sum over `ep` of the flat `input` (`ranks` equal parts, on `like`'s device), this rank's
/// part of it.
fn reduce_scatter_tensor(ep: &dyn Communicator, input: &Tensor, like: &Tensor) -> Result<Tensor> {
    let output = Tensor::zeros_near([input.numel() / ep.size().max(1)], DType::F32, like)?;
    ep.reduce_scatter(input, &output, ReduceOp::Sum)?;
    Ok(output)
}

/// [`reduce_scatter_tensor`] of host `values` (the routing weights' gradients), read back.
fn reduce_scatter(ep: &dyn Communicator, values: &[f32], like: &Tensor) -> Result<Vec<f32>> {
    let input = placed(Tensor::from_slice(values, [values.len()])?, like)?;
    Ok(reduce_scatter_tensor(ep, &input, like)?.to_vec::<f32>()?)
}

/// One all-to-all of the flat rows `input` (rows of `hidden`, on `like`'s device) with the
/// given row counts (sent, received): the received rows, flat.
fn exchange_tensor(
    ep: &dyn Communicator,
    input: &Tensor,
    hidden: usize,
    (send, recv): (&[usize], &[usize]),
    like: &Tensor,
) -> Result<Tensor> {
    let send_elems: Vec<usize> = send.iter().map(|&r| r * hidden).collect();
    let recv_elems: Vec<usize> = recv.iter().map(|&r| r * hidden).collect();
    let output = Tensor::zeros_near([recv_elems.iter().sum::<usize>()], DType::F32, like)?;
    ep.all_to_all(input, &send_elems, &output, &recv_elems)?;
    Ok(output)
}

/// The experts' outputs as [`combine`] had them, kept for its backward: with the all-to-all
/// dispatcher the rows brought back (flat, in the order they were sent), with the all-gather one
/// the local experts' own rows.
#[derive(Debug, Clone)]
pub struct CombineSaved {
    rows: Tensor,
}

/// Brings the experts' outputs `y` (`[rows, hidden]`, as [`dispatch`] gave the rows) back to
/// their tokens and sums them weighted by the routing probabilities (shaped as the dispatched
/// input), and what [`combine_backward`] needs.
pub fn combine(
    ep: &dyn Communicator,
    plan: &Dispatch,
    y: &Tensor,
    routing: &Routing,
) -> Result<(Tensor, CombineSaved)> {
    let y = plan.check_rows(y, "the experts' output")?;
    let (out, rows) = plan.to_tokens(ep, &y, Some(&routing.probs))?;
    Ok((out.reshape(plan.shape.clone())?, CombineSaved { rows }))
}

impl Dispatch {
    /// The way back of the local experts' rows `y` (`[rows, hidden]`, laid out as the dispatch
    /// gave them): each token's rows summed, weighted by its routing probabilities (`probs`,
    /// this rank's `[tokens, experts]`) or not (`None`); with the all-to-all dispatcher, the
    /// rows first go back to the ranks that sent them (and are returned as they arrived, in
    /// sending order), with the all-gather one, the sums over the gathered tokens are
    /// reduce-scattered (and `y` is returned). A collective of `ep`, on `y`'s device.
    fn to_tokens(
        &self,
        ep: &dyn Communicator,
        y: &Tensor,
        probs: Option<&[f32]>,
    ) -> Result<(Tensor, Tensor)> {
        let (h, e, ops) = (self.hidden, self.experts, backend::of(y));
        match &self.route {
            Route::AllToAll {
                pairs,
                send,
                recv,
                recv_per_expert,
            } => {
                let order = sorted_order(recv_per_expert, self.local_experts);
                let unsorted = ops.gather_rows(y, h, &inverse(&order))?;
                let flat = unsorted.reshape([order.len() * h])?;
                let rows = exchange_tensor(ep, &flat, h, (recv, send), y)?;
                let entries: Vec<(usize, f32)> = pairs
                    .iter()
                    .map(|&(t, x)| (t, probs.map_or(1.0, |p| p[t * e + x])))
                    .collect();
                Ok((ops.sum_rows(&rows, h, &entries, self.tokens)?, rows))
            }
            Route::AllGather {
                pairs,
                probs: gathered,
                ranks,
                ..
            } => {
                let entries: Vec<(usize, f32)> = pairs
                    .iter()
                    .map(|&(t, x)| (t, probs.map_or(1.0, |_| gathered[t * e + x])))
                    .collect();
                let all = ops.sum_rows(y, h, &entries, ranks * self.tokens)?;
                let all = all.reshape([ranks * self.tokens * h])?;
                Ok((reduce_scatter_tensor(ep, &all, y)?, y.clone()))
            }
        }
    }

    /// `y` as contiguous f32, checked to be the plan's `[rows, hidden]`.
    fn check_rows(&self, y: &Tensor, what: &str) -> Result<Tensor> {
        if y.dims() != [self.rows(), self.hidden] {
            return invalid!(
                "{what} has shape {}, the dispatch gave [{}, {}]",
                y.shape(),
                self.rows(),
                self.hidden
            );
        }
        Ok(y.to_f32_contiguous()?)
    }
}

/// The backward of [`combine`]: from the tokens' output gradient `dout`, the gradient of the
/// experts' outputs (laid out as they were) and of the routing probabilities (`[tokens,
/// experts]`, zero where a token did not go).
pub fn combine_backward(
    ep: &dyn Communicator,
    plan: &Dispatch,
    saved: &CombineSaved,
    routing: &Routing,
    dout: &Tensor,
) -> Result<(Tensor, Vec<f32>)> {
    let (h, e, like) = (plan.hidden, plan.experts, dout);
    if dout.numel() != plan.tokens * h {
        return invalid!(
            "the combined output's gradient has {} values, {} tokens × {h} need {}",
            dout.numel(),
            plan.tokens,
            plan.tokens * h
        );
    }
    let dout = dout.to_f32_contiguous()?.reshape([plan.tokens * h])?;
    let ops = backend::of(&dout);
    match &plan.route {
        Route::AllToAll {
            pairs,
            send,
            recv,
            recv_per_expert,
        } => {
            let tokens: Vec<usize> = pairs.iter().map(|&(t, _)| t).collect();
            let dots = ops.row_dots(&dout, &saved.rows, h, &tokens)?;
            let mut dprobs = vec![0.0f32; plan.tokens * e];
            for (&(t, x), dot) in pairs.iter().zip(dots) {
                dprobs[t * e + x] = dot;
            }
            let entries: Vec<(usize, f32)> = pairs
                .iter()
                .map(|&(t, x)| (t, routing.probs[t * e + x]))
                .collect();
            let drows = ops.scale_rows(&dout, h, &entries)?;
            let flat = drows.reshape([pairs.len() * h])?;
            let received = exchange_tensor(ep, &flat, h, (send, recv), like)?;
            let order = sorted_order(recv_per_expert, plan.local_experts);
            Ok((ops.gather_rows(&received, h, &order)?, dprobs))
        }
        Route::AllGather {
            pairs,
            probs,
            ranks,
            ..
        } => {
            // Every rank's output gradient, the local experts' rows' gradients from it, and the
            // probabilities' gradients (each pair's on its expert's rank) summed back to the
            // tokens' ranks.
            let all = gather_tensor(ep, &dout, like)?;
            let tokens: Vec<usize> = pairs.iter().map(|&(t, _)| t).collect();
            let dots = ops.row_dots(&all, &saved.rows, h, &tokens)?;
            let mut dprobs = vec![0.0f32; ranks * plan.tokens * e];
            for (&(t, x), dot) in pairs.iter().zip(dots) {
                dprobs[t * e + x] = dot;
            }
            let entries: Vec<(usize, f32)> =
                pairs.iter().map(|&(t, x)| (t, probs[t * e + x])).collect();
            let drows = ops.scale_rows(&all, h, &entries)?;
            Ok((drows, reduce_scatter(ep, &dprobs, like)?))
        }
    }
}

/// The backward of [`dispatch`]: the gradient of the dispatched rows (`[rows, hidden]`) back
/// to the tokens, each token's copies summed (shaped as the dispatched input).
pub fn dispatch_backward(ep: &dyn Communicator, plan: &Dispatch, drows: &Tensor) -> Result<Tensor> {
    let drows = plan.check_rows(drows, "the rows' gradient")?;
    let (dx, _) = plan.to_tokens(ep, &drows, None)?;
    Ok(dx.reshape(plan.shape.clone())?)
}
