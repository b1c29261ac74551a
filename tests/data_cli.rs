//! `megatron preprocess` and `megatron data inspect` from the command line, with the byte
//! tokenizer and with small `tokenizer.json` files written here (a GPT-2-style byte-level BPE
//! and a word-level one).

use std::path::{Path, PathBuf};

use megatron::data::{DType, IndexedDataset};
use serde_json::{Value, json};

mod support;
use support::megatron;

struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let dir =
            std::env::temp_dir().join(format!("megatron-data-cli-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    fn path(&self, name: &str) -> String {
        self.0.join(name).display().to_string()
    }

    fn files(&self) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(&self.0)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn write_jsonl(path: &str, lines: &[Value]) {
    let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
    std::fs::write(path, text).unwrap();
}

fn inspect_json(prefix: &str, extra: &[&str]) -> Value {
    let mut args = vec!["data", "inspect", prefix, "--json"];
    args.extend_from_slice(extra);
    let (ok, stdout, stderr) = megatron(&args);
    assert!(ok, "{stderr}");
    serde_json::from_str(&stdout).unwrap()
}

#[test]
fn preprocess_with_the_byte_tokenizer_and_inspect() {
    let dir = TempDir::new("byte");
    let input = dir.path("in.jsonl");
    std::fs::write(
        &input,
        "{\"text\": \"hello world\", \"id\": 1}\n{\"text\": \"\"}\n{\"text\": [\"ab\", \"\", \"cd\"]}\n\n{\"text\": \"h\\u00e9\"}\n",
    )
    .unwrap();
    let out = dir.path("out");
    let (ok, stdout, stderr) = megatron(&[
        "preprocess",
        "--input",
        &input,
        "--tokenizer",
        "byte",
        "--output-prefix",
        &out,
        "--append-eod",
        "--workers",
        "2",
    ]);
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains("4 documents, 4 sequences, 21 tokens (uint16"),
        "{stdout}"
    );
    // Megatron-LM's names, and nothing else left behind.
    assert_eq!(
        dir.files(),
        ["in.jsonl", "out_text_document.bin", "out_text_document.idx"]
    );
    let prefix = format!("{out}_text_document");

    // What Megatron-LM's preprocess_data.py writes for this input: empty documents keep their
    // place with no sequence, a list gives a sequence per non-empty string, the end-of-document
    // token closes the last one.
    let ds = IndexedDataset::open(&prefix).unwrap();
    assert_eq!(ds.dtype(), DType::U16);
    let lengths: Vec<usize> = (0..ds.len())
        .map(|i| ds.sequence_length(i).unwrap())
        .collect();
    assert_eq!(lengths, [12, 2, 3, 4]);
    assert_eq!(ds.document_sequences(1).unwrap(), 1..1);
    assert_eq!(ds.document_sequences(2).unwrap(), 1..3);

    let v = inspect_json(&prefix, &["--docs", "0..4"]);
    assert_eq!(
        v,
        json!({
            "dtype": "uint16",
            "documents": 4,
            "sequences": 4,
            "tokens": 21,
            "docs": [
                {"index": 0, "tokens": [104, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100, 256]},
                {"index": 1, "tokens": []},
                {"index": 2, "tokens": [97, 98, 99, 100, 256]},
                {"index": 3, "tokens": [104, 195, 169, 256]},
            ]
        })
    );
    let v = inspect_json(&prefix, &["--docs", "3", "--tokenizer", "byte"]);
    assert_eq!(
        v["docs"],
        json!([{"index": 3, "text": "hé<|endoftext|>", "tokens": [104, 195, 169, 256]}])
    );
    // Default: the first three documents.
    assert_eq!(
        inspect_json(&prefix, &[])["docs"].as_array().unwrap().len(),
        3
    );

    let (ok, stdout, _) = megatron(&["data", "inspect", &prefix, "--docs", "2..3"]);
    assert!(ok);
    assert!(stdout.contains("dtype      uint16"), "{stdout}");
    assert!(stdout.contains("tokens     21"), "{stdout}");
    assert!(
        stdout.contains("document 2 (5 tokens): [97,98,99,100,256]"),
        "{stdout}"
    );

    let (ok, _, stderr) = megatron(&["data", "inspect", &prefix, "--docs", "2..9"]);
    assert!(!ok);
    assert!(stderr.contains("out of range"), "{stderr}");

    // Without --append-eod: no end-of-document tokens.
    let (ok, _, stderr) = megatron(&[
        "preprocess",
        "--input",
        &input,
        "--tokenizer",
        "byte",
        "--output-prefix",
        &dir.path("plain"),
        "--quiet",
    ]);
    assert!(ok, "{stderr}");
    let v = inspect_json(&dir.path("plain_text_document"), &["--docs", "0"]);
    assert_eq!(v["tokens"], 18);
    assert_eq!(
        v["docs"][0]["tokens"],
        json!([104, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100])
    );
}

