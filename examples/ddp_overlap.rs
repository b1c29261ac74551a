//! Data parallelism's communication overlapped with compute: `--overlap-grad-reduce` starts each
//! gradient bucket's reduction during the backward, once every gradient in it is final, and
//! `--overlap-param-gather` starts each bucket's all-gather of the updated parameters after the
//! optimizer step, waited for at the next step's first read.
//!
//! It trains gpt-tiny at dp 2 with the distributed optimizer and buckets of 20,000 elements,
//! plainly and with both overlaps, checks that the losses are the same bit for bit, and reads
//! each run's traced last step: without overlap every data-parallel collective runs after the
//! walk, with it some run inside it. A last run keeps two distributed-optimizer instances
//! (`--num-distributed-optimizer-instances 2`, HSDP: here each rank its own whole copy of the
//! state, the gradients summed across the copies): the same losses to the gradient norm's
//! rounding (its partial sums are taken over whole buckets instead of halves). The last shards
//! the gradients too (`--data-parallel-sharding-strategy optim_grads`, ZeRO-2): every
//! micro-batch's buckets reduce-scattered during the backward and their whole gradients freed,
//! each rank keeping its shard: the same losses to the sums' rounding. The very last shards the
//! parameters too (`optim_grads_params`, ZeRO-3): each layer gathered around its forward and
//! its backward, the next one's gather started meanwhile, so most of the step's data-parallel
//! collectives run inside the walk.
//!
//! ```sh
//! cargo run --release --example ddp_overlap
//! ```

use std::path::{Path, PathBuf};

use megatron::distributed::{DdpConfig, ShardingStrategy};
use megatron::job::{Placement, TrainJob};
use megatron::models::preset;
use megatron::optimizer::AdamWConfig;
use megatron::training::{BatchPlan, DecayStyle, LrSchedule, Sampler, TokenStream, TrainConfig};

type R<T> = Result<T, Box<dyn std::error::Error>>;

const STEPS: u64 = 6;

/// gpt-tiny with 4 layers on 2 data-parallel thread ranks, its last step traced into `trace`.
fn job(ddp: DdpConfig, trace: PathBuf) -> R<TrainJob> {
    let mut model = (preset("gpt-tiny").ok_or("gpt-tiny is registered")?.config)();
    model.num_layers = 4;
    let plan = BatchPlan {
        seq_length: 64,
        micro_batch: 2,
        global_batch: 16,
        dp: 2,
    };
    let corpus = TokenStream::from_bytes(include_bytes!("data/corpus.txt"));
    Ok(TrainJob {
        model_name: "gpt-tiny".to_string(),
        model,
        tp: 1,
        sequence_parallel: false,
        cp: 1,
        cp_comm_type: Default::default(),
        ep: 1,
        etp: 1,
        dp: 2,
        pipeline: Default::default(),
        steps: STEPS,
        train_data: Sampler::windows(corpus, plan, 1234)?,
        eval: None,
        train: TrainConfig {
            schedule: LrSchedule {
                max_lr: 2e-3,
                min_lr: 2e-4,
                warmup_steps: 2,
                decay_steps: STEPS,
                style: DecayStyle::Cosine,
            },
            adam: AdamWConfig::default(),
            clip_grad: 1.0,
            seed: 1234,
            bucket_elements: 20_000,
            distributed_optimizer: true,
            recompute: megatron::module::Recompute::Off,
            precision: megatron::optimizer::Precision::FP32,
            check_for_nan: true,
        },
        save: None,
        load: None,
        run_info: serde_json::json!({}),
        files: Vec::new(),
        device: Placement::Cpu,
        cuda_graph_scope: megatron::cuda_graphs::ScopeSet::NONE,
        ddp,
        stop: None,
        rank_steps: None,
        trace: Some(trace),
    })
}

