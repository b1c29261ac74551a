//! A property of the whole command line: whatever number a numeric flag of any command is
//! given (0, 1, the bounds and one past them, 2^32, 2^64 − 1, 2^64, NaN, infinities, negative,
//! tiny and huge floats), alone or in random combinations, `megatron` never panics, aborts or
//! runs past a time bound, and every failing run prints exactly one `error:` line, naming a
//! flag.
//!
//! Flags whose large values ask for long work that fits the machine (`--train-iters`, a
//! global batch of a hundred thousand microbatches, a benchmark's sequence length) get only
//! the values that are refused or small: such a run is slow because it was asked to be.

mod support;

use std::ffi::{OsStr, OsString};
use std::io::Read;
use std::os::unix::ffi::OsStringExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use support::TempDir;

/// The values every numeric flag is tried with.
const VALUES: &[&str] = &[
    "0",
    "1",
    "2",
    "3",
    "-1",
    "0.5",
    "-0.5",
    "16384",
    "16385",
    "65537",
    "262144",
    "262145",
    "1048576",
    "1048577",
    "16777217",
    "1073741825",
    "4294967296",
    "18446744073709551615",
    "18446744073709551616",
    "NaN",
    "inf",
    "-inf",
    "1e39",
    "1e-50",
    "1e300",
];

/// The values of a flag whose large valid values ask for long work: refused ones and small
/// ones only.
const SMALL_VALUES: &[&str] = &[
    "0", "1", "2", "-1", "0.5", "NaN", "inf", "-inf", "1e39", "1e-50",
];

/// The longest a command may run.
const TIME_BOUND: Duration = Duration::from_secs(60);

