//! `megatron train --trace` and `megatron bench --trace`: the last step's timeline as a Chrome
//! trace, every rank a process with its step's phases, its passes and each collective of each
//! group on a track of its own, inside the step; a path that cannot be written is refused
//! before the run.

mod support;

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;
use support::{TempDir, megatron};

/// gpt-tiny at tp 2 × pp 2 × dp 2 (8 thread ranks), two micro-batches of 2 × 32 tokens per
/// data-parallel rank.
const LAYOUT: [&str; 21] = [
    "--quiet",
    "--model",
    "gpt-tiny",
    "--num-layers",
    "4",
    "--tp",
    "2",
    "--pp",
    "2",
    "--dp",
    "2",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--train-iters",
    "2",
    "--seed",
    "3",
];

/// The complete events (`ph: X`) of a trace file, and each rank's track names.
fn read(path: &str) -> (Vec<Value>, BTreeMap<u64, BTreeSet<String>>) {
    let trace: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let events = trace["traceEvents"].as_array().unwrap().clone();
    let mut tracks: BTreeMap<u64, BTreeSet<String>> = BTreeMap::new();
    for e in &events {
        if e["name"] == "thread_name" {
            let name = e["args"]["name"].as_str().unwrap().to_string();
            tracks
                .entry(e["pid"].as_u64().unwrap())
                .or_default()
                .insert(name);
        }
    }
    let spans = events.into_iter().filter(|e| e["ph"] == "X").collect();
    (spans, tracks)
}

#[test]
fn the_last_steps_passes_phases_and_collectives_of_every_rank() {
    let dir = TempDir::new("cli-trace");
    let path = dir.join("trace.json");
    let logs = [dir.join("plain.jsonl"), dir.join("traced.jsonl")];
    for (log, trace) in logs.iter().zip([None, Some(&path)]) {
        let mut args = vec!["train"];
        args.extend(LAYOUT);
        args.extend(["--log-json", log]);
        if let Some(trace) = trace {
            args.extend(["--trace", trace]);
        }
        let (ok, _, stderr) = megatron(&args);
        assert!(ok, "{stderr}");
    }
    // Tracing times the run and changes nothing of it.
    let steps = |log: &str| -> Vec<(Value, Value)> {
        support::log_lines(log)
            .iter()
            .map(|l| (l["loss"].clone(), l["grad_norm"].clone()))
            .collect()
    };
    assert_eq!(steps(&logs[0]), steps(&logs[1]));
    let (spans, tracks) = read(&path);
    let ranks: BTreeSet<u64> = spans.iter().map(|e| e["pid"].as_u64().unwrap()).collect();
    assert_eq!(ranks, (0..8).collect(), "every rank a process");
    for rank in 0..8u64 {
        let mine: Vec<&Value> = spans.iter().filter(|e| e["pid"] == rank).collect();
        let names = |cat: &str| -> Vec<String> {
            mine.iter()
                .filter(|e| e["cat"] == cat)
                .map(|e| e["name"].as_str().unwrap().to_string())
                .collect()
        };
        // One step: its phases once each, a forward and a backward per micro-batch.
        assert_eq!(
            names("step"),
            [
                "forward and backward",
                "reduce gradients",
                "gradient norm",
                "optimizer step",
                "gather parameters"
            ],
            "rank {rank}"
        );
        let mut compute = names("compute");
        compute.sort();
        assert_eq!(
            compute,
            ["backward 0", "backward 1", "forward 0", "forward 1"],
            "rank {rank}"
        );
        for track in ["step", "compute", "comm tp", "comm pp", "comm dp"] {
            assert!(
                tracks[&rank].contains(track),
                "rank {rank}: {:?}",
                tracks[&rank]
            );
        }
        // Every span within the step's phases, none negative.
        let (start, end) =
            mine.iter()
                .filter(|e| e["cat"] == "step")
                .fold((f64::MAX, 0.0f64), |(s, t), e| {
                    let ts = e["ts"].as_f64().unwrap();
                    (s.min(ts), t.max(ts + e["dur"].as_f64().unwrap()))
                });
        for e in &mine {
            let (ts, dur) = (e["ts"].as_f64().unwrap(), e["dur"].as_f64().unwrap());
            assert!(
                ts >= start && ts + dur <= end + 1.0 && dur >= 0.0,
                "rank {rank}: {e}"
            );
        }
    }
    // The tensor-parallel all-reduces of the layers' outputs: [s, b, h] f32 (gpt-tiny's hidden
    // size 128), each naming the line that called it.
    let layer = spans
        .iter()
        .find(|e| {
            e["cat"] == "comm"
                && e["args"]["group"] == "tp"
                && e["name"].as_str().unwrap().starts_with("all_reduce")
                && e["args"]["bytes"] == 32 * 2 * 128 * 4
        })
        .unwrap_or_else(|| panic!("a layer's all-reduce in {spans:?}"));
    assert!(
        layer["args"]["caller"].as_str().unwrap().contains(".rs:"),
        "{layer}"
    );
}

#[test]
fn bench_traces_its_last_step_and_a_bad_path_is_refused_before_the_run() {
    let dir = TempDir::new("cli-trace-bench");
    let path = dir.join("bench.json");
    let (ok, _, stderr) = megatron(&[
        "bench",
        "--model",
        "gpt-tiny",
        "--num-layers",
        "2",
        "--train-iters",
        "1",
        "--warmup",
        "1",
        "--dp",
        "2",
        "--trace",
        &path,
    ]);
    assert!(ok, "{stderr}");
    let (spans, _) = read(&path);
    let ranks: BTreeSet<u64> = spans.iter().map(|e| e["pid"].as_u64().unwrap()).collect();
    assert_eq!(ranks, [0, 1].into());
    for bad in [
        dir.path().to_str().unwrap(),
        "/no/such/directory/trace.json",
    ] {
        let (ok, _, stderr) = megatron(&["train", "--train-iters", "1", "--trace", bad]);
        assert!(
            !ok && stderr.contains(&format!("--trace {bad}")),
            "{stderr}"
        );
    }
}
