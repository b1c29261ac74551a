//! The token dispatchers, on host f32 tensors; the experts are split evenly over the
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

/// Rows `order[i]` of `rows` (`[n, hidden]`) to row i, or with `inverse` row i to row
/// `order[i]`.
pub(crate) fn gather_rows(rows: &[f32], hidden: usize, order: &[usize], inverse: bool) -> Vec<f32> {
    let mut out = vec![0.0f32; order.len() * hidden];
    for (i, &o) in order.iter().enumerate() {
        let (to, from) = if inverse { (o, i) } else { (i, o) };
        out[to * hidden..(to + 1) * hidden]
            .copy_from_slice(&rows[from * hidden..(from + 1) * hidden]);
    }
    out
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

/// `t` (on the host) on `like`'s device: the communicators of a GPU run move device tensors,
/// and the layers after the dispatcher expect theirs there. (The dispatcher computes on the
/// host: on a GPU, each step copies its rows there and back.)
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
    let host = || -> Result<Vec<f32>> { Ok(x.to_f32_contiguous()?.to_vec::<f32>()?) };
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
                None => Rows::Tokens(host()?),
            };
            let (rows, route) =
                all_to_all_dispatch(ep, rows, hidden, routing, local_experts, like)?;
            let plan = plan(route);
            let n = plan.rows();
            Ok((placed(Tensor::from_vec(rows, [n, hidden])?, like)?, plan))
        }
        DispatcherKind::AllGather => {
            let (rows, route) =
                all_gather_dispatch(ep, &host()?, hidden, routing, local_experts, like)?;
            let plan = plan(route);
            let n = plan.rows();
            Ok((placed(Tensor::from_vec(rows, [n, hidden])?, like)?, plan))
        }
    }
}

/// What the all-to-all dispatcher sends from: the tokens on the host, or the rows the device
/// laid out expert-major.
enum Rows<'a> {
    Tokens(Vec<f32>),
    Permuted(&'a Tensor),
}

/// The all-to-all dispatcher's forward: the rows, sorted by local expert, and its route.
fn all_to_all_dispatch(
    ep: &dyn Communicator,
    x: Rows<'_>,
    hidden: usize,
    routing: &Routing,
    local_experts: usize,
    like: &Tensor,
) -> Result<(Vec<f32>, Route)> {
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
            placed(
                Tensor::from_vec(
                    gather_rows(&x, hidden, &order, false),
                    [pairs.len() * hidden],
                )?,
                like,
            )?
        }
        Rows::Permuted(rows) => rows
            .narrow(0, 0, pairs.len())?
            .reshape([pairs.len() * hidden])?,
    };
    let received = exchange_tensor(ep, &permuted, hidden, (&send, &recv), like)?;
    let sorted = gather_rows(
        &received,
        hidden,
        &sorted_order(&recv_per_expert, local_experts),
        false,
    );
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
    x: &[f32],
    hidden: usize,
    routing: &Routing,
    local_experts: usize,
    like: &Tensor,
) -> Result<(Vec<f32>, Route)> {
    let (ranks, experts, tokens) = (ep.size(), routing.experts, routing.tokens);
    let all_x = gather(ep, x, like)?;
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
    let rows = gather_rows(&all_x, hidden, &order, false);
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

/// Every rank's `values` (equal lengths) gathered over `ep`, in rank order (through `like`'s
/// device).
fn gather(ep: &dyn Communicator, values: &[f32], like: &Tensor) -> Result<Vec<f32>> {
    let input = placed(Tensor::from_slice(values, [values.len()])?, like)?;
    let output = Tensor::zeros_near([values.len() * ep.size()], DType::F32, like)?;
    ep.all_gather(&input, &output)?;
    Ok(output.to_vec::<f32>()?)
}

/// The sum over `ep` of `values` (`ranks` equal parts), this rank's part of it (through
/// `like`'s device).
fn reduce_scatter(ep: &dyn Communicator, values: &[f32], like: &Tensor) -> Result<Vec<f32>> {
    let input = placed(Tensor::from_slice(values, [values.len()])?, like)?;
    let output = Tensor::zeros_near([values.len() / ep.size().max(1)], DType::F32, like)?;
    ep.reduce_scatter(&input, &output, ReduceOp::Sum)?;
    Ok(output.to_vec::<f32>()?)
}

/// One all-to-all of rows of `hidden` values with the given row counts (sent, received),
/// through `like`'s device.
fn exchange(
    ep: &dyn Communicator,
    rows: &[f32],
    hidden: usize,
    counts: (&[usize], &[usize]),
    like: &Tensor,
) -> Result<Vec<f32>> {
    let input = placed(Tensor::from_slice(rows, [rows.len()])?, like)?;
    exchange_tensor(ep, &input, hidden, counts, like)
}

/// [`exchange`] of the rows `input` (flat, on `like`'s device).
fn exchange_tensor(
    ep: &dyn Communicator,
    input: &Tensor,
    hidden: usize,
    (send, recv): (&[usize], &[usize]),
    like: &Tensor,
) -> Result<Vec<f32>> {
    let send_elems: Vec<usize> = send.iter().map(|&r| r * hidden).collect();
    let recv_elems: Vec<usize> = recv.iter().map(|&r| r * hidden).collect();
    let output = Tensor::zeros_near([recv_elems.iter().sum::<usize>()], DType::F32, like)?;
    ep.all_to_all(input, &send_elems, &output, &recv_elems)?;
    Ok(output.to_vec::<f32>()?)
}

/// The experts' outputs as [`combine`] had them, kept for its backward: with the all-to-all
/// dispatcher the rows brought back (in the order they were sent), with the all-gather one the
/// local experts' own rows.
#[derive(Debug, Clone, PartialEq)]
pub struct CombineSaved {
    rows: Vec<f32>,
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
    let y_values = plan.check_rows(y, "the experts' output")?;
    let (out, rows) = plan.to_tokens(ep, y_values, Some(&routing.probs), y)?;
    Ok((
        placed(Tensor::from_vec(out, plan.shape.clone())?, y)?,
        CombineSaved { rows },
    ))
}

impl Dispatch {
    /// The way back of the local experts' rows `y` (laid out as the dispatch gave them): each
    /// token's rows summed, weighted by its routing probabilities (`probs`, this rank's
    /// `[tokens, experts]`) or not (`None`); with the all-to-all dispatcher, the rows first go
    /// back to the ranks that sent them (and are returned as they arrived, in sending order),
    /// with the all-gather one, the sums over the gathered tokens are reduce-scattered (and `y`
    /// is returned). A collective of `ep`, through `like`'s device.
    fn to_tokens(
        &self,
        ep: &dyn Communicator,
        y: Vec<f32>,
        probs: Option<&[f32]>,
        like: &Tensor,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let (h, e) = (self.hidden, self.experts);
        match &self.route {
            Route::AllToAll {
                pairs,
                send,
                recv,
                recv_per_expert,
            } => {
                let order = sorted_order(recv_per_expert, self.local_experts);
                let unsorted = gather_rows(&y, h, &order, true);
                let rows = exchange(ep, &unsorted, h, (recv, send), like)?;
                let mut out = vec![0.0f32; self.tokens * h];
                for (i, &(t, x)) in pairs.iter().enumerate() {
                    let p = probs.map_or(1.0, |p| p[t * e + x]);
                    axpy(&mut out[t * h..(t + 1) * h], p, &rows[i * h..(i + 1) * h]);
                }
                Ok((out, rows))
            }
            Route::AllGather {
                pairs,
                probs: gathered,
                ranks,
                ..
            } => {
                let mut all = vec![0.0f32; ranks * self.tokens * h];
                for (i, &(t, x)) in pairs.iter().enumerate() {
                    let p = probs.map_or(1.0, |_| gathered[t * e + x]);
                    axpy(&mut all[t * h..(t + 1) * h], p, &y[i * h..(i + 1) * h]);
                }
                Ok((reduce_scatter(ep, &all, like)?, y))
            }
        }
    }
}

/// `out += a · x`.
fn axpy(out: &mut [f32], a: f32, x: &[f32]) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o += a * v;
    }
}

