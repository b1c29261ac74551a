//! Causal self-attention in tiles on the tensor cores (FlashAttention-2's algorithm, see
//! `cu/flash_attention.cu`): the `s × s` scores and probabilities stay in registers a tile at a
//! time, so the forward reads the fused projection and writes its output, and the backward reads
//! them again with the output gradient and writes the projection's gradient, with no `s × s`
//! tensor kept from one to the other (the backward's score gradients pass through a bounded
//! buffer, below). The dropout is the CPU's: the same Philox mask over the `[b, heads, s, s]`
//! attention weights as the unfused kernels. The forward draws it and stores which elements it
//! kept, a bit each ([`FlashShape::keep_words`]); the backward reads those bits instead of
//! drawing the mask again.
//!
//! The operands are bf16 (the fused projection rounded once, the probabilities and gradients
//! rounded as they enter a product), accumulation f32, the output and the fused projection's
//! gradient bf16 (the projections' operands, rounded once from the accumulators). The
//! backward is deterministic and has FlashAttention-2's five products: one kernel recomputes
//! the probabilities and gives the key and value gradients, storing the score gradients (bf16)
//! for a second kernel's `dq = dS·k`; no atomics. The score gradients pass a chunk of queries
//! at a time through a buffer of at most [`SCORE_GRADIENT_BUDGET`] bytes (for any sequence
//! whose `batch·heads·seq·64` score gradients fit in it), so memory stays linear in the
//! sequence.
//!
//! Packed documents run in the same launches ([`Documents`]): each position's document span in
//! a device table, each query seeing only keys of its own document, the tiles wholly outside
//! every row's document skipped (FlashAttention's variable-length sequences, without a launch
//! per document).

use cudarc::driver::sys::CUfunction_attribute_enum;
use cudarc::driver::{CudaView, CudaViewMut, LaunchArgs, LaunchConfig, PushKernelArg};
use half::bf16;

use super::dropout::MaskArgs;
use super::operand::In;
use super::softmax::{Dropout, mask};
use super::{NULL, check_len, launch, launch_args};
use crate::cuda::error::CudaError;
use crate::cuda::{Gpu, Result};
use crate::kernels::KernelError;
use crate::kernels::dropout::{keep_scale, keep_threshold};

/// The head sizes the kernels are built for.
pub const HEAD_DIMS: [usize; 4] = [32, 64, 96, 128];

/// Threads per block: 4 warps of 16 rows each (`FA_THREADS`).
const THREADS: u32 = 128;
/// Rows of a block (`FA_ROWS`), keys per forward tile (`FA_FWD_KEYS`), queries per key-gradient
/// tile (`FA_BWD_COLS`), keys per query-gradient tile (`FA_DQ_KEYS`) and the padding of shared
/// rows (`FA_PAD`), as in the kernels.
const ROWS: usize = 64;
const FWD_KEYS: usize = 64;
const BWD_COLS: usize = 32;
const DQ_KEYS: usize = 64;
const PAD: usize = 8;
/// The longest sequence the kernels take (their positions are 32-bit, signed-safe).
const MAX_SEQ: usize = (1 << 31) - 1;
/// Bytes the backward's score-gradient buffer may take: 512 MiB, the whole `[b, heads, s, s]`
/// of GPT-1.2B at sequence 2048 and micro-batch 4 in one chunk.
pub const SCORE_GRADIENT_BUDGET: usize = 512 << 20;

/// Packed documents as the kernels read them: per batch entry and position, its document's
/// first position and the position after its last (`first | end << 32`, `[batch, seq]`).
#[derive(Debug, Clone, Copy)]
pub struct Documents<'a>(pub &'a CudaView<'a, i64>);

impl Documents<'_> {
    /// The table's words of `spans`: per batch entry and position, its document's first
    /// position and the position after its last.
    pub fn words(spans: impl IntoIterator<Item = (usize, usize)>) -> Vec<i64> {
        spans
            .into_iter()
            .map(|(first, end)| (first as u64 | ((end as u64) << 32)) as i64)
            .collect()
    }
}

