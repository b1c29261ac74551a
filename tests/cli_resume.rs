//! A resumed run trains as the run that saved the checkpoint did: its precision and loss
//! scaler, expert parallelism, MoE dispatcher and pipeline schedule come from the checkpoint
//! unless a flag says otherwise, a flag that contradicts the checkpoint is refused by name, and
//! an edited meta.json is refused like a changed tensor file.

mod support;

use support::{TempDir, log_lines, megatron};

/// A 2-layer MoE GPT at dp 2 × ep 2 in fp16 with a loss-scale window and the all-gather
/// dispatcher: every setting a resume must keep.
const MOE_FP16: [&str; 19] = [
    "train",
    "--quiet",
    "--num-layers",
    "2",
    "--seq-length",
    "16",
    "--micro-batch-size",
    "2",
    "--num-experts",
    "4",
    "--dp",
    "2",
    "--ep",
    "2",
    "--fp16",
    "--loss-scale-window",
    "100",
    "--moe-token-dispatcher-type",
    "allgather",
];

#[test]
fn a_resumed_run_keeps_what_the_checkpoint_trained_with() {
    let dir = TempDir::new("cli-resume");
    let save = dir.join("ckpt");
    let straight = dir.join("straight.jsonl");
    let mut args = MOE_FP16.to_vec();
    args.extend([
        "--train-iters",
        "3",
        "--save",
        &save,
        "--save-interval",
        "2",
    ]);
    args.extend(["--log-json", &straight]);
    let (ok, _, stderr) = megatron(&args);
    assert!(ok, "{stderr}");
    // Resumed from step 2 with nothing but the checkpoint: the settings are taken, and step 3
    // is the straight run's, bit for bit.
    let resumed = dir.join("resumed.jsonl");
    let iter2 = dir.join("ckpt/iter_0000002");
    let (ok, stdout, stderr) = megatron(&[
        "train",
        "--quiet",
        "--load",
        &iter2,
        "--train-iters",
        "3",
        "--log-json",
        &resumed,
    ]);
    assert!(ok, "{stderr}");
    for taken in [
        "--ep 2",
        "--etp 1",
        "--fp16",
        "--loss-scale-window 100",
        "--moe-token-dispatcher-type allgather",
    ] {
        assert!(stdout.contains(taken), "{taken} not taken: {stdout}");
    }
    let (straight, resumed) = (log_lines(&straight), log_lines(&resumed));
    assert_eq!(resumed.len(), 1);
    for key in ["step", "loss", "grad_norm", "loss_scale"] {
        assert_eq!(straight[2][key], resumed[0][key], "{key}");
    }
    // A precision flag other than the checkpoint's is refused, naming both.
    let (ok, _, stderr) = megatron(&["train", "--load", &iter2, "--train-iters", "3", "--bf16"]);
    assert!(!ok);
    assert!(
        stderr.contains("--bf16 contradicts the checkpoint, which trained in --fp16"),
        "{stderr}"
    );
    // Other MoE layers would load other weights: refused by name.
    let (ok, _, stderr) = megatron(&[
        "train",
        "--load",
        &iter2,
        "--train-iters",
        "3",
        "--moe-layer-freq",
        "[0,1]",
    ]);
    assert!(!ok);
    assert!(
        stderr.contains(
            "--moe-layer-freq [0,1] contradicts the checkpoint, whose model has MoE layers [1,1]"
        ),
        "{stderr}"
    );
    // meta.json edited (its iteration): refused as a changed file.
    let meta = format!("{iter2}/meta.json");
    let text = std::fs::read_to_string(&meta).unwrap();
    assert!(text.contains("\"iteration\": 2"), "{text}");
    std::fs::write(&meta, text.replace("\"iteration\": 2", "\"iteration\": 1")).unwrap();
    let (ok, _, stderr) = megatron(&["train", "--load", &iter2, "--train-iters", "3"]);
    assert!(!ok);
    assert!(
        stderr.contains("meta.json: checksum mismatch") && stderr.contains("the file changed"),
        "{stderr}"
    );
}

#[test]
fn a_resumed_pipeline_keeps_its_virtual_stages_at_its_pipeline_size() {
    let dir = TempDir::new("cli-resume-vpp");
    let save = dir.join("ckpt");
    let common = [
        "train",
        "--quiet",
        "--num-layers",
        "4",
        "--seq-length",
        "16",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "4",
    ];
    let mut args = common.to_vec();
    args.extend([
        "--pp",
        "2",
        "--vpp",
        "2",
        "--train-iters",
        "1",
        "--save",
        &save,
    ]);
    let (ok, _, stderr) = megatron(&args);
    assert!(ok, "{stderr}");
    let (ok, stdout, stderr) =
        megatron(&["train", "--quiet", "--load", &save, "--train-iters", "2"]);
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains("--pp 2") && stdout.contains("--vpp 2"),
        "{stdout}"
    );
    // At another pipeline size the schedule is the flags' (here none: 1F1B).
    let (ok, stdout, stderr) = megatron(&[
        "train",
        "--quiet",
        "--load",
        &save,
        "--train-iters",
        "2",
        "--pp",
        "1",
    ]);
    assert!(ok, "{stderr}");
    assert!(!stdout.contains("--vpp"), "{stdout}");
}
