//! LoRA fine-tuning of an imported model (issue 48): the tiny Llama that transformers made
//! (`tests/data/hf/llama`: grouped-query attention, untied), imported, then trained with
//! `megatron train --load --lora-rank` — the base frozen, rank-4 adapters beside linear_qkv,
//! linear_proj, linear_fc1 and linear_fc2 — at tensor parallelism with sequence parallelism,
//! pipeline parallelism, data parallelism with the distributed optimizer, context parallelism,
//! bf16 and recompute, each step by step as the one-rank run. At the first step the model is the
//! base (B starts at zero); the base's values never move; a save holds the adapters alone and
//! names its base, and resumes from there.

mod support;

use megatron::data::{DType, IndexedDatasetBuilder};
use support::{TempDir, curve, megatron};

/// Documents of tokens below 64 (the golden models' vocabulary).
fn dataset(dir: &TempDir) -> String {
    let prefix = dir.join("tokens");
    let mut b = IndexedDatasetBuilder::create(&prefix, DType::U16).unwrap();
    for d in 0..64u32 {
        let tokens: Vec<u32> = (0..96u32).map(|j| (d * 7 + (j % 12) * 5) % 64).collect();
        b.add_document(&tokens, &[tokens.len()]).unwrap();
    }
    b.finish().unwrap();
    prefix
}

fn import(dir: &TempDir) -> String {
    let hf = format!("{}/tests/data/hf/llama", env!("CARGO_MANIFEST_DIR"));
    let ckpt = dir.join("base");
    let (ok, _, stderr) = megatron(&["convert", "--from", "hf", &hf, "--to", &ckpt]);
    assert!(ok, "{stderr}");
    ckpt
}

fn assert_follows(got: &[(u64, f64, f64)], want: &[(u64, f64, f64)], tol: (f64, f64), what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (g, w) in got.iter().zip(want) {
        assert!(
            (g.1 - w.1).abs() <= tol.0 * w.1,
            "{what}: loss {g:?} vs {w:?}"
        );
        assert!(
            (g.2 - w.2).abs() <= tol.1 * w.2,
            "{what}: grad norm {g:?} vs {w:?}"
        );
    }
}

#[test]
fn lora_fine_tunes_an_imported_llama_at_every_layout_as_one_rank() {
    let dir = TempDir::new("lora-finetune");
    let data = dataset(&dir);
    let base = import(&dir);
    let common = [
        "train",
        "--quiet",
        "--load",
        &base,
        "--data",
        &data,
        "--seq-length",
        "16",
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "4",
        "--lr",
        "1e-2",
        "--train-iters",
        "4",
        "--seed",
        "3",
        "--lora-rank",
        "4",
        "--lora-alpha",
        "8",
    ];
    let one = curve(&common, &dir, "one", &[]);
    assert!(one[3].1 < one[0].1, "LoRA lowers the loss: {one:?}");
    // At the first step B is zero: the loss is the base's.
    let plain = [
        "train",
        "--quiet",
        "--load",
        &base,
        "--data",
        &data,
        "--seq-length",
        "16",
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "4",
        "--lr",
        "1e-2",
        "--train-iters",
        "1",
        "--seed",
        "3",
    ];
    let full = curve(&plain, &dir, "full", &[]);
    assert_eq!(full[0].1, one[0].1, "the adapted model starts as the base");
    for (i, flags) in [
        &["--tp", "2", "--sequence-parallel"][..],
        &["--pp", "2"],
        &["--dp", "2", "--use-distributed-optimizer"],
        &["--cp", "2"],
        &[
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "uniform",
            "--recompute-num-layers",
            "1",
        ],
    ]
    .iter()
    .enumerate()
    {
        let got = curve(&common, &dir, &format!("layout-{i}"), flags);
        assert_follows(&got, &one, (1e-5, 1e-4), &format!("{flags:?}"));
    }
    let bf16 = curve(&common, &dir, "bf16", &["--bf16", "--tp", "2"]);
    assert_follows(&bf16, &one, (2e-2, 1e-1), "bf16");
}

#[test]
fn a_lora_save_holds_the_adapters_names_its_base_and_resumes() {
    let dir = TempDir::new("lora-save");
    let data = dataset(&dir);
    let base = import(&dir);
    let save = dir.join("lora");
    let args = |iters: &'static str, load: &str| {
        vec![
            "train".to_string(),
            "--quiet".into(),
            "--load".into(),
            load.to_string(),
            "--data".into(),
            data.clone(),
            "--seq-length".into(),
            "16".into(),
            "--micro-batch-size".into(),
            "1".into(),
            "--global-batch-size".into(),
            "4".into(),
            "--lr".into(),
            "1e-2".into(),
            "--train-iters".into(),
            iters.into(),
            "--seed".into(),
            "3".into(),
            "--lora-rank".into(),
            "4".into(),
            "--save".into(),
            save.clone(),
        ]
    };
    let run = |a: Vec<String>| {
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        let (ok, stdout, stderr) = megatron(&a);
        assert!(ok, "{stderr}");
        stdout
    };
    // 4 steps, saved at 2 and 4.
    let mut first = args("4", &base);
    let log = dir.join("straight.jsonl");
    first.extend(["--save-interval", "2", "--log-json", &log].map(String::from));
    let said = run(first);
    assert!(said.contains("frozen"), "{said}");
    let at_two = format!("{save}/iter_0000002");
    let loaded = megatron::checkpoint::open(std::path::Path::new(&at_two)).unwrap();
    let names = loaded.model_names().unwrap();
    assert!(!names.is_empty());
    assert!(
        names
            .iter()
            .all(|n| megatron::tensor_parallel::lora::is_adapter_param(n)),
        "{names:?}"
    );
    let resolved = megatron::checkpoint::resolve(std::path::Path::new(&base)).unwrap();
    let base_dir = std::fs::canonicalize(resolved).unwrap();
    assert_eq!(loaded.meta().base.as_deref(), Some(base_dir.as_path()));
    // Resumed from step 2: steps 3 and 4 as the straight run's.
    let mut again = args("4", &at_two);
    let at = again.iter().position(|a| a == "--save").unwrap();
    again[at + 1] = dir.join("resumed");
    let log2 = dir.join("resumed.jsonl");
    again.extend(["--log-json".to_string(), log2.clone()]);
    run(again);
    let losses = |p: &str| -> Vec<f64> {
        support::log_lines(p)
            .iter()
            .map(|l| l["loss"].as_f64().unwrap())
            .collect()
    };
    let (a, b) = (losses(&log), losses(&log2));
    assert_eq!(&a[2..], &b[..], "resumed from the adapters and their base");
}