/// One command: its fixed arguments, and its numeric flags (those marked `true` take only
/// [`SMALL_VALUES`]).
struct Command_ {
    base: Vec<String>,
    flags: Vec<(&'static str, bool)>,
}

/// The architecture flags `train`, `inspect`, `graphs` and `layout` share.
const ARCH: &[(&str, bool)] = &[
    ("--num-layers", false),
    ("--hidden-size", false),
    ("--ffn-hidden-size", false),
    ("--num-attention-heads", false),
    ("--max-position-embeddings", false),
    ("--vocab-size", false),
    ("--make-vocab-size-divisible-by", false),
    ("--init-method-std", false),
    ("--hidden-dropout", false),
    ("--attention-dropout", false),
    ("--num-experts", false),
    ("--moe-router-topk", false),
    ("--moe-ffn-hidden-size", false),
    ("--moe-layer-freq", false),
    ("--moe-router-topk-scaling-factor", false),
    ("--moe-aux-loss-coeff", false),
    ("--moe-z-loss-coeff", false),
    ("--moe-expert-capacity-factor", false),
    ("--moe-router-bias-update-rate", false),
    ("--moe-shared-expert-intermediate-size", false),
];

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

/// Every command with numeric flags, set up in `dir` (a corpus, a checkpoint).
fn commands(dir: &TempDir) -> Vec<Command_> {
    let corpus = dir.join("corpus.jsonl");
    std::fs::write(&corpus, "{\"text\": \"the quick brown fox jumps over\"}\n").unwrap();
    let ckpt = dir.join("ckpt");
    support::small_checkpoint(&ckpt, 1, &[]);
    let small = |extra: &[&str]| {
        let mut v = strings(&["train", "--train-iters", "1"]);
        v.extend(strings(&support::SMALL));
        v.extend(strings(extra));
        v
    };
    let with_arch = |mut flags: Vec<(&'static str, bool)>| {
        flags.extend_from_slice(ARCH);
        flags
    };
    vec![
        Command_ {
            base: strings(&["schedule", "--pp", "2", "--microbatches", "4"]),
            flags: vec![
                ("--pp", false),
                ("--vpp", false),
                ("--microbatches", false),
                ("--group-size", false),
            ],
        },
        Command_ {
            base: strings(&[
                "graphs",
                "--model",
                "gpt-tiny",
                "--pp",
                "2",
                "--microbatches",
                "4",
                "--cuda-graph-scope",
                "attn",
            ]),
            flags: with_arch(vec![
                ("--pp", false),
                ("--vpp", false),
                ("--microbatches", false),
                ("--group-size", false),
                ("--seq-length", false),
                ("--micro-batch-size", false),
            ]),
        },
        Command_ {
            base: strings(&["groups", "--world-size", "8"]),
            flags: vec![
                ("--world-size", false),
                ("--tp", false),
                ("--pp", false),
                ("--cp", false),
                ("--ep", false),
                ("--etp", false),
                ("--dp", false),
            ],
        },
        Command_ {
            base: strings(&["layout", "--model", "gpt-tiny", "--dp", "2"]),
            flags: with_arch(vec![
                ("--tp", false),
                ("--dp", false),
                ("--edp", false),
                ("--bucket-size", false),
            ]),
        },
        Command_ {
            base: strings(&["inspect", "--model", "gpt-moe-tiny"]),
            flags: with_arch(vec![
                ("--tp", false),
                ("--pp", false),
                ("--vpp", false),
                ("--dp", false),
                ("--ep", false),
                ("--etp", false),
                ("--decoder-first-pipeline-num-layers", false),
                ("--decoder-last-pipeline-num-layers", false),
                ("--cp", false),
                ("--seq-length", false),
                ("--micro-batch-size", false),
            ]),
        },
        Command_ {
            base: strings(&["inspect", "--cp", "4", "--cp-comm-type", "a2a+p2p"]),
            flags: vec![("--hierarchical-context-parallel-sizes", false)],
        },
        Command_ {
            base: strings(&[
                "tokenizer",
                "train",
                "--input",
                &corpus,
                "--output",
                &dir.join("tokenizer.json"),
            ]),
            flags: vec![("--vocab-size", false)],
        },
        Command_ {
            base: strings(&[
                "preprocess",
                "--input",
                &corpus,
                "--tokenizer",
                "byte",
                "--output-prefix",
                &dir.join("data"),
            ]),
            flags: vec![("--workers", false)],
        },
        Command_ {
            base: strings(&["generate", "--load", &ckpt, "--prompt", "the"]),
            flags: vec![
                // Bounded by the model's positions: no count asks for long work.
                ("--max-new-tokens", false),
                ("--temperature", false),
                ("--top-k", false),
                ("--tp", false),
                ("--seed", false),
            ],
        },
        Command_ {
            base: strings(&[
                "bench",
                "attention",
                "--seq-length",
                "8",
                "--heads",
                "2",
                "--head-dim",
                "4",
                "--repeats",
                "1",
            ]),
            flags: vec![
                ("--seq-length", true),
                ("--micro-batch-size", true),
                ("--heads", true),
                ("--head-dim", true),
                ("--dropout", false),
                ("--repeats", true),
            ],
        },
        Command_ {
            base: strings(&["bench", "generate", "--load", &ckpt, "--threads", "1"]),
            flags: vec![
                ("--prompt-tokens", false),
                ("--new-tokens", false),
                ("--tp", true),
                ("--threads", true),
            ],
        },
        Command_ {
            base: strings(&["bench", "allreduce", "--elements", "64", "--iters", "1"]),
            flags: vec![("--ranks", true), ("--elements", true), ("--iters", true)],
        },
        Command_ {
            base: small(&[]),
            flags: with_arch(vec![
                ("--tp", false),
                ("--dp", false),
                ("--pp", false),
                ("--cp", false),
                ("--ep", false),
                ("--etp", false),
                ("--vpp", false),
                ("--num-layers-per-virtual-pipeline-stage", false),
                ("--microbatch-group-size-per-virtual-pipeline-stage", false),
                ("--decoder-first-pipeline-num-layers", false),
                ("--decoder-last-pipeline-num-layers", false),
                ("--seq-length", false),
                ("--micro-batch-size", true),
                ("--global-batch-size", true),
                ("--train-iters", true),
                ("--lr", false),
                ("--min-lr", false),
                ("--lr-warmup-iters", false),
                ("--lr-decay-iters", false),
                ("--weight-decay", false),
                ("--clip-grad", false),
                ("--adam-beta1", false),
                ("--adam-beta2", false),
                ("--adam-eps", false),
                ("--seed", false),
                ("--eval-interval", false),
                ("--eval-iters", true),
                ("--save-interval", false),
                ("--ddp-bucket-size", false),
                ("--recompute-num-layers", false),
                ("--loss-scale", false),
                ("--initial-loss-scale", false),
                ("--min-loss-scale", false),
                ("--loss-scale-window", false),
                ("--hysteresis", false),
            ]),
        },
    ]
}

/// How one run ended.
struct Outcome {
    code: Option<i32>,
    stderr: String,
    elapsed: Duration,
}

/// Runs `megatron args`, killed at [`TIME_BOUND`]; standard output is read and dropped.
fn run<S: AsRef<OsStr>>(args: &[S], cwd: &Path) -> Outcome {
    let start = Instant::now();
    let mut child = Command::new(env!("CARGO_BIN_EXE_megatron"))
        .args(args)
        .current_dir(cwd)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let out = std::thread::spawn(move || std::io::copy(&mut stdout, &mut std::io::sink()));
    let err = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > TIME_BOUND {
            let _ = child.kill();
            break child.wait().unwrap();
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let _ = out.join();
    Outcome {
        code: status.code(),
        stderr: err.join().unwrap(),
        elapsed: start.elapsed(),
    }
}

/// What is wrong with an outcome, if anything.
fn violation(o: &Outcome, name_flag: bool) -> Option<String> {
    if o.elapsed > TIME_BOUND {
        return Some(format!("ran past {TIME_BOUND:?}"));
    }
    if o.stderr.contains("panicked") || o.stderr.contains("memory allocation of") {
        return Some("panicked or aborted".to_string());
    }
    match o.code {
        Some(0) => None,
        // clap's usage errors, and the commands' own.
        Some(1 | 2) => {
            let errors: Vec<&str> = o
                .stderr
                .lines()
                .filter(|l| l.starts_with("error:"))
                .collect();
            match errors.as_slice() {
                [line] if line.contains("--") || !name_flag => None,
                [line] => Some(format!("the error names no flag: {line}")),
                _ => Some(format!("{} error lines", errors.len())),
            }
        }
        other => Some(format!("exit status {other:?}")),
    }
}

/// A deterministic stream of indices (xorshift).
struct Picks(u64);

impl Picks {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}

#[test]
fn no_number_on_any_flag_panics_hangs_or_fails_without_naming_a_flag() {
    let dir = TempDir::new("cli-properties");
    let commands = commands(&dir);
    let mut cases: Vec<Vec<String>> = Vec::new();
    // Each flag alone with each value.
    for c in &commands {
        for &(flag, small) in &c.flags {
            let values = if small { SMALL_VALUES } else { VALUES };
            for value in values {
                let mut args = c.base.clone();
                args.push(format!("{flag}={value}"));
                cases.push(args);
            }
        }
    }
    // Random combinations of two to four flags of one command.
    let mut picks = Picks(0x9e37_79b9_7f4a_7c15);
    for _ in 0..300 {
        let c = &commands[picks.below(commands.len())];
        let mut args = c.base.clone();
        for _ in 0..2 + picks.below(3) {
            let (flag, small) = c.flags[picks.below(c.flags.len())];
            let values = if small { SMALL_VALUES } else { VALUES };
            args.push(format!("{flag}={}", values[picks.below(values.len())]));
        }
        cases.push(args);
    }
    assert_property(&cases, dir.path());
}

/// Runs every command line of `cases` in `cwd` and fails naming each that breaks the property,
/// with why and its first lines of standard error; two run at a time (most end at once, while
/// another starts).
fn assert_property<S: AsRef<OsStr> + Sync>(cases: &[Vec<S>], cwd: &Path) {
    assert_property_naming(cases, cwd, true);
}

/// [`assert_property`], where a failing run's one error line must name a flag only when
/// `name_flag` (a positional argument's error names the argument instead).
fn assert_property_naming<S: AsRef<OsStr> + Sync>(cases: &[Vec<S>], cwd: &Path, name_flag: bool) {
    let next = AtomicUsize::new(0);
    let failures = Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for _ in 0..2 {
            scope.spawn(|| {
                while let Some(args) = cases.get(next.fetch_add(1, Ordering::Relaxed)) {
                    let outcome = run(args, cwd);
                    if let Some(why) = violation(&outcome, name_flag) {
                        let stderr: Vec<&str> = outcome.stderr.lines().take(6).collect();
                        let args: Vec<String> =
                            args.iter().map(|a| format!("{:?}", a.as_ref())).collect();
                        failures.lock().unwrap().push(format!(
                            "megatron {}: {why}\n{}",
                            args.join(" "),
                            stderr.join("\n")
                        ));
                    }
                }
            });
        }
    });
    let failures = failures.into_inner().unwrap();
    assert!(
        failures.is_empty(),
        "{} of {} command lines broke the property:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n\n")
    );
}

