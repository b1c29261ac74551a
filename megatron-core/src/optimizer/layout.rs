//! The parameter and gradient buffers' layout, as Megatron-LM computes it
//! (`DistributedOptimizer.compute_full_param_layout` and, without the distributed optimizer,
//! `_compute_default_per_buffer_param_layout`), and each data-parallel rank's shards of it.
//!
//! - Parameters are grouped into buffers by (parameter dtype, gradient dtype, expert or not),
//!   the buffers in the order their first parameter comes.
//! - Inside a buffer the parameters are placed in reverse order (the order backward produces
//!   their gradients). With the distributed optimizer each start is rounded up to a multiple of
//!   64 elements; a bucket closes after a parameter once it holds at least `bucket_size`
//!   elements; a parameter shared by the first and the last pipeline stage (the tied embedding)
//!   sits alone in its bucket (and with `unit_buckets`, a bucket closes where the unit of
//!   gathering changes); and a closed bucket's end is padded to a multiple of
//!   lcm(dp, 128) (lcm(dp, 128, 65536) for NCCL's bus bandwidth). Without it nothing is padded
//!   and buckets are cut by size alone.
//! - Each bucket (not the buffer) is cut into `dp` equal shards; a rank updates the parameters'
//!   parts that fall in its shard of every bucket.

use std::ops::Range;

use thiserror::Error;

use crate::tensor::DType;

/// Every parameter start is a multiple of this many elements (distributed optimizer).
pub const PARAM_ALIGNMENT: usize = 64;

/// A layout that cannot be made.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum LayoutError {
    /// A size is zero.
    #[error("{what} must be at least 1, got 0")]
    Zero {
        /// Which size.
        what: &'static str,
    },
    /// A parameter's dtype cannot be a buffer's.
    #[error("parameter {name} has dtype {dtype}: buffers hold fp32, bf16 or fp16 parameters")]
    Dtype {
        /// The parameter.
        name: String,
        /// Its dtype.
        dtype: DType,
    },
}

/// One parameter, as the layout sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamInfo {
    /// Its name.
    pub name: String,
    /// Its elements (on this rank).
    pub numel: usize,
    /// Its dtype.
    pub dtype: DType,
    /// Held by the first and the last pipeline stage both (the tied embedding with pp > 1):
    /// alone in its bucket.
    pub shared_embedding: bool,
    /// An expert's parameter: reduced and sharded over the expert data-parallel group
    /// (Megatron-LM's `allreduce = False`).
    pub expert: bool,
    /// The unit of gathering holding it (a stack's module, numbered from 1; 0: the rest of the
    /// model), which [`LayoutConfig::unit_buckets`] cuts buckets at.
    pub unit: usize,
}

/// What a layout is made for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayoutConfig {
    /// Data-parallel ranks (the shards of a dense buffer's buckets).
    pub dp: usize,
    /// Expert data-parallel ranks (the shards of an expert buffer's buckets).
    pub edp: usize,
    /// Elements after which a bucket closes; `None`: one bucket per buffer (Megatron-LM's
    /// default without `--overlap-grad-reduce`).
    pub bucket_size: Option<usize>,
    /// Pad bucket ends to a multiple of lcm(dp, 128, 65536) rather than lcm(dp, 128).
    pub pad_for_high_nccl_busbw: bool,
    /// Reduce gradients in fp32 whatever the parameters' dtype.
    pub grad_reduce_in_fp32: bool,
    /// The distributed optimizer's layout (padded, sharded); else the plain data-parallel one.
    pub distributed_optimizer: bool,
    /// With the distributed optimizer, a bucket also closes where the parameters' unit of
    /// gathering changes (Megatron-FSDP's buckets per unit: `optim_grads_params` then
    /// gathers a unit's buckets alone).
    pub unit_buckets: bool,
}

impl LayoutConfig {
    /// The distributed optimizer's layout over `dp` ranks, one bucket per buffer.
    pub fn new(dp: usize) -> Self {
        LayoutConfig {
            dp,
            edp: dp,
            bucket_size: None,
            pad_for_high_nccl_busbw: false,
            grad_reduce_in_fp32: false,
            distributed_optimizer: true,
            unit_buckets: false,
        }
    }
}

/// What sets a buffer apart: Megatron-LM's `BufferKey`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BufferKey {
    /// The parameters' dtype.
    pub param_dtype: DType,
    /// The gradients' dtype.
    pub grad_dtype: DType,
    /// Whether it holds experts' parameters.
    pub expert: bool,
}

/// Where one parameter lies in its buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// The parameter's position in the list the layout was made from.
    pub param: usize,
    /// Its elements in the buffer.
    pub range: Range<usize>,
    /// Its bucket.
    pub bucket: usize,
}

