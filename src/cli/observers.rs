//! What `megatron train` does with each step: the progress bar, the JSON-lines log, TensorBoard
//! scalars and the loss plot.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use megatron::job::{EvalRecord, Observer, StepRecord, TrainJob, comm_json};
use megatron::optimizer::LossScaling;
use megatron::report::plot::{self, Curves, Point};
use megatron::report::tensorboard::EventWriter;
use serde_json::json;

/// The progress bar: loss, tokens/s and ETA.
pub struct Progress {
    bar: ProgressBar,
    /// What lowers the loss scale after an overflow, for the skipped step's warning.
    after_overflow: &'static str,
}

impl Progress {
    /// A bar over `steps` steps (hidden when `quiet`).
    pub fn new(bar: ProgressBar) -> Self {
        bar.set_style(
            ProgressStyle::with_template(
                "{bar:30} {pos}/{len} {msg} [{elapsed_precise} < {eta_precise}]",
            )
            .expect("a valid progress template"),
        );
        Progress {
            bar,
            after_overflow: "",
        }
    }
}

impl Observer for Progress {
    fn start(&mut self, job: &TrainJob, first_step: u64) -> Result<()> {
        self.bar.set_length(job.steps);
        self.bar.set_position(first_step);
        self.after_overflow = match job.train.precision.scaling {
            LossScaling::Dynamic { .. } => "the loss scale drops after --hysteresis such steps",
            _ => "the static --loss-scale stays: a lower one may overflow less",
        };
        Ok(())
    }

    fn step(&mut self, r: &StepRecord) -> Result<()> {
        let m = &r.metrics;
        if m.skipped {
            // Megatron-LM's skipped iteration: the loss scaler saw an overflow.
            tracing::warn!(
                step = m.step,
                loss_scale = m.loss_scale.unwrap_or(1.0),
                "skipped the update: inf or NaN in the scaled gradients ({})",
                self.after_overflow
            );
        }
        let moe = m.routing.as_ref().map_or(String::new(), |r| {
            let (min, _, max) = r.tokens_min_mean_max();
            format!(
                " | aux {:.4} | tokens/expert {min}..{max} | dropped {:.1}%",
                r.mean_aux_loss(),
                100.0 * r.dropped_fraction()
            )
        });
        let counted = m
            .counted_tokens
            .map_or(String::new(), |c| format!(" | counted {c}/{}", m.tokens));
        let aux: String = m
            .aux_losses
            .iter()
            .map(|(name, loss)| format!(" | {name} {loss:.4}"))
            .collect();
        if m.empty_microbatches > 0 {
            tracing::warn!(
                step = m.step,
                "{} microbatches counted no token (every target masked): they add nothing to \
                 the loss or the gradients",
                m.empty_microbatches
            );
        }
        self.bar.set_message(format!(
            "loss {:.4}{aux}{counted}{moe} | {:.0} tok/s",
            m.loss,
            m.tokens as f64 / m.seconds
        ));
        self.bar.inc(1);
        Ok(())
    }

    fn eval(&mut self, r: &EvalRecord) -> Result<()> {
        tracing::info!(
            step = r.step,
            loss = format!("{:.4}", r.loss),
            perplexity = format!("{:.2}", r.perplexity()),
            "validation"
        );
        Ok(())
    }

    fn saved(&mut self, step: u64, dir: &Path) -> Result<()> {
        tracing::info!(step, dir = %dir.display(), "saved checkpoint");
        Ok(())
    }

    fn finish(&mut self) -> Result<()> {
        self.bar.finish_and_clear();
        Ok(())
    }
}

/// One JSON object per step and per evaluation, one per line, each flushed as it is written.
pub struct JsonLog {
    path: PathBuf,
    out: BufWriter<File>,
    comm: bool,
}

