//! Checkpoints and tokenizers are self-contained: `megatron tokenizer train` makes the
//! tokenizer (no download), checkpoints carry it (generation works from anywhere), Hugging Face
//! export and import carry it too, and generation refuses what cannot be sampled.

mod support;
use megatron::tokenizer::{ENDOFTEXT, Tokenizer};
use support::{TempDir, megatron, megatron_in, small_checkpoint};

/// JSON lines of varied text (megatron-rs's own sources, a document per file).
fn corpus(dir: &TempDir) -> String {
    let text = String::from_utf8_lossy(megatron::data::default_corpus()).into_owned();
    let lines: String = text
        .as_bytes()
        .chunks(2000)
        .take(60)
        .map(|c| serde_json::json!({ "text": String::from_utf8_lossy(c) }).to_string() + "\n")
        .collect();
    let path = dir.join("corpus.jsonl");
    std::fs::write(&path, lines).unwrap();
    path
}

#[test]
fn a_trained_tokenizer_goes_from_raw_text_to_generation_in_a_self_contained_checkpoint() {
    let dir = TempDir::new("tokenizer-path");
    let corpus = corpus(&dir);
    let tokenizer = dir.join("tokenizer.json");
    let (ok, stdout, stderr) = megatron(&[
        "tokenizer",
        "train",
        "--input",
        &corpus,
        "--vocab-size",
        "400",
        "--output",
        &tokenizer,
    ]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("400 tokens"), "{stdout}");
    let t = Tokenizer::from_file(&tokenizer).unwrap();
    assert_eq!(t.vocab_size(), 400);
    let eod = t.eod().expect("<|endoftext|> is in the vocabulary");
    // Byte-level BPE: any text round-trips, and merges make it shorter than its bytes.
    let text = "fn main() {\n    let résumé = \"naïve\";\n}";
    let ids = t.encode(text).unwrap();
    assert!(
        ids.len() < text.len(),
        "{} tokens for {} bytes",
        ids.len(),
        text.len()
    );
    assert!(ids.iter().all(|&id| id < 400 && id != eod));
    assert_eq!(t.decode(&ids).unwrap(), text);
    assert_eq!(t.decode(&[eod]).unwrap(), ENDOFTEXT);

    let (ok, _, stderr) = megatron(&[
        "preprocess",
        "--input",
        &corpus,
        "--tokenizer",
        &tokenizer,
        "--output-prefix",
        &dir.join("data"),
        "--append-eod",
        "--quiet",
    ]);
    assert!(ok, "{stderr}");
    let save = dir.join("ckpt");
    let (ok, _, stderr) = megatron(&[
        "train",
        "--quiet",
        "--num-layers",
        "1",
        "--seq-length",
        "32",
        "--train-iters",
        "3",
        "--data",
        &dir.join("data_text_document"),
        "--tokenizer",
        &tokenizer,
        "--save",
        &save,
    ]);
    assert!(ok, "{stderr}");
    assert!(std::path::Path::new(&format!("{save}/iter_0000003/tokenizer.json")).is_file());
    // The checkpoint needs neither the tokenizer file it was trained with nor the directory
    // training ran in.
    std::fs::remove_file(&tokenizer).unwrap();
    let elsewhere = TempDir::new("tokenizer-elsewhere");
    let (ok, stdout, stderr) = megatron_in(
        elsewhere.path(),
        &[
            "generate",
            "--load",
            &save,
            "--prompt",
            "fn main",
            "--max-new-tokens",
            "4",
        ],
    );
    assert!(ok, "{stderr}");
    assert!(stdout.starts_with("fn main"), "{stdout}");
    // A resumed run takes the checkpoint's tokenizer and carries it on.
    let (ok, stdout, stderr) = megatron_in(
        elsewhere.path(),
        &[
            "train",
            "--quiet",
            "--load",
            &save,
            "--save",
            &save,
            "--train-iters",
            "4",
        ],
    );
    assert!(ok, "{stderr}");
    assert!(stdout.contains("iter_0000003/tokenizer.json"), "{stdout}");
    assert!(std::path::Path::new(&format!("{save}/iter_0000004/tokenizer.json")).is_file());

    // Hugging Face export writes the tokenizer and its end-of-text id; import takes them back.
    let hf = dir.join("hf");
    let (ok, _, stderr) = megatron(&["convert", "--from", &save, "--to", "hf-gpt2", &hf]);
    assert!(ok, "{stderr}");
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(format!("{hf}/config.json")).unwrap())
            .unwrap();
    assert_eq!(config["eos_token_id"], eod);
    assert_eq!(config["bos_token_id"], eod);
    assert!(std::path::Path::new(&format!("{hf}/tokenizer.json")).is_file());
    let imported = dir.join("imported");
    let (ok, _, stderr) = megatron(&["convert", "--from", "hf-gpt2", &hf, "--to", &imported]);
    assert!(ok, "{stderr}");
    assert!(std::path::Path::new(&format!("{imported}/iter_0000000/tokenizer.json")).is_file());
    let (ok, stdout, stderr) = megatron_in(
        elsewhere.path(),
        &[
            "generate",
            "--load",
            &imported,
            "--prompt",
            "fn main",
            "--max-new-tokens",
            "4",
        ],
    );
    assert!(ok, "{stderr}");
    assert!(stdout.starts_with("fn main"), "{stdout}");

    // A GPT-2 that does not scale its attention scores computes something else: refused.
    let mut unscaled = config.clone();
    unscaled["scale_attn_weights"] = serde_json::json!(false);
    std::fs::write(format!("{hf}/config.json"), unscaled.to_string()).unwrap();
    let (ok, _, stderr) = megatron(&[
        "convert",
        "--from",
        "hf-gpt2",
        &hf,
        "--to",
        &dir.join("unscaled"),
    ]);
    assert!(
        !ok && stderr.contains("`scale_attn_weights` = false"),
        "{stderr}"
    );
}

