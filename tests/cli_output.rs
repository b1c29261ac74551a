//! A closed or full standard output never costs a run: the describing commands end quietly
//! when their reader leaves (`| head -1`) and name standard output when it is full
//! (`> /dev/full`); training goes on and writes its logs and checkpoints.

mod support;

use std::fs::File;
use std::process::{Command, Output, Stdio};

use support::{SMALL, TempDir};

/// Runs `megatron args` with a standard output whose reader has already left: a pipe whose
/// read end is closed before the command writes.
fn into_closed_pipe(args: &[&str]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_megatron"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    child.wait_with_output().unwrap()
}

/// Runs `megatron args` with standard output on `/dev/full` (every write fails: no space).
fn into_full_device(args: &[&str]) -> Output {
    let full = File::options().write(true).open("/dev/full").unwrap();
    Command::new(env!("CARGO_BIN_EXE_megatron"))
        .args(args)
        .stdout(full)
        .stderr(Stdio::piped())
        .output()
        .unwrap()
}

/// The describing commands, each with enough output to fill more than one write.
const DESCRIBING: [&[&str]; 7] = [
    &["schedule", "--pp", "4", "--vpp", "2", "--microbatches", "8"],
    &["schedule", "--pp", "2", "--microbatches", "4", "--json"],
    &["layout", "--model", "gpt-tiny", "--dp", "4"],
    &[
        "graphs",
        "--model",
        "gpt-tiny",
        "--pp",
        "2",
        "--microbatches",
        "8",
        "--cuda-graph-scope",
        "attn",
    ],
    &["groups", "--world-size", "16", "--tp", "2", "--pp", "2"],
    &["inspect", "--model", "gpt-tiny", "--tp", "2"],
    &["models"],
];

#[test]
fn describing_commands_end_quietly_when_their_reader_leaves() {
    for args in DESCRIBING {
        let out = into_closed_pipe(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{args:?}: {:?} {stderr}", out.status);
        assert!(stderr.is_empty(), "{args:?} printed: {stderr}");
    }
}

#[test]
fn describing_commands_name_a_full_standard_output() {
    for args in DESCRIBING {
        let out = into_full_device(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert_eq!(
            stderr.trim(),
            "error: writing to standard output: No space left on device (os error 28)",
            "{args:?}"
        );
    }
}

#[test]
fn training_goes_on_when_its_output_goes_nowhere() {
    let dir = TempDir::new("cli-output-train");
    let save = dir.join("ckpt");
    let log = dir.join("run.jsonl");
    let train = |extra: &[&str], to: fn(&[&str]) -> Output| {
        let mut args = vec!["train", "--train-iters", "2", "--save", &save];
        args.extend(SMALL);
        args.extend(["--log-json", &log]);
        args.extend(extra);
        let out = to(&args);
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    };
    train(&[], into_closed_pipe);
    assert_eq!(support::log_lines(&log).len(), 2);
    assert!(
        dir.path()
            .join("ckpt/latest_checkpointed_iteration.txt")
            .exists()
    );
    // Resuming prints "from the checkpoint ..." before the first step: into a full device too.
    train(&["--load", &save, "--train-iters", "3"], into_full_device);
    assert_eq!(support::log_lines(&log).len(), 3);
    let latest = std::fs::read_to_string(dir.path().join("ckpt/latest_checkpointed_iteration.txt"));
    assert_eq!(latest.unwrap().trim(), "3");
}