/// Pushes the documents' table, or a null pointer (one document a sequence).
fn push_documents<'a>(args: &mut LaunchArgs<'a>, documents: &'a Option<Documents<'a>>) {
    match documents {
        Some(Documents(table)) => args.arg(*table),
        None => args.arg(&NULL),
    };
}

/// The sizes of one attention call: the fused projection is `[seq, batch, heads·3·head_dim]`
/// (per head its query, key and value), the output `[seq, batch, heads·head_dim]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlashShape {
    /// Sequence length (queries and keys).
    pub seq: usize,
    /// Batch entries.
    pub batch: usize,
    /// Heads (on this rank).
    pub heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Sliding-window attention: each query sees itself and at most this many keys before it
    /// (`None`: every earlier key).
    pub window: Option<usize>,
}

impl FlashShape {
    /// The kernels' `window`: the keys before a query it sees, at most the sequence (all).
    fn window_arg(&self) -> u32 {
        self.window.unwrap_or(self.seq).min(self.seq) as u32
    }

    /// Whether the kernels are built for this head size.
    pub fn supported(&self) -> bool {
        HEAD_DIMS.contains(&self.head_dim)
    }

    /// Elements of the fused projection (and of its gradient).
    pub fn qkv_len(&self) -> usize {
        self.seq * self.batch * self.heads * 3 * self.head_dim
    }

    /// Elements of the output (and of its gradient).
    pub fn out_len(&self) -> usize {
        self.seq * self.batch * self.heads * self.head_dim
    }

    /// Rows of all heads: the length of the log-sum-exp `[batch, heads, seq]`.
    pub fn rows(&self) -> usize {
        self.batch * self.heads * self.seq
    }

    /// 64-bit words of the dropout's kept-element bits: per head, block of 64 keys and query
    /// (queries up to the sequence rounded up to 64), a bit per key of the block.
    pub fn keep_words(&self) -> usize {
        let blocks = self.seq.div_ceil(ROWS);
        self.batch * self.heads * blocks * blocks * ROWS
    }

    fn dims(&self) -> String {
        format!(
            "seq {} × batch {} × heads {} × head size {}",
            self.seq, self.batch, self.heads, self.head_dim
        )
    }

    /// Element strides (position, batch entry, head) of the fused projection and the output.
    fn strides(&self) -> ([i64; 3], [i64; 3]) {
        let (b, h, d) = (self.batch as i64, self.heads as i64, self.head_dim as i64);
        ([b * h * 3 * d, h * 3 * d, 3 * d], [b * h * d, h * d, d])
    }

    /// The grid (row tiles, heads, batch), checked against the launch limits, and the head
    /// size the kernels are built for.
    fn grid(&self, kernel: &'static str) -> Result<(u32, u32, u32)> {
        let invalid = |message: String| CudaError::from(KernelError::Invalid { kernel, message });
        if !self.supported() {
            return Err(invalid(format!(
                "head size {} is not one of the built ones {HEAD_DIMS:?}",
                self.head_dim
            )));
        }
        if self.seq == 0 || self.batch == 0 || self.heads == 0 {
            return Err(invalid(format!("empty attention: {}", self.dims())));
        }
        // Positions are 32-bit in the kernels.
        if self.seq > MAX_SEQ {
            return Err(invalid(format!(
                "{}: sequences of more than {MAX_SEQ} positions are not supported",
                self.dims()
            )));
        }
        let tiles = self.seq.div_ceil(ROWS) as u32;
        let heads = u16::try_from(self.heads).ok();
        let batch = u16::try_from(self.batch).ok();
        match (heads, batch) {
            (Some(h), Some(b)) if h < u16::MAX && b < u16::MAX => Ok((tiles, h.into(), b.into())),
            _ => Err(invalid(format!(
                "{} exceeds the grid's limits (heads and batch below 65535)",
                self.dims()
            ))),
        }
    }
}

