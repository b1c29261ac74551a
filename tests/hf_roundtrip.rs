//! Hugging Face conversion gives back exactly what it took (issue 48): every architecture of
//! `tests/data/hf/` (made by transformers), in f32 as transformers saved it and in a bf16 copy
//! carrying a generation config and tokenizer files, imported and exported straight back,
//! returns the same tensors byte for byte in the same dtype, the same `config.json` byte for
//! byte and the same carried files; shards as transformers shards them; a trained model is
//! written in the imported dtype rounded to nearest even; bad shards, dtypes and flags are
//! refused by name with nothing left behind. `tools/golden/hf_roundtrip.py` checks the same
//! with transformers' own `AutoConfig` and logits.

mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use megatron::convert::{self, ExportOptions};
use safetensors::SafeTensors;
use safetensors::tensor::{Dtype, TensorView};
use serde_json::Value;
use support::{TempDir, edit_tensor, megatron, token_dataset};

const NAMES: [&str; 8] = [
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "mixtral",
    "qwen3_moe",
    "mistral_window",
    "qwen2_window",
];

/// The files a bf16 copy carries besides its weights and config.
const EXTRA: [(&str, &str); 3] = [
    (
        "generation_config.json",
        "{\n  \"bos_token_id\": 1,\n  \"eos_token_id\": [2, 3],\n  \"temperature\": 0.6\n}\n",
    ),
    (
        "tokenizer_config.json",
        "{\"chat_template\": \"{% for m in messages %}{{ m['content'] }}{% endfor %}\"}",
    ),
    ("special_tokens_map.json", "{\"eos_token\": \"</s>\"}"),
];

fn golden(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/data/hf/{name}"))
}

/// Every tensor of a Hugging Face directory's safetensors files: dtype, shape and bytes.
fn tensors(dir: &Path) -> BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)> {
    let mut out = BTreeMap::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "safetensors") {
            let bytes = std::fs::read(&path).unwrap();
            let st = SafeTensors::deserialize(&bytes).unwrap();
            for (name, view) in st.tensors() {
                let t = (view.dtype(), view.shape().to_vec(), view.data().to_vec());
                assert!(out.insert(name.clone(), t).is_none(), "{name} twice");
            }
        }
    }
    out
}

fn read_json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// A copy of golden model `name` in bf16 (each f32 rounded to nearest even), in one file,
/// its config saying so (in transformers 4's `torch_dtype`, with `bos_token_id` 1 and
/// `eos_token_id` 2 and a float that f32 cannot hold), with [`EXTRA`]'s files.
fn bf16_copy(name: &str, dir: &Path) -> PathBuf {
    let out = dir.join(format!("{name}-bf16"));
    std::fs::create_dir_all(&out).unwrap();
    let halves: Vec<(String, Vec<usize>, Vec<u8>)> = tensors(&golden(name))
        .into_iter()
        .map(|(n, (dtype, shape, bytes))| {
            assert_eq!(dtype, Dtype::F32);
            let bf16: Vec<u8> = bytes
                .chunks_exact(4)
                .flat_map(|b| {
                    half::bf16::from_f32(f32::from_le_bytes(b.try_into().unwrap())).to_le_bytes()
                })
                .collect();
            (n, shape, bf16)
        })
        .collect();
    let views: Vec<(String, TensorView)> = halves
        .iter()
        .map(|(n, shape, b)| {
            (
                n.clone(),
                TensorView::new(Dtype::BF16, shape.clone(), b).unwrap(),
            )
        })
        .collect();
    std::fs::write(
        out.join("model.safetensors"),
        safetensors::serialize(views, None).unwrap(),
    )
    .unwrap();
    let mut config = read_json(&golden(name).join("config.json"));
    let map = config.as_object_mut().unwrap();
    map.shift_remove("dtype");
    map.insert("torch_dtype".into(), "bfloat16".into());
    map.insert("bos_token_id".into(), 1.into());
    map.insert("eos_token_id".into(), 2.into());
    map.insert("initializer_range".into(), serde_json::json!(0.1));
    std::fs::write(
        out.join("config.json"),
        serde_json::to_string_pretty(&config).unwrap(),
    )
    .unwrap();
    for (file, text) in EXTRA {
        std::fs::write(out.join(file), text).unwrap();
    }
    out
}

/// `hf`'s tensors, config and carried files against `back`'s, byte for byte (a tied head
/// that transformers saved beside its embedding is not written back).
fn assert_same(hf: &Path, back: &Path, what: &str) {
    let mut want = tensors(hf);
    let config = read_json(&hf.join("config.json"));
    if config["tie_word_embeddings"].as_bool() == Some(true) {
        want.remove("lm_head.weight");
    }
    let got = tensors(back);
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>(),
        "{what}"
    );
    for (name, t) in &want {
        assert!(got[name] == *t, "{what}: `{name}` differs");
    }
    for file in ["config.json", "generation_config.json"]
        .into_iter()
        .chain(EXTRA.iter().map(|(f, _)| *f))
    {
        let (a, b) = (hf.join(file), back.join(file));
        if a.exists() {
            assert_eq!(
                std::fs::read(&a).unwrap(),
                std::fs::read(&b).unwrap_or_default(),
                "{what}: {file}"
            );
        }
    }
}

