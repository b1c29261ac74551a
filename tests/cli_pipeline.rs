//! `megatron train --pp`: the pipeline-parallel runs of the command line against one stage, a
//! checkpoint saved at one pipeline size resumed at others, and the configurations Megatron-LM
//! refuses.

mod support;
use support::{TempDir, megatron};

/// The flags every run here shares: gpt-tiny cut to 4 layers, 8 microbatches a step.
const COMMON: [&str; 11] = [
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
];

/// The (step, loss, grad_norm) of every line of a run with `extra` flags.
fn curve(dir: &TempDir, name: &str, extra: &[&str]) -> Vec<(u64, f64, f64)> {
    support::curve(&COMMON, dir, name, extra)
}

fn assert_close(a: &[(u64, f64, f64)], b: &[(u64, f64, f64)], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (x, y) in a.iter().zip(b) {
        assert_eq!(x.0, y.0, "{what}");
        assert!(
            (x.1 - y.1).abs() <= 1e-6 * y.1,
            "{what}: loss {x:?} vs {y:?}"
        );
        // Gradients amplify the last-bit differences of tensor parallelism's sums (another
        // order of the partial products): norms to 1e-5.
        assert!(
            (x.2 - y.2).abs() <= 1e-5 * y.2,
            "{what}: grad norm {x:?} vs {y:?}"
        );
    }
}

