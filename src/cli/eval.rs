//! `megatron eval`: a checkpoint's loss on a held-out set, without training (Megatron-LM's
//! `--skip-train` with evaluation). The set is read whole and in order, once ([`InOrder`]), at
//! any layout, with the same masks as training.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use clap::{Args, Parser};
use megatron::data::{
    Blend, InOrder, IndexedDataset, PackedDataset, PackedSidecar, SampleSource, is_packed,
};
use megatron::job::Eval;
use megatron::training::Sampler;

use super::mask_args::MaskArgs;
use super::output::{note, text};
use super::train::{TrainArgs, on_ranks};

/// Arguments of `megatron eval`.
#[derive(Debug, Args)]
pub struct EvalArgs {
    /// The checkpoint to evaluate (a save directory or an iteration directory).
    #[arg(long)]
    load: PathBuf,
    /// The held-out data: Megatron-LM indexed datasets (`PREFIX`, several in order), read
    /// whole, in order, without a split or shuffling.
    #[arg(long, visible_alias = "data-path", num_args = 1.., required = true)]
    data: Vec<String>,
    /// Global batches to evaluate [default: every sample once, the last batch filled with
    /// samples that count nothing].
    #[arg(long, value_parser = super::values::steps)]
    eval_iters: Option<u64>,
    /// Print the result as one JSON object (`loss`, `tokens`, `perplexity`).
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    masks: MaskArgs,
    /// Tensor-parallel size [default: the checkpoint's].
    #[arg(long = "tensor-model-parallel-size", visible_alias = "tp")]
    tp: Option<usize>,
    /// Sequence parallelism (with tp > 1).
    #[arg(long)]
    sequence_parallel: bool,
    /// Context-parallel size [default: the checkpoint's].
    #[arg(long = "context-parallel-size", visible_alias = "cp")]
    cp: Option<usize>,
    /// How context-parallel attention exchanges keys and values [default: the checkpoint's].
    #[arg(long)]
    cp_comm_type: Option<String>,
    /// Pipeline-parallel size [default: the checkpoint's].
    #[arg(long = "pipeline-model-parallel-size", visible_alias = "pp")]
    pp: Option<usize>,
    /// Virtual pipeline stages per rank [default: the checkpoint's].
    #[arg(long = "virtual-pipeline-model-parallel-size", visible_alias = "vpp")]
    vpp: Option<usize>,
    /// Data-parallel size [default: the checkpoint's].
    #[arg(long = "data-parallel-size", visible_alias = "dp")]
    dp: Option<usize>,
    /// Samples per microbatch [default: the checkpoint's].
    #[arg(long)]
    micro_batch_size: Option<usize>,
    /// Samples per global batch [default: the checkpoint's].
    #[arg(long)]
    global_batch_size: Option<usize>,
    /// Sequence length [default: the checkpoint's].
    #[arg(long)]
    seq_length: Option<usize>,
    /// Where the ranks compute: cpu or cuda [default: cpu].
    #[arg(long)]
    device: Option<String>,
}

/// `megatron train` parsed from arguments (to build the job an evaluation runs).
#[derive(Debug, Parser)]
struct AsTrain {
    #[command(flatten)]
    args: TrainArgs,
}

impl EvalArgs {
    /// The arguments of a `megatron train` run that loads the checkpoint and trains nothing.
    fn train_args(&self, seq_length: Option<usize>) -> Result<TrainArgs> {
        let mut argv: Vec<String> = vec!["eval".into(), "--load".into()];
        argv.push(self.load.to_string_lossy().into_owned());
        // Read as the training data too (the job needs some); nothing trains on it.
        argv.extend(["--split".into(), "100,0,0".into(), "--data".into()]);
        argv.extend(self.data.iter().cloned());
        argv.extend(["--train-iters".into(), "1".into()]);
        let flags = [
            (
                "--tensor-model-parallel-size",
                self.tp.map(|v| v.to_string()),
            ),
            ("--context-parallel-size", self.cp.map(|v| v.to_string())),
            ("--cp-comm-type", self.cp_comm_type.clone()),
            (
                "--pipeline-model-parallel-size",
                self.pp.map(|v| v.to_string()),
            ),
            (
                "--virtual-pipeline-model-parallel-size",
                self.vpp.map(|v| v.to_string()),
            ),
            ("--data-parallel-size", self.dp.map(|v| v.to_string())),
            (
                "--micro-batch-size",
                self.micro_batch_size.map(|v| v.to_string()),
            ),
            (
                "--global-batch-size",
                self.global_batch_size.map(|v| v.to_string()),
            ),
            (
                "--seq-length",
                self.seq_length.or(seq_length).map(|v| v.to_string()),
            ),
            ("--device", self.device.clone()),
        ];
        for (flag, value) in flags {
            if let Some(v) = value {
                argv.extend([flag.to_string(), v]);
            }
        }
        if self.sequence_parallel {
            argv.push("--sequence-parallel".into());
        }
        argv.extend(self.masks.given().into_iter().map(String::from));
        Ok(AsTrain::try_parse_from(argv)
            .context("the evaluation's settings")?
            .args)
    }
}

