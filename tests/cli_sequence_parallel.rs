//! `megatron train --sequence-parallel`: runs of the command line with sequence parallelism
//! against one rank and against tensor parallelism alone (dropout on, the preset's 0.1) with
//! pipelines, data parallelism and the distributed optimizer, recompute, bf16 and fp16; MoE
//! with tensor parallelism against one rank; a checkpoint saved with it resumed without it and
//! the reverse; `inspect`; what it refuses.

mod support;
use support::{TempDir, megatron};

/// The flags every run here shares: gpt-tiny cut to 4 layers, 8 microbatches a step, 4 steps.
const COMMON: [&str; 13] = [
    "train",
    "--quiet",
    "--num-layers",
    "4",
    "--seq-length",
    "16",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "8",
    "--seed=5",
    "--train-iters",
    "4",
];

fn curve(dir: &TempDir, name: &str, extra: &[&str]) -> Vec<(u64, f64, f64)> {
    support::curve(&COMMON, dir, name, extra)
}

/// Two runs' losses and gradient norms agree step by step to `bound` (relative): only the
/// order of f32 sums differs between them.
fn assert_close(a: &[(u64, f64, f64)], b: &[(u64, f64, f64)], bound: f64, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (x, y) in a.iter().zip(b) {
        assert_eq!(x.0, y.0, "{what}");
        assert!(
            (x.1 - y.1).abs() <= bound * y.1,
            "{what}: loss {x:?} vs {y:?}"
        );
        assert!(
            (x.2 - y.2).abs() <= bound * y.2,
            "{what}: grad norm {x:?} vs {y:?}"
        );
    }
}

#[test]
fn sequence_parallel_runs_train_as_tensor_parallelism_alone() {
    let dir = TempDir::new("cli-sp");
    // Each layout with sequence parallelism at tp 2 (or 4) against the same layout at tp 1, and
    // against tensor parallelism alone: only the order of f32 sums differs.
    for (name, tp, flags) in [
        ("tp2", "2", &[][..]),
        ("tp4", "4", &[]),
        ("pp2", "2", &["--pp", "2"]),
        ("pp2v2", "2", &["--pp", "2", "--vpp", "2"]),
        (
            "dp2dist",
            "2",
            &["--dp", "2", "--use-distributed-optimizer"],
        ),
        (
            "full",
            "2",
            &[
                "--recompute-granularity",
                "full",
                "--recompute-method",
                "uniform",
                "--recompute-num-layers",
                "1",
            ],
        ),
        ("selective", "2", &["--recompute-granularity", "selective"]),
        ("bf16", "2", &["--bf16"]),
    ] {
        let one = curve(&dir, &format!("{name}-tp1"), flags);
        let mut tensor = flags.to_vec();
        tensor.extend(["--tp", tp]);
        let without = curve(&dir, &format!("{name}-tp{tp}"), &tensor);
        tensor.push("--sequence-parallel");
        let with = curve(&dir, &format!("{name}-tp{tp}-sp"), &tensor);
        // bf16 products round their operands: an f32 sum taken in another order (tp's
        // all-reduce or reduce-scatter against one rank's sum) now and then moves an activation
        // across a bf16 rounding boundary, a change of 2⁻⁹ of it that the products carry, and
        // Adam's first steps (about lr·sign(g)) turn into whole updates where a gradient is near
        // zero: 16-bit precision's bound, as fp16's below; a misplaced collective moves the
        // curve by far more.
        let bound = if name == "bf16" { 2e-3 } else { 1e-5 };
        assert_close(
            &with,
            &one,
            bound,
            &format!("{name}: tp {tp} sequence parallel vs tp 1"),
        );
        assert_close(&with, &without, bound, &format!("{name}: with vs without"));
    }
    // fp16 keeps fp16 gradients: a norm's gradient is each rank's shard's, rounded to fp16,
    // then summed over tp (and rounded again) instead of summed over the whole sequence and
    // rounded once: they differ by about fp16's last place (2^-10).
    let fp16 = ["--tp", "2", "--fp16", "--initial-loss-scale", "4096"];
    let without = curve(&dir, "tp2fp16", &fp16);
    let mut with = fp16.to_vec();
    with.push("--sequence-parallel");
    assert_close(&curve(&dir, "tp2fp16-sp", &with), &without, 2e-3, "tp2fp16");
}

