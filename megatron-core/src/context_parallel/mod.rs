//! Context parallelism (`--context-parallel-size`, Megatron-LM's): every activation's sequence is
//! split over the ranks of a context-parallel group, and attention, the one layer that mixes
//! positions, exchanges keys and values over it.
//!
//! The layout is Megatron-LM's load balance for causal attention (`get_batch_on_this_cp_rank`):
//! a sequence of `s` positions is cut into `2·cp` chunks of `s / (2·cp)`, and cp rank `r` holds
//! chunks `r` and `2·cp − 1 − r`, one early and one late, so that every rank's queries see about
//! as many keys. Positions (learned, rotary) are the global ones; the loss of a token is where
//! its rank computes it, summed with the others' over the data×context-parallel group.
//!
//! Attention here is Transformer Engine's `all_gather` form: the ranks' keys and values (with
//! their queries: one exchange of the fused projection) are all-gathered into the whole
//! sequence, each local chunk's queries attend to the keys up to their own positions, and in
//! the backward the gradients of every position's key and value are summed over the group
//! (each rank keeping its chunks'). Attention dropout draws the CPU's mask of each element of
//! the whole `[b, heads, s, s]` weights at the element's global place, as cp 1 does. The ring
//! (`p2p`) and the head all-to-all (`a2a`) are not built yet.

use std::ops::Range;

use crate::comm::{Communicator, ReduceOp};
use crate::error::Result;
use crate::invalid;
use crate::kernels::dropout::{LogicalIndex, dropout_forward, dropout_pair};
use crate::kernels::gemm::product;
use crate::kernels::softmax::{self, KeyMask};
use crate::rng::DropoutStream;
use crate::tensor::{DType, Tensor};

/// Attention dropout under context parallelism: the drop probability, the random stream, and
/// where this rank's heads lie among all of them (all heads, the first of this rank's).
#[derive(Debug, Clone, Copy)]
pub struct CpDropout {
    /// Drop probability.
    pub p: f32,
    /// The random stream of the call.
    pub stream: DropoutStream,
    /// Heads of the whole layer.
    pub all_heads: usize,
    /// The global index of this rank's first head.
    pub first_head: usize,
}

impl CpDropout {
    /// Where the weights of local head `h` of batch entry `b`, queries `rows` (global
    /// positions) against the first keys, lie in the whole `[b, all heads, s, s]` weights.
    fn index(
        &self,
        (b, h): (usize, usize),
        rows: &Range<usize>,
        keys: usize,
        s: usize,
    ) -> LogicalIndex {
        LogicalIndex {
            outer: rows.len(),
            inner: keys,
            logical_stride: s as u64,
            logical_start: (((b * self.all_heads + self.first_head + h) * s + rows.start) * s)
                as u64,
        }
    }
}

/// Where a context-parallel rank's positions lie: its two chunks of the sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpChunks {
    /// The context-parallel size.
    pub size: usize,
    /// This rank's index in the group.
    pub rank: usize,
    /// Positions per chunk (`s / (2·cp)`).
    pub chunk: usize,
}

impl CpChunks {
    /// The chunks of a sequence of `seq` positions on rank `rank` of `size`; an error naming the
    /// numbers when `2·size` does not divide it.
    pub fn new(seq: usize, size: usize, rank: usize) -> Result<CpChunks> {
        if size == 0 || !seq.is_multiple_of(2 * size) {
            return invalid!(
                "context parallelism cuts each sequence into 2·cp = {} chunks: --seq-length \
                 {seq} is not divisible by it",
                2 * size
            );
        }
        Ok(CpChunks {
            size,
            rank,
            chunk: seq / (2 * size),
        })
    }

    /// The chunks of a rank holding `local` positions (two chunks).
    pub fn of_local(local: usize, size: usize, rank: usize) -> Result<CpChunks> {
        CpChunks::new(local * size, size, rank)
    }

    /// The whole sequence's positions.
    pub fn seq(&self) -> usize {
        2 * self.size * self.chunk
    }

