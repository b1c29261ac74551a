//! Blockwise causal attention on the host, the arithmetic every context-parallel form shares.
//!
//! Queries and keys are held as chunks (runs of consecutive positions, of any lengths) at known
//! places in the sequence. Each (query chunk, key chunk) pair is attended with the mask its global positions
//! need (none at all for a key chunk wholly after the query chunk, every key for one wholly
//! before it, causal or windowed element by element on the diagonal), and the pairs are
//! combined by the online softmax: per query row a running maximum, a running sum of
//! exponentials and a running weighted sum of values, rescaled whenever the maximum grows
//! (the log-sum-exp combination of Transformer Engine's ring attention and of flash
//! attention). The backward goes pair by pair from the combined log-sum-exp, with
//! `D = rowsum(dO ∘ O)`, so that a pair needs nothing from the others.
//!
//! Layouts (all `f32`, row-major): queries, outputs and their gradients `[b, heads, rows, d]`;
//! keys and values `[2, b, groups, rows, d]` (keys, then values), `rows` the chunks' positions in
//! local order. Head `h` reads the keys and values of group `h / per_group`.

use std::ops::Range;
use std::sync::Arc;

use super::{CpDocuments, CpDropout};
use crate::error::Result;
use crate::kernels::KernelError;
use crate::kernels::dropout::{LogicalIndex, dropout_forward, dropout_pair};
use crate::rng::DropoutStream;

/// `C = op(A) · op(B) + β·C` ([`crate::kernels::gemm`]'s row-major product) in this thread's
/// precision: in a `--bf16` run the operands rounded to bf16 with f32 sums, as the products of
/// unsharded attention are.
fn product(
    a: &[f32],
    a_shape: (usize, usize, bool),
    b: &[f32],
    b_shape: (usize, usize, bool),
    beta: f32,
    c: &mut [f32],
) -> std::result::Result<(), KernelError> {
    let bf16 = crate::backend::cpu_bf16_products_on();
    crate::kernels::gemm::product(bf16, a, a_shape, b, b_shape, beta, c)
}

/// The sizes and the mask of one layer's blockwise attention.
#[derive(Debug, Clone)]
pub(crate) struct Blocks {
    /// Batch entries.
    pub batch: usize,
    /// Key/value groups held here.
    pub groups: usize,
    /// Query heads per group.
    pub per_group: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Positions of the whole sequence (the dropout mask's logical index).
    pub seq: usize,
    /// The scores' scale (`1/√d`).
    pub scale: f32,
    /// The keys before each query it sees; `None`: all of them.
    pub window: Option<usize>,
    /// Attention dropout, with this engine's first head among all.
    pub dropout: Option<CpDropout>,
    /// Packed documents: a query sees only keys of its own document. `None`: one document.
    pub documents: Option<Arc<CpDocuments>>,
}

/// One side's chunks: the data in its layout and each chunk's global positions.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Side<'a> {
    /// Queries `[b, heads, rows, d]` or keys and values `[2, b, groups, rows, d]`.
    pub data: &'a [f32],
    /// The global positions of each chunk, in local order (`rows` in all).
    pub chunks: &'a [Range<usize>],
}

impl Side<'_> {
    /// Positions held: the chunks' lengths summed.
    fn rows(&self) -> usize {
        self.chunks.iter().map(Range::len).sum()
    }

    /// The local row of chunk `i`'s first position.
    fn offset(&self, i: usize) -> usize {
        self.chunks[..i].iter().map(Range::len).sum()
    }
}

/// How a (query chunk, key chunk) pair is masked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pair {
    /// No query sees any key.
    Skip,
    /// Every query sees every key.
    Full,
    /// Element by element.
    Masked,
}

/// One (query chunk, key chunk) pair of one head to attend: head `h` of batch entry `b`,
/// query chunk `i` (global positions `qs`) and key chunk `j` (`ks`), and its mask.
#[derive(Debug, Clone)]
struct PairAt {
    bh: (usize, usize),
    i: usize,
    j: usize,
    qs: Range<usize>,
    ks: Range<usize>,
    pair: Pair,
}

/// The online softmax of a set of query rows: running maximum, sum and weighted values.
#[derive(Debug, Clone)]
pub(crate) struct Online {
    acc: Vec<f32>,
    max: Vec<f32>,
    sum: Vec<f32>,
}

impl Blocks {
    /// Query heads held here.
    pub fn heads(&self) -> usize {
        self.groups * self.per_group
    }

