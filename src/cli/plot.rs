//! `megatron plot LOG.jsonl`: the loss curve of a run's log as a PNG.

use std::path::PathBuf;

use super::output::say;
use anyhow::{Context, Result, bail};
use clap::Args;
use megatron::report::plot::{Curves, draw};

/// Arguments of `megatron plot`.
#[derive(Debug, Args)]
pub struct PlotArgs {
    /// A JSON-lines log written by `megatron train --log-json`.
    log: PathBuf,
    /// The PNG to write [default: the log's path with `.png`].
    #[arg(long)]
    output: Option<PathBuf>,
}

/// Runs `megatron plot`.
pub fn run(args: &PlotArgs) -> Result<()> {
    let text = std::fs::read_to_string(&args.log)
        .with_context(|| format!("reading {}", args.log.display()))?;
    let curves =
        Curves::from_log(&text).with_context(|| format!("reading {}", args.log.display()))?;
    if curves.train.is_empty() {
        bail!(
            "{} holds no training step: nothing to draw (give the --log-json of a run)",
            args.log.display()
        );
    }
    let out = args
        .output
        .clone()
        .unwrap_or_else(|| args.log.with_extension("png"));
    let title = args
        .log
        .file_stem()
        .map_or_else(|| "loss".to_string(), |s| s.to_string_lossy().into_owned());
    draw(&curves, &title, &out)?;
    say!(
        "wrote {} ({} training steps, {} evaluations)",
        out.display(),
        curves.train.len(),
        curves.valid.len()
    )?;
    Ok(())
}
