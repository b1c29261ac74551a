//! `--num-distributed-optimizer-instances` (Megatron-LM's, HSDP): the distributed optimizer's
//! state sharded within each of k parts of the data-parallel group and replicated across them;
//! gradients reduce-scattered within a part, the shards all-reduced across parts, parameters
//! gathered within a part.
//!
//! Against independent runs:
//! - k = dp is the plain data-parallel run bit for bit: the shards are whole and the sum across
//!   the parts is the same all-reduce, in the same rank order.
//! - 1 < k < dp is the distributed optimizer's run to a named tolerance: each gradient is
//!   summed as (r0 + r1) + (r2 + r3) instead of ((r0 + r1) + r2) + r3, and the gradient norm's
//!   partial sums are taken over shards of another size (1e-6 of the norm, the losses to 1e-5).
//! - Overlapping the reduction and the gather changes nothing, bit for bit.
//! - Each rank holds 1/(dp/k) of the optimizer state, measured.
//! - A checkpoint saved with k parts resumes with another k (the format is the same).

mod support;

use serde_json::Value;
use support::{TempDir, megatron};

/// gpt-tiny with two layers, 32-token samples, 4 steps of 16 sequences, buckets of 20,000.
const BASE: [&str; 15] = [
    "train",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "16",
    "--train-iters",
    "4",
    "--num-layers",
    "2",
    "--seed",
    "5",
    "--ddp-bucket-size",
    "20000",
];

/// Each logged step's (loss, gradient norm) of a run of `flags`, and its standard output.
fn run(dir: &TempDir, name: &str, flags: &[&str]) -> (Vec<(f64, f64)>, String) {
    let log = dir.join(&format!("{name}.jsonl"));
    let mut args = BASE.to_vec();
    args.extend(flags);
    args.extend(["--log-json", &log]);
    let (ok, stdout, stderr) = megatron(&args);
    assert!(ok, "{name}: {stderr}");
    let number = |v: &Value| {
        v.as_f64()
            .unwrap_or_else(|| panic!("{name}: not a number: {v}"))
    };
    let steps = support::log_lines(&log)
        .iter()
        .map(|l| (number(&l["loss"]), number(&l["grad_norm"])))
        .collect();
    (steps, stdout)
}

const DISTOPT: &str = "--use-distributed-optimizer";
const INSTANCES: &str = "--num-distributed-optimizer-instances";

#[test]
fn as_many_instances_as_ranks_is_the_plain_data_parallel_run() {
    let dir = TempDir::new("instances-replicated");
    let (plain, _) = run(&dir, "plain", &["--dp", "4"]);
    let (replicated, _) = run(&dir, "k4", &["--dp", "4", DISTOPT, INSTANCES, "4"]);
    assert_eq!(plain.len(), 4);
    assert_eq!(replicated, plain);
}

#[test]
fn two_instances_train_as_one_to_the_sums_rounding_and_overlap_changes_nothing() {
    let dir = TempDir::new("instances-two");
    for (name, flags) in [
        ("dense", &["--dp", "4"][..]),
        // Experts over ep 2 within dp 4: edp 2 cut into two parts of one rank.
        (
            "moe",
            &["--dp", "4", "--model", "mixtral-tiny", "--ep", "2"],
        ),
        // dp 2 × cp 2: the parts cut the dp × cp group.
        ("cp", &["--dp", "2", "--cp", "2"]),
    ] {
        let one = [flags, &[DISTOPT]].concat();
        let two = [&one[..], &[INSTANCES, "2"]].concat();
        let (sharded, _) = run(&dir, &format!("{name}-k1"), &one);
        let (hybrid, _) = run(&dir, &format!("{name}-k2"), &two);
        assert_eq!(sharded.len(), hybrid.len(), "{name}");
        for (step, (a, b)) in sharded.iter().zip(&hybrid).enumerate() {
            assert!(
                (a.0 - b.0).abs() <= 1e-5 * a.0.abs(),
                "{name} step {step}: {a:?} {b:?}"
            );
            assert!(
                (a.1 - b.1).abs() <= 1e-6 * a.1.abs(),
                "{name} step {step}: {a:?} {b:?}"
            );
        }
        let overlaps = ["--overlap-grad-reduce", "--overlap-param-gather"];
        let (overlapped, _) = run(
            &dir,
            &format!("{name}-k2-overlap"),
            &[&two[..], &overlaps].concat(),
        );
        assert_eq!(overlapped, hybrid, "{name}");
    }
}

