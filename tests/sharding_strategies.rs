//! `--data-parallel-sharding-strategy` (Megatron-FSDP's names): `optim_grads` (ZeRO-2) keeps
//! only each rank's shard of every gradient bucket. Each bucket has a storage of its own,
//! allocated by a micro-batch's first write and freed after its reduce-scatter, which runs once
//! per micro-batch (as Megatron-FSDP's) into the rank's f32 shard of the main gradients.
//!
//! Against independent runs:
//! - At one micro-batch per step the reductions are the distributed optimizer's: the same run
//!   bit for bit, overlapped or not.
//! - At several, each micro-batch's gradients are reduce-scattered and the shards added, where
//!   the distributed optimizer sums the micro-batches first: the same run to the sums'
//!   rounding (losses to 1e-5, gradient norms to 1e-5), on every layout: dp 4, tp 2 with
//!   sequence parallelism, pp 2 with the interleaved schedule and with zb-h1 (the tied
//!   embedding's bucket summed over both ends first), ep 2, cp 2, bf16, fp16, two optimizer
//!   instances, full recompute, LoRA's adapters beside frozen weights; overlapping the reductions with the backward changes nothing, bit for bit.
//! - Each rank holds values, a shard of the gradients and a shard of Adam's state: 4 + 12/d
//!   bytes per parameter in f32, measured.
//! - Checkpoints are the distributed optimizer's: one saved under `optim_grads` resumes under
//!   `optim`, and back, and at another dp.
//!
//! `optim_grads_params` (ZeRO-3) also keeps only each rank's shard of the values: each module
//! of a stack is gathered around its passes, the rest of the model for each walk, and its
//! buckets are cut at those units.
//! - With a bucket per parameter (`--ddp-bucket-size 1`, so that the cut at units changes
//!   nothing) it is `optim_grads` bit for bit on every layout without a pipeline. With one,
//!   Megatron-LM keeps every chunk but the first stage's first in one bucket, which the units
//!   cut: there, and with buckets of 20,000 elements cut at units everywhere, it is the same
//!   run to the gradient norm's rounding (the ranks' partial sums of squares run over other
//!   shards). Prefetching the next unit changes nothing, bit for bit.
//! - Each rank holds 16/d bytes per parameter in f32, and whole values only for the root unit
//!   and one module (two, prefetching): what `megatron inspect` says.
//! - Its checkpoints resume under `optim`, under itself and at another dp.

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

const OPTIM: [&str; 2] = ["--data-parallel-sharding-strategy", "optim"];
const OPTIM_GRADS: [&str; 2] = ["--data-parallel-sharding-strategy", "optim_grads"];
const OPTIM_GRADS_PARAMS: [&str; 2] = ["--data-parallel-sharding-strategy", "optim_grads_params"];
/// With sharded parameters, each unit's gather starts the next one's.
const PREFETCH: [&str; 2] = ["--overlap-grad-reduce", "--overlap-param-gather"];

/// A step's loss and gradient norm (`None`: a step skipped by the loss scaler).
type Step = (f64, Option<f64>);

/// Each logged step's (loss, gradient norm) of a run of `flags`, and its standard output.
fn run(dir: &TempDir, name: &str, flags: &[&str]) -> (Vec<Step>, String) {
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
        .map(|l| (number(&l["loss"]), l["grad_norm"].as_f64()))
        .collect();
    (steps, stdout)
}

/// Asserts that `b` is `a` to the relative tolerance `tol`, step by step.
fn close(name: &str, a: &[Step], b: &[Step], tol: f64) {
    assert_eq!(a.len(), b.len(), "{name}");
    for (step, (a, b)) in a.iter().zip(b).enumerate() {
        let near = |x: f64, y: f64| (x - y).abs() <= tol * x.abs();
        let norms = match (a.1, b.1) {
            (Some(x), Some(y)) => near(x, y),
            (x, y) => x == y,
        };
        assert!(near(a.0, b.0) && norms, "{name} step {step}: {a:?} {b:?}");
    }
}

