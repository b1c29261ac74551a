//! The distributed optimizer (ZeRO-1) against the plain data-parallel optimizer: the same
//! run, the same seed, with tensor and data parallelism, gives the same losses, gradient norms
//! and parameters (to 1e-6 of their size: the norm's f32 partial sums are added in another
//! order), while each rank holds 1/dp of the optimizer state and the gradients go by
//! reduce-scatter and the parameters by all-gather, one of each per bucket.

mod support;

use megatron::comm::threads::launch;
use megatron::comm::{OpKind, ParallelState};
use megatron::models::GptConfig;
use megatron::models::gpt::Gpt;
use megatron::module::{Builder, Module};
use megatron::parallel::{GroupKind, ParallelConfig, ParallelLayout};
use megatron::training::{
    BatchPlan, DecayStyle, LrSchedule, Sampler, TokenStream, TrainConfig, Trainer,
};

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const STEPS: u64 = 5;

/// What one run gives: per step (loss, grad norm), rank 0's parameters at the end, the moments'
/// length and the buffers' length on rank 0, and rank 0's data-parallel calls in the last step
/// (all-reduces, reduce-scatters, all-gathers) with its bucket count.
struct Outcome {
    curve: Vec<(f64, f64)>,
    params: Vec<f32>,
    moments: usize,
    buffer: usize,
    calls: (u64, u64, u64),
    buckets: u64,
}

fn train(tp: usize, dp: usize, distopt: bool) -> Outcome {
    let layout = ParallelLayout::new(&ParallelConfig::new(tp * dp).with_tp(tp)).unwrap();
    let mut config = GptConfig::new(2, 32, 4, 256, 32);
    config.hidden_dropout = 0.1;
    config.attention_dropout = 0.1;
    let spec = config.spec();
    let text = "The distributed optimizer shards Adam's state over data parallelism. ".repeat(20);
    let mut out = launch(tp * dp, |w| -> R<_> {
        let ps = ParallelState::new(&w, &layout)?;
        let model = Gpt::build(&spec, &mut Builder::for_rank(4, ps.groups()))?;
        let sampler = Sampler::windows(
            TokenStream::from_bytes(text.as_bytes()),
            BatchPlan {
                seq_length: 16,
                micro_batch: 1,
                global_batch: 8,
                dp,
            },
            5,
        )?;
        let schedule = LrSchedule {
            max_lr: 3e-3,
            min_lr: 3e-4,
            warmup_steps: 1,
            decay_steps: STEPS,
            style: DecayStyle::Cosine,
        };
        let train = TrainConfig {
            // Low enough that clipping acts: the norm, computed from the shards, matters.
            clip_grad: 0.5,
            distributed_optimizer: distopt,
            // Several buckets (3000 elements each).
            ..support::train_config(schedule, 9, 3000)
        };
        let mut trainer = Trainer::new(model, &ps, sampler, train)?;
        let mut curve = Vec::new();
        let mut comm = Vec::new();
        for s in 0..STEPS {
            let m = trainer.step(&ps, s)?;
            curve.push((m.loss, m.grad_norm));
            comm = m.comm;
        }
        let mut params = Vec::new();
        trainer
            .model()
            .visit_params(&mut |p| params.extend(p.value().to_vec::<f32>().unwrap()));
        let dp_stats = comm
            .iter()
            .find(|(k, _)| *k == GroupKind::Dp)
            .map(|(_, s)| s.clone())
            .unwrap_or_default();
        Ok(Outcome {
            curve,
            params,
            moments: trainer.optimizer().moments().0.numel(),
            buffer: trainer.buffers().values().numel(),
            calls: (
                dp_stats.get(OpKind::AllReduce).calls,
                dp_stats.get(OpKind::ReduceScatter).calls,
                dp_stats.get(OpKind::AllGather).calls,
            ),
            buckets: trainer.buffers().buckets().len() as u64,
        })
    })
    .unwrap();
    out.remove(0)
}

fn assert_close(a: f64, b: f64, what: &str) {
    assert!(
        (a - b).abs() <= 1e-6 * b.abs().max(1e-3),
        "{what}: {a} vs {b}"
    );
}