#[test]
fn each_rank_holds_the_optimizer_state_of_its_instance() {
    let dir = TempDir::new("instances-state");
    for (k, optimizer) in [
        ("1", "optimizer 2.0"),
        ("2", "optimizer 4.0"),
        ("4", "optimizer 8.0"),
    ] {
        let (_, stdout) = run(
            &dir,
            &format!("k{k}"),
            &["--dp", "4", DISTOPT, INSTANCES, k],
        );
        assert!(stdout.contains(optimizer), "k = {k}: {stdout}");
    }
}

#[test]
fn a_checkpoint_resumes_with_another_instance_count() {
    let dir = TempDir::new("instances-resume");
    let flags = ["--dp", "4", DISTOPT, INSTANCES, "4"];
    let (whole, _) = run(&dir, "whole", &flags);
    let save = dir.join("ckpt");
    let saving = [&flags[..], &["--save", &save, "--save-interval", "2"]].concat();
    assert_eq!(run(&dir, "saving", &saving).0, whole);
    // Saved by four replicated instances, resumed by one sharded over the four ranks, and by
    // the plain run: the state is the same, only the last sums' rounding may differ.
    let iter2 = dir.join("ckpt/iter_0000002");
    let (plain, _) = run(&dir, "plain", &["--dp", "4", "--load", &iter2]);
    assert_eq!(plain, whole[2..]);
    let (sharded, _) = run(&dir, "sharded", &["--dp", "4", DISTOPT, "--load", &iter2]);
    for (a, b) in whole[2..].iter().zip(&sharded) {
        assert!((a.0 - b.0).abs() <= 1e-5 * a.0.abs(), "{a:?} {b:?}");
        assert!((a.1 - b.1).abs() <= 1e-6 * a.1.abs(), "{a:?} {b:?}");
    }
}

#[test]
fn an_instance_count_that_does_not_fit_is_refused_by_name() {
    for (flags, says) in [
        (
            &["--dp", "2", INSTANCES, "2"][..],
            "--num-distributed-optimizer-instances 2 shards the distributed optimizer's state: \
             add --use-distributed-optimizer",
        ),
        (
            &["--dp", "4", DISTOPT, INSTANCES, "3"],
            "--num-distributed-optimizer-instances 3 must divide the dp group's 4 ranks",
        ),
        (
            &[
                "--dp",
                "4",
                DISTOPT,
                "--model",
                "mixtral-tiny",
                "--ep",
                "4",
                INSTANCES,
                "2",
            ],
            "must divide the edp group's 1 ranks",
        ),
        (&["--dp", "2", DISTOPT, INSTANCES, "0"], "0 is not in 1.."),
    ] {
        let args = [&["train", "--quiet", "--train-iters", "1"][..], flags].concat();
        let (ok, _, stderr) = megatron(&args);
        assert!(!ok, "{flags:?}");
        assert!(stderr.contains(says), "{flags:?}: {stderr}");
    }
}

/// `megatron inspect` gives each rank's optimizer bytes per parameter with k instances: what a
/// run measures on its rank 0.
#[test]
fn inspect_counts_the_state_of_an_instance_as_training_measures_it() {
    let dir = TempDir::new("instances-inspect");
    for k in ["1", "2", "4"] {
        let flags = ["--dp", "4", DISTOPT, INSTANCES, k];
        let (_, stdout) = run(&dir, &format!("k{k}"), &flags);
        let measured: f64 = stdout
            .split("optimizer ")
            .nth(1)
            .and_then(|rest| rest.split(')').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("k = {k}: no optimizer bytes in {stdout}"));
        let args = [
            &[
                "inspect",
                "--model",
                "gpt-tiny",
                "--num-layers",
                "2",
                "--json",
            ][..],
            &flags,
        ]
        .concat();
        let (ok, out, stderr) = megatron(&args);
        assert!(ok, "{stderr}");
        let json: Value = serde_json::from_str(&out).expect("inspect --json");
        let state = &json["state_bytes_per_param"];
        assert_eq!(
            state["distributed_optimizer_instances"],
            k.parse::<u64>().unwrap()
        );
        let counted = state["optimizer"].as_f64().expect("optimizer bytes");
        assert!(
            (counted - measured).abs() < 0.05,
            "k = {k}: {counted} vs {measured}"
        );
    }
}
