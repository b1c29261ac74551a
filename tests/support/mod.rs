//! Helpers shared by the integration tests that run the `megatron` binary.

use std::process::Command;

/// Runs `megatron` with `args`: (success, stdout, stderr).
pub fn megatron(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_megatron"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}
