//! The all-to-all token dispatcher (Megatron-LM's `MoEAlltoAllTokenDispatcher`), on host f32
//! tensors: a rank's tokens are permuted so that each expert's are contiguous (expert-major,
//! token order within), the per-expert counts are exchanged over the expert-parallel group,
//! the rows go to the ranks that hold their experts in one all-to-all with uneven splits, and
//! the received chunks are sorted by local expert, so every local expert's rows are contiguous
//! for one grouped product. [`combine`] runs the same way back and sums each token's expert
//! outputs weighted by its routing probabilities; the backwards are the transposes.
//!
//! The experts are split evenly over the group: rank r holds experts r·L .. (r + 1)·L.

use crate::comm::Communicator;
use crate::error::Result;
use crate::invalid;
use crate::tensor::{DType, Tensor};

use super::Routing;

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
    /// The pairs in the order they were sent: (token, global expert), expert-major.
    pairs: Vec<(usize, usize)>,
    /// Rows sent to each rank of the group.
    send: Vec<usize>,
    /// Rows received from each rank.
    recv: Vec<usize>,
    /// Rows received from each rank for each local expert: `[ranks, local experts]`.
    recv_per_expert: Vec<usize>,
}

impl Dispatch {
    /// Rows each local expert received (the grouped product's group sizes).
    pub fn rows_per_local_expert(&self) -> Vec<usize> {
        let ranks = self.recv.len();
        (0..self.local_experts)
            .map(|le| {
                (0..ranks)
                    .map(|r| self.recv_per_expert[r * self.local_experts + le])
                    .sum()
            })
            .collect()
    }

    /// Rows this rank received (all local experts).
    pub fn rows(&self) -> usize {
        self.recv.iter().sum()
    }

    /// Rows this rank sent and received, for the all-to-alls' byte counts.
    pub fn sent_and_received(&self) -> (usize, usize) {
        (self.send.iter().sum(), self.rows())
    }

    /// The received rows' order after sorting by local expert: for each position, the
    /// position it had in the all-to-all's output (ranks in order, each rank's chunk
    /// expert-major).
    fn sorted_order(&self) -> Vec<usize> {
        let (ranks, l) = (self.recv.len(), self.local_experts);
        let mut start = vec![0usize; ranks * l];
        let mut at = 0;
        for r in 0..ranks {
            for le in 0..l {
                start[r * l + le] = at;
                at += self.recv_per_expert[r * l + le];
            }
        }
        let mut order = Vec::with_capacity(at);
        for le in 0..l {
            for r in 0..ranks {
                let s = start[r * l + le];
                order.extend(s..s + self.recv_per_expert[r * l + le]);
            }
        }
        order
    }
}

/// Rows `order[i]` of `rows` (`[n, hidden]`) to row i, or with `inverse` row i to row
/// `order[i]`.
fn gather_rows(rows: &[f32], hidden: usize, order: &[usize], inverse: bool) -> Vec<f32> {
    let mut out = vec![0.0f32; order.len() * hidden];
    for (i, &o) in order.iter().enumerate() {
        let (to, from) = if inverse { (o, i) } else { (i, o) };
        out[to * hidden..(to + 1) * hidden]
            .copy_from_slice(&rows[from * hidden..(from + 1) * hidden]);
    }
    out
}

fn counts_tensor(counts: &[usize]) -> Result<Tensor> {
    Ok(Tensor::from_vec(
        counts.iter().map(|&c| c as i64).collect::<Vec<_>>(),
        [counts.len()],
    )?)
}