/// Odd text for the flags that take names, lists and expressions.
const TEXTS: &[&str] = &[
    "",
    " ",
    "-",
    "x",
    "0",
    "-1",
    "NaN",
    "[",
    "[]",
    "[1",
    "[1]*-1",
    "[1]*99999999999999999999",
    "a,b,c",
    ",,,",
    "tp-tp",
    "ep-edp",
    "ATTN",
    "attn,mlp",
    "é",
    "../../nonexistent",
    "/",
    "/dev/null",
    "1e400,1,1",
];

#[test]
fn no_text_on_any_flag_panics_hangs_or_fails_without_naming_a_flag() {
    let dir = TempDir::new("cli-properties-text");
    let ckpt = dir.join("ckpt");
    support::small_checkpoint(&ckpt, 1, &[]);
    let mut train = strings(&["train", "--train-iters", "1"]);
    train.extend(strings(&support::SMALL));
    let commands: Vec<(Vec<String>, &[&str])> = vec![
        (
            strings(&["groups", "--world-size", "8"]),
            &["--order", "--group"],
        ),
        (
            strings(&[
                "graphs",
                "--pp",
                "2",
                "--microbatches",
                "4",
                "--cuda-graph-scope",
                "attn",
            ]),
            &["--cuda-graph-scope", "--model", "--moe-layer-freq"],
        ),
        (
            strings(&["inspect", "--num-experts", "4"]),
            &[
                "--model",
                "--moe-layer-freq",
                "--moe-router-score-function",
                "--moe-router-load-balancing-type",
                "--moe-token-drop-policy",
            ],
        ),
        (
            train,
            &[
                "--data",
                "--split",
                "--tokenizer",
                "--recompute-granularity",
                "--recompute-method",
                "--lr-decay-style",
                "--device",
                "--backend",
                "--cuda-graph-scope",
                "--attention-backend",
                "--config",
                "--load",
            ],
        ),
        (
            strings(&["generate", "--load", &ckpt, "--prompt", "the"]),
            &["--prompt", "--tokenizer"],
        ),
    ];
    let cases: Vec<Vec<String>> = commands
        .iter()
        .flat_map(|(base, flags)| {
            flags.iter().flat_map(move |flag| {
                TEXTS.iter().map(move |text| {
                    let mut args = base.clone();
                    args.push(format!("{flag}={text}"));
                    args
                })
            })
        })
        .collect();
    assert_property(&cases, dir.path());
}