#[test]
fn a_checkpoint_saved_with_sequence_parallelism_resumes_without_it_and_the_reverse() {
    let dir = TempDir::new("cli-sp-ckpt");
    for (first, then) in [(true, false), (false, true)] {
        let flag = |on: bool| {
            if on {
                vec!["--sequence-parallel"]
            } else {
                vec![]
            }
        };
        let save = dir.join(&format!("ckpt-{first}"));
        let mut args = vec!["--tp", "2", "--save", &save, "--save-interval", "2"];
        args.extend(flag(first));
        let whole = curve(&dir, &format!("whole-{first}"), &args);
        let from = format!("{save}/iter_0000002");
        let mut args = vec!["--tp", "2", "--load", &from];
        args.extend(flag(then));
        let resumed = curve(&dir, &format!("resumed-{then}"), &args);
        // The checkpoint holds the same tensors either way, and the forward computes the same
        // sums in the same order with or without the flag: the first resumed loss is the
        // whole run's, bit for bit. The norms' gradients are summed in another order after it.
        let what = format!("saved with sequence parallelism {first}, resumed with {then}");
        assert_eq!(resumed.len(), 2, "{what}");
        assert_eq!(resumed[0].1.to_bits(), whole[2].1.to_bits(), "{what}");
        assert_close(&resumed, &whole[2..], 1e-5, &what);
        // Generation runs without sequence parallelism (the sequence grows a token at a time):
        // the checkpoint is the same either way.
        let (ok, stdout, stderr) =
            megatron(&["generate", "--load", &save, "--prompt", "fn", "--tp", "2"]);
        assert!(ok && stdout.starts_with("fn"), "{what}: {stderr}");
    }
}

#[test]
fn what_sequence_parallelism_refuses_names_the_numbers() {
    let (ok, _, stderr) = megatron(&[
        "train",
        "--quiet",
        "--num-layers",
        "2",
        "--tp",
        "2",
        "--sequence-parallel",
        "--seq-length",
        "15",
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "1",
        "--train-iters",
        "1",
    ]);
    assert!(!ok, "{stderr}");
    assert!(
        stderr.contains("--seq-length 15 is not divisible by --tensor-model-parallel-size 2"),
        "{stderr}"
    );
    // MoE layers at tp > 1 need it, as in Megatron-LM: refused without, naming the size.
    let (ok, _, stderr) = megatron(&[
        "train",
        "--quiet",
        "--model",
        "gpt-moe-tiny",
        "--num-layers",
        "2",
        "--tp",
        "2",
        "--seq-length",
        "16",
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "1",
        "--train-iters",
        "1",
    ]);
    assert!(!ok, "{stderr}");
    assert!(
        stderr.contains("MoE layers with tensor-parallel size 2 need sequence parallelism")
            && stderr.contains("--sequence-parallel"),
        "{stderr}"
    );
    // With one tensor-parallel rank there is nothing to split: accepted, said in one line.
    let (ok, _, stderr) = megatron(&[
        "train",
        "--quiet",
        "--num-layers",
        "2",
        "--sequence-parallel",
        "--seq-length",
        "16",
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "1",
        "--train-iters",
        "1",
    ]);
    assert!(ok, "{stderr}");
    assert_eq!(
        stderr
            .matches("--sequence-parallel with tensor-parallel size 1 does nothing")
            .count(),
        1,
        "{stderr}"
    );
}