/// Sends `x` (`[tokens, hidden]` or `[seq, batch, hidden]`, f32) to the experts `routing`
/// chose: returns the rows each
/// local expert of this rank received (`[rows, hidden]`, local-expert-major) and the plan.
/// A collective of the expert-parallel group `ep`.
pub fn dispatch(
    ep: &dyn Communicator,
    x: &Tensor,
    routing: &Routing,
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
    let counts_out = Tensor::zeros([ranks * local_experts], DType::I64);
    ep.all_to_all(
        &counts_tensor(per_expert)?,
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
    let plan = Dispatch {
        shape,
        tokens,
        hidden,
        experts,
        local_experts,
        pairs,
        send,
        recv,
        recv_per_expert,
    };
    let x = x.to_f32_contiguous()?.to_vec::<f32>()?;
    let order: Vec<usize> = plan.pairs.iter().map(|&(t, _)| t).collect();
    let permuted = gather_rows(&x, hidden, &order, false);
    let received = exchange(ep, &permuted, hidden, &plan.send, &plan.recv)?;
    let sorted = gather_rows(&received, hidden, &plan.sorted_order(), false);
    Ok((Tensor::from_vec(sorted, [plan.rows(), hidden])?, plan))
}

/// One all-to-all of rows of `hidden` values with the given row counts.
fn exchange(
    ep: &dyn Communicator,
    rows: &[f32],
    hidden: usize,
    send: &[usize],
    recv: &[usize],
) -> Result<Vec<f32>> {
    let send_elems: Vec<usize> = send.iter().map(|&r| r * hidden).collect();
    let recv_elems: Vec<usize> = recv.iter().map(|&r| r * hidden).collect();
    let input = Tensor::from_slice(rows, [rows.len()])?;
    let output = Tensor::zeros([recv_elems.iter().sum::<usize>()], DType::F32);
    ep.all_to_all(&input, &send_elems, &output, &recv_elems)?;
    Ok(output.to_vec::<f32>()?)
}

/// The experts' outputs as [`combine`] brought them back, kept for its backward.
#[derive(Debug, Clone, PartialEq)]
pub struct CombineSaved {
    rows: Vec<f32>,
}

/// Brings the experts' outputs `y` (`[rows, hidden]`, as [`dispatch`] gave the rows) back to
/// their tokens and sums them weighted by the routing probabilities (shaped as the dispatched
/// input), and
/// what [`combine_backward`] needs.
pub fn combine(
    ep: &dyn Communicator,
    plan: &Dispatch,
    y: &Tensor,
    routing: &Routing,
) -> Result<(Tensor, CombineSaved)> {
    let rows = returned_rows(ep, plan, y)?;
    let h = plan.hidden;
    let mut out = vec![0.0f32; plan.tokens * h];
    for (i, &(t, e)) in plan.pairs.iter().enumerate() {
        let p = routing.probs[t * plan.experts + e];
        for (o, &v) in out[t * h..(t + 1) * h]
            .iter_mut()
            .zip(&rows[i * h..(i + 1) * h])
        {
            *o += p * v;
        }
    }
    Ok((
        Tensor::from_vec(out, plan.shape.clone())?,
        CombineSaved { rows },
    ))
}

/// The experts' outputs back on the rank that sent their rows, in the order it sent them.
fn returned_rows(ep: &dyn Communicator, plan: &Dispatch, y: &Tensor) -> Result<Vec<f32>> {
    if y.dims() != [plan.rows(), plan.hidden] {
        return invalid!(
            "the experts' output has shape {}, the dispatch gave [{}, {}]",
            y.shape(),
            plan.rows(),
            plan.hidden
        );
    }
    let y = y.to_f32_contiguous()?.to_vec::<f32>()?;
    let unsorted = gather_rows(&y, plan.hidden, &plan.sorted_order(), true);
    exchange(ep, &unsorted, plan.hidden, &plan.recv, &plan.send)
}

/// The backward of [`combine`]: from the tokens' output gradient `dout` (`[tokens, hidden]`),
/// the gradient of the experts' outputs (laid out as they were) and of the routing
/// probabilities (`[tokens, experts]`, zero where a token did not go).
pub fn combine_backward(
    ep: &dyn Communicator,
    plan: &Dispatch,
    saved: &CombineSaved,
    routing: &Routing,
    dout: &Tensor,
) -> Result<(Tensor, Vec<f32>)> {
    let rows = &saved.rows;
    let h = plan.hidden;
    let dout = dout.to_f32_contiguous()?.to_vec::<f32>()?;
    if dout.len() != plan.tokens * h {
        return invalid!(
            "the combined output's gradient has {} values, {} tokens × {h} need {}",
            dout.len(),
            plan.tokens,
            plan.tokens * h
        );
    }
    let mut drows = vec![0.0f32; plan.pairs.len() * h];
    let mut dprobs = vec![0.0f32; plan.tokens * plan.experts];
    for (i, &(t, e)) in plan.pairs.iter().enumerate() {
        let p = routing.probs[t * plan.experts + e];
        let (d, row) = (&dout[t * h..(t + 1) * h], &rows[i * h..(i + 1) * h]);
        dprobs[t * plan.experts + e] = d.iter().zip(row).map(|(a, b)| a * b).sum();
        for (o, &g) in drows[i * h..(i + 1) * h].iter_mut().zip(d) {
            *o = p * g;
        }
    }
    let received = exchange(ep, &drows, h, &plan.send, &plan.recv)?;
    let sorted = gather_rows(&received, h, &plan.sorted_order(), false);
    Ok((Tensor::from_vec(sorted, [plan.rows(), h])?, dprobs))
}

/// The backward of [`dispatch`]: the gradient of the dispatched rows (`[rows, hidden]`) back
/// to the tokens, each token's copies summed (shaped as the dispatched input).
pub fn dispatch_backward(ep: &dyn Communicator, plan: &Dispatch, drows: &Tensor) -> Result<Tensor> {
    let rows = returned_rows(ep, plan, drows)?;
    let h = plan.hidden;
    let mut dx = vec![0.0f32; plan.tokens * h];
    for (i, &(t, _)) in plan.pairs.iter().enumerate() {
        for (o, &g) in dx[t * h..(t + 1) * h]
            .iter_mut()
            .zip(&rows[i * h..(i + 1) * h])
        {
            *o += g;
        }
    }
    Ok(Tensor::from_vec(dx, plan.shape.clone())?)
}