/// Bytes of dynamic shared memory `kernel` uses for head size `d` (the kernels' layouts: two
/// stages of the tiles they stream, rows of `d + PAD` bf16).
fn shared_bytes(kernel: &str, d: usize) -> usize {
    let row = (d + PAD) * 2;
    match kernel {
        // Keys and values of a tile, twice.
        "flash_forward" => 2 * 2 * FWD_KEYS * row,
        // The block's keys and values; twice a query tile (queries, output gradients,
        // log-sum-exps, deltas, kept-element words).
        "flash_backward_kv" => {
            2 * ROWS * row + 2 * (2 * BWD_COLS * row + 2 * BWD_COLS * 4 + BWD_COLS * 8)
        }
        // A key tile and its keys' score gradients for the block's queries, twice.
        _ => 2 * DQ_KEYS * (row + (ROWS + PAD) * 2),
    }
}

/// Queues one of the tiled kernels over the shape's grid with its shared memory (raising the
/// kernel's limit beyond the default 48 KiB where it needs more).
fn launch_tiles(
    gpu: &Gpu,
    kernel: &'static str,
    args: LaunchArgs<'_>,
    grid: (u32, u32, u32),
    d: usize,
) -> Result<()> {
    let bytes = shared_bytes(kernel, d);
    gpu.kernels()
        .get(kernel)?
        .set_attribute(
            CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            bytes as i32,
        )
        .map_err(|e| {
            CudaError::driver(format!("cuFuncSetAttribute({kernel}, {bytes} B shared)"), e)
        })?;
    let cfg = LaunchConfig {
        grid_dim: grid,
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: bytes as u32,
    };
    launch(kernel, args, cfg)
}

/// Checks a buffer's length against the shape.
fn check(
    kernel: &'static str,
    buffer: &'static str,
    actual: usize,
    expected: usize,
    sh: &FlashShape,
) -> Result<()> {
    check_len(kernel, buffer, actual, expected, || sh.dims())
}

/// The grid and mask arguments of a pass over `sh`, after checking the scale (positive and
/// finite: the kernels find each row's largest scaled score as its largest raw one) and the
/// lengths of the buffers both passes read: the fused projection, the output and the
/// log-sum-exp.
fn checked(
    kernel: &'static str,
    sh: &FlashShape,
    scale: f32,
    [qkv, out, lse]: [usize; 3],
    dropout: Option<Dropout<'_>>,
) -> Result<((u32, u32, u32), MaskArgs)> {
    if !(scale > 0.0 && scale.is_finite()) {
        return Err(CudaError::from(KernelError::Invalid {
            kernel,
            message: format!("the score scale must be positive and finite, not {scale}"),
        }));
    }
    let grid = sh.grid(kernel)?;
    check(kernel, "qkv", qkv, sh.qkv_len(), sh)?;
    check(kernel, "out", out, sh.out_len(), sh)?;
    check(kernel, "lse", lse, sh.rows(), sh)?;
    Ok((grid, mask(kernel, dropout, sh.rows() * sh.seq)?))
}