#[test]
fn a_tokenizer_too_small_or_without_documents_is_an_error() {
    let dir = TempDir::new("tokenizer-bad");
    let corpus = corpus(&dir);
    let out = dir.join("tokenizer.json");
    let (ok, _, stderr) = megatron(&[
        "tokenizer",
        "train",
        "--input",
        &corpus,
        "--vocab-size",
        "100",
        "--output",
        &out,
    ]);
    assert!(!ok && stderr.contains("give at least 257"), "{stderr}");
    std::fs::write(dir.join("other.jsonl"), "{\"body\": \"text\"}\n").unwrap();
    let (ok, _, stderr) = megatron(&[
        "tokenizer",
        "train",
        "--input",
        &dir.join("other.jsonl"),
        "--vocab-size",
        "300",
        "--output",
        &out,
    ]);
    assert!(
        !ok && stderr.contains("line 1: no key \"text\""),
        "{stderr}"
    );
    assert!(!std::path::Path::new(&out).exists());
}

#[test]
fn generation_refuses_a_temperature_it_cannot_sample_with_and_says_when_it_cuts_a_prompt() {
    let dir = TempDir::new("generate-checks");
    let save = dir.join("ckpt");
    small_checkpoint(&save, 1, &["--max-position-embeddings", "16"]);
    for t in ["-1", "NaN", "inf"] {
        let (ok, _, stderr) = megatron(&[
            "generate",
            "--load",
            &save,
            "--prompt",
            "hi",
            "--temperature",
            t,
        ]);
        assert!(
            !ok && stderr.contains("invalid value")
                && stderr.contains("'--temperature <TEMPERATURE>'"),
            "{t}: {stderr}"
        );
    }
    let prompt = "x".repeat(40);
    let (ok, _, stderr) = megatron(&[
        "generate",
        "--load",
        &save,
        "--prompt",
        &prompt,
        "--max-new-tokens",
        "2",
    ]);
    assert!(ok, "{stderr}");
    assert!(
        stderr.contains(
            "the prompt is 40 tokens and 2 new ones are asked, more than the model's 16 \
             positions: the model sees the prompt's last 14 tokens"
        ),
        "{stderr}"
    );
}
