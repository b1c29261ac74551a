//! Recycled host allocations: a training step frees and allocates the same activation sizes
//! every step; keeping the freed blocks avoids returning pages to the kernel and faulting them
//! back in (zeroed) on the next step.

use std::collections::HashMap;
use std::ptr::NonNull;
use std::sync::OnceLock;

use parking_lot::Mutex;

use super::dtype::DType;

/// A freed allocation of `len` elements (capacity `cap`) of one dtype.
pub(crate) struct Block {
    pub ptr: NonNull<u8>,
    pub cap: usize,
}

// SAFETY: a pooled block is owned by the pool alone until it is handed out again.
unsafe impl Send for Block {}

struct Pool {
    free: HashMap<(DType, usize), Vec<Block>>,
    bytes: usize,
    limit: usize,
}

fn pool() -> &'static Mutex<Pool> {
    static POOL: OnceLock<Mutex<Pool>> = OnceLock::new();
    POOL.get_or_init(|| {
        let limit = std::env::var("MEGATRON_POOL_BYTES")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(1usize << 30);
        Mutex::new(Pool {
            free: HashMap::new(),
            bytes: 0,
            limit,
        })
    })
}

/// A pooled block for `len` elements of `dtype`, if one was freed.
pub(crate) fn take(dtype: DType, len: usize) -> Option<Block> {
    let mut p = pool().lock();
    let block = p.free.get_mut(&(dtype, len))?.pop()?;
    p.bytes -= block.cap * dtype.size();
    Some(block)
}

/// Offers a freed block back; returns it when the pool is full (the caller frees it).
pub(crate) fn give(dtype: DType, len: usize, block: Block) -> Option<Block> {
    let bytes = block.cap * dtype.size();
    let mut p = pool().lock();
    if len == 0 || p.bytes + bytes > p.limit {
        return Some(block);
    }
    p.bytes += bytes;
    p.free.entry((dtype, len)).or_default().push(block);
    None
}