/// Values that are not UTF-8: a lone byte, Latin-1 text, and a path through such a directory.
fn not_utf8(dir: &TempDir) -> Vec<OsString> {
    let mut path = dir.join("d").into_bytes();
    path.extend_from_slice(b"\xff/x\xe9");
    vec![
        OsString::from_vec(b"\xff".to_vec()),
        OsString::from_vec(b"caf\xe9".to_vec()),
        OsString::from_vec(path),
    ]
}

#[test]
fn no_argument_that_is_not_utf8_panics_or_fails_without_naming_a_flag() {
    let dir = TempDir::new("cli-properties-utf8");
    let ckpt = dir.join("ckpt");
    support::small_checkpoint(&ckpt, 1, &[]);
    std::fs::create_dir_all(dir.path().join(OsString::from_vec(b"d\xff".to_vec()))).unwrap();
    let corpus = dir.join("corpus.jsonl");
    std::fs::write(&corpus, "{\"text\": \"the quick brown fox\"}\n").unwrap();
    let mut train = strings(&["train", "--train-iters", "1"]);
    train.extend(strings(&support::SMALL));
    let commands: Vec<(Vec<String>, &[&str])> = vec![
        (
            train,
            &[
                "--data",
                "--tokenizer",
                "--load",
                "--save",
                "--log-json",
                "--tensorboard-dir",
                "--config",
                "--model",
                "--cuda-graph-scope",
                "--cp-comm-type",
                "--window-size",
                "--split",
                "--device",
            ],
        ),
        (
            strings(&["generate", "--load", &ckpt, "--prompt", "the"]),
            &["--load", "--prompt", "--tokenizer"],
        ),
        (strings(&["convert", "--to", &dir.join("out")]), &["--from"]),
        (strings(&["convert", "--from", &ckpt, "--to", "hf"]), &[""]),
        (
            strings(&[
                "preprocess",
                "--input",
                &corpus,
                "--tokenizer",
                "byte",
                "--output-prefix",
                &dir.join("data"),
            ]),
            &["--input", "--output-prefix", "--tokenizer", "--json-keys"],
        ),
        (
            strings(&[
                "tokenizer",
                "train",
                "--vocab-size",
                "300",
                "--input",
                &corpus,
                "--output",
                &dir.join("t.json"),
            ]),
            &["--input", "--output"],
        ),
        (strings(&["data", "inspect"]), &[""]),
        (strings(&["plot"]), &[""]),
        (strings(&["layout", "--dp", "2"]), &["--params"]),
        (strings(&["bench", "generate"]), &["--load"]),
        (strings(&["inspect"]), &["--model", "--cp-comm-type"]),
        (
            strings(&["schedule", "--pp", "2", "--microbatches", "4"]),
            &["--schedule"],
        ),
        (strings(&[]), &[""]),
    ];
    let values = not_utf8(&dir);
    let (mut flagged, mut positional): (Vec<Vec<OsString>>, Vec<Vec<OsString>>) = (vec![], vec![]);
    for (base, flags) in &commands {
        for flag in *flags {
            for value in &values {
                let mut args: Vec<OsString> = base.iter().map(OsString::from).collect();
                // An empty flag: the value is a positional argument (a path, or a command),
                // whose error names it.
                if flag.is_empty() {
                    args.push(value.clone());
                    positional.push(args);
                    continue;
                }
                args.extend([OsString::from(flag), value.clone()]);
                flagged.push(args);
                let mut joined = OsString::from(format!("{flag}="));
                joined.push(value);
                let mut args: Vec<OsString> = base.iter().map(OsString::from).collect();
                args.push(joined);
                flagged.push(args);
            }
        }
    }
    assert_property(&flagged, dir.path());
    assert_property_naming(&positional, dir.path(), false);
}