impl JsonLog {
    /// Appends to `path` when resuming (`append`), else creates it.
    pub fn create(path: &Path, comm: bool, append: bool) -> Result<Self> {
        use std::os::unix::fs::OpenOptionsExt;
        // Opened without waiting: a named pipe that nothing reads is an error (ENXIO) instead
        // of a run blocked before its first step; then writes wait as usual.
        let file = File::options()
            .write(true)
            .create(true)
            .append(append)
            .truncate(!append)
            .custom_flags(libc::O_NONBLOCK)
            .open(path)
            .and_then(|f| {
                use std::os::fd::AsRawFd;
                // SAFETY: fcntl on a descriptor this function owns; it touches no memory.
                let blocking = unsafe {
                    let flags = libc::fcntl(f.as_raw_fd(), libc::F_GETFL);
                    libc::fcntl(f.as_raw_fd(), libc::F_SETFL, flags & !libc::O_NONBLOCK)
                };
                if blocking < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(f)
            })
            .map_err(|e| match e.raw_os_error() {
                Some(libc::ENXIO) => anyhow::anyhow!(
                    "--log-json {}: a named pipe that no process reads (the run would wait for \
                     one)",
                    path.display()
                ),
                _ => {
                    anyhow::Error::new(e).context(format!("opening --log-json {}", path.display()))
                }
            })?;
        Ok(JsonLog {
            path: path.to_path_buf(),
            out: BufWriter::new(file),
            comm,
        })
    }

    /// Writes one line and flushes it: a run killed at any point keeps every step it logged.
    fn line(&mut self, v: serde_json::Value) -> Result<()> {
        writeln!(self.out, "{v}")
            .and_then(|()| self.out.flush())
            .with_context(|| format!("writing --log-json {}", self.path.display()))
    }
}

impl Observer for JsonLog {
    fn step(&mut self, r: &StepRecord) -> Result<()> {
        let m = &r.metrics;
        let mut v = json!({
            "step": m.step,
            "tokens": r.tokens,
            "loss": m.loss,
            "lr": m.lr,
            "grad_norm": m.grad_norm,
            "tokens_per_s": m.tokens as f64 / m.seconds,
        });
        if let Some(counted) = m.counted_tokens {
            v["counted_tokens"] = json!(counted);
        }
        if !m.aux_losses.is_empty() {
            let losses: serde_json::Map<String, serde_json::Value> = m
                .aux_losses
                .iter()
                .map(|(name, loss)| (name.clone(), json!(loss)))
                .collect();
            v["aux_losses"] = losses.into();
        }
        if m.empty_microbatches > 0 {
            v["empty_microbatches"] = json!(m.empty_microbatches);
        }
        if let Some((early, all)) = m.overlapped_buckets {
            v["overlapped_buckets"] = json!([early, all]);
        }
        if let Some(bytes) = m.gathered_params_peak_bytes {
            v["gathered_params_peak_bytes"] = json!(bytes);
        }
        if let Some(bytes) = m.gradient_buckets_peak_bytes {
            v["gradient_buckets_peak_bytes"] = json!(bytes);
        }
        if let Some(scale) = m.loss_scale {
            v["loss_scale"] = json!(scale);
            v["skipped"] = json!(m.skipped);
        }
        if let Some(r) = &m.routing {
            let (min, mean, max) = r.tokens_min_mean_max();
            v["moe"] = json!({
                "aux_loss": r.mean_aux_loss(),
                "z_loss": r.mean_z_loss(),
                "tokens_per_expert": r.tokens_per_expert,
                "tokens_per_expert_min": min,
                "tokens_per_expert_mean": mean,
                "tokens_per_expert_max": max,
                "dropped_fraction": r.dropped_fraction(),
            });
        }
        if let Some(g) = &m.graphs {
            v["graphs"] = json!({
                "captured": g.graphs(),
                "forward_captured": g.forward_captures,
                "backward_captured": g.backward_captures,
                "replays": g.replays,
                "eager_warmups": g.warmups,
                "static_buffers": g.static_inputs + g.static_grads,
                "static_buffer_bytes": g.static_bytes,
            });
        }
        if self.comm {
            v["comm"] = comm_json(&m.comm);
        }
        self.line(v)
    }

