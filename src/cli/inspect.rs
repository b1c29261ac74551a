//! `megatron inspect`: a model's padded vocabulary, every parameter's logical and local shape and
//! split, and the collectives of one transformer layer, measured.

use std::fmt::Write as _;

use anyhow::{Result, bail};
use clap::Args;
use megatron::comm::threads::launch;
use megatron::comm::{CommStats, ParallelState};
use megatron::models::GptConfig;
use megatron::models::gpt::{Block, Gpt};
use megatron::module::{Builder, Cx, Module, ParamSpec, Site, Split};
use megatron::parallel::{GroupKind, ParallelConfig, ParallelLayout};
use megatron::tensor::{DType, Tensor};
use serde_json::{Value, json};

use super::model_args::ArchitectureArgs;

/// Arguments of `megatron inspect`.
#[derive(Debug, Args)]
pub struct InspectArgs {
    #[command(flatten)]
    arch: ArchitectureArgs,
    /// Tensor-parallel size.
    #[arg(
        long = "tensor-model-parallel-size",
        visible_alias = "tp",
        default_value_t = 1
    )]
    tp: usize,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

/// Micro batch and sequence length of the measured layer (any values work; the report divides them out).
const B: usize = 2;
const S: usize = 3;

/// One collective of a phase: group, operation, calls and elements per call.
struct Collective {
    group: &'static str,
    op: &'static str,
    calls: u64,
    elements_per_call: u64,
}

/// The collectives in `stats` (f32 payloads: bytes / 4 elements).
fn collectives(stats: &[(GroupKind, CommStats)]) -> Vec<Collective> {
    stats
        .iter()
        .flat_map(|(kind, s)| {
            s.ops.iter().map(move |(op, o)| Collective {
                group: kind.name(),
                op: op.name(),
                calls: o.calls,
                elements_per_call: o.bytes / 4 / o.calls.max(1),
            })
        })
        .collect()
}

/// `elements` as a multiple of b·s·h (the layer's activation size) when it is one.
fn in_bsh(elements: u64, hidden: usize) -> String {
    let bsh = (B * S * hidden) as u64;
    if elements.is_multiple_of(bsh) {
        match elements / bsh {
            1 => "b·s·h".to_string(),
            k => format!("{k}·b·s·h"),
        }
    } else {
        format!("{elements} elements at b = {B}, s = {S}")
    }
}

fn split_name(spec: &ParamSpec) -> String {
    match spec.split {
        Split::Replicated => "replicated".to_string(),
        Split::Dim { dim, group } => format!("dim {dim} over {group} ({} parts)", spec.parts),
    }
}

/// Runs one forward and one backward of a transformer layer on tp ranks; returns rank 0's
/// communication in each.
fn layer_collectives(config: &GptConfig, tp: usize) -> Result<(Vec<Collective>, Vec<Collective>)> {
    let layout = ParallelLayout::new(&ParallelConfig::new(tp).with_tp(tp))?;
    let spec = config.spec().blocks.remove(0);
    let h = config.hidden_size;
    let out = launch(tp, |w| -> Result<_> {
        let ps = ParallelState::new(&w, &layout)?;
        let block = Block::build(&spec, &mut Builder::for_rank(0, ps.groups()).meta())?;
        let cx = Cx::new(&ps, 0).eval();
        let x = Tensor::zeros([S, B, h], DType::F32);
        let before = ps.stats();
        let (y, saved) = block.forward(&cx, Site::ROOT, &x)?;
        let middle = ps.stats();
        block.backward(&cx, Site::ROOT, saved, &y)?;
        let after = ps.stats();
        let diff = |a: &[(GroupKind, CommStats)],
                    b: &[(GroupKind, CommStats)]|
         -> Vec<(GroupKind, CommStats)> {
            b.iter()
                .zip(a)
                .map(|((k, n), (_, o))| (*k, n.since(o)))
                .filter(|(_, s)| !s.ops.is_empty())
                .collect()
        };
        Ok((diff(&before, &middle), diff(&middle, &after)))
    })
    .map_err(anyhow::Error::msg)?;
    let (fwd, bwd) = out.into_iter().next().expect("at least one rank");
    Ok((collectives(&fwd), collectives(&bwd)))
}

