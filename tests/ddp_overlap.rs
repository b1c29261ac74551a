//! `--overlap-grad-reduce`: each gradient bucket's data-parallel reduction starts during the
//! backward, once every gradient in it is final; `--overlap-param-gather`: each bucket's
//! all-gather of the updated parameters starts after the optimizer step and the next step waits
//! for it at its first read. The run is the same run bit for bit (the same collectives on the
//! same data) on every layout: tensor and sequence parallelism, pipelines with interleaving and a
//! zero-bubble schedule (the weights' gradients final in W passes), the distributed optimizer,
//! experts over expert data parallelism, context parallelism, bf16 and fp16. From the second
//! step on, the buckets start during the walk.

mod support;

use serde_json::Value;
use support::{TempDir, megatron};

/// gpt-tiny (two layers unless the layout says), 32-token samples, 4 steps, gradient buckets
/// of 20,000 elements unless the layout says (the first pipeline stage's first chunk cut into
/// several, as Megatron-LM cuts only that).
const BASE: [&str; 11] = [
    "--quiet",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "16",
    "--train-iters",
    "4",
    "--seed",
    "5",
];

/// What overlaps the first model chunk's gather with the optimizer step (one bucket a chunk).
const WITH_STEP: &str = "--overlap-param-gather-with-optimizer-step";

/// Each step's loss, gradient norm and overlapped buckets ([started during the walk, all] on
/// the logging rank) of a run of `flags` and the overlap flags `overlap`.
fn run(dir: &TempDir, name: &str, flags: &[&str], overlap: &[&str]) -> Vec<(Value, Value, Value)> {
    let log = dir.join(&format!("{name}-{}.jsonl", overlap.len()));
    let mut args = vec!["train"];
    args.extend(BASE);
    if !flags.contains(&"--num-layers") {
        args.extend(["--num-layers", "2"]);
    }
    if !flags.contains(&"--ddp-bucket-size") && !overlap.contains(&WITH_STEP) {
        args.extend(["--ddp-bucket-size", "20000"]);
    }
    args.extend(flags);
    args.extend(["--log-json", &log]);
    args.extend(overlap);
    let (ok, _, stderr) = megatron(&args);
    assert!(ok, "{name}, {overlap:?}: {stderr}");
    support::log_lines(&log)
        .iter()
        .map(|l| {
            (
                l["loss"].clone(),
                l["grad_norm"].clone(),
                l["overlapped_buckets"].clone(),
            )
        })
        .collect()
}

/// Trains each layout with and without overlap (the parameters' gather too with the
/// distributed optimizer): the same losses and gradient norms, bit for bit. From the second step on, the logging rank's buckets started during the walk: all of
/// them, or with a pipeline all but those of the tied embedding (reduced after its sum over the
/// embedding group, after the walk).
fn the_same_run_overlapped(test: &str, layouts: &[(&str, &[&str])]) {
    let dir = TempDir::new(test);
    for &(name, flags) in layouts {
        let plain = run(&dir, name, flags, &[]);
        let overlapped = run(&dir, name, flags, &["--overlap-grad-reduce"]);
        assert_eq!(plain.len(), 4, "{name}: {plain:?}");
        let numbers = |r: &[(Value, Value, Value)]| -> Vec<(Value, Value)> {
            r.iter().map(|(l, n, _)| (l.clone(), n.clone())).collect()
        };
        assert_eq!(numbers(&plain), numbers(&overlapped), "{name}");
        if flags.contains(&"--use-distributed-optimizer") {
            let both = ["--overlap-grad-reduce", "--overlap-param-gather"];
            let gathered = run(&dir, name, flags, &both);
            assert_eq!(
                numbers(&plain),
                numbers(&gathered),
                "{name}, --overlap-param-gather"
            );
        }
        assert!(plain.iter().all(|(.., b)| b.is_null()), "{name}: {plain:?}");
        let buckets = |step: usize| -> (u64, u64) {
            let b = &overlapped[step].2;
            (b[0].as_u64().unwrap(), b[1].as_u64().unwrap())
        };
        // The first step learns how often each gradient is written and reduces after the walk.
        let (early, all) = buckets(0);
        assert_eq!(early, 0, "{name}: {overlapped:?}");
        let (early, _) = buckets(1);
        let pipelined = flags.contains(&"--pp");
        match pipelined {
            true => assert!(0 < early && early < all, "{name}: {overlapped:?}"),
            false => assert_eq!(early, all, "{name}: {overlapped:?}"),
        }
        for step in 2..4 {
            assert_eq!(
                buckets(step),
                (early, all),
                "{name}, step {step}: {overlapped:?}"
            );
        }
        eprintln!("{name}: the same 4 steps; {early} of {all} buckets started during the walk");
    }
}

