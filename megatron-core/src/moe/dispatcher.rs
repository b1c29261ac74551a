//! The token dispatchers, on f32 tensors where the tokens are: the rows and their index tables
//! live on the tokens' device (moved by the device seam's `RowOps`, `crate::backend`), and only
//! the counts come to the host, for the all-to-alls' splits and the experts' group sizes. The
//! experts are split evenly over the expert-parallel group (rank r holds experts r·L .. (r + 1)·L):
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
//! probabilities; the backwards are the transposes. Each token's rows are named by a slot table
//! (`[tokens, experts]`: the row of each pair, −1 where the token does not go), so a token's
//! sum runs over its experts in order, whichever device computes it.

use crate::backend::{self, Backend};
use crate::comm::{Communicator, ReduceOp};
use crate::error::Result;
use crate::invalid;
use crate::tensor::{DType, Tensor};

use super::PlacedRouting;

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
#[derive(Debug, Clone)]
pub struct Dispatch {
    /// The tokens' shape (`[tokens, hidden]`, or `[seq, batch, hidden]`), which the combine's
    /// output and the input's gradient take.
    shape: Vec<usize>,
    tokens: usize,
    hidden: usize,
    experts: usize,
    local_experts: usize,
    /// The slot table, on the tokens' device: with the all-to-all dispatcher `[tokens,
    /// experts]`, each pair's row in the order sent; with the all-gather one `[ranks · tokens,
    /// experts]`, each local expert's pair's row among this rank's rows.
    slots: Tensor,
    route: Route,
}