#[test]
fn every_architecture_comes_back_byte_for_byte_in_its_dtype() {
    let dir = TempDir::new("hf-roundtrip");
    for name in NAMES {
        for (variant, hf) in [("f32", golden(name)), ("bf16", bf16_copy(name, dir.path()))] {
            let what = format!("{name} {variant}");
            let ckpt = dir.path().join(format!("{name}-{variant}-ckpt"));
            let imported = convert::import_hf(&hf, &ckpt, false).unwrap();
            let dtype = if variant == "f32" {
                Dtype::F32
            } else {
                Dtype::BF16
            };
            assert_eq!(imported.dtype, dtype, "{what}");
            let back = dir.path().join(format!("{name}-{variant}-back"));
            let exported = convert::export_hf(&ckpt, &back, false, &Default::default()).unwrap();
            assert_eq!(exported.dtype, dtype, "{what}");
            // Mistral without a window stays Mistral (a Llama would compute the same).
            let arch = read_json(&hf.join("config.json"))["architectures"][0].clone();
            assert_eq!(arch, exported.arch, "{what}");
            assert_same(&hf, &back, &what);
        }
    }
    // Shards as transformers made them: the golden Llama was saved with 24KB shards.
    let ckpt = dir.path().join("llama-f32-ckpt");
    let back = dir.path().join("llama-sharded");
    let options = ExportOptions {
        max_shard_size: 24_000,
        ..Default::default()
    };
    let exported = convert::export_hf(&ckpt, &back, false, &options).unwrap();
    assert_eq!(
        exported.weight_files.len(),
        5,
        "{:?}",
        exported.weight_files
    );
    let index = "model.safetensors.index.json";
    assert_eq!(
        read_json(&back.join(index)),
        read_json(&golden("llama").join(index))
    );
    // Another dtype on request: widened exactly, the config's dtype field saying so.
    let ckpt = dir.path().join("qwen3-bf16-ckpt");
    let wide = dir.path().join("qwen3-wide");
    let options = ExportOptions {
        dtype: Some(Dtype::F32),
        ..Default::default()
    };
    convert::export_hf(&ckpt, &wide, false, &options).unwrap();
    let narrow = tensors(&dir.path().join("qwen3-bf16"));
    for (name, (dtype, shape, bytes)) in tensors(&wide) {
        assert_eq!(dtype, Dtype::F32);
        let (_, want_shape, halves) = &narrow[&name];
        assert_eq!(&shape, want_shape);
        let widened: Vec<u8> = halves
            .chunks_exact(2)
            .flat_map(|b| {
                half::bf16::from_le_bytes([b[0], b[1]])
                    .to_f32()
                    .to_le_bytes()
            })
            .collect();
        assert!(bytes == widened, "{name}");
    }
    let mut config = read_json(&wide.join("config.json"));
    assert_eq!(config["torch_dtype"], "float32");
    config["torch_dtype"] = "bfloat16".into();
    assert_eq!(
        config,
        read_json(&dir.path().join("qwen3-bf16/config.json"))
    );
}

#[test]
fn a_trained_model_is_written_in_the_imported_dtype_rounded_to_nearest_even() {
    let dir = TempDir::new("hf-roundtrip-trained");
    let hf = bf16_copy("qwen3", dir.path());
    let ckpt = dir.join("imported");
    let (ok, _, stderr) = megatron(&[
        "convert",
        "--from",
        "hf",
        hf.to_str().unwrap(),
        "--to",
        &ckpt,
    ]);
    assert!(ok, "{stderr}");
    let trained = dir.join("trained");
    let data = token_dataset(&dir, 16, 48);
    let (ok, _, stderr) = megatron(&[
        "train",
        "--quiet",
        "--load",
        &ckpt,
        "--data",
        &data,
        "--seq-length",
        "16",
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "2",
        "--lr",
        "1e-3",
        "--train-iters",
        "2",
        "--save",
        &trained,
    ]);
    assert!(ok, "{stderr}");
    let back = dir.join("back");
    let (ok, stdout, stderr) = megatron(&["convert", "--from", &trained, "--to", "hf", &back]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("of bfloat16 weights"), "{stdout}");
    assert!(stdout.contains("peak resident memory"), "{stdout}");
    let back = Path::new(&back);
    // The carried files went through training unchanged.
    for (file, text) in EXTRA {
        assert_eq!(
            std::fs::read_to_string(back.join(file)).unwrap(),
            text,
            "{file}"
        );
    }
    assert_eq!(
        std::fs::read(back.join("config.json")).unwrap(),
        std::fs::read(hf.join("config.json")).unwrap()
    );
    // Each trained f32 value, rounded to nearest even: transformers' `.to(torch.bfloat16)`.
    let loaded = megatron::checkpoint::open(Path::new(&trained)).unwrap();
    let written = tensors(back);
    let (_, _, q) = &written["model.layers.0.self_attn.o_proj.weight"];
    let trained_q = loaded.model_tensor("blocks.0.attn.proj.weight").unwrap();
    let rounded: Vec<u8> = trained_q
        .data
        .iter()
        .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
        .collect();
    assert!(*q == rounded);
    let original = tensors(&hf);
    assert!(
        original["model.layers.0.self_attn.o_proj.weight"].2 != *q,
        "training moved it"
    );
}