#[test]
fn at_one_micro_batch_sharded_gradients_are_the_distributed_optimizer_bit_for_bit() {
    let dir = TempDir::new("sharding-one-microbatch");
    for (name, flags) in [
        ("dp2", &["--dp", "2", "--micro-batch-size", "8"][..]),
        (
            "dp4-bf16",
            &["--dp", "4", "--micro-batch-size", "4", "--bf16"],
        ),
    ] {
        let (optim, _) = run(&dir, &format!("{name}-optim"), &[flags, &OPTIM].concat());
        let (grads, _) = run(
            &dir,
            &format!("{name}-grads"),
            &[flags, &OPTIM_GRADS].concat(),
        );
        assert_eq!(optim.len(), 4);
        assert_eq!(grads, optim, "{name}");
        let overlap = [flags, &OPTIM_GRADS, &["--overlap-grad-reduce"]].concat();
        let (overlapped, _) = run(&dir, &format!("{name}-overlap"), &overlap);
        assert_eq!(overlapped, optim, "{name}");
    }
}

#[test]
fn sharded_gradients_train_as_the_distributed_optimizer_on_every_layout() {
    let dir = TempDir::new("sharding-layouts");
    for (name, flags) in layouts() {
        let flags = &flags[..];
        let (optim, _) = run(&dir, &format!("{name}-optim"), &[flags, &OPTIM].concat());
        let (grads, _) = run(
            &dir,
            &format!("{name}-grads"),
            &[flags, &OPTIM_GRADS].concat(),
        );
        close(name, &optim, &grads, 1e-5);
        let overlap = [flags, &OPTIM_GRADS, &["--overlap-grad-reduce"]].concat();
        let (overlapped, _) = run(&dir, &format!("{name}-overlap"), &overlap);
        assert_eq!(overlapped, grads, "{name}");
    }
}

/// The state line's bytes per parameter: (total, values, gradients, optimizer).
fn state(stdout: &str) -> (f64, f64, f64, f64) {
    let line = stdout
        .lines()
        .find(|l| l.starts_with("rank 0's state: "))
        .unwrap_or_else(|| panic!("no state line in {stdout}"));
    let numbers: Vec<f64> = line
        .split(|c: char| !(c.is_ascii_digit() || c == '.'))
        .filter_map(|w| w.parse().ok())
        .collect();
    match numbers[..] {
        [_, total, values, grads, optimizer] => (total, values, grads, optimizer),
        _ => panic!("{line}: {numbers:?}"),
    }
}

#[test]
fn each_rank_keeps_a_shard_of_the_gradients_and_frees_whole_buckets_between_writes() {
    let dir = TempDir::new("sharding-memory");
    for d in [1usize, 2, 4] {
        let dp = d.to_string();
        let (_, stdout) = run(
            &dir,
            &format!("dp{d}"),
            &["--dp", &dp, OPTIM_GRADS[0], OPTIM_GRADS[1]],
        );
        let (total, values, grads, optimizer) = state(&stdout);
        let d = d as f64;
        // 4 + 12/d: f32 values whole, f32 gradient and Adam shards (to the buffers' padding).
        assert!((values - 4.0).abs() < 0.05, "{stdout}");
        assert!((grads - 4.0 / d).abs() < 0.05, "{stdout}");
        assert!((optimizer - 8.0 / d).abs() < 0.05, "{stdout}");
        assert!((total - (4.0 + 12.0 / d)).abs() < 0.1, "{stdout}");
    }
    // The whole buckets held at once: all of them at the first step (which learns the writes
    // and reduces after its walk), from the second on those between a micro-batch's first
    // write and their reduction: fewer, more with the reductions overlapped (in flight).
    let peaks = |name: &str, flags: &[&str]| -> Vec<u64> {
        let log = dir.join(&format!("{name}.jsonl"));
        run(&dir, name, &[flags, &["--dp", "2"], &OPTIM_GRADS].concat());
        support::log_lines(&log)
            .iter()
            .map(|l| l["gradient_buckets_peak_bytes"].as_u64().expect("logged"))
            .collect()
    };
    let plain = peaks("peaks", &[]);
    let overlapped = peaks("peaks-overlap", &["--overlap-grad-reduce"]);
    let all = plain[0];
    assert_eq!(overlapped[0], all);
    for (p, o) in plain[1..].iter().zip(&overlapped[1..]) {
        assert!(*p < all / 2, "{plain:?}");
        assert!(p <= o && *o < all, "{plain:?} {overlapped:?}");
    }
}

