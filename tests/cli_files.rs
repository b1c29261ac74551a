//! Outputs and checkpoints stay safe: an output path that is not a regular file is never
//! replaced (a link is written through), a save directory has one writer at a time, and a run
//! does not replace later checkpoints without being told to.

mod support;

use std::ffi::CString;
use std::fs;
use std::os::unix::fs::{FileTypeExt, symlink};

use megatron::checkpoint::{LOCK_FILE, SaveLock};
use support::{SMALL, TempDir, megatron};

/// Makes a named pipe at `path`.
fn mkfifo(path: &str) {
    let c = CString::new(path).unwrap();
    // SAFETY: a valid NUL-terminated path; mkfifo reads it and touches nothing else.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
}

#[test]
fn outputs_never_replace_what_is_not_a_regular_file() {
    let dir = TempDir::new("cli-files-outputs");
    let corpus = dir.join("corpus.jsonl");
    fs::write(&corpus, "{\"text\": \"hello world, hello megatron\"}\n").unwrap();
    let pipe = dir.join("pipe.json");
    mkfifo(&pipe);
    let to_pipe = dir.join("to-pipe.json");
    symlink(&pipe, &to_pipe).unwrap();
    let folder = dir.join("folder.json");
    fs::create_dir(&folder).unwrap();
    let train = |output: &str| {
        megatron(&[
            "tokenizer",
            "train",
            "--input",
            &corpus,
            "--vocab-size",
            "300",
            "--output",
            output,
        ])
    };
    for (output, kind) in [
        (&pipe, "a named pipe"),
        (&to_pipe, "a named pipe"),
        (&folder, "a directory"),
    ] {
        let (ok, _, stderr) = train(output);
        assert!(!ok, "{output}");
        assert!(
            stderr.contains(&format!("is {kind}")) && stderr.contains("not a regular file"),
            "{output}: {stderr}"
        );
    }
    // A pipe that nothing reads would block the run before its first step: refused.
    let mut args = vec!["train", "--train-iters", "1", "--log-json", &pipe];
    args.extend(SMALL);
    let (ok, _, stderr) = megatron(&args);
    assert!(
        !ok && stderr.contains("--log-json")
            && stderr.contains("a named pipe that no process reads"),
        "{stderr}"
    );
    assert!(fs::metadata(&pipe).unwrap().file_type().is_fifo());
    assert!(fs::symlink_metadata(&to_pipe).unwrap().is_symlink());
    assert!(fs::metadata(&folder).unwrap().is_dir());
    // A link to a file is written through: the link stays, the file it names is the tokenizer.
    let real = dir.join("real.json");
    let link = dir.join("link.json");
    symlink(&real, &link).unwrap();
    let (ok, _, stderr) = train(&link);
    assert!(ok, "{stderr}");
    assert!(fs::symlink_metadata(&link).unwrap().is_symlink());
    assert!(fs::read_to_string(&real).unwrap().contains("<|endoftext|>"));
    // The dataset files of `preprocess` too.
    let bin = dir.join("data_text_document.bin");
    fs::create_dir(&bin).unwrap();
    let (ok, _, stderr) = megatron(&[
        "preprocess",
        "--input",
        &corpus,
        "--tokenizer",
        "byte",
        "--output-prefix",
        &dir.join("data"),
    ]);
    assert!(
        !ok && stderr.contains("is a directory, not a regular file"),
        "{stderr}"
    );
    assert!(fs::metadata(&bin).unwrap().is_dir());
}

/// `megatron train` of the small run for `steps` steps saving into `save`, with `extra`.
fn train(save: &str, steps: &str, extra: &[&str]) -> (bool, String, String) {
    let mut args = vec!["train", "--train-iters", steps, "--save", save];
    args.extend(SMALL);
    args.extend(extra);
    megatron(&args)
}

#[test]
fn a_save_directory_has_one_writer_and_a_dead_ones_lock_is_taken_over() {
    let dir = TempDir::new("cli-files-lock");
    let save = dir.join("ckpt");
    // Another run (this test process) saves there: the run is refused before its first step.
    let held = SaveLock::acquire(dir.path().join("ckpt").as_path()).unwrap();
    let (ok, stdout, stderr) = train(&save, "1", &[]);
    assert!(!ok, "{stdout}");
    assert!(
        stderr.contains(&format!(
            "another run saves into this directory (process {})",
            std::process::id()
        )),
        "{stderr}"
    );
    assert!(
        !dir.path()
            .join("ckpt/latest_checkpointed_iteration.txt")
            .exists()
    );
    drop(held);
    // A run killed while saving leaves its process id in the lock file but holds no lock.
    fs::write(dir.path().join("ckpt").join(LOCK_FILE), "4194303").unwrap();
    let (ok, stdout, stderr) = train(&save, "1", &[]);
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains("process 4194303, which saved here, ended without releasing"),
        "{stdout}"
    );
    // The run released the directory when it ended.
    assert_eq!(
        fs::read_to_string(dir.path().join("ckpt").join(LOCK_FILE)).unwrap(),
        ""
    );
}

#[test]
fn later_checkpoints_are_replaced_only_when_the_run_is_told_to() {
    let dir = TempDir::new("cli-files-later");
    let save = dir.join("ckpt");
    let (ok, _, stderr) = train(&save, "3", &["--save-interval", "1"]);
    assert!(ok, "{stderr}");
    let first = dir.join("ckpt/iter_0000001");
    let latest = || fs::read_to_string(dir.path().join("ckpt/latest_checkpointed_iteration.txt"));
    // Resumed from iteration 1 into the same directory: iterations 2 and 3 would be replaced.
    let (ok, _, stderr) = train(&save, "3", &["--load", &first]);
    assert!(!ok);
    assert!(
        stderr.contains("holds iterations 2, 3 after step 1, where this run starts")
            && stderr.contains("--overwrite-checkpoints"),
        "{stderr}"
    );
    assert_eq!(latest().unwrap(), "3");
    // A new run into a directory another run saved into, likewise.
    let (ok, _, stderr) = train(&save, "1", &[]);
    assert!(
        !ok && stderr.contains("holds iterations 1, 2, 3 after step 0"),
        "{stderr}"
    );
    // Told to, it replaces them.
    let (ok, _, stderr) = train(&save, "2", &["--load", &first, "--overwrite-checkpoints"]);
    assert!(ok, "{stderr}");
    assert_eq!(latest().unwrap(), "2");
}
