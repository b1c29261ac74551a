//! Generation as a user meets it (issue 45, class 4): tokens are handed out as they are drawn
//! (the text printed as it is produced) and generation stops at the end-of-text token; the
//! prompt and the new tokens share the model's positions, so a count past them is refused at
//! once by name; `bench generate` times the decoding steps directly.

mod support;

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use megatron::generate::{Compute, Sampling, generate, generate_streaming};
use support::{TempDir, megatron, small_checkpoint};

const GREEDY: Sampling = Sampling {
    temperature: 0.0,
    top_k: 0,
    top_p: 1.0,
    seed: 0,
};

#[test]
fn each_token_is_handed_out_as_it_is_drawn_and_the_stop_token_ends_it() {
    let dir = TempDir::new("generate-stream");
    let ckpt = dir.join("ckpt");
    small_checkpoint(&ckpt, 2, &[]);
    let ckpt = Path::new(&ckpt);
    let prompt = [102, 110, 32, 109, 97];
    let seen = Mutex::new(Vec::new());
    let tokens = generate_streaming(ckpt, Compute::f32(2), &prompt, 12, GREEDY, None, &|t| {
        seen.lock().unwrap().push(t);
        Ok(())
    })
    .unwrap();
    assert_eq!(tokens.len(), 12);
    assert_eq!(
        *seen.lock().unwrap(),
        tokens,
        "one hand-out per token, in order, on one rank"
    );
    assert_eq!(
        generate(ckpt, 1, &prompt, 12, GREEDY, None).unwrap(),
        tokens
    );
    // The first token as the stop token: generation ends with it.
    let stopped = generate(ckpt, 1, &prompt, 12, GREEDY, Some(tokens[0])).unwrap();
    assert_eq!(stopped, &tokens[..1]);
    // An error of the hand-out stops generation with it.
    let err = generate_streaming(ckpt, Compute::f32(1), &prompt, 12, GREEDY, None, &|_| {
        anyhow::bail!("the reader left")
    })
    .unwrap_err();
    assert!(err.to_string().contains("the reader left"), "{err}");
    // The prompt and the new tokens must fit the model's 256 positions together.
    let err = generate(ckpt, 1, &prompt, 252, GREEDY, None).unwrap_err();
    assert!(
        err.to_string()
            .contains("the prompt's 5 tokens and 252 new ones are more than the model's 256"),
        "{err}"
    );
}

/// `megatron bench generate`'s JSON report of two new tokens from `ckpt`, with `extra` flags.
fn bench_two_tokens(ckpt: &str, extra: &[&str]) -> serde_json::Value {
    let mut args = vec![
        "bench",
        "generate",
        "--load",
        ckpt,
        "--new-tokens",
        "2",
        "--json",
    ];
    args.extend(extra);
    let (ok, stdout, stderr) = megatron(&args);
    assert!(ok, "{stderr}");
    serde_json::from_str(&stdout).unwrap()
}

#[test]
fn bf16_generation_streams_bf16_weights_and_keeps_the_greedy_tokens() {
    // `--bf16`: the weights rounded to bf16 and products of bf16 operands summed in f32 (the
    // decoding steps stream the bf16 weights). The small model's greedy choices have margins
    // far above bf16's rounding: the f32 tokens, on 1 and 2 ranks.
    let dir = TempDir::new("generate-bf16");
    let ckpt = dir.join("ckpt");
    // Hidden size 128: the MLP's weights are large enough for the decoding steps' streamed
    // few-rows products (128 × 512).
    small_checkpoint(&ckpt, 2, &["--hidden-size", "128"]);
    let path = Path::new(&ckpt);
    let prompt = [102, 110, 32, 109, 97];
    let f32_tokens = generate(path, 1, &prompt, 10, GREEDY, None).unwrap();
    for tp in [1, 2] {
        let bf16 = Compute { tp, bf16: true };
        let tokens =
            generate_streaming(path, bf16, &prompt, 10, GREEDY, None, &|_| Ok(())).unwrap();
        assert_eq!(tokens, f32_tokens, "tp {tp}");
    }
    // The benchmark reads half the bytes a token, and says so.
    let bytes = |bf16: bool| {
        let report = bench_two_tokens(&ckpt, if bf16 { &["--bf16"] } else { &[] });
        assert_eq!(report["bf16"].as_bool(), Some(bf16));
        report["weight_bytes_per_token"].as_u64().unwrap()
    };
    assert_eq!(bytes(true) * 2, bytes(false));
    let (ok, stdout, stderr) = megatron(&[
        "generate",
        "--load",
        &ckpt,
        "--prompt",
        "fn",
        "--max-new-tokens",
        "4",
        "--bf16",
    ]);
    assert!(ok && stdout.starts_with("fn"), "{stdout} {stderr}");
}

#[test]
fn counts_past_the_models_positions_are_refused_at_once() {
    let dir = TempDir::new("generate-bounds");
    let ckpt = dir.join("ckpt");
    small_checkpoint(&ckpt, 1, &[]);
    let start = Instant::now();
    let (ok, _, stderr) = megatron(&[
        "generate",
        "--load",
        &ckpt,
        "--prompt",
        "fn",
        "--max-new-tokens",
        "1073741824",
    ]);
    assert!(!ok);
    assert!(
        stderr.contains("--max-new-tokens 1073741824: the model holds 256 positions"),
        "{stderr}"
    );
    let (ok, _, stderr) = megatron(&[
        "bench",
        "generate",
        "--load",
        &ckpt,
        "--new-tokens",
        "1073741824",
    ]);
    assert!(!ok);
    assert!(
        stderr.contains(
            "--prompt-tokens 32 and --new-tokens 1073741824 are more than the model's 256 positions"
        ),
        "{stderr}"
    );
    assert!(start.elapsed() < Duration::from_secs(20));
    // A long prompt leaves room for the new tokens: its last tokens are seen, with a note.
    let long = "x".repeat(300);
    let (ok, stdout, stderr) = megatron(&[
        "generate",
        "--load",
        &ckpt,
        "--prompt",
        &long,
        "--max-new-tokens",
        "6",
    ]);
    assert!(ok, "{stderr}");
    assert!(stdout.starts_with(&long), "{stdout}");
    assert!(
        stderr.contains("the model sees the prompt's last 250 tokens"),
        "{stderr}"
    );
    // Two new tokens: the one decoding step between them timed directly (no rate of 10^9).
    let report = bench_two_tokens(&ckpt, &[]);
    let rate = report["decode_tokens_per_s"].as_f64().unwrap();
    assert!(rate > 0.0 && rate < 1e7, "{rate} tokens/s");
    assert_eq!(report["tokens"].as_array().unwrap().len(), 2);
}

#[test]
fn a_reader_that_leaves_ends_generation_quietly() {
    let dir = TempDir::new("generate-reader");
    let ckpt = dir.join("ckpt");
    small_checkpoint(&ckpt, 1, &[]);
    let mut child = Command::new(env!("CARGO_BIN_EXE_megatron"))
        .args([
            "generate",
            "--load",
            &ckpt,
            "--prompt",
            "fn main",
            "--max-new-tokens",
            "240",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut first = [0u8; 7];
    stdout.read_exact(&mut first).unwrap();
    assert_eq!(&first, b"fn main");
    drop(stdout);
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(!stderr.contains("error"), "{stderr}");
}
