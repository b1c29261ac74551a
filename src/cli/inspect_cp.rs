//! `megatron inspect --cp N`: what context parallelism moves and keeps for a model: the bytes one
//! rank sends for each attention layer and microbatch (the formula of
//! `megatron_core::context_parallel::traffic`, and the attention itself measured on a stand-in
//! and scaled to the sequence), and one layer's activation bytes per rank at cp against cp 1.

use std::fmt::Write as _;

use anyhow::{Result, bail};
use megatron::comm::ParallelState;
use megatron::comm::threads::launch;
use megatron::context_parallel::traffic::{self, LayerSizes, Traffic};
use megatron::context_parallel::{ContextParallel, CpChunks, CpCommType};
use megatron::models::GptConfig;
use megatron::module::{Cx, Recompute, Site};
use megatron::parallel::{ParallelConfig, ParallelLayout};
use megatron::tensor::{DType, Tensor};
use megatron::tensor_parallel::CausalSelfAttention;
use serde_json::{Value, json};

/// One layer's activation bytes per rank at cp, and at cp 1 without and with selective
/// recompute (`None`: not measured).
type LayerBytes = (usize, Option<(usize, usize)>);

/// What the report shows.
pub struct CpReport {
    kind: CpCommType,
    cp: usize,
    seq: usize,
    batch: usize,
    sizes: LayerSizes,
    formula: Traffic,
    /// `None`: not measured (more ranks than [`MEASURED_RANKS`]).
    measured: Option<Traffic>,
    /// One layer's activation bytes per rank at cp (`Err`: why it was not measured), and
    /// at cp 1 without and with selective recompute (`None`: not measured, its attention
    /// weights would not fit this machine's memory).
    activations: Result<LayerBytes, &'static str>,
}

/// The most thread ranks a measurement starts: the context-parallel group of the traffic's
/// stand-in, and the tp·cp ranks of one layer's activations. Past it the formula stands alone
/// (`inspect` describes any size it accepts, in seconds).
const MEASURED_RANKS: usize = 64;

/// The attention layer's sizes on one tensor-parallel rank of `config` at `tp`.
fn layer_sizes(config: &GptConfig, tp: usize, (seq, batch): (usize, usize)) -> LayerSizes {
    let heads = config.num_attention_heads / tp;
    let groups = config.query_groups();
    let groups = if groups >= tp { groups / tp } else { 1 };
    LayerSizes {
        seq,
        batch,
        groups,
        per_group: heads / groups.max(1),
        head_dim: config.head_dim(),
    }
}

/// The bytes one rank sends for attention of `sizes` at `cp` with `kind`, measured: the
/// attention op run forward and backward on `cp` thread ranks at a stand-in sequence of one
/// position per chunk and one sequence, scaled to `sizes` (every message is per position).
fn measured(kind: CpCommType, cp: usize, sizes: LayerSizes) -> Result<Traffic> {
    let heads = sizes.groups * sizes.per_group;
    let op = CausalSelfAttention::new(heads, 0.0).with_query_groups(sizes.groups);
    let seq = 2 * cp;
    let width = sizes.groups * (sizes.per_group + 2) * sizes.head_dim;
    let layout = ParallelLayout::new(&ParallelConfig::new(cp).with_cp(cp))?;
    let per_rank = launch(cp, |w| -> megatron::Result<Traffic> {
        let ps = ParallelState::new(&w, &layout)?.with_cp_comm_type(&w, kind)?;
        let Some(groups) = ps.context_parallel() else {
            return Ok(Traffic::default());
        };
        let sent = || groups.sent();
        let cx = Cx::new(&ps, 0);
        let chunks = CpChunks::new(seq, cp, ps.groups().cp_rank())?;
        let x = Tensor::full([chunks.local(), 1, width], 0.25, DType::F32);
        let before = sent();
        let (y, saved) = op.forward_chunks(&cx, Site::ROOT, &x)?;
        let forward = sent() - before;
        op.backward_chunks(&cx, Site::ROOT, saved, &y)?;
        Ok(Traffic {
            forward,
            backward: sent() - before - forward,
        })
    })
    .map_err(anyhow::Error::msg)?;
    let scale = (sizes.seq * sizes.batch / seq) as u64;
    let one = per_rank.first().copied().unwrap_or_default();
    Ok(Traffic {
        forward: one.forward * scale,
        backward: one.backward * scale,
    })
}

/// Whether one layer at cp `cp` fits this machine's memory on its tp·cp thread ranks: each
/// builds its tensor-parallel part of the layer's f32 weights, and keeps a generous bound on
/// its activations (the paper's 34·sbh for its s/cp positions, at 4 bytes, twice for their
/// gradients) and one pair of chunks' attention scores (a head's (s/2cp)² per rank's heads).
fn cp_layer_fits(config: &GptConfig, tp: usize, cp: usize, (seq, batch): (usize, usize)) -> bool {
    let mut one = config.clone();
    one.num_layers = 1;
    let weights = one.num_params(tp) as u128 / tp as u128;
    let (h, heads) = (
        config.hidden_size as u128,
        (config.num_attention_heads / tp.max(1)) as u128,
    );
    let local = (seq / cp) as u128 * batch as u128;
    let chunk = (seq / (2 * cp)) as u128;
    let per_rank = 4 * weights + 2 * 4 * 34 * local * h + 2 * 4 * heads * chunk * chunk;
    megatron::limits::check_memory("one layer's activations", per_rank * (tp * cp) as u128).is_ok()
}