#[test]
fn pipelines_of_the_command_line_train_as_one_stage() {
    let dir = TempDir::new("cli-pp");
    let steps = ["--train-iters", "4"];
    let reference = curve(&dir, "pp1", &steps);
    for (name, flags) in [
        ("pp2", &["--pp", "2"][..]),
        ("pp4", &["--pp", "4"]),
        ("pp2v2", &["--pp", "2", "--vpp", "2"]),
        (
            "pp2v2l",
            &["--pp", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
        ),
        ("tp2pp2", &["--tp", "2", "--pp", "2", "--dp", "2"]),
        (
            "uneven",
            &[
                "--pp",
                "2",
                "--decoder-first-pipeline-num-layers",
                "1",
                "--decoder-last-pipeline-num-layers",
                "3",
            ],
        ),
    ] {
        let mut args = flags.to_vec();
        args.extend(steps);
        assert_close(&curve(&dir, name, &args), &reference, name);
    }
}

#[test]
fn the_ends_counted_as_layers_of_the_split_train_as_one_stage() {
    // Megatron-LM's --account-for-embedding/loss-in-pipeline-split: 6 layers and both ends
    // make 8 over 2 stages (3 + 3 transformer layers) or over 2 × 2 virtual stages (1, 2, 2, 1);
    // 7 layers and the loss make 8 (4 + 3).
    let dir = TempDir::new("cli-pp-ends");
    let both = [
        "--account-for-embedding-in-pipeline-split",
        "--account-for-loss-in-pipeline-split",
    ];
    let six = ["--num-layers", "6", "--train-iters", "3"];
    let reference = curve(&dir, "six", &six);
    for (name, flags) in [
        ("pp2", &["--pp", "2"][..]),
        ("pp2v2", &["--pp", "2", "--vpp", "2"]),
    ] {
        let args = [&six[..], flags, &both].concat();
        assert_close(&curve(&dir, name, &args), &reference, name);
    }
    let seven = ["--num-layers", "7", "--train-iters", "3"];
    let reference = curve(&dir, "seven", &seven);
    let args = [
        &seven[..],
        &["--pp", "2", "--account-for-loss-in-pipeline-split"],
    ]
    .concat();
    assert_close(&curve(&dir, "pp2-loss", &args), &reference, "pp2-loss");
}

#[test]
fn sixteen_bit_pipelines_train_as_one_stage() {
    // 16-bit parameters on both pipeline ends (the tied embedding's gradients all-reduced
    // between them), loss scaling and the distributed optimizer. bf16 keeps f32 gradients, whose
    // sums run in another order; an f32 main value one rounding apart can round to the other
    // bf16 neighbour (2^-8 of it), after which the runs drift apart by more than f32's
    // precision: a grad norm 1.9e-5 apart at step 2 on one commit's data (the default data is
    // this repository's sources). fp16 accumulates gradients in fp16: one stage adds the
    // embedding's two gradients in its buffer (rounding each time), a pipeline adds them in the
    // all-reduce (rounding once), so they differ by about fp16's last place (2^-10).
    let dir = TempDir::new("cli-pp-16");
    for (name, precision, bound) in [
        ("bf16", &["--bf16"][..], 1e-4),
        ("fp16", &["--fp16", "--initial-loss-scale", "4096"], 2e-3),
    ] {
        let mut common = vec![
            "--train-iters",
            "4",
            "--dp",
            "2",
            "--use-distributed-optimizer",
        ];
        common.extend(precision);
        let reference = curve(&dir, &format!("{name}-pp1"), &common);
        for (i, flags) in [&["--pp", "2"][..], &["--pp", "2", "--vpp", "2"]]
            .into_iter()
            .enumerate()
        {
            let mut args = flags.to_vec();
            args.extend(&common);
            let run = curve(&dir, &format!("{name}-{i}"), &args);
            assert_eq!(run.len(), reference.len());
            for (x, y) in run.iter().zip(&reference) {
                let what = format!("{name} {flags:?}: {x:?} vs {y:?}");
                assert!((x.1 - y.1).abs() <= bound * y.1, "loss of {what}");
                assert!((x.2 - y.2).abs() <= bound * y.2, "grad norm of {what}");
            }
        }
    }
}

#[test]
fn a_checkpoint_saved_at_one_pipeline_size_resumes_at_others() {
    let dir = TempDir::new("cli-pp-ckpt");
    let save = dir.join("ckpt");
    let whole = curve(
        &dir,
        "whole",
        &[
            "--pp",
            "2",
            "--train-iters",
            "6",
            "--save",
            &save,
            "--save-interval",
            "3",
        ],
    );
    let from = format!("{save}/iter_0000003");
    for pp in ["1", "4"] {
        let resumed = curve(
            &dir,
            &format!("resumed{pp}"),
            &["--load", &from, "--pp", pp, "--train-iters", "6"],
        );
        // The checkpoint's whole tensors load bit for bit at any pipeline size: the first
        // resumed loss is the same. The gradient norm's squares are summed in f32 over other
        // stages, in another order: the norms, and through clipping the updates and the later
        // losses, agree to f32's last places (bit for bit only when the sums happen to round
        // alike, which depends on the data: the built-in corpus is the project's own text).
        assert_eq!(
            resumed[0].1.to_bits(),
            whole[3].1.to_bits(),
            "resumed at pp {pp}"
        );
        for (r, w) in resumed.iter().zip(&whole[3..]) {
            assert_eq!(r.0, w.0, "resumed at pp {pp}");
            assert!(
                (r.1 - w.1).abs() <= 1e-6 * w.1 && (r.2 - w.2).abs() <= 1e-6 * w.2,
                "resumed at pp {pp}: {r:?} vs {w:?}"
            );
        }
        assert_eq!(resumed.len(), 3);
    }
    // The checkpoint holds every stage's tensors under their logical names, once.
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(format!("{from}/meta.json")).unwrap())
            .unwrap();
    assert_eq!(meta["saved_pp"], 2);
    let (ok, stdout, stderr) =
        megatron(&["generate", "--load", &save, "--prompt", "fn", "--tp", "2"]);
    assert!(ok && stdout.starts_with("fn"), "{stderr}");
    // `convert` takes it too: to Hugging Face and back, the same generation.
    let hf = dir.join("hf");
    let back = dir.join("back");
    let (ok, _, stderr) = megatron(&["convert", "--from", &save, "--to", "hf-gpt2", &hf]);
    assert!(ok, "{stderr}");
    let (ok, _, stderr) = megatron(&["convert", "--from", "hf-gpt2", &hf, "--to", &back]);
    assert!(ok, "{stderr}");
    let (ok, again, stderr) = megatron(&["generate", "--load", &back, "--prompt", "fn"]);
    assert!(ok, "{stderr}");
    assert_eq!(again, stdout);
}

#[test]
fn pipeline_configurations_megatron_refuses_are_errors_with_the_numbers() {
    let cases: [(&[&str], &str); 7] = [
        (
            &["--pp", "3"],
            "4 layers of the model do not divide over --pipeline-model-parallel-size 3 stages",
        ),
        (
            &["--vpp", "2"],
            "--virtual-pipeline-model-parallel-size 2 needs a pipeline of at least 2 stages, got --pipeline-model-parallel-size 1",
        ),
        (
            &["--pp", "2", "--vpp", "4"],
            "2 layers of a pipeline rank do not divide over its 4 model chunks",
        ),
        (
            &[
                "--pp",
                "4",
                "--vpp",
                "2",
                "--global-batch-size",
                "6",
                "--num-layers",
                "8",
            ],
            "the remainder of M=6 microbatches divided by N=4",
        ),
        (
            &[
                "--pp",
                "2",
                "--vpp",
                "2",
                "--microbatch-group-size-per-vp-stage",
                "1",
            ],
            "should range in [PP=2, M=8]",
        ),
        (
            &[
                "--pp",
                "2",
                "--vpp",
                "2",
                "--num-layers-per-virtual-pipeline-stage",
                "1",
            ],
            "give one of --virtual-pipeline-model-parallel-size and",
        ),
        (
            &["--pp", "2", "--decoder-first-pipeline-num-layers", "5"],
            "the first stage's 5 (--decoder-first-pipeline-num-layers) and the last stage's 0 layers (--decoder-last-pipeline-num-layers) exceed the model's 4 layers",
        ),
    ];
    for (flags, expected) in cases {
        let mut args: Vec<&str> = COMMON.to_vec();
        args.extend(flags);
        let (ok, _, stderr) = megatron(&args);
        assert!(!ok && stderr.contains(expected), "{flags:?}: {stderr}");
    }
}

