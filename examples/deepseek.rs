//! DeepSeek-V3's architecture, as megatron-models writes it with the DSL: multi-latent attention
//! (queries and keys/values through their latents, a rotary key shared by every head, YaRN),
//! a dense first layer, then routed experts chosen by sigmoid scores within each token's best
//! groups, scaled, beside a shared expert; and a depth of multi-token prediction after the
//! layers, predicting the token after next. deepseek-v3-tiny trains on one rank and at tensor
//! parallelism 2 with sequence parallelism × expert parallelism 2 (thread ranks); the two must
//! route alike and give the same losses (the depth's too) up to the order of f32 sums.
//!
//! ```sh
//! cargo run --release --example deepseek
//! ```

use std::sync::{Arc, Mutex};

use megatron::job::{Observer, Placement, StepRecord, TrainJob};
use megatron::models::{GptConfig, MtpConfig, preset};
use megatron::optimizer::AdamWConfig;
use megatron::training::{BatchPlan, DecayStyle, LrSchedule, Sampler, TokenStream, TrainConfig};

const STEPS: u64 = 20;
const MODEL: &str = "deepseek-v3-tiny";

/// deepseek-v3-tiny at tensor parallelism `tp` (with sequence parallelism above 1) and expert
/// parallelism `ep`, on `tp` thread ranks.
fn job(tp: usize, ep: usize) -> Result<TrainJob, Box<dyn std::error::Error>> {
    let model = config()?;
    let plan = BatchPlan {
        seq_length: 64,
        micro_batch: 2,
        global_batch: 8,
        dp: 1,
    };
    let corpus = TokenStream::from_bytes(include_bytes!("data/corpus.txt"));
    Ok(TrainJob {
        model_name: MODEL.to_string(),
        model,
        tp,
        sequence_parallel: tp > 1,
        cp: 1,
        cp_comm_type: Default::default(),
        ep,
        etp: 1,
        dp: 1,
        pipeline: Default::default(),
        steps: STEPS,
        train_data: Sampler::windows(corpus, plan, 1234)?,
        eval: None,
        train: TrainConfig {
            schedule: LrSchedule {
                max_lr: 3e-3,
                min_lr: 3e-4,
                warmup_steps: 3,
                decay_steps: STEPS,
                style: DecayStyle::Cosine,
            },
            adam: AdamWConfig::default(),
            clip_grad: 1.0,
            seed: 1234,
            bucket_elements: 1 << 20,
            distributed_optimizer: false,
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
        ddp: Default::default(),
        stop: None,
        rank_steps: None,
        trace: None,
    })
}

/// deepseek-v3-tiny with one depth of multi-token prediction (`--mtp-num-layers 1`).
fn config() -> Result<GptConfig, Box<dyn std::error::Error>> {
    let mut config = (preset(MODEL)
        .ok_or("deepseek-v3-tiny is registered")?
        .config)();
    config.mtp = Some(MtpConfig::new(1));
    Ok(config)
}

/// Keeps every step's record (rank 0's view).
struct Keep(Arc<Mutex<Vec<StepRecord>>>);

impl Observer for Keep {
    fn step(&mut self, record: &StepRecord) -> anyhow::Result<()> {
        self.0
            .lock()
            .map_err(|_| anyhow::anyhow!("a poisoned log"))?
            .push(record.clone());
        Ok(())
    }
}

/// Every step's record of a run at `tp` and `ep`.
fn train(tp: usize, ep: usize) -> Result<Vec<StepRecord>, Box<dyn std::error::Error>> {
    let steps = Arc::new(Mutex::new(Vec::new()));
    let mut observers: Vec<Box<dyn Observer>> = vec![Box::new(Keep(steps.clone()))];
    job(tp, ep)?.run(&mut observers)?;
    let steps = steps.lock().map_err(|_| "a poisoned log")?.clone();
    Ok(steps)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let config = config()?;
    let mla = config
        .mla
        .ok_or("deepseek-v3-tiny has multi-latent attention")?;
    println!(
        "{MODEL}: {} layers of hidden {}, {} heads of multi-latent attention (query latent {:?}, \
         key/value latent {}, heads of {} + {} rotary features, values of {}); a depth of \
         multi-token prediction; {} parameters, {} active per token\n",
        config.num_layers,
        config.hidden_size,
        config.num_attention_heads,
        mla.q_lora_rank,
        mla.kv_lora_rank,
        mla.qk_head_dim,
        mla.qk_pos_emb_head_dim,
        mla.v_head_dim,
        config.num_params(1),
        config.active_params(1),
    );
    let one = train(1, 1)?;
    let split = train(2, 2)?;
    println!(
        " step   loss (one rank)   loss (TP=2 + SP × EP=2)   mtp_1 (one)   mtp_1 (TP × EP)   \
         tokens per expert (TP=2 × EP=2)"
    );
    let mtp = |r: &StepRecord| r.metrics.aux_losses.first().map_or(f64::NAN, |(_, l)| *l);
    let tokens = |r: &StepRecord| {
        r.metrics
            .routing
            .as_ref()
            .map(|r| r.tokens_per_expert.clone())
    };
    for step in (0..STEPS as usize).step_by(4).chain([STEPS as usize - 1]) {
        println!(
            "{step:>5}   {:>15.5}   {:>23.5}   {:>11.5}   {:>15.5}   {:?}",
            one[step].metrics.loss,
            split[step].metrics.loss,
            mtp(&one[step]),
            mtp(&split[step]),
            tokens(&split[step]).unwrap_or_default()
        );
    }
    // Until a routing decision differs the two are one computation in another order of sums; a
    // near tie may flip a decision later, after which both must still learn.
    let flip = one
        .iter()
        .zip(&split)
        .position(|(a, b)| tokens(a) != tokens(b));
    let same = flip.unwrap_or(one.len());
    let worst = one[..same]
        .iter()
        .zip(&split)
        .flat_map(|(a, b)| {
            [
                (a.metrics.loss - b.metrics.loss).abs() / a.metrics.loss,
                (mtp(a) - mtp(b)).abs() / mtp(a),
            ]
        })
        .fold(0.0f64, f64::max);
    println!(
        "\nthe same routing for {same} of {STEPS} steps; the losses (and the depth's) differ by \
         {worst:.1e} at most there"
    );
    if one.iter().chain(&split).any(|r| !mtp(r).is_finite()) {
        return Err("a step did not report the depth's loss mtp_1".into());
    }
    if same < 2 || worst > 1e-4 {
        return Err(format!(
            "TP=2 × EP=2 does not train as one rank: the routing differs from step {same}, the \
             losses by {worst:e}"
        )
        .into());
    }
    for (name, run) in [("one rank", &one), ("TP=2 × EP=2", &split)] {
        let (first, last) = (run[0].metrics.loss, run[run.len() - 1].metrics.loss);
        println!("{name}: the loss falls {first:.3} → {last:.3}");
        if last >= first {
            return Err(format!("{name} does not learn").into());
        }
    }
    Ok(())
}
