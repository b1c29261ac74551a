//! Chat data against Hugging Face transformers (tests/data/chat, made by
//! tools/golden/chat_templates.py): the chat templates of Llama 3, Qwen3 and Mistral render
//! and tokenize every conversation as `apply_chat_template` does, the template's own errors
//! come through, and the answer-only masks are the rule's; then `megatron preprocess --chat`
//! packs a file of conversations whole, `megatron data inspect` shows what counts, and a
//! model trains and evaluates on it.

mod support;

use std::path::Path;

use megatron::chat::{self, ChatTemplate, Conversation};
use megatron::tokenizer::Tokenizer;
use serde_json::Value;
use support::{TempDir, megatron};

fn family(name: &str) -> (ChatTemplate, Tokenizer, Vec<Value>) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/chat")
        .join(name);
    let template = ChatTemplate::from_dir(&dir).unwrap();
    let tokenizer = Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    let golden: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap()).unwrap();
    (template, tokenizer, golden.as_array().unwrap().clone())
}

#[test]
fn templates_render_and_tokenize_as_transformers() {
    for name in ["llama3", "qwen3", "mistral"] {
        let (template, tokenizer, cases) = family(name);
        let (mut rendered, mut raised, mut masks, mut per_turn) = (0, 0, 0, 0);
        for case in &cases {
            let messages = case["messages"].as_array().unwrap();
            let generation = case["add_generation_prompt"].as_bool().unwrap();
            let ours = template.render(messages, None, generation);
            match (&case["error"], ours) {
                (Value::String(expected), Err(e)) => {
                    assert_eq!(
                        e.to_string(),
                        format!("the chat template raised: {expected}")
                    );
                    raised += 1;
                }
                (Value::Null, Ok(text)) => {
                    assert_eq!(text, case["text"].as_str().unwrap(), "{name}: {messages:?}");
                    if let Some(ids) = case["ids"].as_array() {
                        let ids: Vec<u32> =
                            ids.iter().map(|v| v.as_u64().unwrap() as u32).collect();
                        assert_eq!(tokenizer.encode(&text).unwrap(), ids, "{name}");
                    }
                    rendered += 1;
                }
                (expected, ours) => panic!("{name}: {messages:?}: {expected:?} vs {ours:?}"),
            }
            let Some(expected) = case.get("answer_documents") else {
                continue;
            };
            let object = serde_json::json!({"messages": messages});
            let conversation = Conversation::from_object(object.as_object().unwrap()).unwrap();
            let ours = chat::tokenize(&conversation, &template, &tokenizer, true, false).unwrap();
            let expected: Vec<(Vec<u32>, Vec<bool>)> = expected
                .as_array()
                .unwrap()
                .iter()
                .map(|d| {
                    let ids = d["ids"].as_array().unwrap();
                    let mask = d["mask"].as_array().unwrap();
                    (
                        ids.iter().map(|v| v.as_u64().unwrap() as u32).collect(),
                        mask.iter().map(|v| v.as_u64() == Some(1)).collect(),
                    )
                })
                .collect();
            let ours: Vec<(Vec<u32>, Vec<bool>)> =
                ours.into_iter().map(|t| (t.tokens, t.counts)).collect();
            assert_eq!(ours, expected, "{name}: {messages:?}");
            masks += 1;
            per_turn += usize::from(ours.len() > 1);
        }
        assert!(
            rendered >= 6 && masks >= 3,
            "{name}: {rendered} rendered, {masks} masks"
        );
        if name == "mistral" {
            assert!(raised >= 2);
        }
        // Qwen3 drops earlier turns' thinking: its multi-turn chats train one turn a document.
        assert_eq!(per_turn, if name == "qwen3" { 2 } else { 0 }, "{name}");
    }
}

