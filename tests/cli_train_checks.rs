//! `megatron train` says when something is wrong instead of training on silently: non-finite
//! losses, a checkpoint's settings and architecture, output paths, flags that cannot work,
//! damaged data, and errors that keep the operating system's words.

mod support;
use support::{TempDir, log_lines, megatron, small_checkpoint, train_small as train};

#[test]
fn a_loss_or_gradient_norm_that_is_not_finite_stops_the_run_naming_the_step() {
    let dir = TempDir::new("nan");
    let save = dir.join("ckpt");
    // Huge initial weights: the first step's gradient norm overflows.
    let (ok, stdout, stderr) = train(&[
        "--init-method-std",
        "1e30",
        "--train-iters",
        "3",
        "--save",
        &save,
    ]);
    assert!(!ok, "{stdout}");
    assert!(
        stderr.contains("step 0:") && stderr.contains("not finite"),
        "{stderr}"
    );
    assert!(
        !stdout.contains("loss "),
        "no summary of a failed run: {stdout}"
    );
    // A learning rate that blows the weights up after some steps: the step is named, and no
    // checkpoint of what came of it exists.
    let (ok, _, stderr) = train(&[
        "--lr",
        "1e6",
        "--train-iters",
        "20",
        "--save",
        &save,
        "--save-interval",
        "1",
    ]);
    assert!(!ok);
    let step: u64 = stderr
        .split("step ")
        .nth(1)
        .and_then(|s| s.split(':').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no step named: {stderr}"));
    assert!(step < 20, "{stderr}");
    let latest: u64 = std::fs::read_to_string(format!("{save}/latest_checkpointed_iteration.txt"))
        .map_or(0, |s| s.trim().parse().unwrap());
    assert!(
        latest <= step,
        "a checkpoint after the failed step: {latest} > {step}"
    );
    // Turning the check off trains on; a checkpoint of non-finite weights is still refused.
    let (ok, _, stderr) = train(&[
        "--init-method-std",
        "1e30",
        "--train-iters",
        "2",
        "--no-check-for-nan-in-loss-and-grad",
        "--save",
        &dir.join("nan-ckpt"),
    ]);
    assert!(!ok);
    assert!(
        stderr.contains("a checkpoint of non-finite values is not saved"),
        "{stderr}"
    );
    assert!(!std::path::Path::new(&dir.join("nan-ckpt/iter_0000002")).exists());
}

#[test]
fn a_loaded_checkpoint_gives_the_settings_no_flag_gives_and_resumes_bit_for_bit() {
    let dir = TempDir::new("load-settings");
    let save = dir.join("ckpt");
    let first = dir.join("first.jsonl");
    // Four steps at TP 2 × DP 2, a global batch of 8 and seed 7, saved at step 2 and 4.
    let (ok, _, stderr) = train(&[
        "--tp",
        "2",
        "--dp",
        "2",
        "--global-batch-size",
        "8",
        "--seed",
        "7",
        "--split",
        "90,10,0",
        "--train-iters",
        "4",
        "--save",
        &save,
        "--save-interval",
        "2",
        "--log-json",
        &first,
    ]);
    assert!(ok, "{stderr}");
    // Resume from step 2 naming only the checkpoint and the steps.
    let second = dir.join("second.jsonl");
    let (ok, stdout, stderr) = megatron(&[
        "train",
        "--quiet",
        "--load",
        &format!("{save}/iter_0000002"),
        "--train-iters",
        "4",
        "--log-json",
        &second,
    ]);
    assert!(ok, "{stderr}");
    for taken in [
        "--tp 2",
        "--dp 2",
        "--global-batch-size 8",
        "--seq-length 16",
        "--micro-batch-size 2",
        "--seed 7",
        "--split 90,10,0",
        "--tokenizer byte",
    ] {
        assert!(stdout.contains(taken), "{taken} not taken: {stdout}");
    }
    assert!(stdout.contains("TP=2 × DP=2 on 4 thread ranks"), "{stdout}");
    let (first, second) = (log_lines(&first), log_lines(&second));
    assert_eq!(second.len(), 2);
    for (a, b) in first[2..].iter().zip(&second) {
        for key in ["step", "loss", "grad_norm", "lr"] {
            assert_eq!(a[key], b[key], "{key}: {a} vs {b}");
        }
    }
    // A flag still wins over the checkpoint: another layout resumes, reshaded.
    let (ok, stdout, stderr) = megatron(&[
        "train",
        "--quiet",
        "--load",
        &save,
        "--train-iters",
        "5",
        "--tp",
        "1",
    ]);
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains("TP=1 × DP=2") && !stdout.contains("--tp 2"),
        "{stdout}"
    );
}

