//! `megatron eval` and the masking flags from the command line: a checkpoint's loss on a
//! held-out set read whole and in order, the same at every layout and batch size (the last
//! batch's padding counts nothing), with Megatron-LM's masks, without touching the checkpoint;
//! and `megatron train` with the masking flags logging the tokens it counts.

mod support;
use support::{TempDir, log_lines, megatron};

/// Writes `NAME.jsonl` of `n` short lines and preprocesses it with end-of-document tokens.
fn dataset(dir: &TempDir, name: &str, n: usize, salt: usize) -> String {
    let lines: String = (0..n)
        .map(|i| {
            let words: Vec<String> = (0..1 + (i * 5 + salt) % 7)
                .map(|k| format!("w{}", (i * 3 + k + salt) % 11))
                .collect();
            format!("{{\"text\": \"{}\"}}\n", words.join(" "))
        })
        .collect();
    std::fs::write(dir.join(&format!("{name}.jsonl")), lines).unwrap();
    let (ok, _, stderr) = megatron(&[
        "preprocess",
        "--input",
        &dir.join(&format!("{name}.jsonl")),
        "--tokenizer",
        "byte",
        "--output-prefix",
        &dir.join(name),
        "--append-eod",
        "--quiet",
    ]);
    assert!(ok, "{stderr}");
    dir.join(&format!("{name}_text_document"))
}

fn eval(args: &[&str]) -> serde_json::Value {
    let mut all = vec!["eval", "--json"];
    all.extend_from_slice(args);
    let (ok, stdout, stderr) = megatron(&all);
    assert!(ok, "{stderr}");
    serde_json::from_str(stdout.trim()).unwrap()
}

/// Every file under `dir` with its bytes.
fn files(dir: &std::path::Path) -> Vec<(std::path::PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            out.extend(files(&path));
        } else {
            out.push((path.clone(), std::fs::read(&path).unwrap()));
        }
    }
    out.sort();
    out
}

#[test]
fn eval_reads_the_held_out_set_once_at_every_layout_with_the_training_masks() {
    let dir = TempDir::new("cli-eval");
    let train = dataset(&dir, "train", 200, 0);
    let held = dataset(&dir, "held", 30, 5);
    let save = dir.join("ckpt");
    let log = dir.join("log.jsonl");
    let (ok, _, stderr) = megatron(&[
        "train",
        "--data",
        &train,
        "--tokenizer",
        "byte",
        "--split",
        "100,0,0",
        "--num-layers",
        "2",
        "--hidden-size",
        "32",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "32",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "4",
        "--train-iters",
        "6",
        "--save",
        &save,
        "--log-json",
        &log,
        "--eod-mask-loss",
        "--reset-position-ids",
        "--reset-attention-mask",
        "--calculate-per-token-loss",
    ]);
    assert!(ok, "{stderr}");
    // The log counts the targets the masks leave.
    let steps = log_lines(&log);
    let counted = steps[0]["counted_tokens"].as_u64().unwrap();
    assert!(counted > 0 && counted < 4 * 32, "{counted}");
    let before = files(dir.path().join("ckpt").as_path());

    let plain = eval(&["--load", &save, "--data", &held]);
    let tokens = plain["tokens"].as_u64().unwrap();
    // Every whole sample once: the held-out set's tokens less one, cut into samples of 32.
    assert_eq!(tokens % 32, 0);
    let loss = plain["loss"].as_f64().unwrap();
    assert!((plain["perplexity"].as_f64().unwrap() - loss.exp()).abs() < 1e-9 * loss.exp());
    // A batch of one sample and the default batch with padding see the same samples.
    let one = eval(&[
        "--load",
        &save,
        "--data",
        &held,
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "1",
    ]);
    assert_eq!(one["tokens"], plain["tokens"]);
    assert!((one["loss"].as_f64().unwrap() - loss).abs() < 1e-5 * loss);

    let masks = [
        "--eod-mask-loss",
        "--reset-position-ids",
        "--reset-attention-mask",
    ];
    let mut masked_args = vec!["--load", &save, "--data", &held];
    masked_args.extend(masks);
    let masked = eval(&masked_args);
    assert!(masked["tokens"].as_u64().unwrap() < tokens);
    assert!((masked["loss"].as_f64().unwrap() - loss).abs() > 1e-4);
    for layout in [
        &["--tp", "2"][..],
        &["--tp", "2", "--sequence-parallel"],
        &["--pp", "2"],
        &["--dp", "2"],
        &["--cp", "2"],
        &["--cp", "2", "--cp-comm-type", "a2a"],
    ] {
        let mut args = masked_args.clone();
        args.extend_from_slice(layout);
        let at = eval(&args);
        assert_eq!(at["tokens"], masked["tokens"], "{layout:?}");
        let (a, b) = (
            at["loss"].as_f64().unwrap(),
            masked["loss"].as_f64().unwrap(),
        );
        assert!((a - b).abs() < 1e-5 * b, "{layout:?}: {a} vs {b}");
    }
    // The checkpoint is read, not written.
    assert_eq!(files(dir.path().join("ckpt").as_path()), before);

    let (ok, _, stderr) = megatron(&[
        "eval",
        "--load",
        &save,
        "--data",
        &held,
        "--eval-iters",
        "99",
    ]);
    assert!(!ok);
    assert!(stderr.contains("--eval-iters 99"), "{stderr}");
}

#[test]
fn masking_flags_without_documents_in_the_data_are_said_once_and_cp_keeps_documents_apart() {
    let small = [
        "train",
        "--num-layers",
        "1",
        "--hidden-size",
        "32",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "32",
        "--micro-batch-size",
        "2",
        "--train-iters",
        "1",
    ];
    let mut args = small.to_vec();
    args.push("--reset-attention-mask");
    let (ok, stdout, stderr) = megatron(&args);
    assert!(ok, "{stderr}");
    assert_eq!(
        stdout.matches("no end-of-document token").count(),
        1,
        "{stdout}"
    );
    let mut args = small.to_vec();
    args.extend(["--reset-attention-mask", "--cp", "2"]);
    // Documents attended apart over context-parallel ranks, with attention dropout (each
    // document's drawn as cp 1 draws it: tests/packed_documents.rs) and without.
    let (ok, _, stderr) = megatron(&args);
    assert!(ok, "{stderr}");
    args.extend(["--attention-dropout", "0"]);
    let (ok, _, stderr) = megatron(&args);
    assert!(ok, "{stderr}");
}
