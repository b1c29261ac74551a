//! `megatron train` runs of mixture-of-experts models read back step by step, and the check
//! that two of them trained alike (the same routing, losses and norms to f32's reordered sums).

use super::{TempDir, log_lines, megatron};

/// One logged step: loss, gradient norm, tokens per expert, aux loss and the model's reported
/// auxiliary losses (multi-token prediction's `mtp_k`).
#[derive(Debug)]
pub struct Step {
    pub loss: f64,
    pub grad_norm: f64,
    pub tokens_per_expert: Vec<u64>,
    pub aux_loss: f64,
    pub aux_losses: Vec<(String, f64)>,
}

/// The text the runs train on: the examples' frozen corpus. The built-in corpus is the
/// project's live sources, and a routing decision near a tie flips when they change (mixtral-tiny
/// at tp 2 × ep 2 did once), which the routing comparison below must not see.
const CORPUS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/data/corpus.txt");

/// The logged steps of `megatron` run with `common` (whose element 3 is the `--model` value,
/// replaced by `model`) and `extra` on [`CORPUS`], logging to `dir`/`name`.jsonl.
pub fn run_model(
    common: &[&str],
    dir: &TempDir,
    model: &str,
    name: &str,
    extra: &[&str],
) -> Vec<Step> {
    let log = dir.join(&format!("{name}.jsonl"));
    let mut args: Vec<&str> = common.to_vec();
    args[3] = model;
    args.extend(extra);
    args.extend(["--data", CORPUS, "--log-json", &log]);
    let (ok, _, stderr) = megatron(&args);
    assert!(ok, "{name}: {stderr}");
    log_lines(&log)
        .iter()
        .map(|l| Step {
            loss: l["loss"].as_f64().unwrap(),
            grad_norm: l["grad_norm"].as_f64().unwrap(),
            tokens_per_expert: l["moe"]["tokens_per_expert"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap())
                .collect(),
            aux_loss: l["moe"]["aux_loss"].as_f64().unwrap(),
            aux_losses: l["aux_losses"].as_object().map_or(Vec::new(), |o| {
                o.iter()
                    .map(|(k, v)| (k.clone(), v.as_f64().unwrap()))
                    .collect()
            }),
        })
        .collect()
}

/// f32 tolerance: the sums of expert parallelism run in another order (the experts' gradients
/// gathered by all-to-all instead of reduced over data parallelism), which moves the last bits.
pub fn assert_same_training(got: &[Step], want: &[Step], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(
            g.tokens_per_expert, w.tokens_per_expert,
            "{what} step {i}: routing decisions"
        );
        assert!(
            (g.loss - w.loss).abs() <= 1e-5 * w.loss,
            "{what} step {i}: loss {} vs {}",
            g.loss,
            w.loss
        );
        assert!(
            (g.grad_norm - w.grad_norm).abs() <= 1e-4 * w.grad_norm,
            "{what} step {i}: grad norm {} vs {}",
            g.grad_norm,
            w.grad_norm
        );
        // The aux loss sums the router's probabilities, computed from weights the previous
        // steps updated in another order of sums: as the gradient norm, to 1e-4 (mixtral-tiny's
        // SwiGLU experts moved it by 3e-5 at ep 2 in a debug build).
        assert!(
            (g.aux_loss - w.aux_loss).abs() <= 1e-4 * w.aux_loss.abs().max(1e-3),
            "{what} step {i}: aux loss {} vs {}",
            g.aux_loss,
            w.aux_loss
        );
        let names = |s: &Step| {
            s.aux_losses
                .iter()
                .map(|(n, _)| n.clone())
                .collect::<Vec<_>>()
        };
        assert_eq!(names(g), names(w), "{what} step {i}: reported losses");
        for ((name, g), (_, w)) in g.aux_losses.iter().zip(&w.aux_losses) {
            assert!(
                (g - w).abs() <= 1e-5 * w.abs(),
                "{what} step {i}: {name} {g} vs {w}"
            );
        }
    }
}
