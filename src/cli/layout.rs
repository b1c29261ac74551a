//! `megatron layout`: the distributed optimizer's buffers for a list of parameters (or a
//! registered model), as Megatron-LM lays them out, and each data-parallel rank's shards.

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Args;
use megatron::limits::MAX_PARAMS;
use megatron::models::gpt::Gpt;
use megatron::module::{Builder, Module};
use megatron::optimizer::{BufferLayout, LayoutConfig, ParamInfo, layout};
use megatron::parallel::GroupKind;
use megatron::tensor::DType;
use serde::Deserialize;
use serde_json::{Value, json};

use super::model_args::ArchitectureArgs;
use super::output::say;
use super::values;

/// The most shards (buckets × data-parallel ranks) `layout` lists: some tens of megabytes of
/// JSON at most, written in seconds.
const MAX_LISTED_SHARDS: usize = 1 << 17;

/// Arguments of `megatron layout`.
#[derive(Debug, Args)]
pub struct LayoutArgs {
    /// A JSON list of parameters in model order: `{"name", "shape", "dtype"?: "fp32" | "bf16" |
    /// "fp16", "shared_embedding"?: bool, "allreduce"?: bool}` (`allreduce: false` is an
    /// expert's parameter).
    #[arg(long, conflicts_with = "model")]
    params: Option<PathBuf>,
    #[command(flatten)]
    arch: ArchitectureArgs,
    /// With `--model`: the tensor-parallel size whose rank-0 parameters are laid out.
    #[arg(
        long = "tensor-model-parallel-size",
        visible_alias = "tp",
        default_value_t = 1,
        value_parser = values::ranks
    )]
    tp: usize,
    /// With `--model`: parameters in bf16.
    #[arg(long, conflicts_with = "fp16")]
    bf16: bool,
    /// With `--model`: parameters in fp16.
    #[arg(long)]
    fp16: bool,
    /// Data-parallel ranks (the shards of a dense buffer's buckets).
    #[arg(long = "dp", visible_alias = "data-parallel-size", value_parser = values::ranks)]
    dp: usize,
    /// Expert data-parallel ranks (the shards of an expert buffer's buckets) [default: dp].
    #[arg(long = "edp", visible_alias = "expert-data-parallel-size", value_parser = values::ranks)]
    edp: Option<usize>,
    /// Elements after which a bucket closes [default: one bucket per buffer, as Megatron-LM
    /// without --overlap-grad-reduce].
    #[arg(long = "bucket-size", visible_alias = "ddp-bucket-size", value_parser = values::elements)]
    bucket_size: Option<usize>,
    /// Pad bucket ends to a multiple of lcm(dp, 128, 65536) rather than lcm(dp, 128).
    #[arg(long)]
    pad_buckets_for_high_nccl_busbw: bool,
    /// Reduce gradients in fp32 whatever the parameters' dtype.
    #[arg(long)]
    grad_reduce_in_fp32: bool,
    /// The plain data-parallel layout (no padding, no shards).
    #[arg(long)]
    no_distributed_optimizer: bool,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

/// One entry of the parameter list.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ParamEntry {
    name: String,
    shape: Vec<usize>,
    dtype: Option<String>,
    shared_embedding: Option<bool>,
    allreduce: Option<bool>,
}

/// The dtype a name stands for.
fn parse_dtype(name: &str) -> Option<DType> {
    match name {
        "fp32" | "float32" | "float" | "torch.float32" => Some(DType::F32),
        "bf16" | "bfloat16" | "torch.bfloat16" => Some(DType::BF16),
        "fp16" | "float16" | "half" | "torch.float16" => Some(DType::F16),
        _ => None,
    }
}

/// The dtype's name in the output.
fn dtype_name(dtype: DType) -> &'static str {
    match dtype {
        DType::BF16 => "bf16",
        DType::F16 => "fp16",
        _ => "fp32",
    }
}

/// The parameters of `--params`.
fn read_params(path: &PathBuf) -> Result<Vec<ParamInfo>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("--params {}: cannot read", path.display()))?;
    let entries: Vec<ParamEntry> = serde_json::from_str(&text)
        .with_context(|| format!("{}: not a JSON list of parameters", path.display()))?;
    let mut params: Vec<ParamInfo> = Vec::with_capacity(entries.len());
    let mut seen: HashMap<String, usize> = HashMap::with_capacity(entries.len());
    let mut total: u128 = 0;
    for (i, e) in entries.into_iter().enumerate() {
        if let Some(j) = seen.insert(e.name.clone(), i) {
            bail!(
                "{}: parameter {:?} appears twice (entries {j} and {i})",
                path.display(),
                e.name
            );
        }
        let numel = megatron::limits::product(&e.shape);
        total += numel;
        if numel > MAX_PARAMS as u128 || total > MAX_PARAMS as u128 {
            bail!(
                "{}: parameter {:?} of shape {:?} brings the list to {total} elements or more, \
                 more than megatron-rs accepts (at most {MAX_PARAMS} parameters)",
                path.display(),
                e.name,
                e.shape
            );
        }
        let dtype = match &e.dtype {
            None => DType::F32,
            Some(name) => parse_dtype(name).with_context(|| {
                format!(
                    "{}: parameter {:?} has dtype {name:?}; use fp32, bf16 or fp16",
                    path.display(),
                    e.name
                )
            })?,
        };
        params.push(ParamInfo {
            numel: numel as usize,
            name: e.name,
            dtype,
            shared_embedding: e.shared_embedding.unwrap_or(false),
            expert: !e.allreduce.unwrap_or(true),
            unit: 0,
        });
    }
    Ok(params)
}

