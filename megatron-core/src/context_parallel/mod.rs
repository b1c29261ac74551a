//! Context parallelism (`--context-parallel-size`, Megatron-LM's): every activation's sequence is
//! split over the ranks of a context-parallel group, and attention, the one layer that mixes
//! positions, exchanges keys and values over it.
//!
//! The layout is Megatron-LM's load balance for causal attention (`get_batch_on_this_cp_rank`):
//! a sequence of `s` positions is cut into `2·cp` chunks of `s / (2·cp)`, and cp rank `r` holds
//! chunks `r` and `2·cp − 1 − r`, one early and one late, so that every rank's queries see about
//! as many keys. A microbatch of one packed sequence whose documents are attended apart and are
//! each a multiple of `2·cp` long is cut document by document instead, as Transformer Engine's
//! `thd` layout cuts packed sequences: rank `r` holds chunks `r` and `2·cp − 1 − r` of every
//! document ([`CpChunks::of_microbatch`]). Positions (learned, rotary) are the global ones; the loss of a token is where
//! its rank computes it, summed with the others' over the data×context-parallel group.
//!
//! Attention comes in Transformer Engine's four forms (`--cp-comm-type`, [`CpCommType`]), all
//! built on one blockwise engine ([`blocks`]: each pair of a query chunk and a key chunk with
//! the mask its global positions need, combined by log-sum-exp):
//! - `p2p`: the keys and values go round a ring of the group; at each step a rank attends its
//!   queries to the block it holds while sending that block on, and in the backward the keys'
//!   and values' gradients travel round with them back to their owner;
//! - `all_gather`: the keys and values are all-gathered, their gradients reduce-scattered;
//! - `a2a` (Ulysses): an all-to-all trades heads for sequence, so that each rank attends the
//!   whole sequence with `1/cp` of the heads, and a second one trades back;
//! - `a2a+p2p`: the all-to-all inside groups of `--hierarchical-context-parallel-sizes`'s first
//!   size (consecutive ranks), the ring across them.
//!
//! Attention dropout draws each element of the whole `[b, heads, s, s]` weights at the
//! element's global place, as cp 1 does, so the forms agree with it up to the order of sums;
//! with packed documents attended apart, each element of a document's own `[heads, n, n]`
//! weights from the document's stream, as cp 1 draws it when it attends the document alone
//! (`backend::attention::attend`). The blocks are computed on the host.

mod blocks;
mod exchange;
pub mod traffic;

use std::ops::Range;
use std::sync::Arc;

use crate::comm::{Communicator, World};
use crate::documents::Documents;
use crate::error::Result;
use crate::invalid;
use crate::kernels::dropout::LogicalIndex;
use crate::module::{Cx, MultiOp, Op, Site};
use crate::rng::DropoutStream;
use crate::tensor::{DType, Tensor};
use blocks::{Blocks, Side};

/// An op that mixes the positions of a sequence (attention), declared `#[context_parallel]` in a
/// module: the one place of a model that context parallelism changes. Its calls run on this
/// rank's positions, with context parallelism its two chunks of the sequence, and exchange keys
/// and values over the context-parallel group as `--cp-comm-type` says (the ring's sends and
/// receives, the all-gather and reduce-scatter, or the all-to-alls); without it they are the
/// op's own.
pub trait ContextParallel: Op {
    /// The forward on this rank's chunks.
    fn forward_chunks(&self, cx: &Cx, site: Site, x: &Tensor) -> Result<(Tensor, Self::Saved)>;
    /// The backward of [`ContextParallel::forward_chunks`].
    fn backward_chunks(
        &self,
        cx: &Cx,
        site: Site,
        saved: Self::Saved,
        dy: &Tensor,
    ) -> Result<Tensor>;
}

/// [`ContextParallel`] for an op of several inputs (a [`MultiOp`]): attention over queries, keys
/// and values given apart ([`crate::ops::DotProductAttention`]), declared `#[context_parallel]`
/// and called with its tensors, `self.core(q, k, v)`.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is called with several tensors but takes one",
    label = "not a context-parallel op of several inputs (`ContextParallelMulti`)",
    note = "`CausalSelfAttention` takes the fused projection `[q | k | v]`; \
            `DotProductAttention` takes queries, keys and values apart"
)]
pub trait ContextParallelMulti: MultiOp {
    /// The forward on this rank's chunks of every input.
    fn forward_chunks(&self, cx: &Cx, site: Site, xs: &[&Tensor]) -> Result<(Tensor, Self::Saved)>;
    /// The backward of [`ContextParallelMulti::forward_chunks`]: each input's gradient, in order.
    fn backward_chunks(
        &self,
        cx: &Cx,
        site: Site,
        saved: Self::Saved,
        dy: &Tensor,
    ) -> Result<Vec<Tensor>>;
}