    /// The global positions of this rank's two chunks, in local order.
    pub fn ranges(&self) -> [Range<usize>; 2] {
        self.ranges_of(self.rank)
    }

    /// The global positions of rank `rank`'s two chunks.
    fn ranges_of(&self, rank: usize) -> [Range<usize>; 2] {
        let c = self.chunk;
        let late = 2 * self.size - 1 - rank;
        [rank * c..(rank + 1) * c, late * c..(late + 1) * c]
    }

    /// This rank's rows of `x` (`[s, ..]`, the whole sequence first): `[2·chunk, ..]`.
    pub fn take_local(&self, x: &Tensor) -> Result<Tensor> {
        if x.dims().first() != Some(&self.seq()) {
            return invalid!(
                "context parallelism: a sequence of shape {} is not the {} positions of the \
                 chunks",
                x.shape(),
                self.seq()
            );
        }
        let mut dims = x.dims().to_vec();
        dims[0] = 2 * self.chunk;
        let out = Tensor::empty_near(dims, x.dtype(), x)?;
        for (k, r) in self.ranges().into_iter().enumerate() {
            out.narrow(0, k * self.chunk, self.chunk)?
                .copy_from(&x.narrow(0, r.start, self.chunk)?)?;
        }
        Ok(out)
    }
}

/// What [`attention_forward`] keeps for [`attention_backward`]: the whole sequence's fused
/// projection and each local chunk's attention weights.
#[derive(Debug, Clone)]
pub struct CpAttentionSaved {
    chunks: CpChunks,
    whole: Vec<f32>,
    probs: [Vec<f32>; 2],
    batch: usize,
    heads: usize,
    head_dim: usize,
    dropout: Option<CpDropout>,
}

/// Offset of element `e` of part `part` (0 q, 1 k, 2 v) of head `head` at position `pos` and
/// batch entry `b` in `[s, batch, heads·3·d]`.
fn at(
    pos: usize,
    b: usize,
    head: usize,
    part: usize,
    (batch, heads, d): (usize, usize, usize),
) -> usize {
    (((pos * batch + b) * heads + head) * 3 + part) * d
}