/// The sequence length packed datasets among `data` were packed for (the same for all, or an
/// error), or `None` for token data.
fn packed_seq_length(data: &[String]) -> Result<Option<usize>> {
    let mut found = None;
    for prefix in data {
        if !is_packed(prefix) {
            continue;
        }
        let dataset = IndexedDataset::open(prefix).context("--data")?;
        let seq = PackedSidecar::open(prefix, &dataset)?
            .capacity()
            .saturating_sub(1);
        match found {
            Some(other) if other != seq => bail!(
                "--data: packed for sequences of {other} and of {seq} tokens: give --seq-length"
            ),
            _ => found = Some(seq),
        }
    }
    Ok(found)
}

/// Runs `megatron eval`.
pub fn run(args: &EvalArgs) -> Result<()> {
    if args.data.iter().any(|v| v.trim().parse::<f64>().is_ok()) {
        bail!("--data: eval reads each dataset whole and in order; give prefixes without weights");
    }
    // Packed data is read at the sequence length it was packed for, unless told otherwise.
    let packed_for = match args.seq_length {
        Some(_) => None,
        None => packed_seq_length(&args.data)?,
    };
    let train = args.train_args(packed_for)?;
    let mut job = train.job()?;
    let plan = *job.train_data.plan();
    let blend = Blend::open(&args.data).context("--data")?;
    blend.validate().context("--data")?;
    let packed = blend
        .datasets
        .iter()
        .filter(|d| is_packed(d.prefix()))
        .count();
    let (source, samples): (Arc<dyn SampleSource>, usize) = match packed {
        0 => {
            let held_out = InOrder::new(blend.datasets.clone(), plan.seq_length, plan.global_batch)
                .context("--data")?;
            let samples = held_out.samples();
            (Arc::new(held_out), samples)
        }
        1 if blend.datasets.len() == 1 => {
            // Packed conversations: each sequence as it was packed, each conversation alone.
            let held_out = PackedDataset::in_order(
                blend.datasets[0].clone(),
                plan.seq_length,
                plan.global_batch,
            )
            .context("--data")?;
            let samples = held_out.samples();
            (Arc::new(held_out), samples)
        }
        _ => bail!(
            "--data: evaluate packed and token datasets one at a time ({packed} of the {} given \
             are packed)",
            blend.datasets.len()
        ),
    };
    let batches = (source.len() / plan.global_batch) as u64;
    let iters = args.eval_iters.unwrap_or(batches);
    if iters > batches {
        bail!(
            "--eval-iters {iters}: the data makes {samples} samples of {} tokens, {batches} \
             global batches of {}",
            plan.seq_length,
            plan.global_batch
        );
    }
    let masks = *job.train_data.masks();
    job.eval = Some(Eval {
        data: Sampler::new(source, plan)?.with_masks(masks)?,
        interval: 0,
        iters,
    });
    job.save = None;
    if !args.json {
        note!(
            "evaluating {} on {samples} samples of {} tokens ({iters} global batches of {}) with {}",
            args.load.display(),
            plan.seq_length,
            plan.global_batch,
            job.layout_name()
        );
    }
    let mut result = None;
    on_ranks(train.backend(), &job, &mut |runner, _| {
        let summary = runner(&job, &mut [])?;
        result = summary.evals.first().copied();
        Ok(())
    })?;
    let Some(record) = result else {
        return Ok(());
    };
    if record.counted == 0 {
        bail!("no target of the evaluated batches counts (every one masked): there is no loss");
    }
    let report = serde_json::json!({
        "loss": record.loss,
        "tokens": record.counted,
        "perplexity": record.perplexity(),
    });
    match args.json {
        true => text(&format!("{report}\n"))?,
        false => text(&format!(
            "loss {:.4} over {} counted tokens: perplexity {:.3}\n",
            record.loss,
            record.counted,
            record.perplexity()
        ))?,
    }
    Ok(())
}