/// How context-parallel attention exchanges keys and values (`--cp-comm-type`, Transformer
/// Engine's names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CpCommType {
    /// A ring of point-to-point exchanges, one key/value block per step.
    P2p,
    /// Keys and values all-gathered (gradients reduce-scattered).
    #[default]
    AllGather,
    /// Heads traded for sequence by all-to-all (Ulysses).
    A2a,
    /// All-to-all inside groups of `a2a` consecutive ranks, a ring across the `p2p` groups
    /// (`--hierarchical-context-parallel-sizes a2a p2p`).
    A2aP2p {
        /// Ranks of each all-to-all group.
        a2a: usize,
        /// Ranks of each ring.
        p2p: usize,
    },
}

impl CpCommType {
    /// The type `name` (`p2p`, `all_gather`, `a2a`, `a2a+p2p`) at context-parallel size `cp`,
    /// with the hierarchical sizes `a2a+p2p` needs (and nothing else takes); an error naming
    /// the numbers otherwise.
    pub fn parse(name: &str, hierarchical: &[usize], cp: usize) -> Result<CpCommType> {
        let kind = match name {
            "p2p" => CpCommType::P2p,
            "all_gather" => CpCommType::AllGather,
            "a2a" => CpCommType::A2a,
            "a2a+p2p" => match hierarchical {
                &[a2a, p2p] if a2a * p2p == cp && a2a > 0 => CpCommType::A2aP2p { a2a, p2p },
                &[a2a, p2p] => {
                    return invalid!(
                        "--hierarchical-context-parallel-sizes {a2a} {p2p}: their product {} \
                         is not --context-parallel-size {cp}",
                        a2a * p2p
                    );
                }
                sizes => {
                    return invalid!(
                        "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes \
                         with two sizes (all-to-all, ring) whose product is \
                         --context-parallel-size {cp}; got {sizes:?}"
                    );
                }
            },
            other => {
                return invalid!(
                    "unknown --cp-comm-type `{other}`: p2p, all_gather, a2a or a2a+p2p"
                );
            }
        };
        if !hierarchical.is_empty() && !matches!(kind, CpCommType::A2aP2p { .. }) {
            return invalid!(
                "--hierarchical-context-parallel-sizes {hierarchical:?} is for --cp-comm-type \
                 a2a+p2p, not {name}"
            );
        }
        Ok(kind)
    }

    /// The type the flags give at context-parallel size `cp`: `name` (all_gather when `None`)
    /// with `hierarchical`, as [`CpCommType::parse`] reads them; at `cp` 1, where there is no
    /// exchange, either flag given is refused as doing nothing.
    pub fn from_flags(name: Option<&str>, hierarchical: &[usize], cp: usize) -> Result<CpCommType> {
        if cp == 1 {
            if let Some(name) = name {
                return invalid!(
                    "--cp-comm-type {name} does nothing without context parallelism \
                     (--context-parallel-size 1): drop it, or give --context-parallel-size"
                );
            }
            if !hierarchical.is_empty() {
                return invalid!(
                    "--hierarchical-context-parallel-sizes {hierarchical:?} does nothing \
                     without context parallelism (--context-parallel-size 1): drop it, or give \
                     --context-parallel-size"
                );
            }
        }
        CpCommType::parse(name.unwrap_or("all_gather"), hierarchical, cp)
    }

    /// Transformer Engine's name.
    pub fn name(self) -> &'static str {
        match self {
            CpCommType::P2p => "p2p",
            CpCommType::AllGather => "all_gather",
            CpCommType::A2a => "a2a",
            CpCommType::A2aP2p { .. } => "a2a+p2p",
        }
    }

    /// Ranks of each all-to-all group at context-parallel size `cp` (1: none).
    pub fn a2a_size(self, cp: usize) -> usize {
        match self {
            CpCommType::A2a => cp,
            CpCommType::A2aP2p { a2a, .. } => a2a,
            CpCommType::P2p | CpCommType::AllGather => 1,
        }
    }

    /// Checks that `heads` query heads in `groups` key/value groups split over `tp` ranks can
    /// be all-to-all'ed over this type's groups at context-parallel size `cp`: each rank's
    /// heads and groups divisible by the all-to-all size; an error naming the numbers.
    pub fn check_heads(self, heads: usize, groups: usize, tp: usize, cp: usize) -> Result<()> {
        let a = self.a2a_size(cp);
        if a == 1 {
            return Ok(());
        }
        let split = |n: usize| n.is_multiple_of(tp) && (n / tp).is_multiple_of(a);
        if !split(heads) || !split(groups) {
            return invalid!(
                "--cp-comm-type {} trades heads over {a} ranks: {heads} attention heads and \
                 {groups} query groups over tensor-parallel size {tp} ({}, {} per rank) must \
                 each be divisible by {a}",
                self.name(),
                heads as f64 / tp as f64,
                groups as f64 / tp as f64
            );
        }
        Ok(())
    }
}

