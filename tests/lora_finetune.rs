//! LoRA fine-tuning of an imported model (issue 48): the tiny Llama that transformers made
//! (`tests/data/hf/llama`: grouped-query attention, untied), imported, then trained with
//! `megatron train --load --lora-rank` — the base frozen, rank-4 adapters beside linear_qkv,
//! linear_proj, linear_fc1 and linear_fc2 — at tensor parallelism with sequence parallelism,
//! pipeline parallelism, data parallelism with the distributed optimizer, context parallelism,
//! bf16 and recompute, each step by step as the one-rank run, with LoRA's dropout too. At the
//! first step the model is the base (B starts at zero); the base's values never move; a save
//! holds the adapters alone and names its base, and resumes from there. The tiny Mixtral's
//! experts get an adapter each, trained at ep, etp, tp with sp, pp, recompute and bf16 as one
//! rank, and go out as PEFT's `target_parameters` or merged, and back.
//! DeepSeek-V3's multi-latent attention takes adapters beside each projection (the replicated
//! down projections too), merged on export.

mod support;

use support::{
    TempDir, assert_follows, curve, edit_tensor, import_golden, megatron, token_dataset,
};

#[test]
fn lora_fine_tunes_an_imported_llama_at_every_layout_as_one_rank() {
    let dir = TempDir::new("lora-finetune");
    let data = token_dataset(&dir, 64, 96);
    let base = import_golden(&dir, "llama", "base");
    let mut common = training(&base, &data, "4");
    common.extend(["--lora-rank", "4", "--lora-alpha", "8"]);
    let one = curve(&common, &dir, "one", &[]);
    assert!(one[3].1 < one[0].1, "LoRA lowers the loss: {one:?}");
    // At the first step B is zero: the loss is the base's.
    let plain = training(&base, &data, "1");
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
    // LoRA's dropout: each rank draws the one rank's masks for its elements.
    let mut dropped = common.to_vec();
    dropped.extend(["--lora-dropout", "0.2"]);
    let one_dropped = curve(&dropped, &dir, "dropout", &[]);
    assert_eq!(
        one_dropped[0].1, one[0].1,
        "B starts at zero: dropout changes nothing yet"
    );
    assert_ne!(one_dropped[3].1, one[3].1, "then it does");
    for (i, flags) in [
        &["--tp", "2", "--sequence-parallel"][..],
        &["--cp", "2", "--tp", "2", "--sequence-parallel"],
        &["--pp", "2", "--dp", "2"],
    ]
    .iter()
    .enumerate()
    {
        let got = curve(&dropped, &dir, &format!("dropout-{i}"), flags);
        assert_follows(
            &got,
            &one_dropped,
            (1e-5, 1e-4),
            &format!("dropout {flags:?}"),
        );
    }
}

#[test]
fn lora_beside_a_mixture_of_experts_trains_with_expert_parallelism_as_one_rank() {
    let dir = TempDir::new("lora-moe");
    let data = token_dataset(&dir, 64, 96);
    let base = import_golden(&dir, "mixtral", "mixtral");
    let mut common = training(&base, &data, "3");
    common.extend(["--lora-rank", "4"]);
    // Every linear layer: the attention's and each expert's fc1 and fc2.
    let one = curve(&common, &dir, "one", &[]);
    assert!(one[2].1 < one[0].1, "LoRA lowers the loss: {one:?}");
    for (i, flags) in [
        &["--dp", "2", "--ep", "2", "--use-distributed-optimizer"][..],
        &["--dp", "4", "--ep", "2", "--etp", "2"],
        &["--tp", "2", "--sequence-parallel", "--ep", "2"],
        &[
            "--tp",
            "2",
            "--sequence-parallel",
            "--etp",
            "2",
            "--pp",
            "2",
        ],
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
        let got = curve(&common, &dir, &format!("moe-{i}"), flags);
        assert_follows(&got, &one, (1e-5, 1e-4), &format!("{flags:?}"));
    }
    let bf16 = ["--bf16", "--dp", "4", "--ep", "2", "--etp", "2"];
    let got = curve(&common, &dir, "moe-bf16", &bf16);
    assert_follows(&got, &one, (2e-2, 1e-1), "bf16 at ep 2 etp 2");
    // The experts' adapters alone, by Megatron-Bridge's pattern.
    let mut experts_only = common.to_vec();
    experts_only.extend([
        "--lora-target-modules",
        "*.experts.linear_fc1",
        "*.experts.linear_fc2",
    ]);
    let alone = curve(&experts_only, &dir, "experts", &[]);
    assert_eq!(alone[0].1, one[0].1, "both start as the base");
    assert!(
        alone[2].1 < alone[0].1,
        "the experts' adapters alone lower the loss: {alone:?}"
    );
    let etp = curve(
        &experts_only,
        &dir,
        "experts-etp",
        &["--dp", "4", "--ep", "2", "--etp", "2"],
    );
    assert_follows(&etp, &alone, (1e-5, 1e-4), "experts alone, dp 4 ep 2 etp 2");
}