/// The rank-0 parameters of the registered model, in model order.
fn model_params(args: &LayoutArgs) -> Result<Vec<ParamInfo>> {
    if args.tp == 0 {
        bail!("--tensor-model-parallel-size must be at least 1");
    }
    let config = args.arch.config(args.tp, 1, false)?;
    let model = Gpt::build(
        &config.spec(),
        &mut Builder::new(0)
            .with_group(GroupKind::Tp, 0, args.tp)
            .specs_only(),
    )?;
    let dtype = if args.bf16 {
        DType::BF16
    } else if args.fp16 {
        DType::F16
    } else {
        DType::F32
    };
    let mut params = Vec::new();
    model.visit_params(&mut |p| {
        params.push(ParamInfo {
            name: p.spec().name.clone(),
            numel: p.spec().local.numel(),
            dtype,
            shared_embedding: false,
            expert: p.spec().is_expert(),
            unit: 0,
        })
    });
    Ok(params)
}

/// One buffer as JSON.
fn buffer_json(buffer: &BufferLayout, params: &[ParamInfo]) -> Value {
    let index_map: Vec<Value> = buffer
        .placements
        .iter()
        .map(|p| {
            json!({
                "param_index": p.param,
                "name": params[p.param].name,
                "numel": p.range.len(),
                "start": p.range.start,
                "end": p.range.end,
                "bucket_id": p.bucket,
            })
        })
        .collect();
    let per_rank: Vec<Value> = (0..buffer.shards.unwrap_or(0))
        .map(|rank| {
            let buckets: Vec<Value> = (0..buffer.buckets.len())
                .filter_map(|b| buffer.shard(rank, b).map(|s| (b, s)))
                .map(|(b, shard)| {
                    let parts: Vec<Value> = shard
                        .parts
                        .iter()
                        .map(|part| {
                            json!({
                                "param_index": part.param,
                                "gbuf_world": [part.gbuf_world.start, part.gbuf_world.end],
                                "gbuf_local": [part.gbuf_local.start, part.gbuf_local.end],
                                "param": [part.param_range.start, part.param_range.end],
                            })
                        })
                        .collect();
                    json!({
                        "bucket": b,
                        "shard_world_range": [shard.world.start, shard.world.end],
                        "params": parts,
                    })
                })
                .collect();
            json!({ "dp_rank": rank, "buckets": buckets })
        })
        .collect();
    json!({
        "param_dtype": dtype_name(buffer.key.param_dtype),
        "grad_dtype": dtype_name(buffer.key.grad_dtype),
        "is_expert_parallel": buffer.key.expert,
        "num_shards": buffer.shards,
        "numel": buffer.numel(),
        "numel_unpadded": buffer.numel_unpadded(),
        "param_index_map": index_map,
        "bucket_indices": buffer.buckets.iter().map(|b| [b.start, b.end]).collect::<Vec<_>>(),
        "per_rank": per_rank,
    })
}

/// Runs `megatron layout`.
pub fn run(args: &LayoutArgs) -> Result<()> {
    let params = match &args.params {
        Some(path) => read_params(path)?,
        None => model_params(args)?,
    };
    let config = LayoutConfig {
        dp: args.dp,
        edp: args.edp.unwrap_or(args.dp),
        bucket_size: args.bucket_size,
        pad_for_high_nccl_busbw: args.pad_buckets_for_high_nccl_busbw,
        grad_reduce_in_fp32: args.grad_reduce_in_fp32,
        distributed_optimizer: !args.no_distributed_optimizer,
        unit_buckets: false,
    };
    let buffers = layout(&params, &config)?;
    let shards: u128 = buffers
        .iter()
        .map(|b| b.buckets.len() as u128 * b.shards.unwrap_or(0) as u128)
        .sum();
    if shards > MAX_LISTED_SHARDS as u128 {
        bail!(
            "--dp {} (--edp {}): {shards} shards to list over {} buckets, more than `megatron \
             layout` prints (at most {MAX_LISTED_SHARDS}): raise --bucket-size or lower --dp",
            config.dp,
            config.edp,
            buffers.iter().map(|b| b.buckets.len()).sum::<usize>()
        );
    }
    if args.json {
        let out = json!({
            "buffers": buffers.iter().map(|b| buffer_json(b, &params)).collect::<Vec<_>>(),
        });
        say!("{}", serde_json::to_string(&out)?)?;
        return Ok(());
    }
    for (i, b) in buffers.iter().enumerate() {
        let shards = b.shards.map_or("not sharded".to_string(), |n| {
            format!("{n} shards per bucket")
        });
        say!(
            "buffer {i}: {} parameters, {} gradients{}: {} elements ({} unpadded), {} bucket(s), {shards}",
            dtype_name(b.key.param_dtype),
            dtype_name(b.key.grad_dtype),
            if b.key.expert { ", experts" } else { "" },
            b.numel(),
            b.numel_unpadded(),
            b.buckets.len(),
        )?;
        for (id, range) in b.buckets.iter().enumerate() {
            say!("  bucket {id}: [{}, {})", range.start, range.end)?;
            for p in b.placements.iter().filter(|p| p.bucket == id) {
                say!(
                    "    [{:>10}, {:>10})  {}",
                    p.range.start,
                    p.range.end,
                    params[p.param].name
                )?;
            }
            if let Some(n) = b.shards {
                let owners: Vec<String> = (0..n)
                    .filter_map(|r| b.shard(r, id))
                    .map(|s| format!("{}", s.parts.len()))
                    .collect();
                say!(
                    "    parameters touched per rank's shard: {}",
                    owners.join(" ")
                )?;
            }
        }
    }
    Ok(())
}