/// The communicators of one rank's context-parallel attention: the all-to-all group (heads for
/// sequence) and the group keys and values travel over (ring or gather), each when its type
/// has one.
#[derive(Clone)]
pub struct CpGroups {
    kind: CpCommType,
    a2a: Option<Arc<dyn Communicator>>,
    keys: Option<Arc<dyn Communicator>>,
}

impl std::fmt::Debug for CpGroups {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpGroups")
            .field("kind", &self.kind)
            .field("a2a", &self.a2a.as_ref().map(|c| c.ranks().to_vec()))
            .field("keys", &self.keys.as_ref().map(|c| c.ranks().to_vec()))
            .finish()
    }
}

impl CpGroups {
    /// The groups of `kind` over the context-parallel group `cp`: for `a2a+p2p` the
    /// all-to-all groups are consecutive members of it and the rings strided, each made on
    /// `world` (every member calls this alike).
    pub fn new(world: &dyn World, cp: &Arc<dyn Communicator>, kind: CpCommType) -> Result<Self> {
        let n = cp.size();
        let (a2a, keys) = match kind {
            CpCommType::P2p | CpCommType::AllGather => (None, Some(Arc::clone(cp))),
            CpCommType::A2a => (Some(Arc::clone(cp)), None),
            CpCommType::A2aP2p { a2a, p2p } => {
                if a2a * p2p != n {
                    return invalid!(
                        "hierarchical context-parallel sizes {a2a} × {p2p} are not the group's \
                         {n} ranks"
                    );
                }
                let (outer, inner) = (cp.index() / a2a, cp.index() % a2a);
                let ranks = cp.ranks();
                let inside: Vec<usize> = ranks[outer * a2a..(outer + 1) * a2a].to_vec();
                let across: Vec<usize> = (0..p2p).map(|k| ranks[k * a2a + inner]).collect();
                let make = |name: &str, r: &[usize]| -> Result<Option<Arc<dyn Communicator>>> {
                    Ok((r.len() > 1)
                        .then(|| world.communicator(name, r))
                        .transpose()?)
                };
                (make("cp_a2a", &inside)?, make("cp_p2p", &across)?)
            }
        };
        Ok(CpGroups { kind, a2a, keys })
    }

    /// The comm type.
    pub fn kind(&self) -> CpCommType {
        self.kind
    }

    /// Each of the groups' counters so far, with its size (the all-to-all group's, then the
    /// keys' group's, each once).
    pub fn stats(&self) -> Vec<(usize, crate::comm::CommStats)> {
        [&self.a2a, &self.keys]
            .into_iter()
            .flatten()
            .map(|c| (c.size(), c.stats()))
            .collect()
    }

    /// The bytes this rank has put on the wire over the groups so far ([`traffic::sent`]).
    pub fn sent(&self) -> u64 {
        self.stats()
            .iter()
            .map(|(n, st)| traffic::sent(*n, st))
            .sum()
    }
}

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
    /// Where the weights of local head `h` of batch entry `b`, the `cq` queries from global
    /// position `qs` against the `ck` keys from `ks`, lie in the whole `[b, all heads, s, s]`
    /// weights.
    fn index(
        &self,
        (b, h): (usize, usize),
        (qs, ks): (usize, usize),
        (cq, ck): (usize, usize),
        s: usize,
    ) -> LogicalIndex {
        LogicalIndex {
            outer: cq,
            inner: ck,
            logical_stride: s as u64,
            logical_start: (((b * self.all_heads + self.first_head + h) * s + qs) * s + ks) as u64,
        }
    }
}