/// One parameter's part in a rank's shard of a bucket (Megatron-LM's four ranges, less the
/// in-bucket one).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardPart {
    /// The parameter's position in the list the layout was made from.
    pub param: usize,
    /// The part's elements in the whole buffer.
    pub gbuf_world: Range<usize>,
    /// The part's elements in the rank's shard.
    pub gbuf_local: Range<usize>,
    /// The part's elements in the parameter itself.
    pub param_range: Range<usize>,
}

/// A rank's shard of one bucket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shard {
    /// The shard's elements in the whole buffer.
    pub world: Range<usize>,
    /// The parameters' parts in it, in buffer order.
    pub parts: Vec<ShardPart>,
}

/// One buffer's layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BufferLayout {
    /// What the buffer holds.
    pub key: BufferKey,
    /// The shards each bucket is cut into (`None` without the distributed optimizer).
    pub shards: Option<usize>,
    /// The parameters, in buffer order (the list's reverse).
    pub placements: Vec<Placement>,
    /// The buckets' elements, padding included.
    pub buckets: Vec<Range<usize>>,
    /// Each bucket's elements before its end's padding.
    pub bucket_numel_unpadded: Vec<usize>,
}

impl BufferLayout {
    /// The buffer's elements, padding included.
    pub fn numel(&self) -> usize {
        self.buckets.last().map_or(0, |b| b.end)
    }

    /// The buffer's elements less the buckets' end padding (Megatron-LM's `numel_unpadded`).
    pub fn numel_unpadded(&self) -> usize {
        self.bucket_numel_unpadded.iter().sum()
    }

    /// Rank `rank`'s shard of bucket `bucket` (`None` without the distributed optimizer, or
    /// for a rank or bucket out of range).
    pub fn shard(&self, rank: usize, bucket: usize) -> Option<Shard> {
        let shards = self.shards?;
        let range = self.buckets.get(bucket)?;
        if rank >= shards {
            return None;
        }
        let size = range.len() / shards;
        let world = range.start + rank * size..range.start + (rank + 1) * size;
        let parts = self
            .placements
            .iter()
            .filter_map(|p| {
                let start = p.range.start.max(world.start);
                let end = p.range.end.min(world.end);
                (end > start).then(|| ShardPart {
                    param: p.param,
                    gbuf_world: start..end,
                    gbuf_local: start - world.start..end - world.start,
                    param_range: start - p.range.start..end - p.range.start,
                })
            })
            .collect();
        Some(Shard { world, parts })
    }
}

/// `value` rounded up to a multiple of `divisor`.
fn round_up(value: usize, divisor: usize) -> usize {
    value.div_ceil(divisor) * divisor
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

fn lcm(a: usize, b: usize) -> usize {
    a / gcd(a, b) * b
}

/// What a bucket's end is padded to a multiple of.
pub fn bucket_end_divisor(dp: usize, pad_for_high_nccl_busbw: bool) -> usize {
    let base = lcm(dp, 128);
    if pad_for_high_nccl_busbw {
        lcm(base, 1 << 16)
    } else {
        base
    }
}

/// The layouts of `params`' buffers, in Megatron-LM's grouping order.
pub fn layout(
    params: &[ParamInfo],
    config: &LayoutConfig,
) -> Result<Vec<BufferLayout>, LayoutError> {
    for (what, v) in [
        ("the data-parallel size", config.dp),
        ("the expert data-parallel size", config.edp),
        ("the bucket size", config.bucket_size.unwrap_or(1)),
    ] {
        if v == 0 {
            return Err(LayoutError::Zero { what });
        }
    }
    // Group by key, in the order each key first comes.
    let mut groups: Vec<(BufferKey, Vec<usize>)> = Vec::new();
    for (i, p) in params.iter().enumerate() {
        if !matches!(p.dtype, DType::F32 | DType::BF16 | DType::F16) {
            return Err(LayoutError::Dtype {
                name: p.name.clone(),
                dtype: p.dtype,
            });
        }
        let key = BufferKey {
            param_dtype: p.dtype,
            grad_dtype: if config.grad_reduce_in_fp32 {
                DType::F32
            } else {
                p.dtype
            },
            expert: p.expert,
        };
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, members)) => members.push(i),
            None => groups.push((key, vec![i])),
        }
    }
    Ok(groups
        .into_iter()
        .map(|(key, members)| {
            let dp = if key.expert { config.edp } else { config.dp };
            if config.distributed_optimizer {
                sharded_buffer(key, &members, params, dp, config)
            } else {
                plain_buffer(key, &members, params, config.bucket_size)
            }
        })
        .collect())
}