/// GPT-2's map of bytes to printable characters.
fn bytes_to_unicode() -> Vec<char> {
    let mut bytes: Vec<u32> = (u32::from(b'!')..=u32::from(b'~'))
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut chars = bytes.clone();
    let mut n = 0;
    for b in 0..256 {
        if !bytes.contains(&b) {
            bytes.push(b);
            chars.push(256 + n);
            n += 1;
        }
    }
    let mut map = vec!['\0'; 256];
    for (b, c) in bytes.into_iter().zip(chars) {
        map[b as usize] = char::from_u32(c).unwrap();
    }
    map
}

/// A GPT-2-style tokenizer.json: byte-level pre-tokenizer and decoder, BPE over the 256 byte
/// symbols (id = byte) with four merges, `<|endoftext|>` = 260.
fn write_bpe_tokenizer(path: &str) {
    let map = bytes_to_unicode();
    let mut vocab = serde_json::Map::new();
    for (b, c) in map.iter().enumerate() {
        vocab.insert(c.to_string(), json!(b));
    }
    for (id, tok) in [(256, "he"), (257, "ll"), (258, "hell"), (259, "Ġw")] {
        vocab.insert(tok.to_string(), json!(id));
    }
    vocab.insert("<|endoftext|>".to_string(), json!(260));
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [{"id": 260, "content": "<|endoftext|>", "single_word": false,
                          "lstrip": false, "rstrip": false, "normalized": true, "special": true}],
        "normalizer": null,
        "pre_tokenizer": byte_level,
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": "", "end_of_word_suffix": "", "fuse_unk": false,
                  "byte_fallback": false, "vocab": vocab,
                  "merges": ["h e", "l l", "he ll", "Ġ w"]}
    });
    std::fs::write(path, tokenizer.to_string()).unwrap();
}

#[test]
fn preprocess_with_a_byte_level_bpe_tokenizer_json() {
    let dir = TempDir::new("bpe");
    let tok = dir.path("tokenizer.json");
    write_bpe_tokenizer(&tok);
    let input = dir.path("in.jsonl");
    write_jsonl(
        &input,
        &[
            json!({"content": "hello world", "text": "x"}),
            json!({"content": "  hell  wo"}),
        ],
    );
    let out = dir.path("bpe");
    let (ok, stdout, stderr) = megatron(&[
        "preprocess",
        "--input",
        &input,
        "--json-key",
        "content",
        "--tokenizer",
        &tok,
        "--output-prefix",
        &out,
        "--append-eod",
        "--quiet",
    ]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("vocabulary 261"), "{stdout}");
    let prefix = format!("{out}_content_document");
    let v = inspect_json(&prefix, &["--tokenizer", &tok]);
    assert_eq!(v["dtype"], "uint16");
    // "hello" → he·ll·o → hell·o; " world" → Ġw·o·r·l·d.
    assert_eq!(
        v["docs"][0],
        json!({"index": 0, "text": "hello world<|endoftext|>",
               "tokens": [258, 111, 259, 111, 114, 108, 100, 260]})
    );
    // GPT-2's pattern keeps all but the last space of a run apart (a look-ahead, which the
    // pure-Rust regex engine handles).
    assert_eq!(
        v["docs"][1],
        json!({"index": 1, "text": "  hell  wo<|endoftext|>",
               "tokens": [32, 32, 258, 32, 259, 111, 260]})
    );
}