#[test]
fn inspect_shows_the_collectives_and_the_exchanges_with_sequence_parallelism() {
    let (ok, stdout, stderr) = megatron(&[
        "inspect",
        "--model",
        "gpt-tiny",
        "--tp",
        "2",
        "--pp",
        "2",
        "--sequence-parallel",
    ]);
    assert!(ok, "{stderr}");
    for line in [
        "forward   tp all_reduce × 2 of b·s·h f32",
        "collectives of one transformer layer, with sequence parallelism",
        "forward   tp all_gather × 2 of b·s·h/tp f32",
        "forward   tp reduce_scatter × 2 of b·s·h/tp f32",
        // The output gradients' gathers, and qkv's and fc1's inputs gathered again.
        "backward  tp all_gather × 4 of b·s·h/tp f32",
        "backward  tp reduce_scatter × 2 of b·s·h/tp f32",
        "each an f32 activation of b·s·h/tp forward",
    ] {
        assert!(stdout.contains(line), "{line}\n{stdout}");
    }
    // The activation memory of one layer, measured both ways: smaller with it.
    let line = stdout
        .lines()
        .find(|l| l.starts_with("activation memory of one transformer layer"))
        .unwrap_or_else(|| panic!("{stdout}"));
    let mib: Vec<f64> = line
        .split_whitespace()
        .filter_map(|w| {
            w.trim_matches(|c: char| !c.is_ascii_digit() && c != '.')
                .parse::<f64>()
                .ok()
        })
        .collect();
    // s = 256, b = 1, then the two figures.
    assert!(mib.len() == 4 && mib[3] < mib[2], "{line}");
}

/// MoE with tensor parallelism (parallel folding: attention tp · dp, experts ep · etp · edp):
/// each tensor-parallel rank routes its shard of the sequence; the load-balancing counts are
/// summed over tp (the ranks' aux losses add up to the sequence's), the z loss averaged, the
/// router's gradient summed over tp. The same run as one rank holding every expert, with the
/// same routing (the log's load-balancing statistics included).
#[test]
fn moe_with_tensor_and_sequence_parallelism_trains_as_one_rank() {
    let dir = TempDir::new("cli-sp-moe");
    let moe = [
        "--model",
        "gpt-moe-tiny",
        "--num-layers",
        "2",
        "--moe-z-loss-coeff",
        "0.001",
    ];
    let flags = |extra: &[&'static str]| -> Vec<&'static str> {
        let mut v = moe.to_vec();
        v.extend(extra);
        v
    };
    let stats = |name: &str| -> Vec<(f64, f64)> {
        support::log_lines(&dir.join(&format!("{name}.jsonl")))
            .iter()
            .map(|l| {
                (
                    l["moe"]["aux_loss"].as_f64().unwrap(),
                    l["moe"]["z_loss"].as_f64().unwrap(),
                )
            })
            .collect()
    };
    for (balance, dispatcher) in [("aux_loss", "alltoall"), ("seq_aux_loss", "allgather")] {
        let base = [
            "--moe-router-load-balancing-type",
            balance,
            "--moe-token-dispatcher-type",
            dispatcher,
        ];
        let reference = curve(&dir, &format!("one-{balance}"), &flags(&base));
        let reference_stats = stats(&format!("one-{balance}"));
        for (name, layout) in [
            ("tp2", &["--tp", "2"][..]),
            ("tp2ep2", &["--tp", "2", "--ep", "2"]),
            ("tp2ep2dp2", &["--tp", "2", "--ep", "2", "--dp", "2"]),
            ("tp2etp2", &["--tp", "2", "--etp", "2"]),
            ("tp2pp2ep2", &["--tp", "2", "--pp", "2", "--ep", "2"]),
        ] {
            let mut args = flags(&base);
            args.extend(layout);
            args.push("--sequence-parallel");
            let name = format!("{name}-{balance}");
            let got = curve(&dir, &name, &args);
            assert_close(&got, &reference, 1e-5, &name);
            for (g, w) in stats(&name).iter().zip(&reference_stats) {
                assert!(
                    (g.0 - w.0).abs() <= 1e-5 * w.0,
                    "{name}: aux loss {g:?} vs {w:?}"
                );
                assert!(
                    (g.1 - w.1).abs() <= 1e-5 * w.1,
                    "{name}: z loss {g:?} vs {w:?}"
                );
            }
        }
    }
}
