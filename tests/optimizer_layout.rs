//! The distributed optimizer's buffer layout (`megatron layout`), against Megatron-LM's own
//! code and rule by rule.
//!
//! `tests/data/megatron_layout_cases.json` holds 150 random parameter lists (dp 1–16, bucket
//! sizes, tied embeddings first, last and in the middle, mixed dtypes, expert buffers over
//! another edp, fp32 gradient reduction, NCCL bus-bandwidth padding, and the plain layout) with
//! the layout Megatron-LM's functions compute for each (made by
//! `tools/golden/megatron_layout.py` from a Megatron-LM checkout).

mod support;

use megatron::optimizer::{LayoutConfig, ParamInfo, layout};
use megatron::tensor::DType;
use serde_json::Value;
use support::{TempDir, megatron};

/// `megatron layout`'s JSON for a case's parameters and flags.
fn run_layout(dir: &TempDir, case: &Value) -> Value {
    let params = dir.join("params.json");
    std::fs::write(&params, case["params"].to_string()).unwrap();
    let dp = case["dp"].to_string();
    let edp = case["edp"].to_string();
    let mut args = vec![
        "layout", "--params", &params, "--dp", &dp, "--edp", &edp, "--json",
    ];
    let bucket = case["bucket"].to_string();
    if !case["bucket"].is_null() {
        args.extend(["--bucket-size", &bucket]);
    }
    for (key, flag) in [
        ("pad", "--pad-buckets-for-high-nccl-busbw"),
        ("fp32grad", "--grad-reduce-in-fp32"),
    ] {
        if case[key] == true {
            args.push(flag);
        }
    }
    if case["distopt"] == false {
        args.push("--no-distributed-optimizer");
    }
    let (ok, stdout, stderr) = megatron(&args);
    assert!(ok, "{args:?}: {stderr}");
    serde_json::from_str(&stdout).unwrap()
}

#[test]
fn layouts_equal_megatrons_on_150_random_cases() {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/megatron_layout_cases.json"
    ))
    .unwrap();
    let cases: Vec<Value> = serde_json::from_str(&text).unwrap();
    assert_eq!(cases.len(), 150);
    let dir = TempDir::new("layout-cases");
    for (i, case) in cases.iter().enumerate() {
        let got = run_layout(&dir, case);
        assert_eq!(
            got,
            case["expected"],
            "case {i}: {}",
            serde_json::to_string(&case["params"]).unwrap()
        );
    }
}

fn param(numel: usize) -> ParamInfo {
    ParamInfo {
        name: format!("p{numel}"),
        numel,
        dtype: DType::F32,
        shared_embedding: false,
        expert: false,
        unit: 0,
    }
}

/// (start, end, bucket) of every parameter, by its index in the list.
fn places(buffer: &megatron::optimizer::BufferLayout) -> Vec<(usize, usize, usize)> {
    let mut v: Vec<_> = buffer
        .placements
        .iter()
        .map(|p| (p.param, p.range.start, p.range.end, p.bucket))
        .collect();
    v.sort();
    v.into_iter().map(|(_, s, e, b)| (s, e, b)).collect()
}

