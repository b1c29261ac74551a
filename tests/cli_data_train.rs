//! The path a Megatron-LM user takes, from the command line: preprocess JSON lines, train on the
//! indexed datasets (blended, with a validation split), generate text from the checkpoint, and
//! export to Hugging Face.

mod support;
use support::megatron;

#[test]
fn preprocess_train_on_a_blend_generate_and_export() {
    let dir = std::env::temp_dir().join(format!("megatron-cli-data-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let p = |name: &str| dir.join(name).to_string_lossy().into_owned();
    for (name, text) in [
        ("a", "alpha beta gamma delta. "),
        ("b", "one two three four five. "),
    ] {
        let lines: String = (0..40)
            .map(|i| format!("{{\"text\": \"{}{i}\"}}\n", text.repeat(3)))
            .collect();
        std::fs::write(dir.join(format!("{name}.jsonl")), lines).unwrap();
        let (ok, _, stderr) = megatron(&[
            "preprocess",
            "--input",
            &p(&format!("{name}.jsonl")),
            "--tokenizer",
            "byte",
            "--output-prefix",
            &p(name),
            "--append-eod",
            "--quiet",
        ]);
        assert!(ok, "{stderr}");
    }
    let (ok, stdout, stderr) = megatron(&["data", "inspect", &p("a_text_document"), "--json"]);
    assert!(ok, "{stderr}");
    let info: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(info["documents"], 40);
    let blend = format!("0.3,{},0.7,{}", p("a_text_document"), p("b_text_document"));
    let (ok, stdout, stderr) = megatron(&[
        "train",
        "--data",
        &blend,
        "--tokenizer",
        "byte",
        "--split",
        "90,10,0",
        "--num-layers",
        "1",
        "--seq-length",
        "16",
        "--micro-batch-size",
        "2",
        "--train-iters",
        "4",
        "--eval-interval",
        "2",
        "--eval-iters",
        "1",
        "--tp",
        "2",
        "--save",
        &p("ckpt"),
        "--quiet",
    ]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("validation loss"), "{stdout}");
    // The model's vocabulary is the tokenizer's: 256 bytes and the end-of-document token.
    let meta: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("ckpt/iter_0000004/meta.json")).unwrap())
            .unwrap();
    assert_eq!(meta["model"]["vocab_size"], 257);
    assert_eq!(meta["run"]["tokenizer"], "byte");
    // Greedy generation is the same at tp 1 and tp 2, and deterministic.
    let generate = |tp: &str| {
        megatron(&[
            "generate",
            "--load",
            &p("ckpt"),
            "--prompt",
            "alpha ",
            "--max-new-tokens",
            "12",
            "--tp",
            tp,
        ])
    };
    let (ok1, out1, err1) = generate("1");
    let (ok2, out2, _) = generate("2");
    assert!(ok1 && ok2, "{err1}");
    assert!(out1.starts_with("alpha "), "{out1}");
    assert_eq!(out1, out2);
    let (ok, out3, _) = megatron(&[
        "generate",
        "--load",
        &p("ckpt"),
        "--prompt",
        "one ",
        "--max-new-tokens",
        "8",
        "--temperature",
        "0.9",
        "--top-k",
        "5",
        "--seed",
        "3",
    ]);
    let (_, out4, _) = megatron(&[
        "generate",
        "--load",
        &p("ckpt"),
        "--prompt",
        "one ",
        "--max-new-tokens",
        "8",
        "--temperature",
        "0.9",
        "--top-k",
        "5",
        "--seed",
        "3",
    ]);
    assert!(ok);
    assert_eq!(out3, out4, "sampling is reproducible for a seed");
    // Export the trained model to Hugging Face and back: the same generation.
    let (ok, _, stderr) = megatron(&["convert", "--from", &p("ckpt"), "--to", "hf-gpt2", &p("hf")]);
    assert!(ok, "{stderr}");
    let (ok, _, stderr) = megatron(&[
        "convert",
        "--from",
        "hf-gpt2",
        &p("hf"),
        "--to",
        &p("ckpt2"),
    ]);
    assert!(ok, "{stderr}");
    let (ok, out5, stderr) = megatron(&[
        "generate",
        "--load",
        &p("ckpt2"),
        "--tokenizer",
        "byte",
        "--prompt",
        "alpha ",
        "--max-new-tokens",
        "12",
    ]);
    assert!(ok, "{stderr}");
    assert_eq!(out5, out1);
    // An empty validation split with evaluation requested is a clear error.
    let (ok, _, stderr) = megatron(&[
        "train",
        "--data",
        &blend,
        "--tokenizer",
        "byte",
        "--split",
        "100,0,0",
        "--num-layers",
        "1",
        "--seq-length",
        "16",
        "--micro-batch-size",
        "2",
        "--train-iters",
        "2",
        "--eval-interval",
        "1",
        "--quiet",
    ]);
    assert!(!ok);
    assert!(stderr.contains("needs a validation split"), "{stderr}");
    std::fs::remove_dir_all(&dir).ok();
}