/// Causal attention of this rank's two chunks of a fused projection `qkv` (`[2·chunk, batch,
/// heads·3·d]`, per head `[q | k | v]`, the local rows of the whole sequence in chunk order),
/// the keys and values all-gathered over `cp`, with attention dropout when given: returns the
/// context `[2·chunk, batch, heads·d]`.
pub fn attention_forward(
    cp: &dyn Communicator,
    chunks: CpChunks,
    qkv: &Tensor,
    (heads, scale): (usize, f32),
    dropout: Option<CpDropout>,
) -> Result<(Tensor, CpAttentionSaved)> {
    let [local, batch, width] = qkv.dims() else {
        return invalid!(
            "context-parallel attention: fused QKV must be [sequence, batch, width], got {}",
            qkv.shape()
        );
    };
    let (local, batch, width) = (*local, *batch, *width);
    if local != 2 * chunks.chunk || heads == 0 || !width.is_multiple_of(3 * heads) {
        return invalid!(
            "context-parallel attention: QKV of shape {} is not 2 chunks of {} positions × \
             {heads} heads × 3 parts",
            qkv.shape(),
            chunks.chunk
        );
    }
    if qkv.gpu().is_some() {
        return invalid!("context parallelism runs on the CPU (the GPU's is not built yet)");
    }
    let d = width / (3 * heads);
    let dims = (batch, heads, d);
    // Every rank's rows, then the whole sequence in order.
    let mine = qkv.to_f32_contiguous()?.reshape([local * batch * width])?;
    let gathered = Tensor::zeros_near([chunks.size * local * batch * width], DType::F32, &mine)?;
    cp.all_gather(&mine, &gathered)?;
    let gathered = gathered.to_vec::<f32>()?;
    let row = batch * width;
    let mut whole = vec![0.0f32; chunks.seq() * row];
    for rank in 0..chunks.size {
        for (k, r) in chunks.ranges_of(rank).into_iter().enumerate() {
            let from = (rank * local + k * chunks.chunk) * row;
            whole[r.start * row..r.end * row]
                .copy_from_slice(&gathered[from..from + chunks.chunk * row]);
        }
    }
    let mut out = vec![0.0f32; local * batch * heads * d];
    let mut probs = [Vec::new(), Vec::new()];
    for (k, r) in chunks.ranges().into_iter().enumerate() {
        let keys = r.end;
        let c = chunks.chunk;
        let mut p = vec![0.0f32; batch * heads * c * keys];
        for b in 0..batch {
            for h in 0..heads {
                let bh = b * heads + h;
                let [q, kk, v] = head_rows(&whole, r.clone(), b, h, dims);
                let scores = &mut p[bh * c * keys..(bh + 1) * c * keys];
                product(&q, (c, d, false), &kk, (keys, d, true), 0.0, scores)?;
                let raw = scores.to_vec();
                // The chunk's queries are the last c of the keys' positions: causal as is.
                softmax::softmax_forward(&raw, 1, c, keys, scale, KeyMask::Causal, scores)?;
                let mut dropped = Vec::new();
                if let Some(drop) = &dropout {
                    dropped = vec![0.0f32; c * keys];
                    let index = drop.index((b, h), &r, keys, chunks.seq());
                    dropout_forward(scores, &mut dropped, drop.p, &drop.stream, index)?;
                }
                let weights: &[f32] = if dropout.is_some() { &dropped } else { scores };
                let mut ctx = vec![0.0f32; c * d];
                product(
                    weights,
                    (c, keys, false),
                    &v,
                    (keys, d, false),
                    0.0,
                    &mut ctx,
                )?;
                for i in 0..c {
                    let to = (((k * c + i) * batch + b) * heads + h) * d;
                    out[to..to + d].copy_from_slice(&ctx[i * d..(i + 1) * d]);
                }
            }
        }
        probs[k] = p;
    }
    let out = Tensor::from_vec(out, [local, batch, heads * d])?;
    Ok((
        out,
        CpAttentionSaved {
            chunks,
            whole,
            probs,
            batch,
            heads,
            head_dim: d,
            dropout,
        },
    ))
}

