//! Embedding lookup and its scatter-add gradient on the device, for a full or vocab-parallel
//! table shard, as [`crate::kernels::embedding`].
//!
//! Ids are not validated, as on the CPU: an id the shard does not hold (negative, below
//! `vocab_start`, or past the shard) gives a zero row and no gradient, so nothing has to be read
//! back from the device.
//!
//! The backward is deterministic and gives the CPU's bits: each element of `dtable` is owned by
//! one thread, which adds its tokens' gradients in token order. Blocks split the columns (1024 per
//! block as float4s) and the shard's rows (`row % parts`); every block reads all the ids, and its
//! threads walk only the tokens that hit its rows. The price against a scatter with atomics is
//! that one row's tokens are added one after another by the same threads: a very frequent token
//! (padding, say) makes a chain of that many dependent adds.

use cudarc::driver::{CudaView, CudaViewMut, LaunchConfig, PushKernelArg};

use super::{THREADS, check_len, launch, launch_args, product};
use crate::cuda::{Gpu, Result};

/// Largest grid y dimension the driver accepts.
const MAX_GRID_Y: usize = 65_535;

/// Blocks the backward aims for (column tiles × row parts), enough to fill an H100.
const BACKWARD_BLOCKS: usize = 1024;

/// Threads per block of the backward (its kernel compacts one token per thread per chunk).
const BACKWARD_THREADS: u32 = 256;

/// Column groups (float4s or strided quads) of a row of `hidden` columns.
fn groups(hidden: usize) -> usize {
    hidden.div_ceil(4)
}

/// Looks up `out[n, hidden]` rows of `table[v_local, hidden]` for `ids[n]`; ids outside the
/// shard give zero rows, as [`crate::kernels::embedding::embedding_forward`].
pub fn embedding_forward(
    gpu: &Gpu,
    ids: &CudaView<i64>,
    table: &CudaView<f32>,
    vocab_start: usize,
    v_local: usize,
    hidden: usize,
    out: &mut CudaViewMut<f32>,
) -> Result<()> {
    const K: &str = "embedding_forward";
    let n = ids.len();
    let dims =
        || format!("tokens {n} × hidden {hidden}, shard of {v_local} rows from {vocab_start}");
    check_len(
        K,
        "table",
        table.len(),
        product(K, &[v_local, hidden])?,
        dims,
    )?;
    check_len(K, "out", out.len(), product(K, &[n, hidden])?, dims)?;
    if hidden == 0 || n == 0 {
        return Ok(());
    }
    let q = groups(hidden);
    let threads = q.next_multiple_of(32).min(THREADS as usize);
    let cfg = LaunchConfig {
        grid_dim: (q.div_ceil(threads) as u32, n.min(MAX_GRID_Y) as u32, 1),
        block_dim: (threads as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let (n64, hidden64) = (n as u64, hidden as u64);
    let (start64, v_local64) = (vocab_start as u64, v_local as u64);
    let mut args = launch_args(gpu, K)?;
    args.arg(ids).arg(table).arg(out);
    args.arg(&n64).arg(&hidden64).arg(&start64).arg(&v_local64);
    launch(K, args, cfg)
}

/// Scatter-adds `dout[n, hidden]` into `dtable[v_local, hidden]` (`+=`) for the ids the shard
/// holds, tokens in order (deterministic, the CPU's bits), as
/// [`crate::kernels::embedding::embedding_backward`].
pub fn embedding_backward(
    gpu: &Gpu,
    ids: &CudaView<i64>,
    dout: &CudaView<f32>,
    vocab_start: usize,
    v_local: usize,
    hidden: usize,
    dtable: &mut CudaViewMut<f32>,
) -> Result<()> {
    const K: &str = "embedding_backward";
    let n = ids.len();
    let dims =
        || format!("tokens {n} × hidden {hidden}, shard of {v_local} rows from {vocab_start}");
    check_len(K, "dout", dout.len(), product(K, &[n, hidden])?, dims)?;
    check_len(
        K,
        "dtable",
        dtable.len(),
        product(K, &[v_local, hidden])?,
        dims,
    )?;
    if hidden == 0 || n == 0 || v_local == 0 {
        return Ok(());
    }
    let tiles = groups(hidden).div_ceil(BACKWARD_THREADS as usize);
    // More row parts give more parallel adders; beyond the rows or the tokens they only add
    // blocks that read the ids and find nothing to do.
    let parts = BACKWARD_BLOCKS
        .div_ceil(tiles)
        .min(v_local)
        .min(n)
        .clamp(1, MAX_GRID_Y);
    let cfg = LaunchConfig {
        grid_dim: (tiles as u32, parts as u32, 1),
        block_dim: (BACKWARD_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let (n64, hidden64) = (n as u64, hidden as u64);
    let (start64, v_local64, parts64) = (vocab_start as u64, v_local as u64, parts as u64);
    let mut args = launch_args(gpu, K)?;
    args.arg(ids).arg(dout).arg(dtable);
    args.arg(&n64)
        .arg(&hidden64)
        .arg(&start64)
        .arg(&v_local64)
        .arg(&parts64);
    launch(K, args, cfg)
}
