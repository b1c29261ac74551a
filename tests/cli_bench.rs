//! `megatron bench`: the commands run and report their figures against a measured limit.

use std::process::Command;

fn megatron_json(args: &[&str]) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_megatron"))
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn bench_allreduce_reports_time_floor_and_ratio() {
    let r = megatron_json(&[
        "bench",
        "allreduce",
        "--ranks",
        "3",
        "--elements",
        "20000",
        "--iters",
        "3",
        "--json",
    ]);
    assert_eq!(r["ranks"], 3);
    assert_eq!(r["elements"], 20000);
    for key in ["time_ms", "floor_ms", "ratio", "machine_gbs", "algbw_gbs"] {
        assert!(r[key].as_f64().unwrap() > 0.0, "{key}: {r}");
    }
}

#[test]
fn bench_gemm_reports_every_shape_against_the_peak() {
    let r = megatron_json(&[
        "bench",
        "gemm",
        "--threads",
        "1",
        "--repeats",
        "1",
        "--json",
    ]);
    assert_eq!(r["threads"], 1);
    let results = r["results"].as_array().unwrap();
    // Each shape in f32, then with its operands rounded to bf16 (what --bf16 runs).
    assert_eq!(results.len(), 8);
    assert_eq!(results[1]["m"], 4096);
    assert_eq!(results[1]["trans_b"], true);
    assert_eq!(results[5]["m"], 4096);
    for (i, s) in results.iter().enumerate() {
        let want = if i < 4 { "f32" } else { "bf16" };
        assert_eq!(s["precision"], want, "{s}");
        assert!(!s["kernel"].as_str().unwrap().is_empty());
    }
    assert!(
        results
            .iter()
            .all(|s| s["gflops_median"].as_f64().unwrap() > 0.0)
    );
    if cfg!(target_arch = "x86_64") {
        assert!(!r["peaks"].as_array().unwrap().is_empty());
    }
}

#[test]
fn a_kernel_cap_that_names_no_instruction_set_is_refused() {
    let out = Command::new(env!("CARGO_BIN_EXE_megatron"))
        .args(["bench", "gemm", "--threads", "1", "--repeats", "1"])
        .env("MEGATRON_KERNEL_ISA", "neon")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("MEGATRON_KERNEL_ISA=\"neon\" names no instruction set"),
        "{stderr}"
    );
    assert!(out.stdout.is_empty());
}

#[test]
fn an_amx_emulation_flag_that_is_neither_0_nor_1_is_refused() {
    let out = Command::new(env!("CARGO_BIN_EXE_megatron"))
        .args(["bench", "gemm", "--threads", "1", "--repeats", "1"])
        .env("MEGATRON_EMULATE_AMX", "yes")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("MEGATRON_EMULATE_AMX=\"yes\": use 1 (emulate AMX) or 0"),
        "{stderr}"
    );
    assert!(out.stdout.is_empty());
}

#[test]
fn bench_rejects_empty_worlds() {
    let out = Command::new(env!("CARGO_BIN_EXE_megatron"))
        .args(["bench", "allreduce", "--ranks", "0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("invalid value '0' for '--ranks <RANKS>': must be at least 1")
    );
}

#[test]
fn bench_attention_times_the_layer_forward_and_backward() {
    let r = megatron_json(&[
        "bench",
        "attention",
        "--seq-length",
        "64",
        "--heads",
        "2",
        "--head-dim",
        "16",
        "--repeats",
        "1",
        "--json",
    ]);
    assert_eq!(r["bench"]["seq"], 64);
    assert_eq!(r["device"], "CPU");
    let cpu = &r["results"][0];
    assert_eq!(cpu["backend"], "cpu");
    for key in [
        "forward_ms",
        "forward_backward_ms",
        "forward_tflops",
        "forward_backward_tflops",
    ] {
        assert!(cpu[key].as_f64().unwrap() > 0.0, "{key}: {r}");
    }
    // No comparison of the two times: one timed run each, on a loaded machine, can come out
    // in either order (CI saw a 4.2 ms forward beside a 0.3 ms forward and backward).

    // Packed documents: the throughput counts each document's causal work only (4 documents
    // of 16: a quarter of one of 64), so TFLOP/s = that work over the time.
    let r = megatron_json(&[
        "bench",
        "attention",
        "--seq-length",
        "64",
        "--heads",
        "2",
        "--head-dim",
        "16",
        "--dropout",
        "0",
        "--documents",
        "4",
        "--repeats",
        "1",
        "--json",
    ]);
    assert_eq!(r["bench"]["documents"], 4);
    let cpu = &r["results"][0];
    let work = 2.0 * (2 * 16) as f64 * 4.0 * (16 * 16) as f64;
    let ms = cpu["forward_ms"].as_f64().unwrap();
    let tflops = cpu["forward_tflops"].as_f64().unwrap();
    assert!(
        (tflops - work / (ms / 1e3) / 1e12).abs() <= 1e-9 * tflops.max(1e-12),
        "{r}"
    );
}

#[test]
fn bench_attention_rejects_bad_sizes_with_the_numbers() {
    for (args, message) in [
        (
            vec!["--heads", "0"],
            "invalid value '0' for '--heads <HEADS>': must be at least 1",
        ),
        (
            vec!["--dropout", "1.5"],
            "invalid value '1.5' for '--dropout <DROPOUT>': must be at least 0 and less than 1",
        ),
        (
            vec!["--seq-length", "8", "--documents", "9"],
            "--documents 9: a sequence of 8 positions holds 1 to 8 documents",
        ),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_megatron"))
            .args(["bench", "attention"])
            .args(&args)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(message), "{args:?}: {stderr}");
    }
}