/// A run of `strategy` saved at step 2 and resumed from there: under itself, the uninterrupted
/// run bit for bit; under the distributed optimizer, and both at dp 4 (the state resharded over
/// 4 ranks), the same runs to `tol` (0: bit for bit).
fn resumes_across_strategies(name: &str, strategy: &[&str], tol: f64) {
    let dir = TempDir::new(name);
    let flags = [&["--dp", "2", "--micro-batch-size", "8"][..], strategy].concat();
    let save = dir.join("ckpt");
    let saving = [&flags[..], &["--save", &save, "--save-interval", "2"]].concat();
    let (whole, _) = run(&dir, "saving", &saving);
    let iter2 = dir.join("ckpt/iter_0000002");
    let (resumed, _) = run(&dir, "resumed", &[&flags[..], &["--load", &iter2]].concat());
    assert_eq!(resumed, whole[2..]);
    let optim_flags = ["--dp", "2", "--micro-batch-size", "8", "--load", &iter2];
    let (optim, _) = run(&dir, "optim", &[&optim_flags[..], &OPTIM].concat());
    close(name, &whole[2..], &optim, tol);
    let dp4 = ["--dp", "4", "--micro-batch-size", "4", "--load", &iter2];
    let (optim4, _) = run(&dir, "optim-dp4", &[&dp4[..], &OPTIM].concat());
    let (sharded4, _) = run(&dir, "sharded-dp4", &[&dp4[..], strategy].concat());
    assert_eq!(optim4.len(), 2);
    close(name, &optim4, &sharded4, tol);
}

#[test]
fn a_checkpoint_of_sharded_gradients_resumes_under_the_distributed_optimizer_and_back() {
    // At one micro-batch the two strategies are the same run bit for bit.
    resumes_across_strategies("sharding-resume", &OPTIM_GRADS, 0.0);
}

#[test]
fn a_strategy_that_cannot_serve_the_flags_is_refused_by_name() {
    for (flags, says) in [
        (
            &["--data-parallel-sharding-strategy", "zero2"][..],
            "\"zero2\" is not a sharding strategy: one of no_shard, optim, optim_grads, \
             optim_grads_params",
        ),
        (
            &[
                "--data-parallel-sharding-strategy",
                "no_shard",
                "--use-distributed-optimizer",
            ],
            "--data-parallel-sharding-strategy no_shard with --use-distributed-optimizer",
        ),
        (
            &[
                "--data-parallel-sharding-strategy",
                "optim_grads_params",
                "--cuda-graph-scope",
                "attn",
            ],
            "--data-parallel-sharding-strategy optim_grads_params with --cuda-graph-scope",
        ),
        (
            &[
                "--data-parallel-sharding-strategy",
                "optim_grads_params",
                "--pp",
                "2",
                "--num-layers",
                "4",
                "--num-layers-per-virtual-pipeline-stage",
                "1",
                "--overlap-grad-reduce",
                "--overlap-param-gather",
                "--overlap-param-gather-with-optimizer-step",
                "--micro-batch-size",
                "1",
                "--global-batch-size",
                "8",
            ],
            "optim_grads_params with --overlap-param-gather-with-optimizer-step",
        ),
        (
            &[
                "--data-parallel-sharding-strategy",
                "optim_grads",
                "--cuda-graph-scope",
                "attn",
            ],
            "--data-parallel-sharding-strategy optim_grads with --cuda-graph-scope",
        ),
        (
            &[
                "--data-parallel-sharding-strategy",
                "no_shard",
                "--overlap-param-gather",
                "--overlap-grad-reduce",
            ],
            "--overlap-param-gather overlaps the distributed optimizer's all-gather",
        ),
    ] {
        let args = [
            &["train", "--quiet", "--train-iters", "1", "--dp", "2"][..],
            flags,
        ]
        .concat();
        let (ok, _, stderr) = megatron(&args);
        assert!(!ok, "{flags:?}");
        assert!(stderr.contains(says), "{flags:?}: {stderr}");
    }
}

/// `megatron inspect` gives each strategy's bytes per parameter: for `optim_grads` what a run
/// measures on its rank 0, in f32 and in bf16, beside the formula.
#[test]
fn inspect_counts_the_sharded_gradients_as_training_measures_them() {
    let dir = TempDir::new("sharding-inspect");
    for (name, precision) in [("f32", &[][..]), ("bf16", &["--bf16"][..])] {
        let flags = [&["--dp", "4"][..], precision, &OPTIM_GRADS].concat();
        let (_, stdout) = run(&dir, name, &flags);
        let measured = state(&stdout);
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
        let state_json = &json["state_bytes_per_param"];
        assert_eq!(state_json["sharding_strategy"], "optim_grads");
        let rows = state_json["by_strategy"].as_array().expect("by_strategy");
        let row = rows
            .iter()
            .find(|r| r["strategy"] == "optim_grads")
            .expect("the optim_grads row");
        let get = |k: &str| row[k].as_f64().expect(k);
        let (total, values, grads, optimizer) = measured;
        for (key, got) in [
            ("total", total),
            ("values", values),
            ("grads", grads),
            ("optimizer", optimizer),
        ] {
            assert!(
                (get(key) - got).abs() < 0.05,
                "{name} {key}: {row} vs {stdout}"
            );
        }
        // The formula: whole + sharded / n.
        let formula = &row["formula"];
        let at = |f: &Value| {
            f["whole"].as_f64().unwrap()
                + f["sharded"].as_f64().unwrap() / f["ranks"].as_f64().unwrap()
        };
        assert!((at(formula) - get("total")).abs() < 0.05, "{name}: {row}");
    }
}