/// The distributed optimizer's buffer: aligned starts, the shared embedding alone in its
/// bucket, bucket ends padded for `dp` shards.
fn sharded_buffer(
    key: BufferKey,
    members: &[usize],
    params: &[ParamInfo],
    dp: usize,
    config: &LayoutConfig,
) -> BufferLayout {
    let divisor = bucket_end_divisor(dp, config.pad_for_high_nccl_busbw);
    let mut buffer = BufferLayout {
        key,
        shards: Some(dp),
        placements: Vec::with_capacity(members.len()),
        buckets: Vec::new(),
        bucket_numel_unpadded: Vec::new(),
    };
    // Closes the open bucket at `end` (unpadded); the next one starts at its padded end.
    let close = |buffer: &mut BufferLayout, bucket_start: usize, end: usize| {
        buffer.bucket_numel_unpadded.push(end - bucket_start);
        let padded = round_up(end, divisor);
        buffer.buckets.push(bucket_start..padded);
        padded
    };
    let (mut next, mut bucket_start, mut open) = (0usize, 0usize, 0usize);
    let (mut last_end, mut unit) = (0, 0);
    for &i in members.iter().rev() {
        let p = &params[i];
        let mut start = round_up(next, PARAM_ALIGNMENT);
        let new_unit = config.unit_buckets && open > 0 && unit != p.unit;
        unit = p.unit;
        if (p.shared_embedding || new_unit) && open > 0 {
            // Megatron closes the bucket at the aligned start, its alignment counted in.
            bucket_start = close(&mut buffer, bucket_start, start);
            open = 0;
            start = bucket_start;
        }
        let end = start + p.numel;
        buffer.placements.push(Placement {
            param: i,
            range: start..end,
            bucket: buffer.buckets.len(),
        });
        open += 1;
        last_end = end;
        let full = config
            .bucket_size
            .is_some_and(|size| end - bucket_start >= size);
        if full || p.shared_embedding {
            bucket_start = close(&mut buffer, bucket_start, end);
            open = 0;
            next = bucket_start;
        } else {
            next = end;
        }
    }
    if open > 0 {
        close(&mut buffer, bucket_start, last_end);
    }
    buffer
}

/// The plain data-parallel buffer: parameters back to back, buckets cut by size.
fn plain_buffer(
    key: BufferKey,
    members: &[usize],
    params: &[ParamInfo],
    bucket_size: Option<usize>,
) -> BufferLayout {
    let mut buffer = BufferLayout {
        key,
        shards: None,
        placements: Vec::with_capacity(members.len()),
        buckets: Vec::new(),
        bucket_numel_unpadded: Vec::new(),
    };
    let (mut start, mut bucket_start, mut open) = (0usize, 0usize, 0usize);
    for &i in members.iter().rev() {
        let end = start + params[i].numel;
        buffer.placements.push(Placement {
            param: i,
            range: start..end,
            bucket: buffer.buckets.len(),
        });
        open += 1;
        if bucket_size.is_some_and(|size| end - bucket_start >= size) {
            buffer.bucket_numel_unpadded.push(end - bucket_start);
            buffer.buckets.push(bucket_start..end);
            bucket_start = end;
            open = 0;
        }
        start = end;
    }
    if open > 0 {
        buffer.bucket_numel_unpadded.push(start - bucket_start);
        buffer.buckets.push(bucket_start..start);
    }
    buffer
}

#[cfg(test)]
mod tests {
    use super::*;

    fn param(name: &str, numel: usize) -> ParamInfo {
        ParamInfo {
            name: name.into(),
            numel,
            dtype: DType::F32,
            shared_embedding: false,
            expert: false,
            unit: 0,
        }
    }

    #[test]
    fn the_seeds_example_is_one_256_element_bucket_today() {
        let params: Vec<_> = [4, 4, 5, 3]
            .iter()
            .enumerate()
            .map(|(i, &n)| param(&format!("p{i}"), n))
            .collect();
        let layouts = layout(&params, &LayoutConfig::new(4)).unwrap();
        assert_eq!(layouts.len(), 1);
        let b = &layouts[0];
        assert_eq!(b.numel(), 256);
        assert_eq!(b.numel_unpadded(), 196);
        let places: Vec<_> = b
            .placements
            .iter()
            .map(|p| (p.param, p.range.clone()))
            .collect();
        assert_eq!(
            places,
            [(3, 0..3), (2, 64..69), (1, 128..132), (0, 192..196)]
        );
        // Four shards of 64: each holds one parameter whole.
        for rank in 0..4 {
            let shard = b.shard(rank, 0).unwrap();
            assert_eq!(shard.world, rank * 64..(rank + 1) * 64);
            assert_eq!(shard.parts.len(), 1);
            assert_eq!(shard.parts[0].param, 3 - rank);
        }
    }
}