#[test]
fn data_tensor_and_context_parallel_runs_are_the_same_overlapped() {
    the_same_run_overlapped(
        "overlap-dp-tp-cp",
        &[
            ("dp2", &["--dp", "2"]),
            ("dp4-distopt", &["--dp", "4", "--use-distributed-optimizer"]),
            (
                "tp2-sp-dp2",
                &["--tp", "2", "--sequence-parallel", "--dp", "2"],
            ),
            ("cp2-dp2", &["--cp", "2", "--dp", "2"]),
            (
                "dp2-bf16-distopt",
                &["--dp", "2", "--bf16", "--use-distributed-optimizer"],
            ),
            (
                "cp2-dp2-distopt",
                &["--cp", "2", "--dp", "2", "--use-distributed-optimizer"],
            ),
            (
                "dp2-fp16-distopt",
                &["--dp", "2", "--fp16", "--use-distributed-optimizer"],
            ),
        ],
    );
}

#[test]
fn pipelines_are_the_same_overlapped() {
    the_same_run_overlapped(
        "overlap-pp",
        &[
            // The tied embedding's buckets start after the embedding group's sum.
            ("pp2-dp2", &["--pp", "2", "--dp", "2"]),
            (
                "pp2-zb-h1-dp2-distopt",
                &[
                    "--pp",
                    "2",
                    "--pipeline-schedule",
                    "zb-h1",
                    "--dp",
                    "2",
                    "--use-distributed-optimizer",
                ],
            ),
            (
                "pp2-vpp2-dp2-distopt",
                &[
                    "--num-layers",
                    "4",
                    "--pp",
                    "2",
                    "--num-layers-per-virtual-pipeline-stage",
                    "1",
                    "--dp",
                    "2",
                    "--use-distributed-optimizer",
                ],
            ),
            // The weights' gradients final in W passes.
            (
                "pp2-zb-h1-dp2",
                &["--pp", "2", "--pipeline-schedule", "zb-h1", "--dp", "2"],
            ),
        ],
    );
}

#[test]
fn experts_are_the_same_overlapped() {
    the_same_run_overlapped(
        "overlap-moe",
        &[
            (
                "moe-ep2-dp2",
                &["--model", "gpt-moe-tiny", "--ep", "2", "--dp", "2"],
            ),
            (
                "moe-ep2-dp4-distopt",
                &[
                    "--model",
                    "gpt-moe-tiny",
                    "--ep",
                    "2",
                    "--dp",
                    "4",
                    "--use-distributed-optimizer",
                ],
            ),
        ],
    );
}

#[test]
fn overlap_with_graph_scopes_is_refused_by_name() {
    let (ok, _, stderr) = megatron(&[
        "train",
        "--quiet",
        "--train-iters",
        "1",
        "--overlap-grad-reduce",
        "--cuda-graph-scope",
        "attn",
    ]);
    assert!(!ok);
    assert!(
        stderr.contains("--overlap-grad-reduce with --cuda-graph-scope"),
        "{stderr}"
    );
}