    /// The document of global position `p` of batch entry `b`, as its first position (0
    /// without documents).
    #[inline]
    fn document(&self, b: usize, p: usize) -> usize {
        self.documents.as_ref().map_or(0, |docs| docs.start(b, p))
    }

    /// Whether the query at global position `q` of batch entry `b` sees the key at `k`.
    #[inline]
    fn sees(&self, b: usize, q: usize, k: usize) -> bool {
        k <= q
            && self.window.is_none_or(|w| q - k <= w)
            && self.document(b, q) == self.document(b, k)
    }

    /// The mask of the pair of batch entry `b` whose chunks hold positions `qs` and `ks`:
    /// with documents, no query sees a key chunk wholly before its documents, and a pair is
    /// whole only within one document.
    fn pair(&self, b: usize, qs: &Range<usize>, ks: &Range<usize>) -> Pair {
        let (q_last, k_last) = (qs.end - 1, ks.end - 1);
        if ks.start > q_last || self.window.is_some_and(|w| qs.start > k_last + w) {
            return Pair::Skip;
        }
        let one_document = match self.documents {
            None => true,
            Some(_) => {
                // Documents increase along the sequence.
                if self.document(b, k_last) < self.document(b, qs.start) {
                    return Pair::Skip;
                }
                self.document(b, ks.start) == self.document(b, q_last)
            }
        };
        let whole = k_last <= qs.start && self.window.is_none_or(|w| q_last - ks.start <= w);
        match one_document && whole {
            true => Pair::Full,
            false => Pair::Masked,
        }
    }

    /// Where the dropout of the pair of head `h` of batch entry `b` whose chunks hold `qs`
    /// and `ks` is drawn: runs of the block's elements (`rows` × `cols`, whole rows when
    /// `cols` spans the block), each with its stream and logical index. Without documents one
    /// run, the block at its place in the whole `[b, heads, s, s]` weights; with them a run per
    /// row, the keys of the row's document at their place in that document's own
    /// `[heads, n, n]` weights, drawn from the document's stream (the rest of the row is 0).
    fn dropout_runs(
        &self,
        drop: &CpDropout,
        (b, h): (usize, usize),
        (qs, ks): (&Range<usize>, &Range<usize>),
    ) -> Vec<(Range<usize>, Range<usize>, DropoutStream, LogicalIndex)> {
        let (cq, ck) = (qs.len(), ks.len());
        let Some(docs) = &self.documents else {
            let index = drop.index((b, h), (qs.start, ks.start), (cq, ck), self.seq);
            return vec![(0..cq, 0..ck, drop.stream, index)];
        };
        let head = (drop.first_head + h) as u64;
        let ks = ks.start;
        (0..cq)
            .filter_map(|r| {
                let q = qs.start + r;
                let (start, end) = docs.span(b, q);
                let (lo, hi) = (start.max(ks), end.min(ks + ck));
                if lo >= hi {
                    return None;
                }
                let cols = lo - ks..hi - ks;
                let n = (end - start) as u64;
                let at = ((head * n + (q - start) as u64) * n) + (ks + cols.start - start) as u64;
                let stream = drop.stream.part(&[b as u64, start as u64]);
                Some((
                    r..r + 1,
                    cols.clone(),
                    stream,
                    LogicalIndex::range(at, cols.len()),
                ))
            })
            .collect()
    }

    /// An empty online softmax for `rows` query rows.
    pub fn online(&self, rows: usize) -> Online {
        let n = self.batch * self.heads() * rows;
        Online {
            acc: vec![0.0; n * self.head_dim],
            max: vec![f32::NEG_INFINITY; n],
            sum: vec![0.0; n],
        }
    }

    /// The first query row of head `h` of batch entry `b`, chunk `i` of side `q`.
    fn q_row(&self, (b, h): (usize, usize), q: &Side, i: usize) -> usize {
        (b * self.heads() + h) * q.rows() + q.offset(i)
    }

    /// Keys (`part` 0) or values (1) of head `h`'s group, chunk `j` of side `kv`.
    fn kv_at(&self, part: usize, (b, h): (usize, usize), kv: &Side, j: usize) -> usize {
        let g = h / self.per_group;
        (((part * self.batch + b) * self.groups + g) * kv.rows() + kv.offset(j)) * self.head_dim
    }