#[test]
fn a_lora_save_holds_the_adapters_names_its_base_and_resumes() {
    let dir = TempDir::new("lora-save");
    let data = token_dataset(&dir, 64, 96);
    let base = import_golden(&dir, "llama", "base");
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

/// `t`'s values from a safetensors file of the directory `dir`, by name: (dtype, shape, f32).
fn read_tensors(dir: &str) -> std::collections::HashMap<String, (Vec<usize>, Vec<f32>)> {
    let mut out = std::collections::HashMap::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "safetensors") {
            let bytes = std::fs::read(&path).unwrap();
            let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
            for (name, view) in st.tensors() {
                assert_eq!(view.dtype(), safetensors::Dtype::F32, "{name}");
                let values = view
                    .data()
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                    .collect();
                out.insert(name, (view.shape().to_vec(), values));
            }
        }
    }
    out
}

/// `w + s·b·a` for `w` `[out, in]`, `b` `[out, r]`, `a` `[r, in]`, in f64.
fn merge(w: &[f32], b: &[f32], a: &[f32], s: f64, inp: usize) -> Vec<f64> {
    let r = a.len() / inp;
    w.chunks(inp)
        .zip(b.chunks(r))
        .flat_map(|(row, brow)| {
            (0..inp).map(move |j| {
                f64::from(row[j])
                    + s * (0..r)
                        .map(|k| f64::from(brow[k]) * f64::from(a[k * inp + j]))
                        .sum::<f64>()
            })
        })
        .collect()
}

/// The largest difference between `got` and `want`.
fn worst(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .map(|(g, w)| (f64::from(*g) - w).abs())
        .fold(0.0, f64::max)
}

/// `megatron train` of the checkpoint `base` on `data` for `steps` steps: 16-token sequences,
/// 4 a batch, one a microbatch, lr 1e-2, seed 3.
fn training<'a>(base: &'a str, data: &'a str, steps: &'a str) -> Vec<&'a str> {
    vec![
        "train",
        "--quiet",
        "--load",
        base,
        "--data",
        data,
        "--seq-length",
        "16",
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "4",
        "--lr",
        "1e-2",
        "--train-iters",
        steps,
        "--seed",
        "3",
    ]
}

/// Trains the checkpoint `base` for `steps` steps with LoRA's `flags` on `data`, saving to
/// `dir`'s `lora`; returns the save's path.
fn train_lora(dir: &TempDir, base: &str, data: &str, steps: &str, flags: &[&str]) -> String {
    let save = dir.join("lora");
    let mut args = training(base, data, steps);
    args.extend(["--save", &save]);
    args.extend(flags);
    let (ok, _, stderr) = megatron(&args);
    assert!(ok, "{stderr}");
    save
}

/// Writes the LoRA checkpoint `save` as a Hugging Face model with its adapters merged, in
/// `dir`'s `merged`; returns its path.
fn export_merged(dir: &TempDir, save: &str) -> String {
    let merged = dir.join("merged");
    let (ok, _, stderr) = megatron(&[
        "convert",
        "--from",
        save,
        "--to",
        "hf",
        &merged,
        "--merge-lora",
    ]);
    assert!(ok, "{stderr}");
    merged
}

/// A tensor of the LoRA checkpoint `lora`, or of its base `base` when the base holds it.
fn lora_or_base(
    lora: &megatron::checkpoint::Loaded,
    base: &megatron::checkpoint::Loaded,
    name: &str,
) -> megatron::checkpoint::Whole {
    match lora.has_model_tensor(name) {
        true => lora.model_tensor(name).unwrap(),
        false => base.model_tensor(name).unwrap(),
    }
}

