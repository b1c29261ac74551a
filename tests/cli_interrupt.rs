//! Nothing is lost when a run is interrupted: logs reach the disk every step, SIGINT and SIGTERM
//! stop the run after its step with a checkpoint, a second signal exits at once, and what a
//! killed save left behind is cleaned up.

mod support;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use support::{TempDir, log_lines, megatron, small_checkpoint};

/// Starts `megatron train` with a model slow enough to interrupt mid-run.
fn start(extra: &[&str]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_megatron"))
        .args([
            "train",
            "--quiet",
            "--num-layers",
            "2",
            "--hidden-size",
            "256",
            "--seq-length",
            "128",
            "--train-iters",
            "100000",
        ])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Waits until `log` holds at least `n` lines (a minute at most).
fn wait_for_lines(child: &mut Child, log: &str, n: usize) {
    let start = Instant::now();
    while log_lines(log).len() < n {
        if let Ok(Some(status)) = child.try_wait() {
            panic!("the run ended early: {status}");
        }
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "{log}: fewer than {n} lines after two minutes (not flushed every step?)"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn signal(child: &Child, signal: i32) {
    // SAFETY: sends a signal to our own child process.
    assert_eq!(unsafe { libc::kill(child.id() as i32, signal) }, 0);
}

/// Waits for `child` (two minutes at most): its status, stdout and stderr.
fn finish(child: Child) -> (ExitStatus, String, String) {
    let pid = child.id();
    let watchdog = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(120));
        // SAFETY: kills our own child if it has not exited by now.
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    });
    let out = child.wait_with_output().unwrap();
    drop(watchdog);
    (
        out.status,
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn logs_reach_the_disk_every_step_so_a_killed_run_keeps_them() {
    let dir = TempDir::new("flush");
    let log = dir.join("log.jsonl");
    let tb = dir.join("tb");
    let mut child = start(&["--log-json", &log, "--tensorboard-dir", &tb]);
    wait_for_lines(&mut child, &log, 3);
    signal(&child, libc::SIGKILL);
    let (status, _, _) = finish(child);
    assert!(!status.success());
    let lines = log_lines(&log);
    assert!(lines.len() >= 3);
    for (i, line) in lines.iter().enumerate() {
        assert_eq!(line["step"], i as u64, "{line}");
    }
    // TensorBoard's events of those steps were flushed too.
    let events = std::fs::read_dir(&tb)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let bytes = std::fs::read(events).unwrap();
    let losses = bytes.windows(7).filter(|w| w == b"lm loss").count();
    assert!(losses >= 3, "{losses} loss records in the event file");
}

#[test]
fn sigterm_finishes_the_step_saves_and_exits_with_an_error() {
    let dir = TempDir::new("sigterm");
    let log = dir.join("log.jsonl");
    let save = dir.join("ckpt");
    let mut child = start(&["--log-json", &log, "--save", &save]);
    wait_for_lines(&mut child, &log, 2);
    signal(&child, libc::SIGTERM);
    let (status, stdout, stderr) = finish(child);
    assert_eq!(status.code(), Some(1), "{stderr}");
    let steps = log_lines(&log).len() as u64;
    assert!(
        stderr.contains(&format!("stopped by SIGTERM after step {steps} of 100000")),
        "{stderr}"
    );
    assert!(stdout.contains(&format!("over {steps} steps")), "{stdout}");
    let latest = std::fs::read_to_string(format!("{save}/latest_checkpointed_iteration.txt"));
    assert_eq!(latest.unwrap().trim(), steps.to_string());
    // The checkpoint resumes where the log ends.
    let (ok, _, stderr) = megatron(&[
        "train",
        "--quiet",
        "--load",
        &save,
        "--train-iters",
        &(steps + 1).to_string(),
        "--log-json",
        &log,
    ]);
    assert!(ok, "{stderr}");
    let lines = log_lines(&log);
    assert_eq!(lines.len() as u64, steps + 1);
    assert_eq!(lines[steps as usize]["step"], steps);
}

#[test]
fn a_second_sigint_exits_at_once() {
    let dir = TempDir::new("sigint-twice");
    let log = dir.join("log.jsonl");
    // Slow steps, so that the second signal comes before the first one's step ends.
    let mut child = start(&[
        "--log-json",
        &log,
        "--num-layers",
        "4",
        "--hidden-size",
        "512",
        "--seq-length",
        "256",
        "--micro-batch-size",
        "8",
        "--save",
        &dir.join("ckpt"),
    ]);
    wait_for_lines(&mut child, &log, 1);
    signal(&child, libc::SIGINT);
    std::thread::sleep(Duration::from_millis(50));
    signal(&child, libc::SIGINT);
    let (status, _, stderr) = finish(child);
    assert_eq!(status.code(), Some(128 + libc::SIGINT), "{stderr}");
    assert!(
        stderr.contains("error: a second SIGINT: stopped at once, without finishing the step"),
        "{stderr}"
    );
}

/// The pid of a process that has exited.
fn dead_pid() -> u32 {
    let mut child = Command::new("true").spawn().unwrap();
    child.wait().unwrap();
    child.id()
}

#[test]
fn what_a_killed_save_left_is_removed_at_the_next_load_and_save() {
    let dir = TempDir::new("killed-save");
    let save = dir.join("ckpt");
    small_checkpoint(&save, 1, &[]);
    // A save killed while writing iteration 2, and one killed while replacing iteration 1.
    let pid = dead_pid();
    let partial = format!("{save}/.iter_0000002.tmp-{pid}");
    let replaced = format!("{save}/.iter_0000001.old-{pid}");
    for d in [&partial, &replaced] {
        std::fs::create_dir_all(d).unwrap();
        std::fs::write(format!("{d}/model.safetensors"), vec![0u8; 1 << 16]).unwrap();
    }
    let (ok, _, stderr) = megatron(&["train", "--quiet", "--load", &save, "--train-iters", "1"]);
    assert!(ok, "{stderr}");
    for d in [&partial, &replaced] {
        assert!(!std::path::Path::new(d).exists(), "{d} is still there");
    }
    // An interrupted replacement whose new copy never arrived is put back.
    let iter1 = format!("{save}/iter_0000001");
    std::fs::rename(&iter1, &replaced).unwrap();
    std::fs::create_dir_all(&partial).unwrap();
    // Iteration 1 cannot load until it is back: the load puts it back first.
    small_checkpoint(&save, 3, &["--load", &save]);
    assert!(std::path::Path::new(&iter1).is_dir());
    assert!(!std::path::Path::new(&partial).exists());
    // A save without a load cleans up too (told to replace the later iterations).
    std::fs::create_dir_all(&partial).unwrap();
    small_checkpoint(&save, 1, &["--overwrite-checkpoints"]);
    assert!(!std::path::Path::new(&partial).exists());
}

#[test]
fn convert_never_writes_into_a_directory_that_holds_files() {
    let dir = TempDir::new("convert-into");
    let save = dir.join("ckpt");
    let hf = dir.join("hf");
    small_checkpoint(&save, 3, &[]);
    let (ok, _, stderr) = megatron(&["convert", "--from", &save, "--to", "hf-gpt2", &hf]);
    assert!(ok, "{stderr}");
    let (ok, _, stderr) = megatron(&["convert", "--from", "hf-gpt2", &hf, "--to", &save]);
    assert!(!ok);
    assert!(stderr.contains("already holds files"), "{stderr}");
    let latest = std::fs::read_to_string(format!("{save}/latest_checkpointed_iteration.txt"));
    assert_eq!(latest.unwrap().trim(), "3");
    let (ok, _, stderr) = megatron(&["convert", "--from", &save, "--to", "hf-gpt2", &hf]);
    assert!(!ok && stderr.contains("already holds files"), "{stderr}");
}