    fn eval(&mut self, r: &EvalRecord) -> Result<()> {
        self.line(json!({ "step": r.step, "tokens": r.tokens, "valid_loss": r.loss, "valid_ppl": r.perplexity(), "valid_counted_tokens": r.counted }))
    }

    fn finish(&mut self) -> Result<()> {
        self.out
            .flush()
            .with_context(|| format!("writing {}", self.path.display()))
    }
}

/// TensorBoard scalars under Megatron-LM's tags, flushed every step.
pub struct TensorBoard {
    writer: EventWriter,
}

impl TensorBoard {
    /// A new event file in `dir`.
    pub fn create(dir: &Path) -> Result<Self> {
        Ok(TensorBoard {
            writer: EventWriter::create(dir)?,
        })
    }
}

impl Observer for TensorBoard {
    fn step(&mut self, r: &StepRecord) -> Result<()> {
        let m = &r.metrics;
        let step = m.step + 1;
        self.writer.scalar("lm loss", step, m.loss)?;
        self.writer.scalar("learning-rate", step, m.lr)?;
        if !m.skipped {
            self.writer.scalar("grad-norm", step, m.grad_norm)?;
        }
        if let Some(scale) = m.loss_scale {
            self.writer.scalar("loss-scale", step, scale)?;
        }
        if let Some(r) = &m.routing {
            // Megatron-LM's MoE tags, and the spread of the experts' loads.
            let (min, mean, max) = r.tokens_min_mean_max();
            self.writer
                .scalar("load_balancing_loss", step, r.mean_aux_loss())?;
            self.writer.scalar("z_loss", step, r.mean_z_loss())?;
            self.writer
                .scalar("tokens-per-expert-min", step, min as f64)?;
            self.writer.scalar("tokens-per-expert-mean", step, mean)?;
            self.writer
                .scalar("tokens-per-expert-max", step, max as f64)?;
            self.writer
                .scalar("dropped-token-fraction", step, r.dropped_fraction())?;
        }
        for (name, loss) in &m.aux_losses {
            // Megatron-LM's tags: `mtp_1 loss`, ...
            self.writer.scalar(&format!("{name} loss"), step, *loss)?;
        }
        self.writer.scalar("lm loss vs tokens", r.tokens, m.loss)?;
        // Every step reaches the file: a killed run keeps what it logged.
        self.writer.flush()
    }

    fn eval(&mut self, r: &EvalRecord) -> Result<()> {
        self.writer.scalar("lm loss validation", r.step, r.loss)?;
        self.writer
            .scalar("lm loss validation ppl", r.step, r.perplexity())?;
        self.writer.flush()
    }

    fn finish(&mut self) -> Result<()> {
        self.writer.flush()
    }
}

/// The loss curve, drawn at the end of the run from what the run logged.
pub struct Plot {
    path: PathBuf,
    title: String,
    curves: Curves,
}

impl Plot {
    /// A plot at `path` titled `title`; `earlier` holds the curves of steps before a resume.
    pub fn new(path: PathBuf, title: String, earlier: Curves) -> Self {
        Plot {
            path,
            title,
            curves: earlier,
        }
    }
}

impl Observer for Plot {
    fn step(&mut self, r: &StepRecord) -> Result<()> {
        self.curves.train.push(Point {
            tokens: r.tokens as f64,
            loss: r.metrics.loss,
        });
        Ok(())
    }

    fn eval(&mut self, r: &EvalRecord) -> Result<()> {
        self.curves.valid.push(Point {
            tokens: r.tokens as f64,
            loss: r.loss,
        });
        Ok(())
    }

    fn finish(&mut self) -> Result<()> {
        // A plot is a convenience: without fonts, say so instead of failing the run.
        if let Err(e) = plot::draw(&self.curves, &self.title, &self.path) {
            tracing::warn!("could not draw {}: {e:#}", self.path.display());
        } else {
            tracing::info!(path = %self.path.display(), "wrote the loss plot");
        }
        Ok(())
    }
}