#[test]
fn flags_that_contradict_the_checkpoints_model_are_errors() {
    let dir = TempDir::new("load-arch");
    let save = dir.join("ckpt");
    small_checkpoint(&save, 1, &[]);
    let cases: [(&[&str], &str); 4] = [
        (
            &["--num-layers", "2"],
            "--num-layers 2 contradicts the checkpoint, whose model has 1",
        ),
        (
            &["--hidden-size", "64"],
            "--hidden-size 64 contradicts the checkpoint, whose model has 128",
        ),
        (
            &["--model", "gpt2-small"],
            "--model gpt2-small contradicts the checkpoint, which holds gpt-tiny",
        ),
        (
            &["--vocab-size", "300"],
            "--vocab-size 300 contradicts the checkpoint",
        ),
    ];
    for (flags, expected) in cases {
        let mut args = vec!["train", "--quiet", "--load", &save, "--train-iters", "2"];
        args.extend(flags);
        let (ok, _, stderr) = megatron(&args);
        assert!(!ok && stderr.contains(expected), "{flags:?}: {stderr}");
    }
    // What does not change the weights may differ.
    let (ok, _, stderr) = megatron(&[
        "train",
        "--quiet",
        "--load",
        &save,
        "--train-iters",
        "2",
        "--model",
        "gpt-tiny",
        "--hidden-dropout",
        "0",
    ]);
    assert!(ok, "{stderr}");
}

#[test]
fn an_unwritable_save_directory_is_found_before_the_first_step() {
    let dir = TempDir::new("save-path");
    let log = dir.join("log.jsonl");
    let (ok, stdout, stderr) = train(&[
        "--train-iters",
        "3",
        "--save",
        "/proc/megatron-cannot-be-here",
        "--log-json",
        &log,
    ]);
    assert!(!ok);
    assert!(
        stderr.contains("--save /proc/megatron-cannot-be-here: cannot create the directory"),
        "{stderr}"
    );
    assert!(!stdout.contains("training gpt-tiny"), "{stdout}");
    assert!(log_lines(&log).is_empty());
}

#[test]
fn flags_that_cannot_work_are_refused_with_their_numbers() {
    let dir = TempDir::new("bad-flags");
    let cases: [(&[&str], &str); 11] = [
        (
            &["--fp16", "--bf16"],
            "--fp16 and --bf16 both given: the parameters take one 16-bit format",
        ),
        (
            &["--fp16", "--loss-scale", "0"],
            "invalid value '0' for '--loss-scale <LOSS_SCALE>': must be more than 0",
        ),
        (
            &["--bf16", "--loss-scale=-8"],
            "invalid value '-8' for '--loss-scale <LOSS_SCALE>': must be more than 0",
        ),
        (
            &[
                "--fp16",
                "--initial-loss-scale",
                "16",
                "--min-loss-scale",
                "32",
            ],
            "--min-loss-scale 32 is above --initial-loss-scale 16",
        ),
        (
            &["--ddp-bucket-size", "0"],
            "invalid value '0' for '--ddp-bucket-size <DDP_BUCKET_SIZE>': must be at least 1",
        ),
        (
            &["--lr", "0.1", "--min-lr", "0.5"],
            "--min-lr 0.5 must be between 0 and --lr 0.1",
        ),
        (
            &["--tokenizer", "byte", "--vocab-size", "300"],
            "--vocab-size 300 contradicts --tokenizer byte, which has 257 tokens",
        ),
        (
            &["--data", "0.7,my,0.3"],
            "has 3 items, and `0.7` looks like a weight",
        ),
        (&["--data", "0,a,0,b"], "gives every dataset weight 0"),
        (
            &["--eval-iters", "0", "--eval-interval", "1"],
            "invalid value '0' for '--eval-iters <EVAL_ITERS>': must be at least 1",
        ),
        (
            &["--save-interval", "0"],
            "invalid value '0' for '--save-interval <SAVE_INTERVAL>': must be at least 1",
        ),
    ];
    for (flags, expected) in cases {
        let mut args = vec!["train", "--quiet", "--train-iters", "1"];
        args.extend(flags);
        let (ok, _, stderr) = support::megatron_in(dir.path(), &args);
        assert!(!ok && stderr.contains(expected), "{flags:?}: {stderr}");
        assert!(!stderr.contains("error: error"), "{stderr}");
    }
}

