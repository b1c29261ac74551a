//! `megatron graphs` and `megatron train --cuda-graph-scope`: the planned graph and buffer
//! counts (the seed's table: 2 × layers without a pipeline; per in-flight slot with one, the
//! same at 8 and 64 microbatches), a run's logged captures equal to the plan, and the choices
//! Megatron-LM refuses.

mod support;
use support::{TempDir, megatron};

/// Runs `megatron` with the space-separated `args`.
fn run(args: &str) -> (bool, String, String) {
    megatron(&args.split_whitespace().collect::<Vec<_>>())
}

/// `megatron graphs --json` with `args`.
fn plan(args: &str) -> serde_json::Value {
    let (ok, out, err) = run(&format!("graphs --json {args}"));
    assert!(ok, "{err}");
    serde_json::from_str(&out).expect("one JSON object")
}

fn graphs(v: &serde_json::Value) -> Vec<u64> {
    v["per_rank"]
        .as_array()
        .expect("ranks")
        .iter()
        .map(|r| r["graphs"].as_u64().expect("graphs"))
        .collect()
}

#[test]
fn graph_counts_follow_the_schedule_not_the_microbatches() {
    // No pipeline: 2 × num_layers, whatever M.
    let dense = |m: usize| {
        plan(&format!(
            "--model gpt-tiny --num-layers 6 --pp 1 --microbatches {m} --cuda-graph-scope attn"
        ))
    };
    assert_eq!(graphs(&dense(8)), [12]);
    assert_eq!(graphs(&dense(64)), [12]);
    // PP 4 × VPP 2, 8 layers: rank r holds (PP − r − 1)·2 + (VPP − 1)·PP + 1 microbatches in
    // flight at most; the counts are the same at M = 8 and 64, and far below one per microbatch.
    let moe = |m: usize| {
        plan(&format!(
            "--model gpt-moe-tiny --num-layers 8 --pp 4 --vpp 2 --microbatches {m} \
             --cuda-graph-scope attn moe_router moe_preprocess"
        ))
    };
    let (at8, at64) = (moe(8), moe(64));
    assert_eq!(graphs(&at8), graphs(&at64));
    for (r, rank) in at64["per_rank"].as_array().unwrap().iter().enumerate() {
        assert_eq!(rank["max_in_flight"], (4 - r - 1) * 2 + 4 + 1, "rank {r}");
        // 2 layers a rank, 2 scoped parts each (attention, the router), forward and backward.
        let slots: u64 = rank["slots_per_chunk"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s.as_u64().unwrap())
            .sum();
        assert_eq!(rank["graphs"].as_u64().unwrap(), 2 * 2 * slots, "rank {r}");
        assert_eq!(
            rank["graphs_one_per_microbatch"],
            2 * 2 * 2 * 64,
            "rank {r}"
        );
    }
}

#[test]
fn a_scoped_run_logs_the_captures_the_plan_counts() {
    let dir = TempDir::new("cli-graphs");
    let log = dir.join("run.jsonl");
    let (ok, _, err) = run(&format!(
        "train --quiet --model gpt-moe-tiny --dp 2 --ep 2 --pp 2 --seq-length 16 \
         --micro-batch-size 1 --global-batch-size 8 --train-iters 3 \
         --cuda-graph-scope attn moe_router --log-json {log}"
    ));
    assert!(ok, "{err}");
    let last = support::log_lines(&log).pop().expect("a step");
    let planned = plan(
        "--model gpt-moe-tiny --pp 2 --microbatches 4 --seq-length 16 \
         --cuda-graph-scope attn moe_router",
    );
    let rank0 = &planned["per_rank"][0];
    let buffers = |key: &str| rank0[key].as_u64().unwrap();
    assert_eq!(last["graphs"]["captured"], rank0["graphs"], "{last}");
    assert_eq!(
        last["graphs"]["static_buffers"].as_u64(),
        Some(buffers("static_input_buffers") + buffers("static_grad_buffers"))
    );
    assert_eq!(
        last["graphs"]["static_buffer_bytes"],
        rank0["static_buffer_bytes"]
    );
}

#[test]
fn scopes_the_model_lacks_or_unknown_names_are_refused() {
    let refused = |args: &str, why: &str| {
        let (ok, _, err) = run(args);
        assert!(!ok && err.contains(why), "{args}: {err}");
    };
    let train = "train --quiet --train-iters 1";
    refused(
        &format!("{train} --cuda-graph-scope attention"),
        "unknown CUDA graph scope `attention`",
    );
    refused(
        &format!("{train} --cuda-graph-scope moe_router"),
        "needs MoE layers",
    );
    refused(
        &format!("{train} --model gpt-moe-tiny --cuda-graph-scope mlp"),
        "all 4 layers of the model are MoE",
    );
    refused(
        &format!("{train} --model gpt-moe-tiny --cuda-graph-scope moe_preprocess"),
        "give moe_router too",
    );
    refused(
        &format!(
            "{train} --cuda-graph-scope attn --recompute-granularity full \
             --recompute-method uniform --recompute-num-layers 1"
        ),
        "full recompute",
    );
    refused(
        "graphs --model gpt-tiny --pp 1 --microbatches 8",
        "--cuda-graph-scope",
    );
}