#[test]
fn the_distributed_optimizer_trains_as_the_plain_one_with_a_shard_of_the_state() {
    for (tp, dp) in [(1, 2), (2, 2), (1, 4)] {
        let plain = train(tp, dp, false);
        let sharded = train(tp, dp, true);
        let what = format!("tp {tp} dp {dp}");
        for (i, (a, b)) in sharded.curve.iter().zip(&plain.curve).enumerate() {
            assert_close(a.0, b.0, &format!("{what} step {i} loss"));
            assert_close(a.1, b.1, &format!("{what} step {i} grad norm"));
        }
        // Clipping acted (the norm is above 0.5), so the norm from the shards was used.
        assert!(plain.curve[0].1 > 0.5, "{:?}", plain.curve);
        let worst = sharded
            .params
            .iter()
            .zip(&plain.params)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(worst < 1e-6, "{what}: parameters differ by {worst}");
        // The state: 1/dp of the (padded) buffer; the plain optimizer holds all of it.
        assert_eq!(plain.moments, plain.buffer);
        assert_eq!(sharded.moments * dp, sharded.buffer, "{what}");
        // A reduce-scatter and an all-gather per bucket; the all-reduces are the loss and the
        // norm's data-parallel sum, never the gradients.
        assert!(sharded.buckets > 1, "{what}: {} buckets", sharded.buckets);
        assert_eq!(
            sharded.calls,
            (2, sharded.buckets, sharded.buckets),
            "{what}"
        );
        assert_eq!(plain.calls, (plain.buckets + 1, 0, 0), "{what}");
    }
}

#[test]
fn one_data_parallel_rank_holds_the_whole_state_either_way() {
    let plain = train(2, 1, false);
    let sharded = train(2, 1, true);
    assert_eq!(sharded.curve, plain.curve);
    assert_eq!(sharded.moments, sharded.buffer);
}

/// `megatron train` flags every run below shares: gpt-tiny cut to 2 layers, 4 microbatches.
const COMMON: [&str; 13] = [
    "train",
    "--quiet",
    "--num-layers",
    "2",
    "--seq-length",
    "16",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "8",
    "--clip-grad",
    "0.5",
    "--seed=5",
];

#[test]
fn a_sharded_checkpoint_resumes_at_its_own_and_at_other_data_parallel_sizes() {
    let dir = support::TempDir::new("distopt-ckpt");
    let save = dir.join("ckpt");
    let run = |name: &str, extra: &[&str]| support::curve(&COMMON, &dir, name, extra);
    let whole = run(
        "whole",
        &[
            "--dp",
            "2",
            "--use-distributed-optimizer",
            "--train-iters",
            "6",
            "--save",
            &save,
            "--save-interval",
            "3",
        ],
    );
    let from = format!("{save}/iter_0000003");
    // Each rank wrote its shard of the optimizer state; no rank gathered it.
    let files: Vec<String> = std::fs::read_dir(&from)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    for shard in [
        "optimizer.rank00000.safetensors",
        "optimizer.rank00001.safetensors",
    ] {
        assert!(files.iter().any(|f| f == shard), "{files:?}");
    }
    assert!(
        !files.iter().any(|f| f == "optimizer.safetensors"),
        "{files:?}"
    );
    // At the same data-parallel size the moments go back to the same shards: bit for bit.
    let same = run(
        "same",
        &[
            "--load",
            &from,
            "--use-distributed-optimizer",
            "--train-iters",
            "6",
        ],
    );
    assert_eq!(same, whole[3..]);
    // At other sizes, sharded or not, they are cut anew; the sums over data parallelism (and
    // the norm's over the shards) run in another order.
    for (name, extra) in [
        ("dp4", &["--dp", "4", "--use-distributed-optimizer"][..]),
        ("dp1", &["--dp", "1"][..]),
    ] {
        let mut args = vec!["--load", &from, "--train-iters", "6"];
        args.extend(extra);
        let resumed = run(name, &args);
        assert_eq!(resumed.len(), 3, "{name}");
        for (r, w) in resumed.iter().zip(&whole[3..]) {
            assert_eq!(r.0, w.0);
            assert!((r.1 - w.1).abs() <= 1e-6 * w.1, "{name}: {r:?} vs {w:?}");
            assert!((r.2 - w.2).abs() <= 1e-5 * w.2, "{name}: {r:?} vs {w:?}");
        }
    }
}