/// The report for `config` at `tp` (with sequence parallelism when `sp`), cp `cp` of `kind`,
/// sequences of `seq` in microbatches of `batch`; one layer's activation bytes measured at cp,
/// and at cp 1 when `cp1_fits` (its attention weights, `s²` per head, fit this machine).
pub fn report(
    config: &GptConfig,
    (tp, sp): (usize, bool),
    (cp, kind): (usize, CpCommType),
    (seq, batch): (usize, usize),
    cp1_fits: bool,
) -> Result<CpReport> {
    if !seq.is_multiple_of(2 * cp) {
        bail!(
            "--context-parallel-size {cp} cuts each sequence into 2·cp = {} chunks: \
             --seq-length {seq} is not divisible by it",
            2 * cp
        );
    }
    kind.check_heads(config.num_attention_heads, config.query_groups(), tp, cp)?;
    let sizes = layer_sizes(config, tp, (seq, batch));
    let not_measured = if config.moe.is_some() {
        Some("a MoE layer")
    } else if tp * cp > MEASURED_RANKS {
        Some("more tp·cp ranks than the 64 measured")
    } else if !cp_layer_fits(config, tp, cp, (seq, batch)) {
        Some("more memory than this machine has")
    } else {
        None
    };
    let activations = match not_measured {
        Some(why) => Err(why),
        None => {
            use megatron::bench::activations::layer_bytes_with_cp;
            let at = |cp, recompute| {
                layer_bytes_with_cp(config, (seq, batch), (tp, sp), (cp, kind), recompute)
            };
            let one = match cp1_fits {
                true => Some((at(1, Recompute::Off)?, at(1, Recompute::Selective)?)),
                false => None,
            };
            Ok((at(cp, Recompute::Off)?, one))
        }
    };
    Ok(CpReport {
        kind,
        cp,
        seq,
        batch,
        sizes,
        formula: traffic::traffic(kind, cp, sizes),
        measured: match cp <= MEASURED_RANKS {
            true => Some(measured(kind, cp, sizes)?),
            false => None,
        },
        activations,
    })
}

impl CpReport {
    /// The report as JSON.
    pub fn json(&self) -> Value {
        json!({
            "cp": self.cp,
            "cp_comm_type": self.kind.name(),
            "seq_length": self.seq,
            "micro_batch_size": self.batch,
            "positions_per_rank": self.seq / self.cp,
            "attention_bytes_sent_per_rank_and_microbatch": {
                "formula": self.formula,
                "measured": self.measured,
                "measured_up_to_ranks": MEASURED_RANKS,
            },
            "layer_activation_bytes_per_rank": self.activations.ok().map(|(at, one)| json!({
                "cp1": one.map(|o| o.0),
                "cp1_selective_recompute": one.map(|o| o.1),
                "cp": at,
            })),
        })
    }

    /// The report as text.
    pub fn text(&self, out: &mut String) {
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        let LayerSizes {
            groups,
            per_group,
            head_dim,
            ..
        } = self.sizes;
        let hierarchy = match self.kind {
            CpCommType::A2aP2p { a2a, p2p } => format!(" ({a2a} × {p2p})"),
            _ => String::new(),
        };
        let _ = writeln!(
            out,
            "\ncontext parallelism: cp {} with {}{hierarchy}: each rank holds {} of the {} \
             positions (chunks r and {} − r of {})",
            self.cp,
            self.kind.name(),
            self.seq / self.cp,
            self.seq,
            2 * self.cp - 1,
            2 * self.cp
        );
        let sends = match self.measured {
            Some(m) => format!(
                "forward {:.2} MiB, backward {:.2} MiB (the formula: {:.2} and {:.2} MiB)",
                mib(m.forward),
                mib(m.backward),
                mib(self.formula.forward),
                mib(self.formula.backward)
            ),
            None => format!(
                "forward {:.2} MiB, backward {:.2} MiB by the formula (measured up to cp \
                 {MEASURED_RANKS})",
                mib(self.formula.forward),
                mib(self.formula.backward)
            ),
        };
        let _ = writeln!(
            out,
            "  attention sends per rank and microbatch (s = {}, b = {}, {groups} key/value \
             groups of {per_group} queries of {head_dim} per tensor-parallel rank, f32): {sends}",
            self.seq, self.batch,
        );
        if let Err(why) = self.activations {
            let _ = writeln!(
                out,
                "  activation memory of one transformer layer per rank: not measured ({why})"
            );
        }
        if let Ok((at, one)) = self.activations {
            let cp1 = match one {
                Some((one, selective)) => format!(
                    "{:.1} MiB at cp 1 ({:.2}×: cp 1's unfused attention keeps the s × s \
                     weights of each head, the blocks only each row's log-sum-exp) and {:.1} \
                     MiB at cp 1 with selective recompute ({:.2}×)",
                    mib(one as u64),
                    one as f64 / at.max(1) as f64,
                    mib(selective as u64),
                    selective as f64 / at.max(1) as f64
                ),
                None => "cp 1 not measured: its s × s attention weights would not fit this \
                         machine's memory"
                    .to_string(),
            };
            let _ = writeln!(
                out,
                "  activation memory of one transformer layer per rank (measured): {:.1} MiB \
                 at cp {} against {cp1}",
                mib(at as u64),
                self.cp,
            );
        }
    }
}