#[test]
fn bad_shards_dtypes_and_flags_are_refused_by_name_with_nothing_left_behind() {
    let dir = TempDir::new("hf-roundtrip-bad");
    let copy = |name: &str| {
        let to = dir.path().join(name);
        std::fs::create_dir_all(&to).unwrap();
        for entry in std::fs::read_dir(golden("llama")).unwrap() {
            let p = entry.unwrap().path();
            std::fs::copy(&p, to.join(p.file_name().unwrap())).unwrap();
        }
        to
    };
    let refused = |hf: &Path, what: &str| {
        let out = dir.join(&format!(
            "{}-ckpt",
            hf.file_name().unwrap().to_string_lossy()
        ));
        let (ok, _, stderr) = megatron(&[
            "convert",
            "--from",
            "hf",
            hf.to_str().unwrap(),
            "--to",
            &out,
        ]);
        assert!(!ok);
        assert!(stderr.contains(what), "{stderr}");
        let left: Vec<_> = std::fs::read_dir(&out)
            .map(|d| d.flatten().map(|e| e.file_name()).collect())
            .unwrap_or_default();
        assert!(left.is_empty(), "{what}: left {left:?}");
        stderr
    };
    // A shard the index names, missing.
    let missing = copy("missing");
    std::fs::remove_file(missing.join("model-00003-of-00004.safetensors")).unwrap();
    refused(&missing, "shard `model-00003-of-00004.safetensors`");
    // A shard cut short.
    let truncated = copy("truncated");
    let shard = truncated.join("model-00002-of-00004.safetensors");
    let bytes = std::fs::read(&shard).unwrap();
    std::fs::write(&shard, &bytes[..bytes.len() - 100]).unwrap();
    let stderr = refused(&truncated, "model-00002-of-00004.safetensors: truncated");
    assert!(
        stderr.contains(&format!("the file has {} bytes", bytes.len() - 100)),
        "{stderr}"
    );
    // A tensor of integers where a weight should be.
    let ints = copy("ints");
    let shard = ints.join("model-00004-of-00004.safetensors");
    edit_tensor(&shard, "model.norm.weight", |b| (Dtype::I32, b));
    refused(&ints, "I32 values: parameters are F32, F16 or BF16");
    // A value that is not finite, found while the checkpoint is written.
    let nan = copy("nan");
    let shard = nan.join("model-00004-of-00004.safetensors");
    edit_tensor(&shard, "model.norm.weight", |mut b| {
        b[8..12].copy_from_slice(&f32::NAN.to_le_bytes());
        (Dtype::F32, b)
    });
    refused(&nan, "element 2 of `ln_f.weight` is NaN");
    // Flags: a dtype parameters are not held in, a size without a number, export flags on an
    // import.
    let ckpt = dir.join("good-ckpt");
    let hf = golden("llama");
    let (ok, _, stderr) = megatron(&[
        "convert",
        "--from",
        "hf",
        hf.to_str().unwrap(),
        "--to",
        &ckpt,
    ]);
    assert!(ok, "{stderr}");
    let out = dir.join("out");
    for (flags, what) in [
        (
            &["--dtype", "int8"][..],
            "`int8` is not a dtype parameters are held in",
        ),
        (
            &["--max-shard-size", "lots"],
            "size `lots` does not start with a number",
        ),
    ] {
        let mut args = vec!["convert", "--from", &ckpt, "--to", "hf", &out];
        args.extend(flags);
        let (ok, _, stderr) = megatron(&args);
        assert!(!ok);
        assert!(stderr.contains(what), "{stderr}");
        assert!(!Path::new(&out).exists());
    }
    let again = dir.join("again");
    let (ok, _, stderr) = megatron(&[
        "convert",
        "--from",
        "hf",
        hf.to_str().unwrap(),
        "--to",
        &again,
        "--dtype",
        "bf16",
    ]);
    assert!(!ok);
    assert!(
        stderr.contains("--dtype and --max-shard-size shape an export"),
        "{stderr}"
    );
    // Nothing is left beside an export's target either.
    let parent: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.'))
        .collect();
    assert!(parent.is_empty(), "{parent:?}");
}
