//! `megatron groups`: prints Megatron's process groups for a parallel configuration.

use std::fmt::Write as _;

use super::output::{self, say};
use super::values;
use anyhow::{Context, Result};
use clap::Args;
use megatron_core::parallel::{
    GroupToken, Layout, Order, ParallelConfig, ParallelLayout, ValidConfig,
};
use serde_json::{Map, Value, json};

/// Arguments of `megatron groups`.
#[derive(Debug, Args)]
pub struct GroupsArgs {
    /// Total number of ranks.
    #[arg(long = "world-size", alias = "world_size", value_parser = values::ranks)]
    world_size: usize,
    /// Tensor-parallel size.
    #[arg(
        long = "tp",
        alias = "tensor-model-parallel-size",
        default_value_t = 1,
        value_parser = values::ranks
    )]
    tp: usize,
    /// Pipeline-parallel size.
    #[arg(
        long = "pp",
        alias = "pipeline-model-parallel-size",
        default_value_t = 1,
        value_parser = values::ranks
    )]
    pp: usize,
    /// Context-parallel size.
    #[arg(
        long = "cp",
        alias = "context-parallel-size",
        default_value_t = 1,
        value_parser = values::ranks
    )]
    cp: usize,
    /// Expert-parallel size.
    #[arg(
        long = "ep",
        alias = "expert-model-parallel-size",
        default_value_t = 1,
        value_parser = values::ranks
    )]
    ep: usize,
    /// Expert tensor-parallel size (default: the tensor-parallel size).
    #[arg(long = "etp", alias = "expert-tensor-parallel-size", value_parser = values::ranks)]
    etp: Option<usize>,
    /// Data-parallel size; derived from the world size when omitted, checked when given.
    #[arg(long = "dp", value_parser = values::ranks)]
    dp: Option<usize>,
    /// Layout order of the axes, first varying fastest.
    #[arg(long, default_value = "tp-cp-ep-dp-pp")]
    order: String,
    /// Extra group tokens to print, e.g. `tp-dp-cp` or `ep-edp` (repeatable).
    #[arg(long = "group")]
    groups: Vec<String>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

/// The tokens printed for each layout before any `--group`.
const DENSE_TOKENS: [&str; 4] = ["tp", "cp", "dp", "pp"];
const EXPERT_TOKENS: [&str; 4] = ["etp", "ep", "edp", "pp"];

/// Runs `megatron groups`.
pub fn run(args: &GroupsArgs) -> Result<()> {
    let mut config = ParallelConfig::new(args.world_size)
        .with_tp(args.tp)
        .with_pp(args.pp)
        .with_cp(args.cp)
        .with_ep(args.ep)
        .with_order(Order::parse(&args.order).context("--order")?);
    if let Some(etp) = args.etp {
        config = config.with_etp(etp);
    }
    if let Some(dp) = args.dp {
        config = config.with_dp(dp);
    }
    let layout = ParallelLayout::new(&config)?;
    let mut dense: Vec<(String, Vec<Vec<usize>>)> = Vec::new();
    let mut expert: Vec<(String, Vec<Vec<usize>>)> = Vec::new();
    let tokens = DENSE_TOKENS
        .iter()
        .chain(&EXPERT_TOKENS)
        .map(|t| t.to_string());
    let extra = args.groups.iter().cloned();
    let mut parsed: Vec<(String, GroupToken)> = Vec::new();
    for (i, token) in tokens.chain(extra).enumerate() {
        // The first four tokens are dense, the next four expert (`pp` appears in both).
        let mut parsed_token = GroupToken::parse(&token).context("--group")?;
        if (DENSE_TOKENS.len()..DENSE_TOKENS.len() + EXPERT_TOKENS.len()).contains(&i) {
            parsed_token.layout = Layout::Expert;
        }
        parsed.push((token, parsed_token));
    }
    for (name, token) in parsed {
        let target = match token.layout {
            Layout::Dense => &mut dense,
            Layout::Expert => &mut expert,
        };
        if !target.iter().any(|(n, _)| *n == name) {
            target.push((name, layout.token_groups(&token)));
        }
    }
    if args.json {
        let section = |families: &[(String, Vec<Vec<usize>>)]| {
            let map: Map<String, Value> = families
                .iter()
                .map(|(name, groups)| (name.clone(), json!(groups)))
                .collect();
            Value::Object(map)
        };
        let out = json!({ "dense": section(&dense), "expert": section(&expert) });
        say!("{}", serde_json::to_string(&out)?)?;
    } else {
        output::text(&table(layout.config(), &dense, &expert))?;
    }
    Ok(())
}

/// Formats the groups as a human-readable table.
fn table(
    c: &ValidConfig,
    dense: &[(String, Vec<Vec<usize>>)],
    expert: &[(String, Vec<Vec<usize>>)],
) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "world size {}, order {}", c.world_size, c.order);
    let width = dense
        .iter()
        .chain(expert)
        .map(|(name, _)| name.len())
        .max()
        .unwrap_or(2);
    let sections = [
        (
            format!(
                "dense: tp {} × cp {} × dp {} × pp {}",
                c.tp, c.cp, c.dp, c.pp
            ),
            dense,
        ),
        (
            format!(
                "expert: etp {} × ep {} × edp {} × pp {}",
                c.etp, c.ep, c.edp, c.pp
            ),
            expert,
        ),
    ];
    for (title, families) in sections {
        let _ = writeln!(out, "\n{title}");
        for (name, groups) in families {
            let size = groups.first().map_or(0, Vec::len);
            let _ = write!(out, "  {name:<width$}  {} × {size}:", groups.len());
            for group in groups {
                let members: Vec<String> = group.iter().map(usize::to_string).collect();
                let _ = write!(out, " [{}]", members.join(", "));
            }
            out.push('\n');
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_lists_every_group() {
        let layout = ParallelLayout::new(&ParallelConfig::new(8).with_tp(2).with_pp(2)).unwrap();
        let tp = GroupToken::parse("tp").unwrap();
        let dense = vec![("tp".to_string(), layout.token_groups(&tp))];
        let text = table(layout.config(), &dense, &[]);
        assert!(
            text.contains("tp  4 × 2: [0, 1] [2, 3] [4, 5] [6, 7]"),
            "{text}"
        );
        assert!(text.contains("dense: tp 2 × cp 1 × dp 2 × pp 2"), "{text}");
    }
}