/// Where a context-parallel rank's positions lie: its two chunks of the sequence, or with
/// packed documents cut as Transformer Engine's `thd` layout cuts them, its two chunks of every
/// document.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CpChunks {
    /// The context-parallel size.
    pub size: usize,
    /// This rank's index in the group.
    pub rank: usize,
    /// Positions of the whole sequence.
    seq: usize,
    /// The documents each cut into `2·cp` chunks (`thd`); `None`: the whole sequence is.
    documents: Option<Arc<Vec<Range<usize>>>>,
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
            seq,
            documents: None,
        })
    }

    /// The chunks of a rank holding `local` positions (two chunks).
    pub fn of_local(local: usize, size: usize, rank: usize) -> Result<CpChunks> {
        CpChunks::new(local * size, size, rank)
    }

    /// The chunks of a microbatch of `seq` positions with its packed `documents`: Transformer
    /// Engine's `thd` cut (rank `r` holds chunks `r` and `2·cp − 1 − r` of every document, so
    /// that each rank has its share of every document's causal work) where the documents are
    /// attended apart, the microbatch is one sequence (as Megatron-LM's packed sequences are)
    /// and every document's length is a multiple of `2·cp` (`megatron preprocess --chat
    /// --pad-to-multiple-of`); else the whole sequence's two chunks.
    pub fn of_microbatch(
        seq: usize,
        size: usize,
        rank: usize,
        documents: Option<&Documents>,
    ) -> Result<CpChunks> {
        let chunks = CpChunks::new(seq, size, rank)?;
        let Some(docs) = documents.filter(|d| d.separates_attention() && d.batch() == 1) else {
            return Ok(chunks);
        };
        let spans = docs.segments(0);
        if docs.seq() != seq || spans.iter().any(|r| !r.len().is_multiple_of(2 * size)) {
            return Ok(chunks);
        }
        Ok(CpChunks {
            documents: Some(Arc::new(spans)),
            ..chunks
        })
    }

    /// Whether the documents are cut one by one (`thd`).
    pub fn cuts_documents(&self) -> bool {
        self.documents.is_some()
    }

    /// The whole sequence's positions.
    pub fn seq(&self) -> usize {
        self.seq
    }

    /// Positions each rank holds.
    pub fn local(&self) -> usize {
        self.seq / self.size
    }

    /// The global positions of this rank's chunks, in local order.
    pub fn ranges(&self) -> Vec<Range<usize>> {
        self.ranges_of(self.rank)
    }

    /// Where local rows `rows` (of the chunks, in local order) lie in the sequence: one run of
    /// global positions per chunk they touch.
    pub fn runs(&self, rows: Range<usize>) -> Vec<Range<usize>> {
        let mut at = 0;
        self.ranges()
            .into_iter()
            .filter_map(|global| {
                let local = at..at + global.len();
                at = local.end;
                let (lo, hi) = (rows.start.max(local.start), rows.end.min(local.end));
                (lo < hi).then(|| global.start + lo - local.start..global.start + hi - local.start)
            })
            .collect()
    }

    /// The global positions of each chunk of cp ranks `ranks`, in order.
    fn chunks_of(&self, ranks: Range<usize>) -> Vec<Range<usize>> {
        ranks.flat_map(|r| self.ranges_of(r)).collect()
    }

    /// The global positions of rank `rank`'s chunks: chunks `rank` and `2·cp − 1 − rank` of
    /// the sequence, or of every document in turn.
    fn ranges_of(&self, rank: usize) -> Vec<Range<usize>> {
        let late = 2 * self.size - 1 - rank;
        let two = |whole: &Range<usize>| {
            let c = whole.len() / (2 * self.size);
            let at = |k: usize| whole.start + k * c..whole.start + (k + 1) * c;
            [at(rank), at(late)]
        };
        match &self.documents {
            None => two(&(0..self.seq)).to_vec(),
            Some(docs) => docs.iter().flat_map(two).collect(),
        }
    }

    /// This rank's rows of `x` (`[s, ..]`, the whole sequence first): `[local, ..]`.
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
        dims[0] = self.local();
        let out = Tensor::empty_near(dims, x.dtype(), x)?;
        let mut at = 0;
        for r in self.ranges() {
            out.narrow(0, at, r.len())?
                .copy_from(&x.narrow(0, r.start, r.len())?)?;
            at += r.len();
        }
        Ok(out)
    }
}

