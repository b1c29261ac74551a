//! Context parallelism's bounds and bookkeeping where a user meets them (issue 45, class 3):
//! `inspect --cp` answers any size it accepts without starting a thread per rank (the formula
//! past 64 ranks), counts experts over tp·cp·dp as training does, and reads an odd
//! `--seq-length` without cp; a thread the OS refuses is an error naming the rank count; the
//! cp flags do nothing at cp 1 and are refused there; a checkpoint records cp and its comm type,
//! and a resume without `--cp` takes them and continues bit for bit.

mod support;

use std::time::{Duration, Instant};

use support::{SMALL, TempDir, log_lines, megatron};

#[test]
fn inspect_answers_any_context_parallel_size_it_accepts() {
    // 2^20 ranks: the formula alone, no thread started and nothing allocated for them.
    let start = Instant::now();
    let (ok, stdout, stderr) = megatron(&[
        "inspect",
        "--cp",
        "1048576",
        "--seq-length",
        "2097152",
        "--max-position-embeddings",
        "2097152",
    ]);
    assert!(ok, "{stderr}");
    assert!(start.elapsed() < Duration::from_secs(30));
    assert!(
        stdout.contains("by the formula (measured up to cp 64)"),
        "{stdout}"
    );
    assert!(
        stdout.contains("not measured (more tp·cp ranks than the 64 measured)"),
        "{stdout}"
    );
    // Within 64 ranks the traffic is measured; a layer whose blocks would not fit this
    // machine is not built.
    let (ok, stdout, stderr) = megatron(&[
        "inspect",
        "--cp",
        "8",
        "--seq-length",
        "1048576",
        "--max-position-embeddings",
        "1048576",
        "--json",
    ]);
    assert!(ok, "{stderr}");
    let report: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let cp = &report["context_parallel"]["attention_bytes_sent_per_rank_and_microbatch"];
    assert_eq!(cp["measured"], cp["formula"], "{cp}");
    // Experts fold tp·cp·dp ranks, as training's layout does: ep 2 at cp 2.
    let (ok, stdout, stderr) = megatron(&[
        "inspect",
        "--model",
        "gpt-moe-tiny",
        "--cp",
        "2",
        "--ep",
        "2",
    ]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("cp 2 with all_gather"), "{stdout}");
    // An odd sequence without context parallelism is no chunking question.
    let (ok, _, stderr) = megatron(&["inspect", "--seq-length", "255"]);
    assert!(ok, "{stderr}");
}

#[test]
fn a_thread_the_os_refuses_is_an_error_naming_the_ranks() {
    // A virtual-memory limit the 16 MiB stacks of 1,024 rank threads pass.
    let bin = env!("CARGO_BIN_EXE_megatron");
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!(
            "ulimit -v 3000000 && exec {bin} bench allreduce --ranks 1024 --elements 16 --iters 1"
        ))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(
        stderr.contains("the operating system refused thread rank") && stderr.contains("of 1024"),
        "{stderr}"
    );
}

#[test]
fn context_parallel_flags_at_cp_1_are_refused_as_doing_nothing() {
    for command in [&["train", "--train-iters", "1"][..], &["inspect"][..]] {
        for extra in [
            &["--cp-comm-type", "p2p"][..],
            &["--hierarchical-context-parallel-sizes", "1", "1"][..],
            &["--cp", "1", "--cp-comm-type", "a2a"][..],
        ] {
            let mut args = command.to_vec();
            args.extend(extra);
            let (ok, _, stderr) = megatron(&args);
            assert!(!ok, "{args:?}");
            assert!(
                stderr.contains("does nothing without context parallelism"),
                "{args:?}: {stderr}"
            );
        }
    }
}

#[test]
fn a_checkpoint_records_context_parallelism_and_a_resume_keeps_it() {
    let dir = TempDir::new("cli-cp-resume");
    let save = dir.join("ckpt");
    let straight = dir.join("straight.jsonl");
    let common = [
        "train",
        "--cp",
        "2",
        "--cp-comm-type",
        "p2p",
        "--train-iters",
        "3",
    ];
    let mut args = common.to_vec();
    args.extend(SMALL);
    args.extend([
        "--save",
        &save,
        "--save-interval",
        "2",
        "--log-json",
        &straight,
    ]);
    let (ok, _, stderr) = megatron(&args);
    assert!(ok, "{stderr}");
    let resumed = dir.join("resumed.jsonl");
    let iter2 = dir.join("ckpt/iter_0000002");
    let (ok, stdout, stderr) = megatron(&[
        "train",
        "--quiet",
        "--load",
        &iter2,
        "--train-iters",
        "3",
        "--log-json",
        &resumed,
    ]);
    assert!(ok, "{stderr}");
    for taken in ["--cp 2", "--cp-comm-type p2p"] {
        assert!(stdout.contains(taken), "{taken} not taken: {stdout}");
    }
    let (straight, resumed) = (log_lines(&straight), log_lines(&resumed));
    assert_eq!(resumed.len(), 1);
    for key in ["step", "loss", "grad_norm"] {
        assert_eq!(straight[2][key], resumed[0][key], "{key}");
    }
}