#[test]
fn sharded_checkpoints_reshard_over_tensor_and_pipeline_parallelism() {
    let dir = support::TempDir::new("distopt-ckpt-tp-pp");
    let save = dir.join("ckpt");
    let run = |name: &str, extra: &[&str]| support::curve(&COMMON, &dir, name, extra);
    // Saved by 8 ranks, each with its shard of a tensor-parallel part of a stage.
    let layout = [
        "--tp",
        "2",
        "--pp",
        "2",
        "--dp",
        "2",
        "--use-distributed-optimizer",
    ];
    let mut args = layout.to_vec();
    args.extend([
        "--train-iters",
        "6",
        "--save",
        &save,
        "--save-interval",
        "3",
    ]);
    let whole = run("whole", &args);
    let from = format!("{save}/iter_0000003");
    let mut args = layout.to_vec();
    args.extend(["--load", &from, "--train-iters", "6"]);
    assert_eq!(run("same", &args), whole[3..]);
    for (name, extra) in [
        ("dp4", &["--dp", "4", "--use-distributed-optimizer"][..]),
        ("tp2dp1", &["--tp", "2", "--dp", "1"]),
    ] {
        let mut args = vec!["--load", &from, "--train-iters", "6"];
        args.extend(extra);
        let resumed = run(name, &args);
        assert_eq!(resumed.len(), 3, "{name}");
        for (r, w) in resumed.iter().zip(&whole[3..]) {
            assert!((r.1 - w.1).abs() <= 1e-6 * w.1, "{name}: {r:?} vs {w:?}");
            assert!((r.2 - w.2).abs() <= 1e-5 * w.2, "{name}: {r:?} vs {w:?}");
        }
    }
    // A shard missing (its file and its checksum gone): the others do not cover the buffer.
    let meta_path = format!("{from}/meta.json");
    let mut meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&meta_path).unwrap()).unwrap();
    let files = meta["files"].as_object_mut().unwrap();
    assert_eq!(
        files
            .keys()
            .filter(|f| f.starts_with("optimizer.rank"))
            .count(),
        8
    );
    files.remove("optimizer.rank00005.safetensors");
    // Without its seal, as a checkpoint written before meta.json had one: the edit itself is
    // refused otherwise (tests/cli_resume.rs), before the shards are counted.
    meta.as_object_mut().unwrap().remove("meta_sha256");
    std::fs::write(&meta_path, serde_json::to_vec(&meta).unwrap()).unwrap();
    std::fs::remove_file(format!("{from}/optimizer.rank00005.safetensors")).unwrap();
    let (ok, _, stderr) =
        support::megatron(&["train", "--quiet", "--load", &from, "--train-iters", "6"]);
    assert!(!ok, "{stderr}");
    assert!(
        stderr.contains("the shards do not cover the buffer") && stderr.contains("7 shard files"),
        "{stderr}"
    );
}

#[test]
fn bytes_per_parameter_follow_the_seeds_table_8_plus_8_over_d() {
    // f32 values and gradients (4 + 4 bytes) on every rank, Adam's two f32 moments (8 bytes)
    // split over the d data-parallel ranks; the plain optimizer keeps all 16.
    for (dp, distopt, expected) in [
        (
            "1",
            true,
            "16.0 bytes per parameter (values 4.0, gradients 4.0, optimizer 8.0)",
        ),
        (
            "2",
            true,
            "12.0 bytes per parameter (values 4.0, gradients 4.0, optimizer 4.0)",
        ),
        (
            "4",
            true,
            "10.0 bytes per parameter (values 4.0, gradients 4.0, optimizer 2.0)",
        ),
        (
            "8",
            true,
            "9.0 bytes per parameter (values 4.0, gradients 4.0, optimizer 1.0)",
        ),
        (
            "2",
            false,
            "16.0 bytes per parameter (values 4.0, gradients 4.0, optimizer 8.0)",
        ),
    ] {
        let mut args = vec![
            "train",
            "--quiet",
            "--dp",
            dp,
            "--train-iters",
            "1",
            "--seq-length",
            "16",
            "--micro-batch-size",
            "1",
            "--global-batch-size",
            "8",
        ];
        if distopt {
            args.push("--use-distributed-optimizer");
        }
        let (ok, stdout, stderr) = support::megatron(&args);
        assert!(ok, "{stderr}");
        assert!(
            stdout.contains(&format!("rank 0's state: {expected}")),
            "dp {dp} distopt {distopt}: {stdout}"
        );
    }
}

#[test]
fn inspect_shows_a_ranks_state_at_a_data_parallel_size() {
    // The seed's table: f32 8 + 8/d, 16-bit values with f32 gradients 6 + 12/d, 16-bit values
    // and gradients 4 + 16/d.
    let cases: [(usize, bool, &[&str], f64); 7] = [
        (4, true, &[], 10.0),
        (4, false, &[], 16.0),
        (8, true, &[], 9.0),
        (4, true, &["--bf16"], 9.0),
        (1, false, &["--bf16"], 18.0),
        (8, true, &["--fp16"], 6.0),
        (1, false, &["--bf16", "--grad-reduce-in-bf16"], 20.0),
    ];
    for (dp, distopt, precision, total) in cases {
        let dp = dp.to_string();
        let mut args = vec!["inspect", "--model", "gpt2-small", "--dp", &dp, "--json"];
        args.extend(precision);
        if distopt {
            args.push("--use-distributed-optimizer");
        }
        let (ok, stdout, stderr) = support::megatron(&args);
        assert!(ok, "{stderr}");
        let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
        let got = v["state_bytes_per_param"]["total"].as_f64().unwrap();
        // Padding adds a little: under 0.01 bytes per parameter for gpt2-small.
        assert!(
            got >= total && got < total + 0.01,
            "dp {dp} {distopt} {precision:?}: {got}"
        );
    }
}