#[test]
fn a_tokenizer_without_endoftext_needs_an_eod_token() {
    let dir = TempDir::new("wordlevel");
    let tok = dir.path("words.json");
    let tokenizer = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "hello": 1, "world": 2, "</s>": 3},
                  "unk_token": "[UNK]"}
    });
    std::fs::write(&tok, tokenizer.to_string()).unwrap();
    let input = dir.path("in.jsonl");
    write_jsonl(
        &input,
        &[
            json!({"text": "hello world hello"}),
            json!({"text": "big world"}),
        ],
    );
    let out = dir.path("w");
    let args = |extra: &[&'static str]| {
        let mut a: Vec<String> = [
            "preprocess",
            "--input",
            &input,
            "--tokenizer",
            &tok,
            "--output-prefix",
            &out,
            "--append-eod",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let a = args(&[]);
    let (ok, _, stderr) = megatron(&a.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(!ok);
    assert!(
        stderr.contains("--append-eod")
            && stderr.contains("no <|endoftext|> token")
            && stderr.contains(&tok),
        "{stderr}"
    );
    assert_eq!(dir.files(), ["in.jsonl", "words.json"]);

    let a = args(&["--eod-token", "</s>"]);
    let (ok, _, stderr) = megatron(&a.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(ok, "{stderr}");
    let v = inspect_json(&format!("{out}_text_document"), &[]);
    assert_eq!(v["docs"][0]["tokens"], json!([1, 2, 1, 3]));
    assert_eq!(v["docs"][1]["tokens"], json!([0, 2, 3]));
}

#[test]
fn a_bad_line_fails_the_run_and_leaves_no_files() {
    let dir = TempDir::new("bad");
    let input = dir.path("in.jsonl");
    std::fs::write(
        &input,
        "{\"text\": \"a\"}\n{\"text\": \"b\"}\n{\"text\": \n",
    )
    .unwrap();
    let run = |input: &str| {
        megatron(&[
            "preprocess",
            "--input",
            input,
            "--tokenizer",
            "byte",
            "--output-prefix",
            &dir.path("out"),
        ])
    };
    let (ok, _, stderr) = run(&input);
    assert!(!ok);
    assert!(
        stderr.contains("line 3") && stderr.contains("in.jsonl"),
        "{stderr}"
    );
    assert_eq!(dir.files(), ["in.jsonl"]);

    std::fs::write(&input, "{\"body\": \"a\"}\n").unwrap();
    let (ok, _, stderr) = run(&input);
    assert!(!ok);
    assert!(stderr.contains("line 1: no key \"text\""), "{stderr}");
    assert_eq!(dir.files(), ["in.jsonl"]);

    let (ok, _, stderr) = run(&dir.path("missing.jsonl"));
    assert!(!ok);
    assert!(stderr.contains("missing.jsonl"), "{stderr}");

    let (ok, _, stderr) = megatron(&["data", "inspect", &dir.path("nothing")]);
    assert!(!ok);
    assert!(stderr.contains("nothing.idx: no such file"), "{stderr}");
}

#[test]
fn workers_do_not_change_the_output() {
    let dir = TempDir::new("workers");
    let input = dir.path("in.jsonl");
    let lines: Vec<Value> = (0..1500)
        .map(|i| json!({"text": "x".repeat(i % 37) + &format!("document {i} ✓")}))
        .collect();
    write_jsonl(&input, &lines);
    let mut outputs = Vec::new();
    for workers in ["1", "3"] {
        let out = dir.path(&format!("w{workers}"));
        let (ok, stdout, stderr) = megatron(&[
            "preprocess",
            "--input",
            &input,
            "--tokenizer",
            "byte",
            "--output-prefix",
            &out,
            "--workers",
            workers,
            "--append-eod",
        ]);
        assert!(ok, "{stderr}");
        assert!(stdout.contains("1500 documents"), "{stdout}");
        let prefix = format!("{out}_text_document");
        outputs.push((
            std::fs::read(format!("{prefix}.bin")).unwrap(),
            std::fs::read(format!("{prefix}.idx")).unwrap(),
        ));
    }
    assert_eq!(outputs[0], outputs[1]);
    let ds = IndexedDataset::open(Path::new(&dir.path("w3_text_document"))).unwrap();
    assert_eq!(ds.documents(), 1500);
    let last = ds.document(1499).unwrap();
    let text: Vec<u8> = last[..last.len() - 1].iter().map(|&t| t as u8).collect();
    assert_eq!(
        String::from_utf8(text).unwrap(),
        "x".repeat(1499 % 37) + "document 1499 ✓"
    );
}

#[test]
fn several_json_keys_give_a_dataset_each() {
    let dir = TempDir::new("keys");
    let input = dir.path("in.jsonl");
    write_jsonl(
        &input,
        &[
            json!({"text": "ab", "title": "T"}),
            json!({"text": "c", "title": ""}),
        ],
    );
    let out = dir.path("out");
    let (ok, _, stderr) = megatron(&[
        "preprocess",
        "--input",
        &input,
        "--json-keys",
        "text",
        "title",
        "--tokenizer",
        "byte",
        "--output-prefix",
        &out,
        "--append-eod",
    ]);
    assert!(ok, "{stderr}");
    let text = inspect_json(&format!("{out}_text_document"), &[]);
    assert_eq!(
        text["docs"],
        json!([{"index": 0, "tokens": [97, 98, 256]}, {"index": 1, "tokens": [99, 256]}])
    );
    let title = inspect_json(&format!("{out}_title_document"), &[]);
    assert_eq!(
        title["docs"],
        json!([{"index": 0, "tokens": [84, 256]}, {"index": 1, "tokens": []}])
    );
}