/// Runs `megatron inspect`.
pub fn run(args: &InspectArgs) -> Result<()> {
    if args.tp == 0 {
        bail!("--tensor-model-parallel-size must be at least 1");
    }
    let config = args.arch.config(args.tp)?;
    let model = Gpt::build(
        &config.spec(),
        &mut Builder::new(0).with_group(GroupKind::Tp, 0, args.tp).meta(),
    )?;
    let mut specs = Vec::new();
    model.visit_params(&mut |p| specs.push(p.spec().clone()));
    drop(model);
    let total: usize = specs.iter().map(|s| s.logical.numel()).sum();
    let local: usize = specs.iter().map(|s| s.local.numel()).sum();
    let (fwd, bwd) = layer_collectives(&config, args.tp)?;
    let padded = config.padded_vocab_size(args.tp);
    let h = config.hidden_size;
    if args.json {
        let params: Vec<Value> = specs
            .iter()
            .map(|s| json!({ "name": s.name, "logical": s.logical.dims(), "local": s.local.dims(), "split": split_name(s) }))
            .collect();
        let phase = |cs: &[Collective]| -> Vec<Value> {
            cs.iter()
                .map(|c| json!({ "group": c.group, "op": c.op, "calls": c.calls, "elements_per_call": in_bsh(c.elements_per_call, h) }))
                .collect()
        };
        let out = json!({
            "model": args.arch.model_name(),
            "tp": args.tp,
            "vocab_size": config.vocab_size,
            "padded_vocab_size": padded,
            "parameters_total": total,
            "parameters_per_rank": local,
            "parameters": params,
            "layer_collectives": { "forward": phase(&fwd), "backward": phase(&bwd) },
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{} at tensor-parallel size {}",
        args.arch.model_name(),
        args.tp
    );
    let _ = writeln!(
        out,
        "vocabulary {} padded to {padded} (a multiple of {} × {})",
        config.vocab_size, config.make_vocab_size_divisible_by, args.tp
    );
    let _ = writeln!(
        out,
        "parameters: {:.2}M in total, {:.2}M on each rank\n",
        total as f64 / 1e6,
        local as f64 / 1e6
    );
    let _ = writeln!(
        out,
        "{:<28} {:<16} {:<16} split",
        "parameter", "logical", "local"
    );
    for s in &specs {
        // One block stands for all of them.
        if s.name.starts_with("blocks.") && !s.name.starts_with("blocks.0.") {
            continue;
        }
        let _ = writeln!(
            out,
            "{:<28} {:<16} {:<16} {}",
            s.name,
            s.logical.to_string(),
            s.local.to_string(),
            split_name(s)
        );
        if s.name == "blocks.0.mlp.fc2.bias" && config.num_layers > 1 {
            let _ = writeln!(
                out,
                "{:<28} (as blocks.0)",
                format!("blocks.1 … blocks.{}", config.num_layers - 1)
            );
        }
    }
    let _ = writeln!(
        out,
        "\ncollectives of one transformer layer (b: micro batch, s: sequence length, h: hidden size):"
    );
    for (name, cs) in [("forward", &fwd), ("backward", &bwd)] {
        if cs.is_empty() {
            let _ = writeln!(out, "  {name:<9} none");
        }
        for c in cs.iter() {
            let _ = writeln!(
                out,
                "  {name:<9} {} {} × {} of {} f32",
                c.group,
                c.op,
                c.calls,
                in_bsh(c.elements_per_call, h)
            );
        }
    }
    print!("{out}");
    Ok(())
}