/// What each dispatcher remembers besides the slots.
#[derive(Debug, Clone)]
enum Route {
    AllToAll {
        /// Rows sent to each rank of the group.
        send: Vec<usize>,
        /// Rows received from each rank.
        recv: Vec<usize>,
        /// Rows received from each rank for each local expert: `[ranks, local experts]`.
        recv_per_expert: Vec<usize>,
        /// The same counts where the rows are (what sorts them by local expert).
        counts: Tensor,
    },
    AllGather {
        /// Rows of each local expert.
        per_expert: Vec<usize>,
        /// The gathered probabilities `[ranks · tokens, experts]`, where the rows are.
        probs: Tensor,
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
            Route::AllGather { per_expert, .. } => per_expert.iter().sum(),
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

/// `t` (on the host: counts and routing values) on `like`'s device, where the communicators of a
/// GPU run move tensors.
pub(crate) fn placed(t: Tensor, like: &Tensor) -> Result<Tensor> {
    crate::backend::of(like).place(&t)
}

/// The i64 counts `t` holds, read back to the host.
pub(crate) fn counts_of(t: &Tensor) -> Result<Vec<usize>> {
    Ok(t.to_vec::<i64>()?
        .iter()
        .map(|&c| c.max(0) as usize)
        .collect())
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
    routing: &PlacedRouting,
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
    let ops = backend::of(x);
    let tokens_2d = || -> Result<Tensor> { Ok(x.to_f32_contiguous()?.reshape([tokens, hidden])?) };
    let plan = |(rows, slots, route)| {
        (
            rows,
            Dispatch {
                shape: shape.clone(),
                tokens,
                hidden,
                experts,
                local_experts,
                slots,
                route,
            },
        )
    };
    match kind {
        DispatcherKind::AllToAll => {
            let routed: usize = routing.tokens_per_expert.iter().sum();
            let rows = match permuted {
                Some(p) => {
                    // Checked before any collective, so that every rank stops here alike.
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
            all_to_all_dispatch(ep, ops, rows, hidden, routing, local_experts).map(plan)
        }
        DispatcherKind::AllGather => {
            all_gather_dispatch(ep, ops, &tokens_2d()?, hidden, routing, local_experts).map(plan)
        }
    }
}

/// What the all-to-all dispatcher sends from: the tokens (`[tokens, hidden]`), or the rows the
/// device's router laid out expert-major.
enum Rows<'a> {
    Tokens(Tensor),
    Permuted(&'a Tensor),
}

/// The all-to-all dispatcher's forward: the rows, sorted by local expert, the slot table and the
/// route.
fn all_to_all_dispatch(
    ep: &dyn Communicator,
    ops: &dyn Backend,
    x: Rows<'_>,
    hidden: usize,
    routing: &PlacedRouting,
    local_experts: usize,
) -> Result<(Tensor, Tensor, Route)> {
    let (ranks, experts) = (ep.size(), routing.experts);
    let per_expert = &routing.tokens_per_expert;
    let routed: usize = per_expert.iter().sum();
    let (slots, source) = ops.expert_slots(&routing.map, 0..experts, routed)?;
    let send: Vec<usize> = per_expert
        .chunks(local_experts)
        .map(|c| c.iter().sum())
        .collect();
    // The counts first: each rank learns how many rows of each of its experts come from whom
    // (the one read-back of the dispatch).
    let counts = Tensor::zeros_near([ranks * local_experts], DType::I64, &routing.counts)?;
    let splits = vec![local_experts; ranks];
    ep.all_to_all(&routing.counts, &splits, &counts, &splits)?;
    let recv_per_expert = counts_of(&counts)?;
    let recv: Vec<usize> = recv_per_expert
        .chunks_exact(local_experts)
        .map(|c| c.iter().sum())
        .collect();
    let permuted = match x {
        Rows::Tokens(x) => ops.gather_rows(&x, hidden, &source)?,
        Rows::Permuted(rows) => rows.narrow(0, 0, routed)?,
    };
    let flat = permuted.reshape([routed * hidden])?;
    let received = exchange_tensor(ep, &flat, hidden, (&send, &recv), &flat)?;
    let rows: usize = recv.iter().sum();
    let order = ops.chunk_order(&counts, local_experts, rows, false)?;
    let sorted = ops.gather_rows(&received, hidden, &order)?;
    let route = Route::AllToAll {
        send,
        recv,
        recv_per_expert,
        counts,
    };
    Ok((sorted, slots, route))
}

/// The all-gather dispatcher's forward: every rank's tokens and routing gathered over `ep`, the
/// rows of this rank's experts taken from them (local-expert-major, gathered-token order).
fn all_gather_dispatch(
    ep: &dyn Communicator,
    ops: &dyn Backend,
    x: &Tensor,
    hidden: usize,
    routing: &PlacedRouting,
    local_experts: usize,
) -> Result<(Tensor, Tensor, Route)> {
    let (ranks, experts, tokens) = (ep.size(), routing.experts, routing.tokens);
    let all_x = gather_tensor(ep, &x.reshape([tokens * hidden])?, DType::F32, x)?;
    let all_probs = gather_tensor(ep, &flat(&routing.probs)?, DType::F32, x)?
        .reshape([ranks * tokens, experts])?;
    let all_map = gather_tensor(ep, &flat(&routing.map)?, DType::I64, x)?
        .reshape([ranks * tokens, experts])?;
    // This rank's experts' group sizes, counted where the map is (the one read-back).
    let mine = ep.index() * local_experts..(ep.index() + 1) * local_experts;
    let per_expert = counts_of(&ops.column_counts(&all_map, mine.clone())?)?;
    let rows = per_expert.iter().sum();
    let (slots, source) = ops.expert_slots(&all_map, mine, rows)?;
    let own = ops.gather_rows(&all_x, hidden, &source)?;
    let route = Route::AllGather {
        per_expert,
        probs: all_probs,
        ranks,
    };
    Ok((own, slots, route))
}

/// `t` contiguous and flat.
fn flat(t: &Tensor) -> Result<Tensor> {
    Ok(t.contiguous()?.reshape([t.numel()])?)
}

/// Every rank's flat `input` (equal lengths, of `dtype`, on `like`'s device) gathered over
/// `ep`, in rank order.
fn gather_tensor(
    ep: &dyn Communicator,
    input: &Tensor,
    dtype: DType,
    like: &Tensor,
) -> Result<Tensor> {
    let output = Tensor::zeros_near([input.numel() * ep.size()], dtype, like)?;
    ep.all_gather(input, &output)?;
    Ok(output)
}

/// The sum over `ep` of the flat `input` (`ranks` equal parts, on `like`'s device), this rank's
/// part of it.
fn reduce_scatter_tensor(ep: &dyn Communicator, input: &Tensor, like: &Tensor) -> Result<Tensor> {
    let output = Tensor::zeros_near([input.numel() / ep.size().max(1)], DType::F32, like)?;
    ep.reduce_scatter(input, &output, ReduceOp::Sum)?;
    Ok(output)
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
    routing: &PlacedRouting,
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
        probs: Option<&Tensor>,
    ) -> Result<(Tensor, Tensor)> {
        let (h, ops) = (self.hidden, backend::of(y));
        match &self.route {
            Route::AllToAll {
                send, recv, counts, ..
            } => {
                let unsorted = ops.gather_rows(y, h, &self.unsort(ops, counts)?)?;
                let flat = unsorted.reshape([self.rows() * h])?;
                let rows = exchange_tensor(ep, &flat, h, (recv, send), y)?;
                Ok((ops.sum_rows(&rows, h, &self.slots, probs)?, rows))
            }
            Route::AllGather {
                probs: gathered,
                ranks,
                ..
            } => {
                let weights = probs.map(|_| gathered);
                let all = ops.sum_rows(y, h, &self.slots, weights)?;
                let all = all.reshape([ranks * self.tokens * h])?;
                Ok((reduce_scatter_tensor(ep, &all, y)?, y.clone()))
            }
        }
    }

    /// The received rows' positions once sorted by local expert (the index that puts sorted
    /// rows back in the order they arrived).
    fn unsort(&self, ops: &dyn Backend, counts: &Tensor) -> Result<Tensor> {
        ops.chunk_order(counts, self.local_experts, self.rows(), true)
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
/// experts]`, zero where a token did not go), both where `dout` lives.
pub fn combine_backward(
    ep: &dyn Communicator,
    plan: &Dispatch,
    saved: &CombineSaved,
    routing: &PlacedRouting,
    dout: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let (h, like) = (plan.hidden, dout);
    if dout.numel() != plan.tokens * h {
        return invalid!(
            "the combined output's gradient has {} values, {} tokens × {h} need {}",
            dout.numel(),
            plan.tokens,
            plan.tokens * h
        );
    }
    let dout = dout.to_f32_contiguous()?.reshape([plan.tokens, h])?;
    let ops = backend::of(&dout);
    match &plan.route {
        Route::AllToAll {
            send, recv, counts, ..
        } => {
            let dprobs = ops.row_dots(&dout, &saved.rows, h, &plan.slots)?;
            let sent: usize = send.iter().sum();
            let drows = ops.scale_rows(&dout, h, &plan.slots, &routing.probs, sent)?;
            let flat = drows.reshape([sent * h])?;
            let received = exchange_tensor(ep, &flat, h, (send, recv), like)?;
            let order = ops.chunk_order(counts, plan.local_experts, plan.rows(), false)?;
            Ok((ops.gather_rows(&received, h, &order)?, dprobs))
        }
        Route::AllGather { probs, ranks, .. } => {
            // Every rank's output gradient, the local experts' rows' gradients from it, and the
            // probabilities' gradients (each pair's on its expert's rank) summed back to the
            // tokens' ranks.
            let all = gather_tensor(ep, &flat(&dout)?, DType::F32, like)?
                .reshape([ranks * plan.tokens, h])?;
            let dots = ops.row_dots(&all, &saved.rows, h, &plan.slots)?;
            let drows = ops.scale_rows(&all, h, &plan.slots, probs, plan.rows())?;
            let dprobs = reduce_scatter_tensor(ep, &flat(&dots)?, like)?
                .reshape([plan.tokens, plan.experts])?;
            Ok((drows, dprobs))
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
