//! `megatron train`, `inspect` and `models` from the command line: logs, reports and errors.

mod support;
use support::megatron;

#[test]
fn train_writes_a_json_line_per_step_with_the_communication_report() {
    let dir = std::env::temp_dir().join(format!("megatron-cli-train-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("log.jsonl");
    let (ok, stdout, stderr) = megatron(&[
        "train",
        "--model",
        "gpt-tiny",
        "--tp",
        "2",
        "--dp",
        "2",
        "--num-layers",
        "1",
        "--seq-length",
        "16",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "8",
        "--steps",
        "3",
        "--quiet",
        "--comm-report",
        "--log-json",
        log.to_str().unwrap(),
    ]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("TP=2 × DP=2 on 4 thread ranks"), "{stdout}");
    assert!(stdout.contains("tokens/s"), "{stdout}");
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 3);
    for (i, line) in lines.iter().enumerate() {
        assert_eq!(line["step"], i);
        for key in ["loss", "lr", "grad_norm", "tokens_per_s"] {
            assert!(line[key].as_f64().unwrap().is_finite(), "{key}: {line}");
        }
        // One layer, 2 microbatches of 2×16 tokens, hidden 128: per microbatch 4 + 2 all-reduces of
        // b·s·h and 3 of b·s on tp.
        let tp = &line["comm"]["tp"]["all_reduce"];
        assert_eq!(tp["calls"], 2 * 9);
        assert_eq!(tp["bytes"], 2 * (6 * 2 * 16 * 128 * 4 + 3 * 2 * 16 * 4));
        assert!(line["comm"]["dp"]["all_reduce"]["calls"].as_u64().unwrap() >= 2);
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn bad_configurations_are_clear_errors() {
    let cases: [(&[&str], &str); 5] = [
        (
            &["train", "--tp", "3"],
            "--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 3",
        ),
        (
            &[
                "train",
                "--dp",
                "2",
                "--micro-batch-size",
                "3",
                "--global-batch-size",
                "8",
            ],
            "--global-batch-size 8 is not divisible by --micro-batch-size 3 × --data-parallel-size 2 = 6",
        ),
        (
            &["train", "--seq-length", "512"],
            "--seq-length 512 exceeds --max-position-embeddings 256",
        ),
        (
            &["train", "--model", "gpt-5"],
            "unknown model `gpt-5`; registered models: deepseek-v3, deepseek-v3-tiny, gpt-1.2b, gpt-moe-tiny, gpt-tiny, gpt2-medium, gpt2-small, kimi-k2, llama-tiny, llama3-70b, llama3-8b, mistral-7b, mixtral-8x7b, mixtral-tiny, moonlight-16b-a3b, qwen3-0.6b, qwen3-30b-a3b, qwen3-8b",
        ),
        (
            &["train", "--data", "/nonexistent/corpus.txt"],
            "/nonexistent/corpus.txt.idx: no such file",
        ),
    ];
    for (args, message) in cases {
        let (ok, _, stderr) = megatron(args);
        assert!(!ok, "{args:?}");
        assert!(stderr.contains(message), "{args:?}: {stderr}");
    }
}

#[test]
fn inspect_pads_the_vocabulary_and_lists_shards() {
    let (ok, stdout, stderr) = megatron(&[
        "inspect",
        "--model",
        "gpt-tiny",
        "--tp",
        "2",
        "--vocab-size",
        "50257",
        "--json",
    ]);
    assert!(ok, "{stderr}");
    let r: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(r["padded_vocab_size"], 50432);
    let qkv = r["parameters"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "blocks.0.attn.qkv.weight")
        .unwrap();
    assert_eq!(qkv["logical"], serde_json::json!([384, 128]));
    assert_eq!(qkv["local"], serde_json::json!([192, 128]));
    let fwd = &r["layer_collectives"]["forward"];
    assert_eq!(
        fwd,
        &serde_json::json!([{ "group": "tp", "op": "all_reduce", "calls": 2, "elements_per_call": "b·s·h" }])
    );
    // 50,257 tokens pad to a multiple of 128 × tp (tp 8 → 51,200 is checked in megatron-models).
    for (tp, padded) in [("1", 50304), ("4", 50688)] {
        let (ok, stdout, stderr) = megatron(&[
            "inspect",
            "--model",
            "gpt-tiny",
            "--vocab-size",
            "50257",
            "--tp",
            tp,
            "--json",
        ]);
        assert!(ok, "{stderr}");
        let r: serde_json::Value = serde_json::from_str(&stdout).unwrap();
        assert_eq!(r["padded_vocab_size"], padded, "tp {tp}");
    }
}

#[test]
fn models_lists_the_presets() {
    let (ok, stdout, _) = megatron(&["models"]);
    assert!(ok);
    for name in ["gpt-tiny", "gpt2-small", "gpt2-medium", "gpt-1.2b"] {
        assert!(stdout.contains(name), "{stdout}");
    }
}

#[test]
fn save_resume_evaluate_plot_and_config_files() {
    let dir = std::env::temp_dir().join(format!("megatron-cli-run-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let p = |name: &str| dir.join(name).to_string_lossy().into_owned();
    // The small architecture and batch come from a config file; the command line adds the rest.
    std::fs::write(
        dir.join("run.toml"),
        "num_layers = 1\nseq_length = 16\nmicro_batch_size = 2\ntrain_iters = 99\nquiet = true\n",
    )
    .unwrap();
    let common = |steps: &'static str| {
        vec![
            "train".to_string(),
            "--config".into(),
            p("run.toml"),
            "--train-iters".into(),
            steps.into(),
            "--eval-interval".into(),
            "2".into(),
            "--eval-iters".into(),
            "1".into(),
            "--save".into(),
            p("ckpt"),
            "--log-json".into(),
            p("log.jsonl"),
            "--tensorboard-dir".into(),
            p("tb"),
        ]
    };
    let args = common("4");
    let (ok, stdout, stderr) = megatron(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(ok, "{stderr}");
    assert!(stdout.contains("4 steps of 32 tokens"), "{stdout}");
    assert!(stdout.contains("validation loss"), "{stdout}");
    let mut args = common("6");
    args.extend(["--load".to_string(), p("ckpt")]);
    let (ok, stdout, stderr) = megatron(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains("over 2 steps"),
        "resumed at step 4: {stdout}"
    );
    let log = std::fs::read_to_string(dir.join("log.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let steps: Vec<u64> = lines
        .iter()
        .filter(|l| l.get("loss").is_some())
        .map(|l| l["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, [0, 1, 2, 3, 4, 5]);
    let evals: Vec<u64> = lines
        .iter()
        .filter(|l| l.get("valid_loss").is_some())
        .map(|l| l["step"].as_u64().unwrap())
        .collect();
    assert_eq!(evals, [2, 4, 6]);
    assert!(
        lines
            .iter()
            .filter(|l| l.get("valid_ppl").is_some())
            .all(|l| l["valid_ppl"].as_f64().unwrap() > 1.0)
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("ckpt/latest_checkpointed_iteration.txt")).unwrap(),
        "6"
    );
    assert!(
        std::fs::read(dir.join("log.png"))
            .unwrap()
            .starts_with(b"\x89PNG")
    );
    assert_eq!(
        std::fs::read_dir(dir.join("tb")).unwrap().count(),
        2,
        "one event file per run"
    );
    let (ok, stdout, stderr) = megatron(&["plot", &p("log.jsonl"), "--output", &p("again.png")]);
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains("6 training steps, 3 evaluations"),
        "{stdout}"
    );
    // A corrupt checkpoint is refused with the file named, and nothing is written.
    let model = dir.join("ckpt/iter_0000006/model.safetensors");
    let bytes = std::fs::read(&model).unwrap();
    std::fs::write(&model, &bytes[..bytes.len() / 2]).unwrap();
    let mut args = common("8");
    args.extend(["--load".to_string(), p("ckpt")]);
    let (ok, _, stderr) = megatron(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(!ok);
    assert!(
        stderr.contains("model.safetensors: checksum mismatch"),
        "{stderr}"
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("ckpt/latest_checkpointed_iteration.txt")).unwrap(),
        "6"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn devices_and_backends_this_build_lacks_are_clear_errors() {
    let tiny = ["train", "--steps", "1", "--quiet"];
    let with = |extra: &[&'static str]| -> Vec<&'static str> { [&tiny[..], extra].concat() };
    let mut cases: Vec<(Vec<&str>, &str)> = vec![
        (
            with(&["--device", "tpu"]),
            "--device must be cpu or cuda, got \"tpu\"",
        ),
        (
            vec!["bench", "--train-iters", "1", "--profile"],
            "--profile times GPU kernels: add --device cuda",
        ),
        (
            with(&["--attention-backend", "flash"]),
            "--attention-backend flash runs on a GPU: add --device cuda",
        ),
        (
            with(&[
                "--attention-backend",
                "flash",
                "--device",
                "cuda",
                "--fp32-products",
            ]),
            "--attention-backend flash multiplies in bf16: drop --fp32-products",
        ),
    ];
    if cfg!(not(feature = "cuda")) {
        cases.push((
            with(&["--device", "cuda"]),
            "this build has no GPU support: cargo build --release --features cuda",
        ));
        cases.push((
            vec!["bench", "gemm", "--device", "cuda"],
            "--device cuda needs a build with CUDA",
        ));
    }
    if cfg!(not(all(feature = "mpi", feature = "cuda"))) {
        cases.push((
            with(&["--backend", "nccl", "--device", "cuda"]),
            "--backend nccl needs a build with MPI and CUDA",
        ));
    }
    if cfg!(not(feature = "mpi")) {
        cases.push((
            with(&["--backend", "mpi"]),
            "--backend mpi needs a build with MPI",
        ));
    }
    for (args, message) in cases {
        let (ok, _, stderr) = megatron(&args);
        assert!(!ok, "{args:?}");
        assert!(stderr.contains(message), "{args:?}: {stderr}");
    }
}