/// Rank 0's data-parallel collectives in a trace: how many, and how many began before its walk
/// (the step's "forward and backward" phase) ended.
fn collectives_in_the_walk(trace: &Path) -> R<(usize, usize)> {
    let trace: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(trace)?)?;
    let events = trace["traceEvents"].as_array().ok_or("trace events")?;
    let rank0 = |e: &&serde_json::Value| e["pid"] == 0;
    let track = |name: &str| {
        events
            .iter()
            .filter(rank0)
            .find(|e| e["name"] == "thread_name" && e["args"]["name"] == name)
            .map(|e| e["tid"].clone())
    };
    let (step, dp) = (track("step").ok_or("a step track")?, track("comm dp"));
    let spans = |tid: &serde_json::Value| -> Vec<&serde_json::Value> {
        let on = |e: &&serde_json::Value| e["ph"] == "X" && e["tid"] == *tid;
        events.iter().filter(rank0).filter(on).collect()
    };
    let walk = spans(&step)
        .into_iter()
        .find(|e| e["name"] == "forward and backward")
        .ok_or("the walk's phase")?;
    let walk_end = walk["ts"].as_f64().unwrap_or(0.0) + walk["dur"].as_f64().unwrap_or(0.0);
    let comms = dp.map(|tid| spans(&tid)).unwrap_or_default();
    let inside = comms
        .iter()
        .filter(|e| e["ts"].as_f64().is_some_and(|t| t < walk_end))
        .count();
    Ok((comms.len(), inside))
}

/// The largest relative difference of `losses` from `plain`'s.
fn drift(losses: impl Iterator<Item = f64>, plain: &[f64]) -> f64 {
    losses
        .zip(plain)
        .map(|(l, plain)| ((l - plain) / plain).abs())
        .fold(0.0, f64::max)
}

fn main() -> R<()> {
    let dir = std::env::temp_dir().join(format!("megatron-ddp-overlap-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let both = DdpConfig {
        overlap_grad_reduce: true,
        overlap_param_gather: true,
        ..DdpConfig::default()
    };
    let mut losses = Vec::new();
    for (name, ddp) in [("plain", DdpConfig::default()), ("overlapped", both)] {
        let trace = dir.join(format!("{name}.json"));
        let run = job(ddp, trace.clone())?.run(&mut [])?;
        let (comms, inside) = collectives_in_the_walk(&trace)?;
        let steps: Vec<f64> = run.steps.iter().map(|s| s.0).collect();
        println!(
            "{name}: loss {:.4} → {:.4}; rank 0's last step: {inside} of its {comms} data-parallel \
             collectives began inside the walk",
            steps[0],
            steps[steps.len() - 1]
        );
        match (name, inside) {
            ("plain", 0) => {}
            ("plain", _) => return Err("a plain step reduced during its walk".into()),
            (_, 0) => return Err("no bucket's reduction began during the walk".into()),
            _ => {}
        }
        losses.push(steps);
    }
    let plain = &losses[0];
    let instances = DdpConfig {
        num_distributed_optimizer_instances: 2,
        ..both
    };
    let hybrid = job(instances, dir.join("instances.json"))?.run(&mut [])?;
    let far = drift(hybrid.steps.iter().map(|s| s.0), plain);
    println!("two optimizer instances: the losses within {far:.1e} of the plain run's");
    if far > 1e-5 {
        return Err(format!("two optimizer instances drift {far:.1e} from the plain run").into());
    }
    // Sharded gradients, then sharded parameters too: every micro-batch's buckets reduced
    // during the backward; with the parameters, every layer gathered around its passes and the
    // next one's gather started meanwhile.
    for (strategy, what, inside_at_least) in [
        (
            ShardingStrategy::OptimGrads,
            "each bucket once per micro-batch",
            1,
        ),
        (
            ShardingStrategy::OptimGradsParams,
            "each unit's gathers and each bucket's reductions",
            2,
        ),
    ] {
        let name = strategy.name();
        let trace = dir.join(format!("{name}.json"));
        let ddp = DdpConfig {
            sharding: strategy,
            ..both
        };
        let sharded = job(ddp, trace.clone())?.run(&mut [])?;
        let (comms, inside) = collectives_in_the_walk(&trace)?;
        let far = drift(sharded.steps.iter().map(|s| s.0), plain);
        println!(
            "{name}: the losses within {far:.1e} of the plain run's; rank 0's last step: \
             {inside} of its {comms} data-parallel collectives began inside the walk ({what})"
        );
        if far > 1e-5 {
            return Err(format!("{name} drifts {far:.1e} from the plain run").into());
        }
        // Some inside the walk; with sharded parameters, most (the gathers).
        if inside == 0 || inside * inside_at_least <= comms * (inside_at_least - 1) {
            return Err(format!("{name}: too few collectives began during the walk").into());
        }
    }
    std::fs::remove_dir_all(&dir)?;
    if losses[0] != losses[1] {
        return Err(format!(
            "the overlapped run differs: {:?} vs {:?}",
            losses[1], losses[0]
        )
        .into());
    }
    println!("the same {STEPS} losses bit for bit");
    Ok(())
}