#[test]
fn parameters_go_in_reverse_at_multiples_of_64_and_buckets_end_at_multiples_of_lcm_dp_128() {
    let params = [param(100), param(10), param(70)];
    for dp in [1, 2, 3, 4, 5, 8, 16] {
        let b = &layout(&params, &LayoutConfig::new(dp)).unwrap()[0];
        // Reverse order: the last parameter first, each start rounded up to 64.
        assert_eq!(places(b), [(192, 292, 0), (128, 138, 0), (0, 70, 0)]);
        let divisor = 128 * dp / gcd(128, dp);
        assert_eq!(b.numel(), 292usize.div_ceil(divisor) * divisor, "dp {dp}");
        assert_eq!(b.numel_unpadded(), 292);
        // Shards: dp equal parts of the bucket, covering it.
        let mut covered = 0;
        for rank in 0..dp {
            let shard = b.shard(rank, 0).unwrap();
            assert_eq!(shard.world.start, covered);
            covered = shard.world.end;
            for part in &shard.parts {
                assert_eq!(part.gbuf_world.len(), part.param_range.len());
                assert_eq!(
                    part.gbuf_local.start + shard.world.start,
                    part.gbuf_world.start
                );
            }
        }
        assert_eq!(covered, b.numel());
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

#[test]
fn a_bucket_closes_once_it_holds_the_bucket_size_and_the_tied_embedding_sits_alone() {
    let config = LayoutConfig {
        bucket_size: Some(150),
        ..LayoutConfig::new(2)
    };
    // Reverse order: 82 at 0, 81 at 128 (the bucket now holds 209 ≥ 150 elements and closes,
    // padded to 256), 80 at 256.
    let b = &layout(&[param(80), param(81), param(82)], &config).unwrap()[0];
    assert_eq!(places(b), [(256, 336, 1), (128, 209, 0), (0, 82, 0)]);
    assert_eq!(b.buckets, [0..256, 256..384]);
    assert_eq!(b.bucket_numel_unpadded, [209, 80]);
    // The tied embedding (first in the list, so last in the buffer) closes the open bucket at
    // its aligned start and gets one of its own.
    let mut params = vec![param(30), param(10), param(20)];
    params[0].shared_embedding = true;
    let b = &layout(&params, &LayoutConfig::new(2)).unwrap()[0];
    assert_eq!(places(b), [(128, 158, 1), (64, 74, 0), (0, 20, 0)]);
    assert_eq!(b.buckets, [0..128, 128..256]);
    // Megatron counts the alignment before the embedding in the closed bucket's unpadded size.
    assert_eq!(b.bucket_numel_unpadded, [128, 30]);
}

#[test]
fn buffers_split_by_dtype_gradient_dtype_and_experts_in_the_order_they_first_come() {
    let mut params = vec![param(1), param(2), param(3), param(4)];
    params[1].dtype = DType::BF16;
    params[2].expert = true;
    params[3].dtype = DType::BF16;
    let config = LayoutConfig {
        edp: 3,
        ..LayoutConfig::new(2)
    };
    let buffers = layout(&params, &config).unwrap();
    let keys: Vec<_> = buffers
        .iter()
        .map(|b| (b.key.param_dtype, b.key.grad_dtype, b.key.expert, b.shards))
        .collect();
    assert_eq!(
        keys,
        [
            (DType::F32, DType::F32, false, Some(2)),
            (DType::BF16, DType::BF16, false, Some(2)),
            (DType::F32, DType::F32, true, Some(3)),
        ]
    );
    // The expert buffer is padded for its own group: lcm(3, 128).
    assert_eq!(buffers[2].numel(), 384);
    // With fp32 gradient reduction the bf16 parameters keep their own buffer.
    let fp32 = LayoutConfig {
        grad_reduce_in_fp32: true,
        ..config
    };
    let buffers = layout(&params, &fp32).unwrap();
    assert_eq!(buffers[1].key.grad_dtype, DType::F32);
    assert_eq!(buffers.len(), 3);
}

#[test]
fn without_the_distributed_optimizer_nothing_is_padded_or_sharded() {
    let mut params = vec![param(30), param(10), param(20)];
    params[0].shared_embedding = true;
    let config = LayoutConfig {
        distributed_optimizer: false,
        bucket_size: Some(25),
        ..LayoutConfig::new(4)
    };
    let b = &layout(&params, &config).unwrap()[0];
    // Back to back; the tied embedding shares a bucket (Megatron splits it out only for the
    // distributed optimizer).
    assert_eq!(places(b), [(30, 60, 1), (20, 30, 0), (0, 20, 0)]);
    assert_eq!(b.buckets, [0..30, 30..60]);
    assert_eq!(b.shards, None);
    assert!(b.shard(0, 0).is_none());
}

#[test]
fn the_high_busbw_padding_rounds_buckets_to_65536() {
    let config = LayoutConfig {
        pad_for_high_nccl_busbw: true,
        ..LayoutConfig::new(3)
    };
    let b = &layout(&[param(5)], &config).unwrap()[0];
    // lcm(3, 128, 65536) = 196608.
    assert_eq!(b.numel(), 196_608);
}

#[test]
fn bad_input_is_a_clear_error() {
    let dir = TempDir::new("layout-bad");
    let path = dir.join("params.json");
    for (params, expected) in [
        (
            r#"[{"name": "w", "shape": [4], "dtype": "int8"}]"#,
            "parameter \"w\" has dtype \"int8\"; use fp32, bf16 or fp16",
        ),
        (
            r#"[{"name": "w", "shape": [4]}, {"name": "w", "shape": [2]}]"#,
            "parameter \"w\" appears twice (entries 0 and 1)",
        ),
        (r#"[{"name": "w"}]"#, "not a JSON list of parameters"),
        (
            r#"[{"name": "w", "shape": [4], "sharded": true}]"#,
            "unknown field `sharded`",
        ),
    ] {
        std::fs::write(&path, params).unwrap();
        let (ok, _, stderr) = megatron(&["layout", "--params", &path, "--dp", "2"]);
        assert!(!ok && stderr.contains(expected), "{params}: {stderr}");
    }
    std::fs::write(&path, r#"[{"name": "w", "shape": [4]}]"#).unwrap();
    let (ok, _, stderr) = megatron(&["layout", "--params", &path, "--dp", "0"]);
    assert!(
        !ok && stderr.contains("invalid value '0' for '--dp <DP>': must be at least 1"),
        "{stderr}"
    );
    let (ok, _, stderr) = megatron(&["layout", "--params", "/nonexistent.json", "--dp", "2"]);
    assert!(!ok && stderr.contains("/nonexistent.json"), "{stderr}");
}

#[test]
fn a_registered_model_is_laid_out_too() {
    let (ok, stdout, stderr) = megatron(&["layout", "--model", "gpt-tiny", "--dp", "4", "--json"]);
    assert!(ok, "{stderr}");
    let v: Value = serde_json::from_str(&stdout).unwrap();
    let buffer = &v["buffers"][0];
    let first = &buffer["param_index_map"][0];
    // The last parameter (the final norm's bias) comes first.
    assert_eq!(first["name"], "ln_f.bias");
    assert_eq!(buffer["numel"].as_u64().unwrap() % 128, 0);
    assert_eq!(buffer["per_rank"].as_array().unwrap().len(), 4);
}