/// One layer's attention as this rank runs it: its key/value groups, query heads per group,
/// the scores' scale, the window, the dropout (with the tensor-parallel rank's first head) and
/// the packed documents it keeps apart.
#[derive(Debug, Clone)]
pub struct CpLayer {
    /// Key/value groups on this tensor-parallel rank.
    pub groups: usize,
    /// Query heads per group.
    pub per_group: usize,
    /// The scores' scale (`1/√d`).
    pub scale: f32,
    /// The keys before each query it sees (`--window-size`'s left part); `None`: all.
    pub window: Option<usize>,
    /// Attention dropout, if any.
    pub dropout: Option<CpDropout>,
    /// Packed documents attended apart; `None`: one document a sequence.
    pub documents: Option<Arc<CpDocuments>>,
}

impl CpLayer {
    /// The documents `cx`'s microbatch keeps apart, as [`CpLayer::documents`] holds them.
    pub fn documents_of(cx: &Cx) -> Option<Arc<CpDocuments>> {
        let docs = cx.documents().filter(|d| d.separates_attention())?;
        Some(Arc::new(CpDocuments::new(docs)))
    }
}

/// Packed documents as the blocks read them: for each batch entry and global position, the
/// first position of its document and the position after its last.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CpDocuments {
    seq: usize,
    spans: Vec<(u32, u32)>,
}

impl CpDocuments {
    /// The spans of `documents`' samples.
    pub fn new(documents: &Documents) -> CpDocuments {
        let spans = documents.spans().into_iter();
        CpDocuments {
            seq: documents.seq(),
            spans: spans.map(|(a, b)| (a as u32, b as u32)).collect(),
        }
    }

    /// Positions covered: batch entries × sequence.
    pub fn positions(&self) -> usize {
        self.spans.len()
    }

    /// The document of global position `p` of batch entry `b`: its first position and the
    /// position after its last.
    #[inline]
    pub(crate) fn span(&self, b: usize, p: usize) -> (usize, usize) {
        let (start, end) = self.spans[b * self.seq + p];
        (start as usize, end as usize)
    }

    /// The first position of the document of position `p` of batch entry `b` (which tells
    /// documents apart: they do not overlap).
    #[inline]
    pub(crate) fn start(&self, b: usize, p: usize) -> usize {
        self.spans[b * self.seq + p].0 as usize
    }
}

/// What [`attention_forward`] keeps for [`attention_backward`]: the queries and this rank's
/// keys and values in the blocks' layouts, the output and each row's log-sum-exp.
#[derive(Debug, Clone)]
pub struct CpAttentionSaved {
    blocks: Blocks,
    chunks: CpChunks,
    held: Vec<Range<usize>>,
    q: Vec<f32>,
    kv: Vec<f32>,
    out: Vec<f32>,
    lse: Vec<f32>,
    dtype: DType,
}

/// Where this rank's queries come from after the all-to-all: the cp ranks whose chunks it
/// holds, its index in the all-to-all group, and the group's size.
fn held(groups: &CpGroups, chunks: &CpChunks) -> (Range<usize>, usize, usize) {
    let a = groups.a2a.as_ref().map_or(1, |c| c.size());
    let first = chunks.rank / a * a;
    (first..first + a, chunks.rank % a, a)
}