/// The layouts the sharded parameters train on, beside their flags.
fn layouts() -> Vec<(&'static str, Vec<&'static str>)> {
    vec![
        ("dp4", vec!["--dp", "4"]),
        (
            "tp2-sp",
            vec!["--tp", "2", "--sequence-parallel", "--dp", "2"],
        ),
        ("pp2-1f1b", vec!["--pp", "2", "--dp", "2"]),
        (
            "pp2-interleaved",
            vec![
                "--pp",
                "2",
                "--dp",
                "2",
                "--num-layers",
                "4",
                "--num-layers-per-virtual-pipeline-stage",
                "1",
            ],
        ),
        (
            "pp2-zbh1",
            vec!["--pp", "2", "--dp", "2", "--pipeline-schedule", "zb-h1"],
        ),
        (
            "pp2-zbv",
            vec![
                "--pp",
                "2",
                "--dp",
                "2",
                "--num-layers",
                "4",
                "--pipeline-schedule",
                "zbv",
            ],
        ),
        (
            "pp2-dualpipev",
            vec![
                "--pp",
                "2",
                "--dp",
                "2",
                "--num-layers",
                "4",
                "--pipeline-schedule",
                "dualpipev",
            ],
        ),
        (
            "ep2",
            vec!["--model", "mixtral-tiny", "--dp", "2", "--ep", "2"],
        ),
        ("cp2", vec!["--cp", "2", "--dp", "2"]),
        ("bf16", vec!["--dp", "2", "--bf16"]),
        ("fp16", vec!["--dp", "2", "--fp16"]),
        (
            "instances",
            vec!["--dp", "4", "--num-distributed-optimizer-instances", "2"],
        ),
        (
            "recompute",
            vec![
                "--dp",
                "2",
                "--recompute-granularity",
                "full",
                "--recompute-method",
                "uniform",
                "--recompute-num-layers",
                "1",
            ],
        ),
        (
            "lora",
            vec![
                "--dp",
                "2",
                "--lora-rank",
                "4",
                "--lora-target-modules",
                "linear_qkv",
            ],
        ),
        // A loop of several statements (the depths' bodies) and the tied embedding read
        // in it: the root unit's.
        (
            "mtp",
            vec![
                "--dp",
                "2",
                "--mtp-num-layers",
                "1",
                "--position-embedding-type",
                "rope",
            ],
        ),
        // The expert bias is read from the shards after the walk.
        (
            "expert-bias",
            vec![
                "--model",
                "mixtral-tiny",
                "--dp",
                "2",
                "--moe-router-enable-expert-bias",
                "--moe-router-score-function",
                "sigmoid",
            ],
        ),
    ]
}

