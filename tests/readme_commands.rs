//! Every `megatron` command of the README and of the user guide (docs/guide, its pages in the
//! index's order) runs as written (issue 45, class 8; issue 46, section 7), in order, in one
//! directory, with its iterations shortened: documentation that drifts from the program fails
//! here. The commands are read from the documents themselves. What they assume exists is made first: a
//! corpus of JSON lines (the project's docs), `other_text_document`, a Hugging Face Llama at
//! `~/Llama-3.2-1B` (llama-tiny trained a step with its own tokenizer and exported: HOME points
//! into the test's directory), a `DeepseekV3ForCausalLM` at `~/Moonlight-16B-A3B`
//! (deepseek-v3-tiny, likewise) and a parameter list for `layout --params`. Commands for a GPU or
//! for MPI processes (`--device cuda`, `--backend mpi|nccl`, `mpirun`, `srun`) are left to the
//! GPU and MPI tests; `cargo` commands are CI's own steps (the main command runs here as
//! `megatron train`).

mod support;

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use support::TempDir;

/// The guide's pages in the order of its index (the later pages' commands use what the
/// earlier ones made).
const GUIDE: [&str; 14] = [
    "data",
    "training",
    "pipeline-parallel",
    "tensor-and-sequence-parallel",
    "context-parallel",
    "llama-and-hugging-face",
    "fine-tuning",
    "optimizer-and-precision",
    "recompute",
    "expert-parallel",
    "deepseek",
    "graph-scopes",
    "processes-and-gpus",
    "writing-a-model",
];

/// The shell commands of the README and the guide: the lines of their `sh` blocks,
/// continuations joined, comments dropped.
fn readme_commands() -> Vec<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut documents = vec![root.join("README.md")];
    documents.extend(
        GUIDE
            .iter()
            .map(|p| root.join("docs/guide").join(format!("{p}.md"))),
    );
    let mut commands = Vec::new();
    for doc in documents {
        let text =
            std::fs::read_to_string(&doc).unwrap_or_else(|e| panic!("{}: {e}", doc.display()));
        commands.extend(sh_commands(&text));
    }
    commands
}

/// The commands of one document's `sh` blocks.
fn sh_commands(readme: &str) -> Vec<String> {
    let mut commands = Vec::new();
    let mut in_block = false;
    let mut pending = String::new();
    for line in readme.lines() {
        if line.starts_with("```") {
            in_block = line.trim() == "```sh";
            continue;
        }
        if !in_block {
            continue;
        }
        let code = match line.find(" #") {
            Some(at) if !line[..at].contains('"') => &line[..at],
            _ if line.trim_start().starts_with('#') => "",
            _ => line,
        };
        let code = code.trim_end();
        match code.strip_suffix('\\') {
            Some(part) => pending.push_str(part),
            None => {
                pending.push_str(code);
                let command = pending.split_whitespace().collect::<Vec<_>>().join(" ");
                if !command.is_empty() {
                    commands.push(command);
                }
                pending.clear();
            }
        }
    }
    commands
}

/// Words of a command line as a shell splits them (double quotes kept together), `~/`
/// expanded to `home`.
fn words(command: &str, home: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut word = String::new();
    let mut quoted = false;
    let mut any = false;
    for c in command.chars() {
        match c {
            '"' => {
                quoted = !quoted;
                any = true;
            }
            ' ' if !quoted => {
                if any {
                    out.push(std::mem::take(&mut word));
                    any = false;
                }
            }
            c => {
                word.push(c);
                any = true;
            }
        }
    }
    if any {
        out.push(word);
    }
    out.into_iter()
        .map(|w| match w.strip_prefix("~/") {
            Some(rest) => format!("{home}/{rest}"),
            None => w,
        })
        .collect()
}

/// The command's arguments with its iterations shortened (a run of N steps takes N / 100, at
/// least 1; a run that names none takes 2; intervals of 100 become 1), or `None` for a
/// command this test leaves to others.
fn shortened(command: &str, home: &str) -> Option<Vec<String>> {
    let command = command
        .strip_prefix("cargo run --release -- ")
        .map_or_else(|| command.to_string(), |rest| format!("megatron {rest}"));
    let rest = command.strip_prefix("megatron ")?;
    if ["--device cuda", "--backend mpi", "--backend nccl", "..."]
        .iter()
        .any(|s| rest.contains(s))
    {
        return None;
    }
    let mut args = words(rest, home);
    let mut i = 0;
    let mut has_iters = false;
    while i + 1 < args.len() {
        match args[i].as_str() {
            "--train-iters" => {
                has_iters = true;
                let n: u64 = args[i + 1].parse().unwrap();
                args[i + 1] = (n / 100).max(1).to_string();
            }
            "--save-interval" | "--eval-interval" => args[i + 1] = "1".to_string(),
            _ => {}
        }
        i += 1;
    }
    let trains = matches!(args.first().map(String::as_str), Some("train"))
        || (args.first().map(String::as_str) == Some("bench")
            && args.get(1).is_some_and(|a| a.starts_with("--")));
    if trains && !has_iters {
        args.extend(["--train-iters".to_string(), "2".to_string()]);
        if args[0] == "bench" {
            args.extend(["--warmup".to_string(), "1".to_string()]);
        }
    }
    Some(args)
}