/// Imports the PEFT adapter `peft` onto `base` in `dir`'s `back` and checks that it holds the
/// tensors of the LoRA checkpoint `lora`, with the same base.
fn assert_comes_back(dir: &TempDir, peft: &str, base: &str, lora: &megatron::checkpoint::Loaded) {
    let back = dir.join("back");
    let (ok, _, stderr) = megatron(&[
        "convert", "--from", "peft", peft, "--to", &back, "--base", base,
    ]);
    assert!(ok, "{stderr}");
    let again = megatron::checkpoint::open(std::path::Path::new(&back)).unwrap();
    assert_eq!(again.meta().base, lora.meta().base);
    assert_eq!(again.model_names().unwrap(), lora.model_names().unwrap());
    for name in lora.model_names().unwrap() {
        assert_eq!(
            again.model_tensor(&name).unwrap(),
            lora.model_tensor(&name).unwrap(),
            "{name}"
        );
    }
}

#[test]
fn a_lora_checkpoint_goes_out_as_peft_adapters_or_merged() {
    let dir = TempDir::new("lora-export");
    let data = token_dataset(&dir, 64, 96);
    let base = import_golden(&dir, "llama", "base");
    let flags = ["--lora-rank", "4", "--lora-alpha", "8"];
    let save = train_lora(&dir, &base, &data, "3", &flags);
    // Without --merge-lora an export is refused; with it, the weights are W + (α/r)·B·A.
    let (ok, _, stderr) = megatron(&["convert", "--from", &save, "--to", "hf", &dir.join("x")]);
    assert!(
        !ok && stderr.contains("--merge-lora folds them"),
        "{stderr}"
    );
    let merged = export_merged(&dir, &save);
    let (ok, _, stderr) = megatron(&[
        "convert",
        "--from",
        &base,
        "--to",
        "hf",
        &dir.join("y"),
        "--merge-lora",
    ]);
    assert!(!ok && stderr.contains("holds no LoRA adapters"), "{stderr}");
    let lora = megatron::checkpoint::open(std::path::Path::new(&save)).unwrap();
    let basec = megatron::checkpoint::open(std::path::Path::new(&base)).unwrap();
    let ours = |name: &str| lora_or_base(&lora, &basec, name);
    let hf = read_tensors(&merged);
    let (h, s) = (32, 2.0);
    // o_proj: the whole of attn.proj; down_proj: of mlp.fc2.
    for (layer, hf_name, inp) in [
        ("attn.proj", "self_attn.o_proj", 32),
        ("mlp.fc2", "mlp.down_proj", 48),
    ] {
        let w = ours(&format!("blocks.1.{layer}.weight"));
        let a = ours(&format!("blocks.1.{layer}.lora_a.weight"));
        let b = ours(&format!("blocks.1.{layer}.lora_b.weight"));
        assert!(b.data.iter().any(|&v| v != 0.0), "training moved B");
        let want = merge(&w.data, &b.data, &a.data, s, inp);
        let got = &hf[&format!("model.layers.1.{hf_name}.weight")].1;
        let worst = worst(got, &want);
        assert!(worst < 1e-6, "{layer}: {worst}");
    }
    // gate_proj: the first half of fc1's rows, merged.
    let w = ours("blocks.0.mlp.fc1.weight");
    let a = ours("blocks.0.mlp.fc1.lora_a.weight");
    let b = ours("blocks.0.mlp.fc1.lora_b.weight");
    let want = merge(&w.data, &b.data, &a.data, s, h);
    let got = &hf["model.layers.0.mlp.gate_proj.weight"].1;
    let worst = worst(got, &want[..want.len() / 2]);
    assert!(worst < 1e-6, "gate_proj: {worst}");
    // PEFT: q, k and v share the fused A; their Bs are the fused B's rows per query group.
    let peft = dir.join("peft");
    let (ok, _, stderr) = megatron(&["convert", "--from", &save, "--to", "peft", &peft]);
    assert!(ok, "{stderr}");
    let config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(format!("{peft}/adapter_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(config["peft_type"], "LORA");
    assert_eq!(config["r"], 4);
    assert_eq!(config["lora_alpha"], 8.0);
    let adapters = read_tensors(&peft);
    assert_eq!(
        adapters.len(),
        2 * 7 * 2,
        "7 projections × 2 matrices × 2 layers"
    );
    let name = |m: &str, x: &str| format!("base_model.model.model.layers.0.{m}.lora_{x}.weight");
    let a = ours("blocks.0.attn.qkv.lora_a.weight");
    let b = ours("blocks.0.attn.qkv.lora_b.weight");
    for proj in ["q_proj", "k_proj", "v_proj"] {
        assert_eq!(adapters[&name(&format!("self_attn.{proj}"), "A")].1, a.data);
    }
    // 4 heads in 2 groups of 8 channels: each group's 16 query rows, its key's 8, its value's 8.
    let rows = |range: std::ops::Range<usize>| b.data[range.start * 4..range.end * 4].to_vec();
    let k = [rows(16..24), rows(48..56)].concat();
    assert_eq!(adapters[&name("self_attn.k_proj", "B")].1, k);
    assert_eq!(adapters[&name("self_attn.k_proj", "B")].0, vec![16, 4]);
    // Back in: the same adapters beside the same fused layers, on the same base.
    assert_comes_back(&dir, &peft, &base, &lora);
    // What the fused layers cannot hold is refused by name.
    let edited = |name: &str, edit: &dyn Fn(&std::path::Path)| {
        let to = dir.join(name);
        std::fs::create_dir_all(&to).unwrap();
        for f in ["adapter_config.json", "adapter_model.safetensors"] {
            std::fs::copy(format!("{peft}/{f}"), format!("{to}/{f}")).unwrap();
        }
        edit(std::path::Path::new(&to));
        to
    };
    let rs = edited("rslora", &|d| {
        let p = d.join("adapter_config.json");
        let mut c: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        c["use_rslora"] = true.into();
        std::fs::write(&p, c.to_string()).unwrap();
    });
    let separate = edited("separate", &|d| {
        let key = name("self_attn.k_proj", "A");
        edit_tensor(&d.join("adapter_model.safetensors"), &key, |b| {
            (safetensors::Dtype::F32, b.iter().map(|x| x ^ 1).collect())
        });
    });
    let other_base = import_golden(&dir, "qwen3", "qwen3");
    for (adapter, on, what) in [
        (rs.as_str(), base.as_str(), "`use_rslora` is true"),
        (separate.as_str(), base.as_str(), "have different lora_A"),
        (
            peft.as_str(),
            other_base.as_str(),
            "an adapter for another base",
        ),
    ] {
        let out = dir.join("refused");
        let (ok, _, stderr) = megatron(&[
            "convert", "--from", "peft", adapter, "--to", &out, "--base", on,
        ]);
        assert!(!ok && stderr.contains(what), "{what}: {stderr}");
        assert!(
            std::fs::read_dir(&out).map_or(true, |mut d| d.next().is_none()),
            "{what}"
        );
    }
}

#[test]
fn the_experts_adapters_go_out_as_peft_target_parameters_or_merged_and_back() {
    let dir = TempDir::new("lora-experts-export");
    let data = token_dataset(&dir, 64, 96);
    let base = import_golden(&dir, "mixtral", "base");
    let flags = [
        "--lora-rank",
        "2",
        "--lora-alpha",
        "8",
        "--lora-target-modules",
        "linear_fc1",
        "linear_fc2",
    ];
    let save = train_lora(&dir, &base, &data, "2", &flags);
    let lora = megatron::checkpoint::open(std::path::Path::new(&save)).unwrap();
    let basec = megatron::checkpoint::open(std::path::Path::new(&base)).unwrap();
    let ours = |name: &str| lora_or_base(&lora, &basec, name);
    // 4 experts of hidden 32 and ffn 24: fc1 [4, 48, 32], fc2 [4, 32, 24]; rank 2, scale 4.
    let (e, h, f, r, s) = (4, 32, 24, 2, 4.0);
    let a1 = ours("blocks.1.mlp.experts.fc1.lora_a.weight");
    let b1 = ours("blocks.1.mlp.experts.fc1.lora_b.weight");
    assert_eq!(
        (a1.shape.as_slice(), b1.shape.as_slice()),
        (&[e, r, h][..], &[e, 2 * f, r][..])
    );
    assert!(b1.data.iter().any(|&v| v != 0.0), "training moved B");
    // Merged: expert x's gate_proj (w1) is fc1's first f rows of x plus x's adapter's.
    let merged = export_merged(&dir, &save);
    let hf = read_tensors(&merged);
    let w1 = ours("blocks.1.mlp.experts.fc1.weight");
    let w2 = ours("blocks.1.mlp.experts.fc2.weight");
    let a2 = ours("blocks.1.mlp.experts.fc2.lora_a.weight");
    let b2 = ours("blocks.1.mlp.experts.fc2.lora_b.weight");
    for x in [0, 3] {
        let expert = |t: &[f32], n: usize| t[x * n..(x + 1) * n].to_vec();
        let want = merge(
            &expert(&w1.data, 2 * f * h),
            &expert(&b1.data, 2 * f * r),
            &expert(&a1.data, r * h),
            s,
            h,
        );
        let up = &hf[&format!("model.layers.1.block_sparse_moe.experts.{x}.w3.weight")].1;
        let want_down = merge(
            &expert(&w2.data, h * f),
            &expert(&b2.data, h * r),
            &expert(&a2.data, r * f),
            s,
            f,
        );
        let down = &hf[&format!("model.layers.1.block_sparse_moe.experts.{x}.w2.weight")].1;
        for (got, want, what) in [(up, &want[f * h..], "w3"), (down, &want_down[..], "w2")] {
            let worst = worst(got, want);
            assert!(worst < 1e-6, "expert {x} {what}: {worst}");
        }
    }
    // The adapted model generates as its merged export does (the training's merge on the fly
    // against the export's, written out).
    let again = dir.join("merged-ckpt");
    let (ok, _, stderr) = megatron(&["convert", "--from", "hf", &merged, "--to", &again]);
    assert!(ok, "{stderr}");
    let tokens = |ckpt: &str| {
        let (ok, stdout, stderr) = megatron(&[
            "bench",
            "generate",
            "--load",
            ckpt,
            "--prompt-tokens",
            "8",
            "--new-tokens",
            "8",
            "--json",
        ]);
        assert!(ok, "{stderr}");
        serde_json::from_str::<serde_json::Value>(&stdout).unwrap()["tokens"].clone()
    };
    assert_eq!(tokens(&save), tokens(&again), "adapted vs merged");
    // PEFT: the fused weights adapted as parameters, gate_up_proj's wrapped first.
    let peft = dir.join("peft");
    let (ok, _, stderr) = megatron(&["convert", "--from", &save, "--to", "peft", &peft]);
    assert!(ok, "{stderr}");
    let config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(format!("{peft}/adapter_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(
        config["target_parameters"],
        serde_json::json!(["experts.gate_up_proj", "experts.down_proj"])
    );
    assert_eq!(config["target_modules"], serde_json::json!([]));
    let adapters = read_tensors(&peft);
    let name =
        |m: &str, x: &str| format!("base_model.model.model.layers.1.mlp.{m}.lora_{x}.weight");
    // A: each expert's r rows in turn; B: expert x's column k at k·E + x.
    let (shape, a) = &adapters[&name("experts.base_layer", "A")];
    assert_eq!((shape.as_slice(), a), (&[e * r, h][..], &a1.data));
    let (shape, b) = &adapters[&name("experts.base_layer", "B")];
    assert_eq!(shape, &vec![2 * f, r * e]);
    for (x, o, k) in [(0, 0, 1), (2, 47, 0), (3, 5, 1)] {
        assert_eq!(b[o * r * e + k * e + x], b1.data[(x * 2 * f + o) * r + k]);
    }
    assert_eq!(adapters[&name("experts", "A")].0, vec![e * r, f]);
    assert_eq!(adapters[&name("experts", "B")].0, vec![h, r * e]);
    // Back in: the same adapters.
    assert_comes_back(&dir, &peft, &base, &lora);
    // An experts' adapter on a base without experts is refused by name.
    let llama = import_golden(&dir, "llama", "llama");
    let (ok, _, stderr) = megatron(&[
        "convert",
        "--from",
        "peft",
        &peft,
        "--to",
        &dir.join("no"),
        "--base",
        &llama,
    ]);
    assert!(!ok && stderr.contains("has no experts"), "{stderr}");
}

#[test]
fn bad_lora_settings_are_refused_by_name() {
    let dir = TempDir::new("lora-bad");
    let data = token_dataset(&dir, 64, 96);
    let base = import_golden(&dir, "llama", "base");
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
        "2",
        "--train-iters",
        "1",
    ];
    for (flags, what) in [
        (&["--lora-rank", "0"][..], "--lora-rank 0 adapts nothing"),
        (
            &["--lora-rank", "64"],
            "LoRA rank 64 is larger than the layer",
        ),
        (
            &["--lora-rank", "3", "--tp", "2"],
            "choose a rank divisible by 2",
        ),
        (
            &["--lora-rank", "4", "--lora-target-modules", "linear_fc3"],
            "the model has no `linear_fc3`",
        ),
        (
            &["--lora-rank", "4", "--lora-dropout", "1"],
            "--lora-dropout 1 must be a probability",
        ),
        (&["--lora-alpha", "8"], "--lora-rank"),
    ] {
        let mut args = common.to_vec();
        args.extend(flags);
        let (ok, _, stderr) = megatron(&args);
        assert!(!ok, "{flags:?}");
        assert!(stderr.contains(what), "{flags:?}: {stderr}");
    }
    // A pattern naming no layer of the model: a dense Llama has no experts.
    let mut args = common.to_vec();
    args.extend([
        "--lora-rank",
        "4",
        "--lora-target-modules",
        "*.experts.linear_fc1",
    ]);
    let (ok, _, stderr) = megatron(&args);
    assert!(
        !ok && stderr.contains("the model has no `*.experts.linear_fc1`"),
        "{stderr}"
    );
}

/// The tiny DeepSeek-V3 of transformers (`tests/data/hf/deepseek_v3`) with adapters beside every
/// projection of its multi-latent attention, by Megatron-LM's names (the replicated down
/// projections, the column-parallel up projections, the output projection): merged into
/// `q_a_proj`, `q_b_proj`, `kv_a_proj_with_mqa`, `kv_b_proj` and `o_proj` as `W + (α/r)·B·A`, and
/// the merged export, imported back, evaluates the held-out data as the adapted model does.
#[test]
fn latent_attentions_adapters_merge_into_deepseeks_projections() {
    let dir = TempDir::new("lora-deepseek-merge");
    let data = token_dataset(&dir, 64, 96);
    let base = import_golden(&dir, "deepseek_v3", "base");
    let flags = [
        "--lora-rank",
        "2",
        "--lora-alpha",
        "8",
        "--lora-target-modules",
        "linear_q_down_proj",
        "linear_q_up_proj",
        "linear_kv_down_proj",
        "linear_kv_up_proj",
        "linear_proj",
    ];
    let save = train_lora(&dir, &base, &data, "2", &flags);
    let lora = megatron::checkpoint::open(std::path::Path::new(&save)).unwrap();
    let basec = megatron::checkpoint::open(std::path::Path::new(&base)).unwrap();
    let ours = |name: &str| lora_or_base(&lora, &basec, name);
    let merged = export_merged(&dir, &save);
    let hf = read_tensors(&merged);
    for (layer, theirs) in [
        ("attn.q_down", "q_a_proj"),
        ("attn.q_up", "q_b_proj"),
        ("attn.kv_down", "kv_a_proj_with_mqa"),
        ("attn.kv_up", "kv_b_proj"),
        ("attn.proj", "o_proj"),
    ] {
        let w = ours(&format!("blocks.1.{layer}.weight"));
        let a = ours(&format!("blocks.1.{layer}.lora_a.weight"));
        let b = ours(&format!("blocks.1.{layer}.lora_b.weight"));
        assert!(
            b.data.iter().any(|&v| v != 0.0),
            "{layer}: training moved B"
        );
        let want = merge(&w.data, &b.data, &a.data, 4.0, w.shape[1]);
        let got = &hf[&format!("model.layers.1.self_attn.{theirs}.weight")].1;
        let worst = worst(got, &want);
        assert!(worst < 1e-6, "{theirs}: {worst}");
    }
    let again = dir.join("merged-ckpt");
    let (ok, _, stderr) = megatron(&["convert", "--from", "hf", &merged, "--to", &again]);
    assert!(ok, "{stderr}");
    let loss = |ckpt: &str| {
        let (ok, stdout, stderr) = megatron(&[
            "eval",
            "--json",
            "--load",
            ckpt,
            "--data",
            &data,
            "--seq-length",
            "16",
            "--micro-batch-size",
            "2",
            "--global-batch-size",
            "4",
            "--eval-iters",
            "2",
        ]);
        assert!(ok, "{stderr}");
        let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
        v["loss"].as_f64().unwrap()
    };
    let (adapted, folded) = (loss(&save), loss(&again));
    assert!(
        (adapted - folded).abs() < 1e-5 * adapted,
        "adapted {adapted} vs merged {folded}"
    );
}