/// `--overlap-param-gather-with-optimizer-step`: the first model chunk updated first and its
/// gathers started during the others' update, every chunk one bucket. The same run as the plain
/// one with one bucket a chunk, bit for bit: pp 2 × vpp 2 at dp 2, in f32 and in bf16 (whose
/// compute copies each chunk's gathers refresh), and with experts over ep 2.
#[test]
fn the_first_chunks_gather_overlaps_the_optimizer_step() {
    let dir = TempDir::new("overlap-with-step");
    // pp 2 × vpp 2 (one layer a chunk) with the distributed optimizer, at `dp`.
    let interleaved = |dp: &'static str| {
        let mut flags = vec!["--num-layers", "4", "--pp", "2"];
        flags.extend(["--num-layers-per-virtual-pipeline-stage", "1"]);
        flags.extend(["--dp", dp, "--use-distributed-optimizer"]);
        flags
    };
    let layouts: [(&str, &str, &[&str]); 3] = [
        ("f32", "2", &[]),
        ("bf16", "2", &["--bf16"]),
        // Experts over ep 2 within dp 4: their own buckets, gathered over edp.
        ("moe", "4", &["--model", "mixtral-tiny", "--ep", "2"]),
    ];
    for (name, dp, extra) in layouts {
        let mut flags = interleaved(dp);
        flags.extend(extra);
        let mut plain_flags = flags.clone();
        plain_flags.extend(["--ddp-bucket-size", "1000000000"]);
        let plain = run(&dir, name, &plain_flags, &[]);
        let overlaps = ["--overlap-grad-reduce", "--overlap-param-gather", WITH_STEP];
        let overlapped = run(&dir, name, &flags, &overlaps);
        let numbers = |r: &[(Value, Value, Value)]| -> Vec<(Value, Value)> {
            r.iter().map(|(l, n, _)| (l.clone(), n.clone())).collect()
        };
        assert_eq!(plain.len(), 4, "{name}: {plain:?}");
        assert_eq!(numbers(&plain), numbers(&overlapped), "{name}");
    }
}

#[test]
fn the_parameters_gather_needs_the_distributed_optimizer_and_the_reduction_overlapped() {
    for (flags, says) in [
        (
            &["--overlap-param-gather", "--overlap-grad-reduce"][..],
            "add --use-distributed-optimizer",
        ),
        (
            &["--overlap-param-gather", "--use-distributed-optimizer"],
            "--overlap-param-gather needs --overlap-grad-reduce",
        ),
        (
            &[
                WITH_STEP,
                "--overlap-grad-reduce",
                "--use-distributed-optimizer",
            ],
            "--overlap-param-gather-with-optimizer-step needs --overlap-param-gather",
        ),
        (
            &[
                WITH_STEP,
                "--overlap-param-gather",
                "--overlap-grad-reduce",
                "--use-distributed-optimizer",
                "--ddp-bucket-size",
                "1000",
            ],
            "drop --ddp-bucket-size",
        ),
        (
            &[
                WITH_STEP,
                "--overlap-param-gather",
                "--overlap-grad-reduce",
                "--use-distributed-optimizer",
            ],
            "needs interleaved pipeline parallelism",
        ),
    ] {
        let mut args = vec!["train", "--quiet", "--train-iters", "1", "--dp", "2"];
        args.extend(flags);
        let (ok, _, stderr) = megatron(&args);
        assert!(!ok);
        assert!(stderr.contains(says), "{stderr}");
    }
}

/// A checkpoint saved by an overlapped run (every gather in flight waited for first) resumes, with
/// both overlaps again, as the plain run goes on: the same last steps bit for bit.
#[test]
fn a_checkpoint_of_an_overlapped_run_resumes_as_the_plain_run() {
    let dir = TempDir::new("overlap-resume");
    let flags = ["--dp", "2", "--use-distributed-optimizer"];
    let both = ["--overlap-grad-reduce", "--overlap-param-gather"];
    let plain = run(&dir, "plain", &flags, &[]);
    let save = dir.join("ckpt");
    let saving = [&flags[..], &["--save", &save, "--save-interval", "2"]].concat();
    let numbers = |r: &[(Value, Value, Value)]| -> Vec<(Value, Value)> {
        r.iter().map(|(l, n, _)| (l.clone(), n.clone())).collect()
    };
    assert_eq!(
        numbers(&run(&dir, "saving", &saving, &both)),
        numbers(&plain)
    );
    let iter2 = dir.join("ckpt/iter_0000002");
    let resuming = [&flags[..], &["--load", &iter2]].concat();
    let resumed = run(&dir, "resumed", &resuming, &both);
    assert_eq!(numbers(&resumed), numbers(&plain[2..]));
}