#[test]
fn inspect_shows_which_layers_each_stage_and_chunk_holds() {
    let (ok, stdout, stderr) = megatron(&[
        "inspect",
        "--num-layers",
        "8",
        "--pp",
        "2",
        "--vpp",
        "2",
        "--json",
    ]);
    assert!(ok, "{stderr}");
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let stages: Vec<(u64, u64, u64, u64)> = v["pipeline"]["stages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["pp_rank"].as_u64().unwrap(),
                s["chunk"].as_u64().unwrap(),
                s["layers"][0].as_u64().unwrap(),
                s["layers"][1].as_u64().unwrap(),
            )
        })
        .collect();
    // Megatron's assignment: chunk k of rank r is virtual stage k·pp + r, 2 layers each.
    assert_eq!(
        stages,
        [(0, 0, 0, 2), (0, 1, 4, 6), (1, 0, 2, 4), (1, 1, 6, 8)]
    );
    assert_eq!(v["pipeline"]["stages"][0]["embedding"], true);
    assert_eq!(v["pipeline"]["stages"][3]["head"], true);
    assert_eq!(v["pipeline"]["p2p_per_microbatch"]["boundaries"], 3);
    // Uneven ends.
    let (ok, stdout, _) = megatron(&[
        "inspect",
        "--num-layers",
        "8",
        "--pp",
        "3",
        "--decoder-first-pipeline-num-layers",
        "2",
    ]);
    assert!(ok);
    assert!(
        stdout.contains("rank 0 chunk 0 (virtual stage 0): blocks 0..2"),
        "{stdout}"
    );
    assert!(
        stdout.contains("rank 2 chunk 0 (virtual stage 2): blocks 5..8"),
        "{stdout}"
    );
}

#[test]
fn inspect_suggests_the_split_that_balances_the_stages() {
    // gpt2-medium (24 layers, vocabulary 50,304 × 1,024) on 4 stages: the output layer weighs
    // about 2.6 layers, so the even split loads the last rank most; three layers there and seven
    // on each other rank balance them (Megatron-LM's --decoder-last-pipeline-num-layers).
    let (ok, stdout, stderr) =
        megatron(&["inspect", "--model", "gpt2-medium", "--pp", "4", "--json"]);
    assert!(ok, "{stderr}");
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let balance = &v["pipeline"]["balance"];
    let loads = |split: &serde_json::Value| -> Vec<f64> {
        split["flops_per_token_per_rank"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| f.as_f64().unwrap())
            .collect()
    };
    let even = loads(&balance["given"]);
    assert!(
        even[0] == even[1] && even[1] == even[2] && even[3] > 1.3 * even[0],
        "{even:?}"
    );
    let best = &balance["most_balanced"];
    assert_eq!(best["decoder_last_pipeline_num_layers"], 3);
    assert_eq!(
        best["decoder_first_pipeline_num_layers"],
        serde_json::Value::Null
    );
    assert!(best["max_over_mean"].as_f64().unwrap() < 1.01, "{best}");
    // Both splits carry the whole model.
    let total = |l: &[f64]| l.iter().sum::<f64>();
    assert!((total(&even) - total(&loads(best))).abs() < 1e-6 * total(&even));
    // The text names the flag; a split already the most balanced says so.
    let (_, text, _) = megatron(&["inspect", "--model", "gpt2-medium", "--pp", "4"]);
    assert!(
        text.contains("most balanced: --decoder-last-pipeline-num-layers 3"),
        "{text}"
    );
    let (_, text, _) = megatron(&[
        "inspect",
        "--model",
        "gpt2-medium",
        "--pp",
        "4",
        "--decoder-last-pipeline-num-layers",
        "3",
    ]);
    assert!(
        text.contains("the most balanced split Megatron-LM's uneven-stage flags allow"),
        "{text}"
    );
}