/// `out = dropout(softmax(scale·q·kᵀ, causal)) · v` per head, and the log-sum-exp of each row's
/// scaled scores (`[batch, heads, seq]`, for the backward). `dropout` is the CPU's mask over the
/// `[batch, heads, seq, seq]` attention weights, with where to store which elements it kept
/// for the backward ([`FlashShape::keep_words`] 64-bit words). With `documents`, each query
/// sees only the keys of its own document.
#[allow(clippy::too_many_arguments)]
pub fn flash_attention_forward(
    gpu: &Gpu,
    qkv: &CudaView<bf16>,
    sh: FlashShape,
    scale: f32,
    dropout: Option<(Dropout<'_>, &mut CudaViewMut<i64>)>,
    documents: Option<Documents<'_>>,
    out: &mut CudaViewMut<bf16>,
    lse: &mut CudaViewMut<f32>,
) -> Result<()> {
    const K: &str = "flash_forward";
    let (mask, keep) = dropout.unzip();
    let (grid, mask) = checked(K, &sh, scale, [qkv.len(), out.len(), lse.len()], mask)?;
    if let Some(keep) = &keep {
        check(K, "keep bits", keep.len(), sh.keep_words(), &sh)?;
    }
    if let Some(Documents(table)) = &documents {
        check(K, "documents", table.len(), sh.batch * sh.seq, &sh)?;
    }
    let ([ss, bs, hs], [os, ob, oh]) = sh.strides();
    let (s, heads, d) = (sh.seq as u64, sh.heads as u64, sh.head_dim as i32);
    let mut args = launch_args(gpu, K)?;
    args.arg(qkv).arg(&ss).arg(&bs).arg(&hs);
    args.arg(out).arg(&os).arg(&ob).arg(&oh);
    args.arg(lse);
    match keep {
        Some(keep) => args.arg(keep),
        None => args.arg(&NULL),
    };
    let window = sh.window_arg();
    args.arg(&s).arg(&heads).arg(&d).arg(&scale).arg(&window);
    let keys = mask.round_keys();
    mask.push(&mut args);
    args.arg(&keys);
    push_documents(&mut args, &documents);
    launch_tiles(gpu, K, args, grid, sh.head_dim)
}

/// The gradient of the fused projection (`d_qkv`, every element written) from the output
/// gradient (f32 or bf16), with the forward's fused projection, output and log-sum-exp, scale and
/// dropout (its probability and the kept-element bits the forward stored). The score gradients pass through a buffer of at most `budget` bytes
/// ([`SCORE_GRADIENT_BUDGET`] in the attention layer; at least one chunk of 64 queries:
/// `batch·heads·⌈seq/64⌉·64·64` bf16), a chunk of queries at a time: the key and value
/// gradients are sums over the chunks (equal to one chunk's within bf16 rounding), the query
/// gradients the same bits whatever the budget. `documents` are the forward's.
#[allow(clippy::too_many_arguments)]
pub fn flash_attention_backward(
    gpu: &Gpu,
    qkv: &CudaView<bf16>,
    out: &CudaView<bf16>,
    lse: &CudaView<f32>,
    d_out: In<'_, '_>,
    sh: FlashShape,
    scale: f32,
    dropout: Option<(f32, &CudaView<i64>)>,
    documents: Option<Documents<'_>>,
    d_qkv: &mut CudaViewMut<bf16>,
    budget: usize,
) -> Result<()> {
    const K: &str = "flash_backward";
    let (grid, _) = checked(K, &sh, scale, [qkv.len(), out.len(), lse.len()], None)?;
    if let Some(Documents(table)) = &documents {
        check(K, "documents", table.len(), sh.batch * sh.seq, &sh)?;
    }
    check(K, "d_out", d_out.len(), sh.out_len(), &sh)?;
    check(K, "d_qkv", d_qkv.len(), sh.qkv_len(), &sh)?;
    let keep_scale = match &dropout {
        Some((p, keep)) => {
            check(K, "keep bits", keep.len(), sh.keep_words(), &sh)?;
            keep_threshold(*p).map_err(CudaError::from)?;
            keep_scale(*p)
        }
        None => 1.0,
    };
    let ([ss, bs, hs], [os, ob, oh]) = sh.strides();
    let (s, heads, batch, d) = (
        sh.seq as u64,
        sh.heads as u64,
        sh.batch as u64,
        sh.head_dim as u64,
    );

    // The output gradient in bf16 and each row's Σ d_out·out: one warp per row.
    let d_out16 = gpu.uninit::<bf16>(sh.out_len())?;
    let delta = gpu.uninit::<f32>(sh.rows())?;
    const PREPARE: &str = "flash_backward_prepare";
    let d_out_flag = d_out.flag();
    let mut args = launch_args(gpu, PREPARE)?;
    args.arg(out);
    d_out.push(&mut args, &d_out_flag);
    args.arg(&d_out16).arg(&os).arg(&ob).arg(&oh);
    args.arg(&delta).arg(&s).arg(&heads).arg(&batch).arg(&d);
    let warps_per_block = 256 / 32;
    let blocks = sh.rows().div_ceil(warps_per_block).clamp(1, 1 << 16) as u32;
    let cfg = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    launch(PREPARE, args, cfg)?;

    // The score gradients: rows for the keys up to the sequence rounded up to a block, columns
    // for one chunk of queries (a multiple of a block).
    let rows = sh.seq.div_ceil(ROWS) * ROWS;
    let (chunk, elements) = score_chunk(&sh, budget)?;
    let ds = gpu.uninit::<bf16>(elements)?;
    let (d32, chunk32) = (sh.head_dim as i32, chunk as u32);
    let (_, grid_heads, grid_batch) = grid;
    for c_begin in (0..rows).step_by(chunk) {
        let c_end = (c_begin + chunk).min(rows);
        let (begin32, end32) = (c_begin as u32, c_end as u32);
        const KV: &str = "flash_backward_kv";
        let mut args = launch_args(gpu, KV)?;
        args.arg(qkv).arg(&ss).arg(&bs).arg(&hs);
        args.arg(&d_out16).arg(&os).arg(&ob).arg(&oh);
        args.arg(lse).arg(&delta).arg(&mut *d_qkv);
        args.arg(&ds).arg(&chunk32).arg(&begin32).arg(&end32);
        let window = sh.window_arg();
        args.arg(&s).arg(&heads).arg(&d32).arg(&scale).arg(&window);
        match &dropout {
            Some((_, keep)) => args.arg(*keep),
            None => args.arg(&NULL),
        };
        args.arg(&keep_scale);
        push_documents(&mut args, &documents);
        // The key blocks the chunk's queries see: those before its end.
        let key_blocks = (c_end / ROWS) as u32;
        launch_tiles(
            gpu,
            KV,
            args,
            (key_blocks, grid_heads, grid_batch),
            sh.head_dim,
        )?;

        const Q: &str = "flash_backward_q";
        let mut args = launch_args(gpu, Q)?;
        args.arg(qkv).arg(&ss).arg(&bs).arg(&hs);
        args.arg(&ds).arg(&chunk32).arg(&begin32).arg(&mut *d_qkv);
        args.arg(&s).arg(&heads).arg(&d32).arg(&window);
        push_documents(&mut args, &documents);
        let query_blocks = (c_end.min(sh.seq) - c_begin).div_ceil(ROWS) as u32;
        launch_tiles(
            gpu,
            Q,
            args,
            (query_blocks, grid_heads, grid_batch),
            sh.head_dim,
        )?;
    }
    Ok(())
}

/// Queries per chunk of the backward, and the elements of its score-gradient buffer: the most
/// whole blocks of queries whose score gradients (bf16, all heads, rows up to the sequence
/// rounded up to a block) fit in `budget` bytes, at least one block, at most the whole sequence.
fn score_chunk(sh: &FlashShape, budget: usize) -> Result<(usize, usize)> {
    let rows = sh.seq.div_ceil(ROWS) * ROWS;
    let per_query = (sh.batch * sh.heads).checked_mul(rows);
    let chunk = per_query.map(|n| (budget / (2 * n) / ROWS * ROWS).clamp(ROWS, rows));
    match (chunk, per_query.and_then(|n| n.checked_mul(chunk?))) {
        (Some(chunk), Some(elements)) => Ok((chunk, elements)),
        _ => Err(CudaError::from(KernelError::Invalid {
            kernel: "flash_backward",
            message: format!("{}: the score-gradient buffer overflows", sh.dims()),
        })),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn score_gradient_chunks_fit_the_budget_in_whole_blocks() {
        let sh = |seq, batch, heads| FlashShape {
            seq,
            batch,
            heads,
            head_dim: 96,
            window: None,
        };
        // GPT-1.2B, micro-batch 4: the whole [4, 16, 2048, 2048] in 512 MiB.
        let big = sh(2048, 4, 16);
        assert_eq!(
            score_chunk(&big, SCORE_GRADIENT_BUDGET).unwrap(),
            (2048, 64 * 2048 * 2048)
        );
        assert_eq!(
            score_chunk(&big, SCORE_GRADIENT_BUDGET - 1).unwrap().0,
            1984
        );
        // Rows and columns in whole blocks of 64; never less than one block.
        assert_eq!(
            score_chunk(&sh(100, 1, 1), 1 << 30).unwrap(),
            (128, 128 * 128)
        );
        assert_eq!(score_chunk(&sh(100, 1, 1), 1).unwrap(), (64, 128 * 64));
        // 32k positions, 16 heads: 512 queries a chunk (16 · 32768 · 512 · 2 bytes = 512 MiB).
        assert_eq!(
            score_chunk(&sh(32768, 1, 16), SCORE_GRADIENT_BUDGET)
                .unwrap()
                .0,
            512
        );
    }
}