    /// The scores `scale·Q·Kᵀ` of a pair of `cq` queries and `ck` keys, masked entries left
    /// for the caller.
    fn scores(&self, q: &[f32], k: &[f32], (cq, ck): (usize, usize)) -> Result<Vec<f32>> {
        let d = self.head_dim;
        let mut s = vec![0.0f32; cq * ck];
        product(q, (cq, d, false), k, (ck, d, true), 0.0, &mut s)?;
        for v in &mut s {
            *v *= self.scale;
        }
        Ok(s)
    }

    /// Every pair of a head and a query chunk of `q` with a key chunk of `kv` that some query
    /// of it sees.
    fn pairs<'s>(&'s self, q: Side<'s>, kv: Side<'s>) -> impl Iterator<Item = PairAt> + 's {
        let heads = (0..self.batch).flat_map(move |b| (0..self.heads()).map(move |h| (b, h)));
        heads.flat_map(move |bh| {
            q.chunks.iter().enumerate().flat_map(move |(i, qs)| {
                kv.chunks.iter().enumerate().filter_map(move |(j, ks)| {
                    let pair = self.pair(bh.0, qs, ks);
                    (pair != Pair::Skip).then(|| PairAt {
                        bh,
                        i,
                        j,
                        qs: qs.clone(),
                        ks: ks.clone(),
                        pair,
                    })
                })
            })
        })
    }

    /// Attends every query chunk of `q` to every key chunk of `kv`, folding the pairs into
    /// `state`.
    pub fn forward(&self, q: Side, kv: Side, state: &mut Online) -> Result<()> {
        let d = self.head_dim;
        for PairAt {
            bh: (b, h),
            i,
            j,
            qs,
            ks,
            pair,
        } in self.pairs(q, kv)
        {
            let (cq, ck) = (qs.len(), ks.len());
            let row0 = self.q_row((b, h), &q, i);
            let qb = &q.data[row0 * d..][..cq * d];
            let kb = &kv.data[self.kv_at(0, (b, h), &kv, j)..][..ck * d];
            let vb = &kv.data[self.kv_at(1, (b, h), &kv, j)..][..ck * d];
            let mut e = self.scores(qb, kb, (cq, ck))?;
            for r in 0..cq {
                let row = &mut e[r * ck..(r + 1) * ck];
                let seen =
                    |k: usize| pair == Pair::Full || self.sees(b, qs.start + r, ks.start + k);
                let top = (0..ck)
                    .filter(|&k| seen(k))
                    .map(|k| row[k])
                    .fold(f32::NEG_INFINITY, f32::max);
                if top == f32::NEG_INFINITY {
                    row.fill(0.0);
                    continue;
                }
                let old = state.max[row0 + r];
                let new = old.max(top);
                let alpha = if old == f32::NEG_INFINITY {
                    0.0
                } else {
                    (old - new).exp()
                };
                let mut total = 0.0f32;
                for (k, x) in row.iter_mut().enumerate() {
                    *x = if seen(k) { (*x - new).exp() } else { 0.0 };
                    total += *x;
                }
                state.sum[row0 + r] = state.sum[row0 + r] * alpha + total;
                state.max[row0 + r] = new;
                for a in &mut state.acc[(row0 + r) * d..(row0 + r + 1) * d] {
                    *a *= alpha;
                }
            }
            if let Some(drop) = &self.dropout {
                let mut dropped = vec![0.0f32; cq * ck];
                for (rows, cols, stream, index) in self.dropout_runs(drop, (b, h), (&qs, &ks)) {
                    let (from, to) = (rows.start * ck + cols.start, (rows.end - 1) * ck + cols.end);
                    let (e, dropped) = (&e[from..to], &mut dropped[from..to]);
                    dropout_forward(e, dropped, drop.p, &stream, index)?;
                }
                e = dropped;
            }
            let acc = &mut state.acc[row0 * d..(row0 + cq) * d];
            product(&e, (cq, ck, false), vb, (ck, d, false), 1.0, acc)?;
        }
        Ok(())
    }

    /// The output `[b, heads, rows, d]` and each row's log-sum-exp `[b, heads, rows]`.
    pub fn finish(&self, state: Online) -> (Vec<f32>, Vec<f32>) {
        let d = self.head_dim;
        let Online {
            mut acc, max, sum, ..
        } = state;
        let mut lse = vec![f32::INFINITY; sum.len()];
        for (row, (&m, &l)) in max.iter().zip(&sum).enumerate() {
            // Every query sees itself, so every row has a positive sum; one without keys
            // would stay 0 with weights exp(s − ∞) = 0 in the backward.
            if l > 0.0 {
                lse[row] = m + l.ln();
                for a in &mut acc[row * d..(row + 1) * d] {
                    *a /= l;
                }
            }
        }
        (acc, lse)
    }

    /// `D = rowsum(dO ∘ O)` per query row (`[b, heads, rows]`).
    pub fn delta(&self, d_out: &[f32], out: &[f32]) -> Vec<f32> {
        d_out
            .chunks_exact(self.head_dim)
            .zip(out.chunks_exact(self.head_dim))
            .map(|(g, o)| g.iter().zip(o).map(|(a, b)| a * b).sum())
            .collect()
    }

    /// Adds the gradients of every (query chunk, key chunk) pair of `q` against `kv` into
    /// `dq` (query layout) and `dkv` (`kv`'s layout), from the forward's log-sum-exp `lse`,
    /// the output gradient `d_out` and `delta` ([`Blocks::delta`]).
    #[allow(clippy::too_many_arguments)]
    pub fn backward(
        &self,
        q: Side,
        kv: Side,
        (d_out, lse, delta): (&[f32], &[f32], &[f32]),
        dq: &mut [f32],
        dkv: &mut [f32],
    ) -> Result<()> {
        let d = self.head_dim;
        for PairAt {
            bh: (b, h),
            i,
            j,
            qs,
            ks,
            pair,
        } in self.pairs(q, kv)
        {
            let (cq, ck) = (qs.len(), ks.len());
            let row0 = self.q_row((b, h), &q, i);
            let at = row0 * d;
            let qb = &q.data[at..][..cq * d];
            let gb = &d_out[at..][..cq * d];
            let (ka, va) = (self.kv_at(0, (b, h), &kv, j), self.kv_at(1, (b, h), &kv, j));
            let kb = &kv.data[ka..][..ck * d];
            let vb = &kv.data[va..][..ck * d];
            // P = exp(S − lse) where seen.
            let mut p = self.scores(qb, kb, (cq, ck))?;
            for r in 0..cq {
                for (k, x) in p[r * ck..(r + 1) * ck].iter_mut().enumerate() {
                    let seen = pair == Pair::Full || self.sees(b, qs.start + r, ks.start + k);
                    *x = if seen {
                        (*x - lse[row0 + r]).exp()
                    } else {
                        0.0
                    };
                }
            }
            // dP = dO·Vᵀ; with dropout, dV from the dropped weights and dP
            // through the mask (regenerated from its key).
            let mut dp = vec![0.0f32; cq * ck];
            product(gb, (cq, d, false), vb, (ck, d, true), 0.0, &mut dp)?;
            let dropped = match &self.dropout {
                Some(drop) => {
                    let (mut pm, mut dpm) = (vec![0.0f32; cq * ck], vec![0.0f32; cq * ck]);
                    for (rows, cols, stream, index) in self.dropout_runs(drop, (b, h), (&qs, &ks)) {
                        let (from, to) =
                            (rows.start * ck + cols.start, (rows.end - 1) * ck + cols.end);
                        let (p, pm) = (&p[from..to], &mut pm[from..to]);
                        let (dp, dpm) = (&dp[from..to], &mut dpm[from..to]);
                        dropout_pair(p, pm, dp, dpm, drop.p, &stream, index)?;
                    }
                    dp = dpm;
                    Some(pm)
                }
                None => None,
            };
            let weights = dropped.as_deref().unwrap_or(&p);
            product(
                weights,
                (cq, ck, true),
                gb,
                (cq, d, false),
                1.0,
                &mut dkv[va..][..ck * d],
            )?;
            // dS = P ∘ (dP − D), scaled back through the scores' scale.
            for r in 0..cq {
                let dr = delta[row0 + r];
                let (pr, dpr) = (&mut p[r * ck..(r + 1) * ck], &dp[r * ck..(r + 1) * ck]);
                for (x, g) in pr.iter_mut().zip(dpr) {
                    *x *= (g - dr) * self.scale;
                }
            }
            product(
                &p,
                (cq, ck, false),
                kb,
                (ck, d, false),
                1.0,
                &mut dq[at..][..cq * d],
            )?;
            product(
                &p,
                (cq, ck, true),
                qb,
                (cq, d, false),
                1.0,
                &mut dkv[ka..][..ck * d],
            )?;
        }
        Ok(())
    }
}