/// Runs `megatron args` in `dir` with HOME at `home`; panics with its output if it fails.
fn run(dir: &Path, home: &str, args: &[String]) -> String {
    let start = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_megatron"))
        .args(args)
        .current_dir(dir)
        .env("HOME", home)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "megatron {} failed:\n{stderr}",
        args.join(" ")
    );
    eprintln!(
        "{:6.1} s  megatron {}",
        start.elapsed().as_secs_f64(),
        args.join(" ")
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// JSON lines of the project's documentation, a paragraph each.
fn corpus() -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = vec![root.join("README.md"), root.join("BENCHMARKS.md")];
    let mut docs: Vec<_> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .collect();
    docs.sort();
    files.extend(docs);
    let mut lines = String::new();
    for file in files {
        let text = std::fs::read_to_string(file).unwrap();
        for paragraph in text.split("\n\n").filter(|p| p.trim().len() > 40) {
            lines.push_str(&serde_json::json!({ "text": paragraph }).to_string());
            lines.push('\n');
        }
    }
    lines
}

#[test]
fn every_readme_command_runs_as_written() {
    let dir = TempDir::new("readme");
    let work = dir.path();
    let home = dir.join("home");
    std::fs::create_dir_all(&home).unwrap();
    std::fs::write(work.join("corpus.jsonl"), corpus()).unwrap();
    // What the README's commands assume exists.
    let setup: [&[&str]; 6] = [
        &[
            "preprocess",
            "--input",
            "corpus.jsonl",
            "--tokenizer",
            "byte",
            "--output-prefix",
            "other",
            "--quiet",
        ],
        &[
            "tokenizer",
            "train",
            "--input",
            "corpus.jsonl",
            "--vocab-size",
            "512",
            "--output",
            "llama-tokenizer.json",
        ],
        &[
            "train",
            "--model",
            "llama-tiny",
            "--tokenizer",
            "llama-tokenizer.json",
            "--train-iters",
            "1",
            "--quiet",
            "--save",
            "llama-src",
        ],
        &[
            "convert",
            "--from",
            "llama-src",
            "--to",
            "hf",
            "home/Llama-3.2-1B",
        ],
        // A DeepSeek-V3-architecture model as Hugging Face writes Moonlight.
        &[
            "train",
            "--model",
            "deepseek-v3-tiny",
            "--tokenizer",
            "llama-tokenizer.json",
            "--train-iters",
            "1",
            "--quiet",
            "--save",
            "deepseek-src",
        ],
        &[
            "convert",
            "--from",
            "deepseek-src",
            "--to",
            "hf",
            "home/Moonlight-16B-A3B",
        ],
    ];
    for args in setup {
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        run(work, &home, &args);
    }
    // The fine-tuning commands' chats, and the exported Llama's chat template (Llama 3's,
    // kept with the chat tests' stand-in tokenizers).
    let template =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/chat/llama3/tokenizer_config.json");
    std::fs::copy(
        template,
        Path::new(&home).join("Llama-3.2-1B/tokenizer_config.json"),
    )
    .unwrap();
    for (name, n) in [("chats.jsonl", 120), ("held-out.jsonl", 20)] {
        let chats: String = (0..n)
            .map(|i| {
                let (q, a) = [
                    ("What is two plus two?", "Four."),
                    ("Name a colour.", "Blue."),
                ][i % 2];
                serde_json::json!({"messages": [
                    {"role": "user", "content": format!("{q} ({i})")},
                    {"role": "assistant", "content": a},
                ]})
                .to_string()
                    + "\n"
            })
            .collect();
        std::fs::write(work.join(name), chats).unwrap();
    }
    // `layout --params` reads a list of parameters, {name, shape, dtype}.
    let params = serde_json::json!([
        {"name": "embedding.word_embeddings.weight", "shape": [50304, 768], "dtype": "bf16"},
        {"name": "decoder.layers.0.self_attention.linear_qkv.weight", "shape": [2304, 768]},
        {"name": "decoder.layers.0.mlp.linear_fc1.weight", "shape": [3072, 768]},
        {"name": "decoder.layers.0.mlp.linear_fc2.weight", "shape": [768, 3072]},
        {"name": "decoder.final_layernorm.weight", "shape": [768]},
    ]);
    std::fs::write(work.join("params.json"), params.to_string()).unwrap();
    let mut ran = 0;
    for command in readme_commands() {
        let Some(args) = shortened(&command, &home) else {
            continue;
        };
        run(work, &home, &args);
        ran += 1;
    }
    // The main command and every page of the guide.
    assert!(ran >= 40, "only {ran} README and guide commands found");
}