#[test]
fn conversations_without_an_answer_or_with_bad_lines_are_refused_by_name() {
    let (template, tokenizer, _) = family("llama3");
    let user_only = chat::parse(r#"{"messages": [{"role": "user", "content": "hi"}]}"#, 3).unwrap();
    let err = chat::tokenize(&user_only, &template, &tokenizer, true, false).unwrap_err();
    assert!(err.to_string().contains("no assistant turn"), "{err}");
    for (line, expected) in [
        (
            r#"{"prompt": "a"}"#,
            "line 7: a \"prompt\" without its \"completion\"",
        ),
        (
            r#"{"messages": [{"content": "x"}]}"#,
            "line 7: message 0 has no \"role\" string",
        ),
        (r#"[1]"#, "line 7: not a JSON object"),
        (r#"{"text": "x"}"#, "line 7: no \"messages\""),
    ] {
        let err = chat::parse(line, 7).unwrap_err();
        assert!(format!("{err:#}").starts_with(expected), "{err:#}");
    }
    // A prompt and a completion are a user turn and an assistant turn.
    let pc = chat::parse(r#"{"prompt": "2+2?", "completion": "4"}"#, 1).unwrap();
    let [t] = &chat::tokenize(&pc, &template, &tokenizer, true, false).unwrap()[..] else {
        panic!("a prompt and its completion are one document");
    };
    let counted: Vec<u32> = t
        .tokens
        .iter()
        .zip(&t.counts)
        .filter(|(_, c)| **c)
        .map(|(t, _)| *t)
        .collect();
    assert_eq!(tokenizer.decode(&counted).unwrap(), "4<|eot_id|>");
}

/// Writes `n` short chats (each a user question and the assistant's answer).
fn chats(path: &Path, n: usize) {
    let lines: String = (0..n)
        .map(|i| {
            let q = [
                "what is two plus two",
                "name a colour",
                "count to three",
                "hello",
            ][i % 4];
            let a = ["four", "blue", "one two three", "hi how can i help"][i % 4];
            let extra = " the quick brown fox".repeat(i % 3);
            serde_json::json!({"messages": [
                {"role": "user", "content": format!("{q}{extra}")},
                {"role": "assistant", "content": a},
            ]})
            .to_string()
                + "\n"
        })
        .collect();
    std::fs::write(path, lines).unwrap();
}

/// `megatron preprocess --chat` of `input` with the tokenizer directory `tok` into `prefix`,
/// bins of `seq_length + 1` tokens, with `extra` flags: (success, stdout, stderr).
fn preprocess_chat(
    input: &str,
    tok: &Path,
    prefix: &str,
    seq_length: &str,
    extra: &[&str],
) -> (bool, String, String) {
    let mut args = vec![
        "preprocess",
        "--chat",
        "--input",
        input,
        "--tokenizer",
        tok.to_str().unwrap(),
        "--output-prefix",
        prefix,
        "--seq-length",
        seq_length,
    ];
    args.extend_from_slice(extra);
    megatron(&args)
}

/// `megatron data inspect PREFIX --docs RANGE --json`: each document's text and the text of its
/// tokens that count, decoded with `tokenizer`, and its length in tokens.
fn inspected(prefix: &str, range: &str, tokenizer: &Tokenizer) -> Vec<(String, String, usize)> {
    let (ok, stdout, stderr) = megatron(&["data", "inspect", prefix, "--docs", range, "--json"]);
    assert!(ok, "{stderr}");
    stdout
        .lines()
        .map(|l| {
            let d: Value = serde_json::from_str(l).unwrap();
            let ids: Vec<u32> = d["tokens"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32)
                .collect();
            let mask = d["loss_mask"].as_array().unwrap();
            assert_eq!(mask.len(), ids.len());
            let counted: Vec<u32> = ids
                .iter()
                .zip(mask)
                .filter(|(_, m)| m.as_u64() == Some(1))
                .map(|(t, _)| *t)
                .collect();
            let text = tokenizer.decode(&ids).unwrap();
            (text, tokenizer.decode(&counted).unwrap(), ids.len())
        })
        .collect()
}

/// The log lines of `megatron train` of a one-layer model of width 32 on `--seq-length
/// seq`, a global batch of 4, with the tokenizer `tokenizer_json` and `extra` flags (the data
/// among them), its log written to `log`.
fn tiny_train(tokenizer_json: &str, seq: &str, log: &str, extra: &[&str]) -> Vec<Value> {
    let mut args = vec![
        "train",
        "--tokenizer",
        tokenizer_json,
        "--split",
        "100,0,0",
        "--num-layers",
        "1",
        "--hidden-size",
        "32",
        "--num-attention-heads",
        "4",
        "--seq-length",
        seq,
        "--global-batch-size",
        "4",
        "--log-json",
        log,
    ];
    args.extend_from_slice(extra);
    let (ok, _, stderr) = megatron(&args);
    assert!(ok, "{stderr}");
    support::log_lines(log)
}

#[test]
fn preprocess_packs_chats_whole_and_inspect_shows_what_counts() {
    let dir = TempDir::new("chat-preprocess");
    let input = dir.join("chats.jsonl");
    chats(Path::new(&input), 40);
    let tok = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/chat/llama3");
    let prefix = dir.join("sft");
    let (ok, stdout, stderr) = preprocess_chat(&input, &tok, &prefix, "63", &[]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("40 conversations in"), "{stdout}");
    for ext in ["bin", "idx", "packed"] {
        assert!(Path::new(&format!("{prefix}.{ext}")).is_file());
    }
    // Every document shown with its tokens and which of them count: the assistant's answer
    // and its end-of-turn token, nothing else.
    let tokenizer = Tokenizer::from_file(tok.join("tokenizer.json")).unwrap();
    let docs = inspected(&prefix, "0..40", &tokenizer);
    assert_eq!(docs.len(), 40);
    let mut answers: Vec<String> = docs.into_iter().map(|(_, counted, _)| counted).collect();
    answers.sort();
    answers.dedup();
    assert_eq!(
        answers,
        [
            "blue<|eot_id|>",
            "four<|eot_id|>",
            "hi how can i help<|eot_id|>",
            "one two three<|eot_id|>"
        ]
    );
    // A packed sample's documents and positions.
    let (ok, stdout, stderr) = megatron(&["data", "inspect", &prefix, "--sample", "0"]);
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains("document") && stdout.contains("positions"),
        "{stdout}"
    );

    // Training on the packed chats, alone and blended with token data (whose targets all
    // count): the log counts the answers' targets only where packed samples are.
    let tokens = dir.join("plain");
    let plain: String = (0..60)
        .map(|i| format!("{{\"text\": \"plain text {i}\"}}\n"))
        .collect();
    std::fs::write(dir.join("plain.jsonl"), plain).unwrap();
    let (ok, _, stderr) = megatron(&[
        "preprocess",
        "--input",
        &dir.join("plain.jsonl"),
        "--tokenizer",
        tok.join("tokenizer.json").to_str().unwrap(),
        "--output-prefix",
        &tokens,
    ]);
    assert!(ok, "{stderr}");
    let tokenizer_json = tok.join("tokenizer.json").to_string_lossy().into_owned();
    let mut counted = Vec::new();
    for data in [
        vec![prefix.clone()],
        vec![
            "0.5".into(),
            prefix.clone(),
            "0.5".into(),
            format!("{tokens}_text_document"),
        ],
    ] {
        let log = dir.join("log.jsonl");
        let mut args = vec!["--micro-batch-size", "2", "--train-iters", "3", "--data"];
        args.extend(data.iter().map(String::as_str));
        let steps = tiny_train(&tokenizer_json, "63", &log, &args);
        counted.push(steps[0]["counted_tokens"].as_u64().unwrap());
    }
    // Packed alone: only answers count; blended: the token data's targets too.
    assert!(counted[0] < 4 * 63 / 2, "{counted:?}");
    assert!(counted[1] > counted[0], "{counted:?}");

    // Too long for the sequence: refused by name, or dropped and counted.
    let short = dir.join("short");
    let (ok, _, stderr) = preprocess_chat(&input, &tok, &short, "15", &[]);
    assert!(
        !ok && stderr.contains("more than a sequence of 16 holds"),
        "{stderr}"
    );
    assert!(!Path::new(&dir.join("short.bin")).exists());
    let (ok, stdout, stderr) = preprocess_chat(&input, &tok, &short, "31", &["--overlong", "drop"]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("dropped (lines"), "{stdout}");
}

#[test]
fn a_template_that_rewrites_earlier_turns_trains_each_turn_in_its_own_context() {
    // Qwen3 keeps the thinking of the last answer only: a two-answer chat is two documents,
    // each the chat up to its answer (the earlier answer without its thinking), each counting
    // its own answer; a one-answer chat stays one document.
    let dir = TempDir::new("chat-per-turn");
    let input = dir.join("chats.jsonl");
    let two = serde_json::json!({"messages": [
        {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "reasoning_content": "two and two", "content": "Four."},
        {"role": "user", "content": "And three plus one?"},
        {"role": "assistant", "reasoning_content": "three and one", "content": "Four too."},
    ]});
    let one = serde_json::json!({"prompt": "hello", "completion": "hi"});
    std::fs::write(Path::new(&input), format!("{two}\n{one}\n")).unwrap();
    let tok = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/chat/qwen3");
    let prefix = dir.join("sft");
    let (ok, stdout, stderr) = preprocess_chat(&input, &tok, &prefix, "255", &[]);
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains("2 conversations as 3 documents")
            && stdout.contains("1 conversations made one document per assistant turn"),
        "{stdout}"
    );
    let tokenizer = Tokenizer::from_file(tok.join("tokenizer.json")).unwrap();
    let mut shown = inspected(&prefix, "0..3", &tokenizer);
    shown.sort_by(|a, b| a.1.cmp(&b.1));
    let answers: Vec<&str> = shown.iter().map(|(_, a, _)| a.as_str()).collect();
    assert_eq!(
        answers,
        [
            "<think>\n\n</think>\n\nhi<|im_end|>\n",
            "<think>\nthree and one\n</think>\n\nFour too.<|im_end|>\n",
            "<think>\ntwo and two\n</think>\n\nFour.<|im_end|>\n",
        ]
    );
    // The second turn's context has the first answer without its thinking.
    assert!(
        shown[1].0.contains("assistant\nFour.<|im_end|>") && !shown[1].0.contains("two and two"),
        "{}",
        shown[1].0
    );
}

#[test]
fn conversations_padded_to_2cp_train_cut_over_context_parallel_ranks_as_on_one() {
    // Each conversation padded to a multiple of 4 positions (what counts unchanged), so that
    // at cp 2 with one sequence a microbatch every conversation is cut over both ranks
    // (Transformer Engine's thd): the same losses as cp 1.
    let dir = TempDir::new("chat-thd");
    let input = dir.join("chats.jsonl");
    chats(Path::new(&input), 24);
    let tok = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/chat/llama3");
    let prefix = dir.join("sft");
    let pad = ["--pad-to-multiple-of", "4"];
    let (ok, _, stderr) = preprocess_chat(&input, &tok, &prefix, "64", &pad);
    assert!(ok, "{stderr}");
    let tokenizer = Tokenizer::from_file(tok.join("tokenizer.json")).unwrap();
    let docs = inspected(&prefix, "0..24", &tokenizer);
    for (text, _, tokens) in &docs {
        assert_eq!(tokens % 4, 0, "{text:?}");
    }
    // Padding counts nothing: the answers are the unpadded run's.
    let (ok, _, stderr) = preprocess_chat(&input, &tok, &dir.join("plain"), "64", &[]);
    assert!(ok, "{stderr}");
    let mut padded: Vec<String> = docs.into_iter().map(|(_, c, _)| c).collect();
    let mut plain: Vec<String> = inspected(&dir.join("plain"), "0..24", &tokenizer)
        .into_iter()
        .map(|(_, c, _)| c)
        .collect();
    padded.sort();
    plain.sort();
    assert_eq!(padded, plain);
    let (ok, _, stderr) = preprocess_chat(&input, &tok, &dir.join("odd"), "62", &pad);
    assert!(
        !ok && stderr.contains("does not divide --seq-length 62"),
        "{stderr}"
    );

    let tokenizer_json = tok.join("tokenizer.json").to_string_lossy().into_owned();
    let losses = |cp: &str| {
        let log = dir.join(&format!("cp{cp}.jsonl"));
        let extra = [
            "--micro-batch-size",
            "1",
            "--train-iters",
            "2",
            "--attention-dropout",
            "0",
            "--hidden-dropout",
            "0",
            "--cp",
            cp,
            "--data",
            &prefix,
        ];
        tiny_train(&tokenizer_json, "64", &log, &extra)
            .iter()
            .map(|s| s["loss"].as_f64().unwrap())
            .collect::<Vec<f64>>()
    };
    let (one, two) = (losses("1"), losses("2"));
    assert_eq!(one.len(), 2);
    for (a, b) in one.iter().zip(&two) {
        assert!(
            (a - b).abs() <= 1e-5 * a.abs(),
            "cp 1 {one:?} vs cp 2 {two:?}"
        );
    }
}
