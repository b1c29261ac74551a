//! How the queries, keys and values of context-parallel attention move: the fused projection
//! split into the blocks' layouts and joined back, the all-to-all that trades heads for
//! sequence (Ulysses), and the ways keys and values reach the queries (a ring, an all-gather,
//! or none when every rank already holds the whole sequence).

use super::blocks::{Blocks, Online, Side};
use super::{CpChunks, CpGroups};
use crate::comm::{Communicator, ReduceOp};
use crate::error::Result;
use crate::tensor::{DType, Shape, Tensor};

/// `data` as a tensor of `shape` and `dtype` on the device of `like` (messages and results).
pub(super) fn near(
    data: Vec<f32>,
    shape: impl Into<Shape>,
    dtype: DType,
    like: &Tensor,
) -> Result<Tensor> {
    let host = Tensor::from_vec(data, shape)?;
    if like.gpu().is_none() && dtype == DType::F32 {
        return Ok(host);
    }
    let out = Tensor::empty_near(host.dims().to_vec(), dtype, like)?;
    out.copy_from(&host)?;
    Ok(out)
}

/// Where each head-sized run of grouped rows `[rows, b, groups, per_group + 2, d]` lies in the
/// blocks' layouts: its offset there, the buffer (0: queries `[b, heads, rows, d]`, 1: keys and
/// values `[2, b, groups, rows, d]`) and its offset in it.
fn qkv_places(rows: usize, bl: &Blocks) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
    let (b_n, g_n, pg, d) = (bl.batch, bl.groups, bl.per_group, bl.head_dim);
    let runs = (0..rows).flat_map(move |r| {
        (0..b_n)
            .flat_map(move |b| (0..g_n).flat_map(move |g| (0..pg + 2).map(move |k| (r, b, g, k))))
    });
    runs.map(move |(r, b, g, slot)| {
        let grouped = (((r * b_n + b) * g_n + g) * (pg + 2) + slot) * d;
        match slot.checked_sub(pg) {
            None => (
                grouped,
                0,
                ((b * bl.heads() + g * pg + slot) * rows + r) * d,
            ),
            Some(part) => (grouped, 1, (((part * b_n + b) * g_n + g) * rows + r) * d),
        }
    })
}

/// Splits grouped rows `[rows, b, groups, per_group + 2, d]` into queries `[b, heads, rows,
/// d]` and keys and values `[2, b, groups, rows, d]`.
pub(super) fn split_qkv(x: &[f32], rows: usize, bl: &Blocks) -> (Vec<f32>, Vec<f32>) {
    let d = bl.head_dim;
    let mut parts = [
        vec![0.0f32; bl.batch * bl.heads() * rows * d],
        vec![0.0f32; 2 * bl.batch * bl.groups * rows * d],
    ];
    for (from, part, to) in qkv_places(rows, bl) {
        parts[part][to..to + d].copy_from_slice(&x[from..from + d]);
    }
    let [q, kv] = parts;
    (q, kv)
}

/// [`split_qkv`]'s inverse: query and key/value gradients joined into grouped rows.
pub(super) fn join_qkv(dq: &[f32], dkv: &[f32], rows: usize, bl: &Blocks) -> Vec<f32> {
    let d = bl.head_dim;
    let parts = [dq, dkv];
    let mut x = vec![0.0f32; rows * bl.batch * bl.groups * (bl.per_group + 2) * d];
    for (to, part, from) in qkv_places(rows, bl) {
        x[to..to + d].copy_from_slice(&parts[part][from..from + d]);
    }
    x
}

/// Where each head-sized run of `[b, heads, rows, d]` lies in `[rows, b, heads·d]`: both
/// offsets.
fn head_places(rows: usize, bl: &Blocks) -> impl Iterator<Item = (usize, usize)> + '_ {
    let (b_n, h_n, d) = (bl.batch, bl.heads(), bl.head_dim);
    (0..b_n).flat_map(move |b| {
        (0..h_n).flat_map(move |h| {
            (0..rows).map(move |r| {
                (
                    ((b * h_n + h) * rows + r) * d,
                    ((r * b_n + b) * h_n + h) * d,
                )
            })
        })
    })
}

/// `[b, heads, rows, d]` to `[rows, b, heads·d]`.
pub(super) fn heads_to_rows(x: &[f32], rows: usize, bl: &Blocks) -> Vec<f32> {
    let d = bl.head_dim;
    let mut y = vec![0.0f32; x.len()];
    for (from, to) in head_places(rows, bl) {
        y[to..to + d].copy_from_slice(&x[from..from + d]);
    }
    y
}

/// [`heads_to_rows`]' inverse.
pub(super) fn rows_to_heads(y: &[f32], rows: usize, bl: &Blocks) -> Vec<f32> {
    let d = bl.head_dim;
    let mut x = vec![0.0f32; y.len()];
    for (to, from) in head_places(rows, bl) {
        x[to..to + d].copy_from_slice(&y[from..from + d]);
    }
    x
}