/// The gradient of [`attention_forward`]'s fused projection (`[2·chunk, batch, heads·3·d]`)
/// from the context's `d_out`: each local chunk's query, key and value gradients over the whole
/// sequence, summed over `cp` (every rank's queries reach other ranks' keys), this rank's rows
/// kept.
pub fn attention_backward(
    cp: &dyn Communicator,
    saved: &CpAttentionSaved,
    d_out: &Tensor,
    scale: f32,
) -> Result<Tensor> {
    let CpAttentionSaved {
        chunks,
        whole,
        probs,
        batch,
        heads,
        head_dim: d,
        dropout,
    } = saved;
    let (batch, heads, d, c) = (*batch, *heads, *d, chunks.chunk);
    let dims = (batch, heads, d);
    let local = 2 * c;
    if d_out.numel() != local * batch * heads * d {
        return invalid!(
            "context-parallel attention: output gradient of shape {} does not fit [{local}, \
             {batch}, {}]",
            d_out.shape(),
            heads * d
        );
    }
    let dy = d_out.to_vec_f32()?;
    let width = heads * 3 * d;
    let mut grad = vec![0.0f32; chunks.seq() * batch * width];
    for (k, r) in chunks.ranges().into_iter().enumerate() {
        let keys = r.end;
        for b in 0..batch {
            for h in 0..heads {
                let bh = b * heads + h;
                let p = &probs[k][bh * c * keys..(bh + 1) * c * keys];
                let [q, kk, v] = head_rows(whole, r.clone(), b, h, dims);
                let mut g = vec![0.0f32; c * d];
                for i in 0..c {
                    let from = (((k * c + i) * batch + b) * heads + h) * d;
                    g[i * d..(i + 1) * d].copy_from_slice(&dy[from..from + d]);
                }
                // dP = dY·Vᵀ, dV = Pᵀ·dY, dS = softmax'(dP), dQ = dS·K, dK = dSᵀ·Q.
                let mut dp = vec![0.0f32; c * keys];
                product(&g, (c, d, false), &v, (keys, d, true), 0.0, &mut dp)?;
                // With dropout: dP through the mask, dV from the dropped weights (the mask
                // regenerated from its key).
                let mut dropped = Vec::new();
                if let Some(drop) = dropout {
                    let index = drop.index((b, h), &r, keys, chunks.seq());
                    let (mut pm, mut dpm) = (vec![0.0f32; c * keys], vec![0.0f32; c * keys]);
                    dropout_pair(p, &mut pm, &dp, &mut dpm, drop.p, &drop.stream, index)?;
                    dropped = pm;
                    dp = dpm;
                }
                let weights: &[f32] = if dropout.is_some() { &dropped } else { p };
                let mut dv = vec![0.0f32; keys * d];
                product(weights, (c, keys, true), &g, (c, d, false), 0.0, &mut dv)?;
                let mut ds = vec![0.0f32; c * keys];
                softmax::softmax_backward(p, &dp, 1, c, keys, scale, &mut ds)?;
                let mut dq = vec![0.0f32; c * d];
                product(&ds, (c, keys, false), &kk, (keys, d, false), 0.0, &mut dq)?;
                let mut dk = vec![0.0f32; keys * d];
                product(&ds, (c, keys, true), &q, (c, d, false), 0.0, &mut dk)?;
                add_rows(&mut grad, &dq, r.clone(), b, h, 0, dims);
                add_rows(&mut grad, &dk, 0..keys, b, h, 1, dims);
                add_rows(&mut grad, &dv, 0..keys, b, h, 2, dims);
            }
        }
    }
    let grad = Tensor::from_vec(grad, [chunks.seq(), batch, width])?;
    cp.all_reduce(&grad, ReduceOp::Sum)?;
    chunks.take_local(&grad)
}

/// Head `h` of batch entry `b` for the query chunk at `rows`: its queries there, and its keys
/// and values up to the chunk's end (`[rows, d]`, `[end, d]`, `[end, d]`).
fn head_rows(
    whole: &[f32],
    rows: Range<usize>,
    b: usize,
    h: usize,
    dims: (usize, usize, usize),
) -> [Vec<f32>; 3] {
    let keys = 0..rows.end;
    [
        gather_rows(whole, rows, b, h, 0, dims),
        gather_rows(whole, keys.clone(), b, h, 1, dims),
        gather_rows(whole, keys, b, h, 2, dims),
    ]
}

/// Rows `rows` of part `part` of head `h` of batch entry `b` of the whole projection:
/// `[rows, d]`.
fn gather_rows(
    whole: &[f32],
    rows: Range<usize>,
    b: usize,
    h: usize,
    part: usize,
    dims: (usize, usize, usize),
) -> Vec<f32> {
    let d = dims.2;
    let mut out = Vec::with_capacity(rows.len() * d);
    for pos in rows {
        let from = at(pos, b, h, part, dims);
        out.extend_from_slice(&whole[from..from + d]);
    }
    out
}

/// Adds `x` (`[rows, d]`) into rows `rows` of part `part` of head `h` of batch entry `b`.
fn add_rows(
    grad: &mut [f32],
    x: &[f32],
    rows: Range<usize>,
    b: usize,
    h: usize,
    part: usize,
    dims: (usize, usize, usize),
) {
    let d = dims.2;
    for (i, pos) in rows.enumerate() {
        let to = at(pos, b, h, part, dims);
        for (o, v) in grad[to..to + d].iter_mut().zip(&x[i * d..(i + 1) * d]) {
            *o += v;
        }
    }
}