#[test]
fn sharded_parameters_train_as_sharded_gradients_on_every_layout() {
    let dir = TempDir::new("sharding-params");
    let own_buckets = ["--ddp-bucket-size", "1"];
    for (name, flags) in layouts() {
        // Every parameter in a bucket of its own: the same layout, the same run bit for bit.
        let alone = [&flags[..], &own_buckets].concat();
        let (grads, _) = run(
            &dir,
            &format!("{name}-grads"),
            &[&alone[..], &OPTIM_GRADS].concat(),
        );
        let (params, _) = run(
            &dir,
            &format!("{name}-params"),
            &[&alone[..], &OPTIM_GRADS_PARAMS].concat(),
        );
        // With a pipeline, Megatron-LM keeps every chunk but the first stage's first in one
        // bucket (the bucket size applies to that one alone), which the units cut: another
        // layout, the same run to the norm's rounding.
        match flags.contains(&"--pp") {
            true => close(name, &grads, &params, 1e-6),
            false => assert_eq!(params, grads, "{name}"),
        }
        let (prefetched, _) = run(
            &dir,
            &format!("{name}-prefetch"),
            &[&alone[..], &OPTIM_GRADS_PARAMS, &PREFETCH].concat(),
        );
        assert_eq!(prefetched, params, "{name}");
        // Buckets cut at the units: the norm's partial sums run over other shards. With 16-bit
        // values, an update one rounding apart (the clip factor follows the norm) may round a
        // value to the other neighbour, 2⁻⁸ of it in bf16: the runs then drift further, the
        // norm by 1.0e-6 and the loss by 2e-7 in 4 bf16 steps on the data of one commit (the
        // default data is this repository's sources, so each commit draws other batches).
        let (cut, _) = run(
            &dir,
            &format!("{name}-units"),
            &[&flags[..], &OPTIM_GRADS_PARAMS].concat(),
        );
        let sixteen_bit = flags.iter().any(|f| ["--bf16", "--fp16"].contains(f));
        close(name, &grads, &cut, if sixteen_bit { 1e-5 } else { 1e-6 });
    }
}

/// Each logged step's peak of gathered values, in bytes, of a run of `flags`.
fn gathered_peaks(dir: &TempDir, name: &str, flags: &[&str]) -> Vec<u64> {
    run(dir, name, flags);
    support::log_lines(&dir.join(&format!("{name}.jsonl")))
        .iter()
        .map(|l| l["gathered_params_peak_bytes"].as_u64().expect("logged"))
        .collect()
}

#[test]
fn each_rank_keeps_a_shard_of_the_values_and_gathers_a_unit_at_a_time() {
    let dir = TempDir::new("sharding-params-memory");
    for d in [1usize, 2, 4, 8] {
        let dp = d.to_string();
        let (_, stdout) = run(
            &dir,
            &format!("dp{d}"),
            &["--dp", &dp, OPTIM_GRADS_PARAMS[0], OPTIM_GRADS_PARAMS[1]],
        );
        let (total, values, grads, optimizer) = state(&stdout);
        let d = d as f64;
        // 16/d: f32 values, gradients and Adam's state all sharded (to the padding).
        assert!((values - 4.0 / d).abs() < 0.05, "{stdout}");
        assert!((grads - 4.0 / d).abs() < 0.05, "{stdout}");
        assert!((optimizer - 8.0 / d).abs() < 0.05, "{stdout}");
        assert!((total - 16.0 / d).abs() < 0.1, "{stdout}");
    }
    // Four layers: the root unit and one layer gathered at once, two prefetching; what
    // inspect computes from the model (the buckets' padding aside).
    let four = ["--num-layers", "4", "--dp", "2"];
    let one = gathered_peaks(&dir, "one", &[&four[..], &OPTIM_GRADS_PARAMS].concat());
    let two = gathered_peaks(
        &dir,
        "two",
        &[&four[..], &OPTIM_GRADS_PARAMS, &PREFETCH].concat(),
    );
    let args = [
        &["inspect", "--model", "gpt-tiny", "--json"][..],
        &four,
        &OPTIM_GRADS_PARAMS,
    ]
    .concat();
    let (ok, out, stderr) = megatron(&args);
    assert!(ok, "{stderr}");
    let json: Value = serde_json::from_str(&out).expect("inspect --json");
    let params = json["parameters_total"].as_f64().expect("parameters_total");
    let rows = json["state_bytes_per_param"]["by_strategy"]
        .as_array()
        .expect("by_strategy");
    let row = rows
        .iter()
        .find(|r| r["strategy"] == "optim_grads_params")
        .expect("the optim_grads_params row");
    let expect = |key: &str| row[key].as_f64().expect(key) * params;
    for (peaks, key) in [
        (&one, "gathered_peak"),
        (&two, "gathered_peak_with_prefetch"),
    ] {
        for &peak in peaks {
            let (peak, expected) = (peak as f64, expect(key));
            assert!(
                peak >= expected && peak < expected * 1.01,
                "{key}: measured {peak}, inspect {expected}"
            );
        }
    }
    assert!(expect("gathered_peak_with_prefetch") < 4.0 * params * 0.75);
}

#[test]
fn a_checkpoint_of_sharded_parameters_resumes_under_every_strategy() {
    // The distributed optimizer's buckets are not cut at units: the norm's rounding.
    resumes_across_strategies("sharding-params-resume", &OPTIM_GRADS_PARAMS, 1e-6);
}