/// Ulysses' first all-to-all: `x` `[rb, width]` (this rank's `rb` rows of every head) becomes
/// `[a·rb, width / a]`, every rank's rows (in group order) of this rank's `1/a` of the width.
pub(super) fn heads_for_rows(
    comm: &dyn Communicator,
    x: Vec<f32>,
    rb: usize,
    width: usize,
    like: &Tensor,
) -> Result<Vec<f32>> {
    let a = comm.size();
    let w = width / a;
    let mut send = vec![0.0f32; x.len()];
    for r in 0..rb {
        for j in 0..a {
            let to = (j * rb + r) * w;
            send[to..to + w].copy_from_slice(&x[r * width + j * w..][..w]);
        }
    }
    all_to_all(comm, send, rb * w, like)
}

/// Ulysses' second all-to-all, [`heads_for_rows`]' inverse: `y` `[a·rb, w]` (every rank's rows
/// of this rank's part of the width) becomes `[rb, a·w]`.
pub(super) fn rows_for_heads(
    comm: &dyn Communicator,
    y: Vec<f32>,
    rb: usize,
    w: usize,
    like: &Tensor,
) -> Result<Vec<f32>> {
    let a = comm.size();
    let got = all_to_all(comm, y, rb * w, like)?;
    let mut x = vec![0.0f32; got.len()];
    for j in 0..a {
        for r in 0..rb {
            x[(r * a + j) * w..][..w].copy_from_slice(&got[(j * rb + r) * w..][..w]);
        }
    }
    Ok(x)
}

/// Sends block `j` (of `each` elements) of `data` to rank `j`, returns rank `i`'s block to
/// this rank at `i`.
fn all_to_all(
    comm: &dyn Communicator,
    data: Vec<f32>,
    each: usize,
    like: &Tensor,
) -> Result<Vec<f32>> {
    let n = data.len();
    let splits = vec![each; comm.size()];
    let input = near(data, [n], DType::F32, like)?;
    let output = Tensor::zeros_near([n], DType::F32, like)?;
    comm.all_to_all(&input, &splits, &output, &splits)?;
    Ok(output.to_vec_f32()?)
}

/// How keys and values reach this rank's queries.
#[derive(Clone, Copy)]
enum Route<'a> {
    /// Every key is here (after Ulysses' all-to-all, or in a group of one).
    Local,
    /// All-gathered over the group (reduce-scattered in the backward).
    Gather(&'a dyn Communicator),
    /// Round a ring of the group, one member's block per step.
    Ring(&'a dyn Communicator),
}

/// The route of a rank's keys and values, and which chunks each member of its group holds.
pub(super) struct Keys<'a> {
    route: Route<'a>,
    chunks: CpChunks,
    /// Context-parallel ranks per member (the all-to-all size).
    per_member: usize,
}