/// Causal attention of this rank's two chunks of a fused projection `qkv` (`[2·chunk, batch,
/// groups·(per_group + 2)·d]`, Megatron-LM's grouped layout, the local rows of the whole
/// sequence in chunk order) against every key before them in the sequence, the keys and values
/// exchanged over `groups` as its comm type says: returns the context `[2·chunk, batch,
/// heads·d]` (in `qkv`'s dtype and place).
pub fn attention_forward(
    groups: &CpGroups,
    chunks: CpChunks,
    qkv: &Tensor,
    layer: CpLayer,
) -> Result<(Tensor, CpAttentionSaved)> {
    let [local, batch, width] = qkv.dims() else {
        return invalid!(
            "context-parallel attention: fused QKV must be [sequence, batch, width], got {}",
            qkv.shape()
        );
    };
    let (local, batch, width) = (*local, *batch, *width);
    let parts = layer.groups * (layer.per_group + 2);
    if local != chunks.local() || parts == 0 || !width.is_multiple_of(parts) {
        return invalid!(
            "context-parallel attention: QKV of shape {} is not the rank's {} positions × \
             {} groups × ({} queries + a key + a value)",
            qkv.shape(),
            chunks.local(),
            layer.groups,
            layer.per_group
        );
    }
    let (ranks, inner, a) = held(groups, &chunks);
    if !layer.groups.is_multiple_of(a) {
        return invalid!(
            "--cp-comm-type {} trades heads over {a} ranks: {} query groups on this rank are not \
             divisible by it",
            groups.kind.name(),
            layer.groups
        );
    }
    let mut x = qkv.to_vec_f32()?;
    if let Some(comm) = &groups.a2a {
        x = exchange::heads_for_rows(comm.as_ref(), x, local * batch, width, qkv)?;
    }
    if let Some(docs) = &layer.documents
        && docs.positions() != batch * chunks.seq()
    {
        return invalid!(
            "context-parallel attention: the documents cover {} positions, the batch {batch} \
             sequences of {}",
            docs.positions(),
            chunks.seq()
        );
    }
    let here = layer.groups / a;
    let blocks = Blocks {
        batch,
        groups: here,
        per_group: layer.per_group,
        head_dim: width / parts,
        seq: chunks.seq(),
        scale: layer.scale,
        window: layer.window,
        dropout: layer.dropout.map(|d| CpDropout {
            first_head: d.first_head + inner * here * layer.per_group,
            ..d
        }),
        documents: layer.documents.clone(),
    };
    let held = chunks.chunks_of(ranks);
    let rows = held.iter().map(Range::len).sum();
    let (q, kv) = exchange::split_qkv(&x, rows, &blocks);
    let mut online = blocks.online(rows);
    let queries = Side {
        data: &q,
        chunks: &held,
    };
    let sources = exchange::Keys::new(groups, chunks.clone());
    sources.forward(&blocks, queries, &kv, &mut online, qkv)?;
    let (out, lse) = blocks.finish(online);
    let mut y = exchange::heads_to_rows(&out, rows, &blocks);
    if let Some(comm) = &groups.a2a {
        y = exchange::rows_for_heads(
            comm.as_ref(),
            y,
            local * batch,
            here * layer.per_group * blocks.head_dim,
            qkv,
        )?;
    }
    let y = exchange::near(
        y,
        [
            local,
            batch,
            layer.groups * layer.per_group * blocks.head_dim,
        ],
        qkv.dtype(),
        qkv,
    )?;
    let saved = CpAttentionSaved {
        blocks,
        chunks,
        held,
        q,
        kv,
        out,
        lse,
        dtype: qkv.dtype(),
    };
    Ok((y, saved))
}

/// The gradient of [`attention_forward`]'s fused projection (`[2·chunk, batch,
/// groups·(per_group + 2)·d]`) from the context's `d_out`: every query's gradient from the
/// keys it saw, every key's and value's from every query that saw it (summed over the ranks
/// that hold those queries), this rank's rows.
pub fn attention_backward(
    groups: &CpGroups,
    saved: &CpAttentionSaved,
    d_out: &Tensor,
) -> Result<Tensor> {
    let CpAttentionSaved {
        blocks,
        chunks,
        held,
        q,
        kv,
        out,
        lse,
        dtype,
    } = saved;
    let (local, batch) = (chunks.local(), blocks.batch);
    let (d, heads) = (blocks.head_dim, blocks.heads());
    let a = groups.a2a.as_ref().map_or(1, |c| c.size());
    let all_heads = heads * a;
    if d_out.numel() != local * batch * all_heads * d {
        return invalid!(
            "context-parallel attention: output gradient of shape {} does not fit [{local}, \
             {batch}, {}]",
            d_out.shape(),
            all_heads * d
        );
    }
    let rows = held.iter().map(Range::len).sum();
    let mut dy = d_out.to_vec_f32()?;
    if let Some(comm) = &groups.a2a {
        dy = exchange::heads_for_rows(comm.as_ref(), dy, local * batch, all_heads * d, d_out)?;
    }
    let g = exchange::rows_to_heads(&dy, rows, blocks);
    let delta = blocks.delta(&g, out);
    let mut dq = vec![0.0f32; q.len()];
    let mut dkv = vec![0.0f32; kv.len()];
    let queries = Side {
        data: q,
        chunks: held,
    };
    exchange::Keys::new(groups, chunks.clone()).backward(
        blocks,
        queries,
        kv,
        (&g, lse, &delta),
        (&mut dq, &mut dkv),
        d_out,
    )?;
    let mut dx = exchange::join_qkv(&dq, &dkv, rows, blocks);
    let width = blocks.groups * (blocks.per_group + 2) * d;
    if let Some(comm) = &groups.a2a {
        dx = exchange::rows_for_heads(comm.as_ref(), dx, local * batch, width, d_out)?;
    }
    exchange::near(dx, [local, batch, width * a], *dtype, d_out)
}
