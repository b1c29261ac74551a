//! bf16 products on AMX tiles through the whole CLI, on the emulator of the tile instructions
//! (`MEGATRON_EMULATE_AMX=1`) where the CPU has no AMX: `megatron train --bf16` says which tile
//! its products run on, and its losses follow the same run on the CPU's own bf16 kernel to the
//! precision of another order of f32 sums.

mod support;

use std::process::Command;

use support::TempDir;

/// A bf16 run of one small layer, 2 steps; `emulate` sets `MEGATRON_EMULATE_AMX=1`. Its standard
/// output and each step's loss.
fn run(dir: &TempDir, name: &str, emulate: bool) -> (String, Vec<f64>) {
    let log = dir.join(&format!("{name}.jsonl"));
    let mut command = Command::new(env!("CARGO_BIN_EXE_megatron"));
    command.args([
        "train",
        "--model",
        "gpt-tiny",
        "--num-layers",
        "1",
        "--seq-length",
        "32",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "4",
        "--train-iters",
        "2",
        "--bf16",
        "--log-json",
        &log,
    ]);
    command.env_remove("MEGATRON_KERNEL_ISA");
    match emulate {
        true => command.env("MEGATRON_EMULATE_AMX", "1"),
        false => command.env_remove("MEGATRON_EMULATE_AMX"),
    };
    let out = command.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{name}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let losses = support::log_lines(&log)
        .iter()
        .map(|l| l["loss"].as_f64().unwrap())
        .collect();
    (stdout, losses)
}

#[test]
fn a_bf16_run_on_amx_tiles_follows_the_run_on_the_cpus_own_bf16_kernel() {
    #[cfg(target_arch = "x86_64")]
    let emulator_runs = std::arch::is_x86_feature_detected!("avx512bf16")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && cfg!(target_os = "linux");
    #[cfg(not(target_arch = "x86_64"))]
    let emulator_runs = false;
    if !emulator_runs {
        eprintln!("no AVX512_BF16 here: neither AMX nor its emulator runs");
        return;
    }
    let dir = TempDir::new("amx-emulated");
    let (own, own_losses) = run(&dir, "own", false);
    let (amx, amx_losses) = run(&dir, "amx", true);
    // A CPU with AMX runs its own tiles both times (the variable is for CPUs without).
    assert!(amx.contains("bf16 products on amx 32×32"), "{amx}");
    assert!(own.contains("bf16 products on "), "{own}");
    if !own.contains("amx") {
        assert!(amx.contains("(AMX emulated in software"), "{amx}");
    }
    assert_eq!(own_losses.len(), 2);
    assert_eq!(amx_losses.len(), 2);
    // The same bf16 operands, their products summed in AMX's order: the first step's loss to
    // f32's precision; the second after an update whose values may round to the other bf16
    // neighbour (2⁻⁸ of a value), to 1e-4.
    for (step, (a, b)) in amx_losses.iter().zip(&own_losses).enumerate() {
        let bound = if step == 0 { 1e-6 } else { 1e-4 };
        assert!(
            (a - b).abs() <= bound * b.abs(),
            "step {step}: {a} on AMX tiles, {b} on the CPU's own kernel"
        );
    }
}