impl<'a> Keys<'a> {
    /// The route `groups` give, for a rank at `chunks`.
    pub fn new(groups: &'a CpGroups, chunks: CpChunks) -> Keys<'a> {
        let per_member = groups.a2a.as_ref().map_or(1, |c| c.size());
        let route = match (&groups.keys, groups.kind) {
            (None, _) => Route::Local,
            (Some(c), _) if c.size() == 1 => Route::Local,
            (Some(c), super::CpCommType::AllGather) => Route::Gather(c.as_ref()),
            (Some(c), _) => Route::Ring(c.as_ref()),
        };
        Keys {
            route,
            chunks,
            per_member,
        }
    }

    /// The chunks member `m` of the key group holds (those of its all-to-all group's ranks).
    fn chunks_of(&self, m: usize) -> Vec<std::ops::Range<usize>> {
        let a = self.per_member;
        self.chunks.chunks_of(m * a..(m + 1) * a)
    }

    /// Attends the queries `q` to every key before them, this rank's keys and values `kv`
    /// and the others' as the route brings them.
    pub fn forward(
        &self,
        bl: &Blocks,
        q: Side,
        kv: &[f32],
        online: &mut Online,
        like: &Tensor,
    ) -> Result<()> {
        let len = kv.len();
        match self.route {
            Route::Local => bl.forward(
                q,
                Side {
                    data: kv,
                    chunks: q.chunks,
                },
                online,
            ),
            Route::Gather(comm) => {
                let all = gather(comm, kv, like)?;
                for (m, block) in all.chunks_exact(len).enumerate() {
                    let held = self.chunks_of(m);
                    bl.forward(
                        q,
                        Side {
                            data: block,
                            chunks: &held,
                        },
                        online,
                    )?;
                }
                Ok(())
            }
            Route::Ring(comm) => {
                // Where sends never wait, each block goes on to the next rank before this rank
                // attends to it (the exchange overlaps the block's compute); where they wait for
                // their receive (NCCL), after, in one batched exchange.
                let (n, me) = (comm.size(), comm.index());
                let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
                let early = !comm.rendezvous();
                let mut cur = kv.to_vec();
                for step in 0..n {
                    let more = step + 1 < n;
                    if more && early {
                        comm.send(&near(cur.clone(), [len], DType::F32, like)?, next)?;
                    }
                    let held = self.chunks_of((me + n - step) % n);
                    let block = Side {
                        data: &cur,
                        chunks: &held,
                    };
                    bl.forward(q, block, online)?;
                    cur = match (more, early) {
                        (false, _) => cur,
                        (true, true) => receive(comm, len, prev, like)?,
                        (true, false) => swap(comm, cur, (next, prev), like)?,
                    };
                }
                Ok(())
            }
        }
    }

    /// The backward of [`Keys::forward`]: query gradients into `dq`, this rank's key and
    /// value gradients (every rank's queries' part summed) into `dkv`.
    pub fn backward(
        &self,
        bl: &Blocks,
        q: Side,
        kv: &[f32],
        grads: (&[f32], &[f32], &[f32]),
        (dq, dkv): (&mut [f32], &mut [f32]),
        like: &Tensor,
    ) -> Result<()> {
        let len = kv.len();
        match self.route {
            Route::Local => bl.backward(
                q,
                Side {
                    data: kv,
                    chunks: q.chunks,
                },
                grads,
                dq,
                dkv,
            ),
            Route::Gather(comm) => {
                let all = gather(comm, kv, like)?;
                let mut d_all = vec![0.0f32; all.len()];
                for (m, (block, d_block)) in all
                    .chunks_exact(len)
                    .zip(d_all.chunks_exact_mut(len))
                    .enumerate()
                {
                    let held = self.chunks_of(m);
                    bl.backward(
                        q,
                        Side {
                            data: block,
                            chunks: &held,
                        },
                        grads,
                        dq,
                        d_block,
                    )?;
                }
                let input = near(d_all, [comm.size() * len], DType::F32, like)?;
                let output = Tensor::zeros_near([len], DType::F32, like)?;
                comm.reduce_scatter(&input, &output, ReduceOp::Sum)?;
                dkv.copy_from_slice(&output.to_vec_f32()?);
                Ok(())
            }
            Route::Ring(comm) => {
                // Each block's gradients travel round with it and come home after a full turn.
                // Where sends never wait, the block goes on before its gradients are computed
                // and the gradients after; where they wait for their receive (NCCL), block and
                // gradients go as one message in one batched exchange after the step (the
                // gradients alone after the last), so that it cannot deadlock.
                let (n, me) = (comm.size(), comm.index());
                let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
                let early = !comm.rendezvous();
                let mut cur = kv.to_vec();
                let mut d_cur = vec![0.0f32; len];
                for step in 0..n {
                    let more = step + 1 < n;
                    if more && early {
                        comm.send(&near(cur.clone(), [len], DType::F32, like)?, next)?;
                    }
                    let held = self.chunks_of((me + n - step) % n);
                    let block = Side {
                        data: &cur,
                        chunks: &held,
                    };
                    bl.backward(q, block, grads, dq, &mut d_cur)?;
                    if early {
                        comm.send(&near(d_cur, [len], DType::F32, like)?, next)?;
                        if more {
                            cur = receive(comm, len, prev, like)?;
                        }
                        d_cur = receive(comm, len, prev, like)?;
                        continue;
                    }
                    let mut message = if more { cur } else { Vec::new() };
                    message.extend_from_slice(&d_cur);
                    let got = swap(comm, message, (next, prev), like)?;
                    let (block, so_far) = got.split_at(got.len() - len);
                    cur = block.to_vec();
                    d_cur = so_far.to_vec();
                }
                dkv.copy_from_slice(&d_cur);
                Ok(())
            }
        }
    }
}

/// Every member's `kv`, in group order.
fn gather(comm: &dyn Communicator, kv: &[f32], like: &Tensor) -> Result<Vec<f32>> {
    let mine = near(kv.to_vec(), [kv.len()], DType::F32, like)?;
    let all = Tensor::zeros_near([comm.size() * kv.len()], DType::F32, like)?;
    comm.all_gather(&mine, &all)?;
    Ok(all.to_vec_f32()?)
}

/// Sends `message` to group rank `next` and receives one of the same length from `prev`, in
/// one batch.
fn swap(
    comm: &dyn Communicator,
    message: Vec<f32>,
    (next, prev): (usize, usize),
    like: &Tensor,
) -> Result<Vec<f32>> {
    let size = message.len();
    let out = near(message, [size], DType::F32, like)?;
    let got = Tensor::zeros_near([size], DType::F32, like)?;
    comm.exchange(&[(&out, next)], &[(&got, prev)])?;
    Ok(got.to_vec_f32()?)
}

/// The next `len` elements from group rank `src`.
fn receive(comm: &dyn Communicator, len: usize, src: usize, like: &Tensor) -> Result<Vec<f32>> {
    let buf = Tensor::zeros_near([len], DType::F32, like)?;
    comm.recv(&buf, src)?;
    Ok(buf.to_vec_f32()?)
}