impl Dispatch {
    /// `y`'s values, checked to be the plan's `[rows, hidden]`.
    fn check_rows(&self, y: &Tensor, what: &str) -> Result<Vec<f32>> {
        if y.dims() != [self.rows(), self.hidden] {
            return invalid!(
                "{what} has shape {}, the dispatch gave [{}, {}]",
                y.shape(),
                self.rows(),
                self.hidden
            );
        }
        Ok(y.to_f32_contiguous()?.to_vec::<f32>()?)
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
    let rows = &saved.rows;
    let (h, e, like) = (plan.hidden, plan.experts, dout);
    let dout = dout.to_f32_contiguous()?.to_vec::<f32>()?;
    if dout.len() != plan.tokens * h {
        return invalid!(
            "the combined output's gradient has {} values, {} tokens × {h} need {}",
            dout.len(),
            plan.tokens,
            plan.tokens * h
        );
    }
    match &plan.route {
        Route::AllToAll {
            pairs,
            send,
            recv,
            recv_per_expert,
        } => {
            let mut drows = vec![0.0f32; pairs.len() * h];
            let mut dprobs = vec![0.0f32; plan.tokens * e];
            for (i, &(t, x)) in pairs.iter().enumerate() {
                let p = routing.probs[t * e + x];
                let (d, row) = (&dout[t * h..(t + 1) * h], &rows[i * h..(i + 1) * h]);
                dprobs[t * e + x] = dot(d, row);
                axpy(&mut drows[i * h..(i + 1) * h], p, d);
            }
            let received = exchange(ep, &drows, h, (send, recv), like)?;
            let order = sorted_order(recv_per_expert, plan.local_experts);
            let sorted = gather_rows(&received, h, &order, false);
            Ok((
                placed(Tensor::from_vec(sorted, [plan.rows(), h])?, like)?,
                dprobs,
            ))
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
            let all = gather(ep, &dout, like)?;
            let mut drows = vec![0.0f32; pairs.len() * h];
            let mut dprobs = vec![0.0f32; ranks * plan.tokens * e];
            for (i, &(t, x)) in pairs.iter().enumerate() {
                let d = &all[t * h..(t + 1) * h];
                dprobs[t * e + x] = dot(d, &rows[i * h..(i + 1) * h]);
                axpy(&mut drows[i * h..(i + 1) * h], probs[t * e + x], d);
            }
            let dprobs = reduce_scatter(ep, &dprobs, like)?;
            Ok((
                placed(Tensor::from_vec(drows, [plan.rows(), h])?, like)?,
                dprobs,
            ))
        }
    }
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// The backward of [`dispatch`]: the gradient of the dispatched rows (`[rows, hidden]`) back
/// to the tokens, each token's copies summed (shaped as the dispatched input).
pub fn dispatch_backward(ep: &dyn Communicator, plan: &Dispatch, drows: &Tensor) -> Result<Tensor> {
    let values = plan.check_rows(drows, "the rows' gradient")?;
    let (dx, _) = plan.to_tokens(ep, values, None, drows)?;
    placed(Tensor::from_vec(dx, plan.shape.clone())?, drows)
}