#[test]
fn a_damaged_index_is_refused_before_training_starts() {
    let dir = TempDir::new("bad-idx");
    let lines: String = (0..20)
        .map(|i| format!("{{\"text\": \"document number {i}, long enough to train on.\"}}\n"))
        .collect();
    std::fs::write(dir.join("docs.jsonl"), lines).unwrap();
    let (ok, _, stderr) = megatron(&[
        "preprocess",
        "--input",
        &dir.join("docs.jsonl"),
        "--tokenizer",
        "byte",
        "--output-prefix",
        &dir.join("docs"),
        "--append-eod",
        "--quiet",
    ]);
    assert!(ok, "{stderr}");
    // The first sequence's pointer (after the 34-byte header and 20 i32 lengths) sent far past
    // the end of the .bin file: opening checks only the last sequence.
    let idx = dir.join("docs_text_document.idx");
    let mut bytes = std::fs::read(&idx).unwrap();
    let at = 34 + 4 * 20;
    bytes[at..at + 8].copy_from_slice(&(1i64 << 40).to_le_bytes());
    std::fs::write(&idx, bytes).unwrap();
    let log = dir.join("log.jsonl");
    let (ok, stdout, stderr) = train(&[
        "--data",
        &dir.join("docs_text_document"),
        "--train-iters",
        "50",
        "--log-json",
        &log,
    ]);
    assert!(!ok, "{stdout}");
    assert!(
        stderr.contains("docs_text_document.bin") && stderr.contains("sequence 0"),
        "{stderr}"
    );
    assert!(log_lines(&log).is_empty(), "steps ran on a damaged index");
}

#[test]
fn an_error_from_the_system_keeps_its_words() {
    // /dev/full: every write fails with ENOSPC, as a full disk does.
    let (ok, _, stderr) = train(&["--train-iters", "2", "--log-json", "/dev/full"]);
    assert!(!ok);
    assert!(
        stderr.contains("--log-json /dev/full") && stderr.contains("No space left on device"),
        "{stderr}"
    );
    assert!(!stderr.contains("error: error"), "{stderr}");
    // A dataset file the system cannot map: its words once, not once per layer of the report.
    let dir = TempDir::new("os-words");
    for f in ["d.idx", "d.bin"] {
        std::fs::create_dir_all(dir.path().join(f)).unwrap();
    }
    let (ok, _, stderr) = megatron(&["data", "inspect", &dir.join("d")]);
    assert!(!ok);
    assert!(stderr.contains("d.idx: cannot map: "), "{stderr}");
    assert_eq!(stderr.matches("(os error").count(), 1, "{stderr}");
}

#[test]
fn fp16_logs_its_loss_scale_and_the_steps_it_skips() {
    let dir = TempDir::new("fp16-log");
    let log = dir.join("log.jsonl");
    let (ok, stdout, stderr) = train(&[
        "--train-iters",
        "4",
        "--fp16",
        "--dp",
        "2",
        "--use-distributed-optimizer",
        "--log-json",
        &log,
    ]);
    assert!(ok, "{stderr}");
    // Megatron-LM's 2^32 start overflows fp16 gradients: the first steps are skipped, the
    // second halves the scale (hysteresis 2).
    assert!(stderr.contains("skipped the update"), "{stderr}");
    let lines = log_lines(&log);
    let scales: Vec<f64> = lines
        .iter()
        .map(|l| l["loss_scale"].as_f64().unwrap())
        .collect();
    assert_eq!(scales[..3], [4294967296.0, 4294967296.0, 2147483648.0]);
    assert!(lines.iter().all(|l| l["skipped"] == true), "{lines:?}");
    // 16-bit values and gradients: 4 + 16/2 bytes per parameter, up to padding.
    assert!(stdout.contains("rank 0's state: 12."), "{stdout}");
}
