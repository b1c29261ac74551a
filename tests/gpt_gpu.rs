//! The GPT written with the DSL, trained on a GPU: losses and gradient norms of every step equal
//! the CPU run's (f32 products), and tensor parallelism on one GPU (thread ranks with the
//! device-local communicator) reproduces TP = 1.
//!
//! Needs a GPU: `cargo test --features cuda --test gpt_gpu -- --ignored`, or the emulated one
//! (`MEGATRON_EMULATED_GPU=1`, see `megatron-core/tests/emulated/device.rs`).
#![cfg(feature = "cuda")]

#[path = "../megatron-core/tests/emulated/device.rs"]
mod device;

mod support;

use std::sync::{Arc, Mutex};

use megatron::job::{Observer, Placement, StepRecord, TrainJob};
use megatron::models::preset;
use megatron::training::{BatchPlan, DecayStyle, LrSchedule, Sampler, TokenStream};

/// Collects (loss, grad norm) of every step.
struct Curve(Arc<Mutex<Vec<(f64, f64)>>>);

impl Observer for Curve {
    fn step(&mut self, record: &StepRecord) -> anyhow::Result<()> {
        self.0
            .lock()
            .expect("curve")
            .push((record.metrics.loss, record.metrics.grad_norm));
        Ok(())
    }
}

/// f32 products; bf16 products; bf16 products with flash attention.
const F32: Placement = Placement::Cuda {
    bf16: false,
    flash_attention: false,
};
const BF16: Placement = Placement::Cuda {
    bf16: true,
    flash_attention: false,
};
const FLASH: Placement = Placement::Cuda {
    bf16: true,
    flash_attention: true,
};

fn job(tp: usize, dp: usize, device: Placement) -> TrainJob {
    let mut model = (preset("gpt-tiny").expect("gpt-tiny").config)();
    model.hidden_dropout = 0.1;
    model.attention_dropout = 0.1;
    TrainJob {
        model_name: "gpt-tiny".to_string(),
        model,
        tp,
        sequence_parallel: false,
        cp: 1,
        cp_comm_type: Default::default(),
        ep: 1,
        etp: 1,
        dp,
        pipeline: Default::default(),
        steps: 5,
        train_data: windows(8, dp),
        eval: None,
        train: support::train_config(
            LrSchedule {
                max_lr: 1e-3,
                min_lr: 1e-4,
                warmup_steps: 1,
                decay_steps: 5,
                style: DecayStyle::Cosine,
            },
            3,
            1 << 20,
        ),
        save: None,
        load: None,
        run_info: serde_json::json!({}),
        files: Vec::new(),
        device,
        cuda_graph_scope: megatron::cuda_graphs::ScopeSet::NONE,
        ddp: Default::default(),
        stop: None,
        rank_steps: None,
        trace: None,
    }
}

/// Sequences of 64 tokens of a repeated sentence in micro-batches of 2, `global_batch` a step
/// over `dp` ranks.
fn windows(global_batch: usize, dp: usize) -> Sampler {
    let plan = BatchPlan {
        seq_length: 64,
        micro_batch: 2,
        global_batch,
        dp,
    };
    let text = "the quick brown fox jumps over the lazy dog; ".repeat(200);
    Sampler::windows(TokenStream::from_bytes(text.as_bytes()), plan, 7).expect("data")
}

/// (loss, grad norm) of every step `job` runs.
fn run(job: &TrainJob) -> Vec<(f64, f64)> {
    counted(job).0
}

/// Notes the emulated GPU's counters of global rank 0's thread (where observers run) after
/// every step.
struct Launched(Arc<Mutex<Vec<device::Launches>>>);

impl Observer for Launched {
    fn step(&mut self, _: &StepRecord) -> anyhow::Result<()> {
        // A real GPU counts nothing: no entries, and `counted` says so.
        if let Some(now) = device::launches() {
            self.0.lock().expect("launches").push(now);
        }
        Ok(())
    }
}

/// (loss, grad norm) of every step, and the emulated GPU's counters after each (`None` on a
/// real GPU, whose driver does not count: the tests check the counts on the emulated one).
fn counted(job: &TrainJob) -> (Vec<(f64, f64)>, Option<Vec<device::Launches>>) {
    device::install_if_requested(std::path::Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/megatron-core"
    )));
    let points = Arc::new(Mutex::new(Vec::new()));
    let launched = Arc::new(Mutex::new(Vec::new()));
    let mut observers: Vec<Box<dyn Observer>> = vec![
        Box::new(Curve(points.clone())),
        Box::new(Launched(launched.clone())),
    ];
    job.run(&mut observers).expect("the run");
    let points = points.lock().expect("curve").clone();
    let launched = launched.lock().expect("launches").clone();
    let counts = (!launched.is_empty()).then_some(launched);
    (points, counts)
}

/// The last step's counters, from `counted`'s (`None` on a real GPU).
fn last_step(launched: &Option<Vec<device::Launches>>) -> Option<device::Launches> {
    launched.as_ref().map(|l| l[l.len() - 1] - l[l.len() - 2])
}

/// Said once per check skipped on a real GPU.
fn not_counted(what: &str) {
    eprintln!("{what}: a real GPU does not count launches or copies (the emulated GPU does)");
}

/// [`run`] of a job of all its 5 steps.
fn curve(job: &TrainJob) -> Vec<(f64, f64)> {
    let out = run(job);
    assert_eq!(out.len(), 5);
    out
}

/// [`support::assert_curves_close`] with losses and norms below 1e-3 compared as 1e-3.
fn assert_close(a: &[(f64, f64)], b: &[(f64, f64)], rel: f64, what: &str) {
    support::assert_curves_close(a, b, rel, 1e-3, what);
}

#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn gpt_training_on_the_gpu_follows_the_cpu_run() {
    let cpu = curve(&job(1, 1, Placement::Cpu));
    let gpu = curve(&job(1, 1, F32));
    assert_close(&gpu, &cpu, 2e-4, "GPU vs CPU");
    // Mixed precision follows too, more loosely.
    let bf16 = curve(&job(1, 1, BF16));
    assert_close(&bf16, &cpu, 3e-2, "bf16 products vs CPU");
    // So does attention in flash kernels (gpt-tiny's heads are 32 wide), at tp 1 and 2.
    let flash = curve(&job(1, 1, FLASH));
    assert_close(&flash, &cpu, 3e-2, "flash attention vs CPU");
    let flash_tp2 = curve(&job(2, 1, FLASH));
    assert_close(&flash_tp2, &cpu, 3e-2, "flash attention at TP=2 vs CPU");
}

/// The Llama-family blocks on the GPU (RMSNorm, SwiGLU's gated MLP, no linear biases, rotary
/// embeddings, grouped-query attention, qk-layernorm, an untied output layer, a sliding
/// window: their CUDA kernels) follow the CPU run, in f32 and bf16 products, at tp 1 and with
/// the gated fc1 split over tp 2 (flash attention on turned queries and keys).
#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn llama_blocks_on_the_gpu_follow_the_cpu_run() {
    let llama = |tp, device| {
        let mut job = job(tp, 1, device);
        job.model.normalization = megatron::tensor_parallel::Normalization::RmsNorm;
        job.model.swiglu = true;
        job.model.ffn_hidden_size = 320;
        job.model.add_bias_linear = false;
        job.model.position_embedding_type = megatron::models::PositionEmbeddingType::Rope;
        job.model.untie_embeddings_and_output_weights = true;
        job.model.num_query_groups = Some(2);
        job.model.qk_layernorm = true;
        // A sliding window of 9 keys before each query (the unfused softmax's and the flash
        // kernels' masks).
        job.model.window_size = Some(9);
        job
    };
    let cpu = curve(&llama(1, Placement::Cpu));
    assert_close(
        &curve(&llama(1, F32)),
        &cpu,
        2e-4,
        "RMSNorm + SwiGLU: GPU vs CPU",
    );
    assert_close(&curve(&llama(1, BF16)), &cpu, 3e-2, "bf16 products vs CPU");
    assert_close(&curve(&llama(2, FLASH)), &cpu, 3e-2, "flash at TP=2 vs CPU");
}

/// LoRA on the GPU (rank-8 adapters beside every column- and row-parallel layer of a Llama,
/// the base frozen) follows the CPU run, in f32 and with bf16 products, and at TP 2; with
/// LoRA's dropout too.
#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn lora_on_the_gpu_follows_the_cpu_run() {
    let lora = |tp, device| {
        let mut job = job(tp, 1, device);
        job.model.normalization = megatron::tensor_parallel::Normalization::RmsNorm;
        job.model.swiglu = true;
        job.model.ffn_hidden_size = 320;
        job.model.add_bias_linear = false;
        job.model.position_embedding_type = megatron::models::PositionEmbeddingType::Rope;
        job.model.num_query_groups = Some(2);
        job.model.lora = Some(megatron::tensor_parallel::lora::LoraConfig {
            rank: 8,
            alpha: 16.0,
            dropout: 0.0,
            targets: ["attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2"]
                .map(String::from)
                .to_vec(),
        });
        job
    };
    let cpu = curve(&lora(1, Placement::Cpu));
    assert!(cpu[4].0 < cpu[0].0, "the adapters train: {cpu:?}");
    assert_close(&curve(&lora(1, F32)), &cpu, 2e-4, "LoRA: GPU vs CPU");
    assert_close(
        &curve(&lora(1, BF16)),
        &cpu,
        3e-2,
        "LoRA, bf16 products vs CPU",
    );
    assert_close(&curve(&lora(2, F32)), &cpu, 2e-4, "LoRA at TP=2 vs CPU");
    // LoRA's dropout: the device draws the host's masks, at tp 2 with sequence parallelism too.
    let dropped = |tp, device| {
        let mut job = lora(tp, device);
        if let Some(l) = &mut job.model.lora {
            l.dropout = 0.2;
        }
        job.sequence_parallel = tp > 1;
        job
    };
    let cpu_dropped = curve(&dropped(1, Placement::Cpu));
    assert_close(
        &curve(&dropped(2, F32)),
        &cpu_dropped,
        2e-4,
        "LoRA dropout at TP=2 with SP vs CPU",
    );
}

/// Tensor and data parallelism on thread ranks sharing the GPU follow one rank, with and
/// without sequence parallelism.
#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn tensor_and_data_parallel_ranks_on_one_gpu_reproduce_tp1() {
    let one = curve(&job(1, 1, F32));
    let tp2 = curve(&job(2, 1, F32));
    assert_close(&tp2, &one, 2e-4, "TP=2 vs TP=1 on the GPU");
    let tp2dp2 = curve(&job(2, 2, F32));
    assert_close(&tp2dp2, &one, 2e-4, "TP=2 × DP=2 vs TP=1 on the GPU");
    // Traced (`--trace`): the same run bit for bit, and every rank's last step in the file, its
    // collectives over the device-local communicators included.
    let path = std::env::temp_dir().join(format!("megatron-gpu-trace-{}.json", std::process::id()));
    let mut traced = job(2, 2, F32);
    traced.trace = Some(path.clone());
    assert_eq!(bits(curve(&traced)), bits(tp2dp2.clone()), "traced vs not");
    let trace: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("the trace")).expect("JSON");
    let events = trace["traceEvents"].as_array().expect("events");
    for rank in 0..4u64 {
        let comm = events
            .iter()
            .filter(|e| e["ph"] == "X" && e["pid"] == rank && e["cat"] == "comm")
            .count();
        assert!(comm > 0, "rank {rank}'s collectives");
    }
    let _ = std::fs::remove_file(&path);
    // `--overlap-grad-reduce`: buckets of 20,000 elements reduced as their gradients become
    // final, during the backward; with `--overlap-param-gather` (the distributed optimizer, bf16
    // products: each bucket's bf16 copies converted once its gather arrived) gathered while the
    // next step begins. The same runs bit for bit.
    let buckets = |placement, distributed, overlap| {
        let mut job = job(2, 2, placement);
        job.train.bucket_elements = 20_000;
        job.train.distributed_optimizer = distributed;
        job.ddp.overlap_grad_reduce = overlap;
        job.ddp.overlap_param_gather = overlap && distributed;
        bits(curve(&job))
    };
    assert_eq!(
        buckets(F32, false, true),
        buckets(F32, false, false),
        "overlapped vs not"
    );
    assert_eq!(
        buckets(BF16, true, true),
        buckets(BF16, true, false),
        "bf16 products, distributed optimizer: overlapped vs not"
    );
    // Sharded gradients (optim_grads): each bucket's device storage freed after its
    // reduce-scatter and allocated again by the next micro-batch's first write; at one
    // micro-batch per step the distributed optimizer's run bit for bit, overlapped or not.
    let sharded_on = |placement, strategy, overlap, global_batch| {
        let mut job = job(2, 2, placement);
        job.train_data = windows(global_batch, 2);
        job.train.bucket_elements = 20_000;
        job.train.distributed_optimizer = true;
        job.ddp.sharding = strategy;
        job.ddp.overlap_grad_reduce = overlap;
        job.ddp.overlap_param_gather = overlap && strategy == OptimGradsParams;
        curve(&job)
    };
    let sharded =
        |strategy, overlap, global_batch| bits(sharded_on(F32, strategy, overlap, global_batch));
    use megatron::distributed::ShardingStrategy::{Optim, OptimGrads, OptimGradsParams};
    assert_eq!(
        sharded(OptimGrads, false, 4),
        sharded(Optim, false, 4),
        "sharded gradients vs the distributed optimizer at one micro-batch"
    );
    assert_eq!(
        sharded(OptimGrads, true, 8),
        sharded(OptimGrads, false, 8),
        "sharded gradients: overlapped vs not"
    );
    // Sharded parameters (optim_grads_params): each unit's device storages allocated for its
    // gather and freed after its pass (bf16 products: its bf16 copies converted at each
    // gather); the next unit prefetched on the communication stream or not, the same run bit
    // for bit; sharded gradients' to the norm's rounding (the buckets cut at units).
    for placement in [F32, BF16] {
        let params = sharded_on(placement, OptimGradsParams, false, 8);
        assert_eq!(
            bits(sharded_on(placement, OptimGradsParams, true, 8)),
            bits(params.clone()),
            "sharded parameters: prefetched vs not"
        );
        assert_close(
            &params,
            &sharded_on(placement, OptimGrads, false, 8),
            1e-5,
            "sharded parameters vs sharded gradients",
        );
    }
    // Sequence parallelism: the all-gathers and reduce-scatters of the shards between the
    // ranks' device tensors, dropout per global position, the norms' gradients summed over tp.
    let mut sp = job(2, 1, F32);
    sp.sequence_parallel = true;
    assert_close(
        &curve(&sp),
        &tp2,
        2e-4,
        "TP=2 with sequence parallelism vs without",
    );
    let mut sp_bf16 = job(2, 2, BF16);
    sp_bf16.sequence_parallel = true;
    assert_close(
        &curve(&sp_bf16),
        &curve(&job(2, 2, BF16)),
        1e-3,
        "bf16 products, TP=2 × DP=2 with sequence parallelism vs without",
    );
}

/// A checkpoint saved by ranks on the GPU (parameters and Adam moments gathered from the device
/// over the device-local communicator) resumes there bit for bit: 5 steps straight equal 3
/// steps, a save, and the last 2 steps from it.
#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn a_checkpoint_saved_on_the_gpu_resumes_bit_for_bit() {
    let dir = std::env::temp_dir().join(format!("megatron-gpu-checkpoint-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let straight = curve(&job(2, 1, FLASH));
    let mut saving = job(2, 1, FLASH);
    saving.save = Some((dir.clone(), 3));
    assert_eq!(curve(&saving), straight);
    let mut resumed = job(2, 1, FLASH);
    resumed.load = Some(dir.join("iter_0000003"));
    assert_eq!(run(&resumed), straight[3..]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `job` with Megatron-LM's `--bf16` (bf16 gradients too with `bf16_grads`) and, with
/// `distributed`, the distributed optimizer.
fn bf16_job(dp: usize, bf16_grads: bool, distributed: bool) -> TrainJob {
    let mut job = job(1, dp, BF16);
    job.train.precision =
        megatron::optimizer::Precision::from_flags(&megatron::optimizer::PrecisionFlags {
            bf16: true,
            grad_reduce_in_bf16: bf16_grads,
            ..Default::default()
        })
        .expect("bf16");
    job.train.distributed_optimizer = distributed;
    job
}

/// bf16 parameters on the GPU: bf16 values in the buffers (what the products read) and f32 main
/// parameters in the optimizer, whose update writes the values. The products are the default's
/// (f32 values with bf16 copies), only the initial values are rounded: the run follows it. The
/// distributed optimizer gives the same run; bf16 gradients follow more loosely; a checkpoint
/// (f32 main parameters, every rank's shard of the moments) resumes bit for bit.
#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn bf16_parameters_on_the_gpu_follow_the_bf16_copies_run() {
    let copies = curve(&job(1, 2, BF16));
    let mixed = curve(&bf16_job(2, false, false));
    assert_close(&mixed, &copies, 3e-2, "--bf16 vs bf16 copies");
    // The rounded initial values make it another run.
    assert_ne!(mixed, copies);
    let sharded = curve(&bf16_job(2, false, true));
    assert_close(&sharded, &mixed, 1e-5, "--bf16 distributed vs plain");
    let bf16_grads = curve(&bf16_job(2, true, true));
    assert_close(&bf16_grads, &mixed, 3e-2, "bf16 gradients vs f32");
    let dir = std::env::temp_dir().join(format!("megatron-gpu-bf16-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut saving = bf16_job(2, false, true);
    saving.save = Some((dir.clone(), 3));
    assert_eq!(curve(&saving), sharded);
    let mut resumed = bf16_job(2, false, true);
    resumed.load = Some(dir.join("iter_0000003"));
    assert_eq!(run(&resumed), sharded[3..]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `job` with Megatron-LM's `--fp16` from the loss scale `initial` (fp16 gradients too unless
/// `fp32_grads`), with the distributed optimizer when `distributed`.
fn fp16_job(initial: f64, fp32_grads: bool, distributed: bool) -> TrainJob {
    let mut job = job(1, 2, BF16);
    job.train.precision =
        megatron::optimizer::Precision::from_flags(&megatron::optimizer::PrecisionFlags {
            fp16: true,
            initial_loss_scale: Some(initial),
            grads_in_fp32: fp32_grads,
            ..Default::default()
        })
        .expect("fp16");
    job.train.distributed_optimizer = distributed;
    job.train.check_for_nan = false;
    job
}

/// fp16 parameters and gradients on the GPU with dynamic loss scaling: the scale's start 2^32
/// overflows the fp16 gradients, so the first steps are skipped (no gradient norm) as on the
/// CPU; from a scale that fits, the run follows the bf16-copies run; the distributed
/// optimizer gives the same run; f32 gradients follow.
#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn fp16_parameters_with_loss_scaling_on_the_gpu() {
    let overflowing = curve(&fp16_job(2f64.powi(32), false, false));
    assert!(
        overflowing[0].1.is_nan() && overflowing[1].1.is_nan(),
        "{overflowing:?}"
    );
    assert!(
        overflowing.iter().all(|s| s.0.is_finite()),
        "{overflowing:?}"
    );
    let copies = curve(&job(1, 2, BF16));
    let fitting = curve(&fp16_job(1024.0, false, false));
    assert_close(&fitting, &copies, 3e-2, "--fp16 vs bf16 copies");
    // The distributed optimizer sums the gradient norm's squares by shards, in another order:
    // clipping carries that last bit into the updates, and an fp16 weight (10 bits) then rounds
    // the other way now and then: 2.7e-5 by step 3 on an H100 (within 1e-5 on the emulated
    // GPU, whose reductions run in another order).
    let sharded = curve(&fp16_job(1024.0, false, true));
    assert_close(&sharded, &fitting, 1e-4, "--fp16 distributed vs plain");
    let fp32_grads = curve(&fp16_job(1024.0, true, true));
    assert_close(&fp32_grads, &fitting, 3e-2, "f32 gradients vs fp16");
}

/// Activation recompute on the GPU: full recompute (uniform and block) reruns the layers'
/// forwards (the same dropout masks) and gives the very same run; selective recompute with the
/// flash kernels (which keep no attention weights) too; the unfused kernels refuse it.
#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn activation_recompute_on_the_gpu_gives_the_same_run() {
    use megatron::module::Recompute;
    let with = |device, recompute| {
        let mut job = job(2, 1, device);
        job.train.recompute = recompute;
        job
    };
    let plain = curve(&with(BF16, Recompute::Off));
    for recompute in [Recompute::Uniform(1), Recompute::Block(1)] {
        assert_eq!(curve(&with(BF16, recompute)), plain, "{recompute:?}");
    }
    let flash = curve(&with(FLASH, Recompute::Off));
    assert_eq!(
        curve(&with(FLASH, Recompute::Selective)),
        flash,
        "selective"
    );
    device::install_if_requested(std::path::Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/megatron-core"
    )));
    let err = with(BF16, Recompute::Selective)
        .run(&mut Vec::new())
        .expect_err("the unfused kernels keep the weights");
    assert!(
        format!("{err:#}").contains("selective activation recompute on the GPU"),
        "{err:#}"
    );
}

/// `job` with 4 layers cut into `pp` stages of `vpp` chunks.
fn pipelined(tp: usize, pp: usize, vpp: usize, device: Placement) -> TrainJob {
    let mut job = job(tp, 1, device);
    job.model.num_layers = 4;
    job.pipeline = megatron::job::PipelineSettings {
        pp,
        vpp,
        ..Default::default()
    };
    job
}

/// Pipeline stages as thread ranks sharing the GPU: activations and gradients go between
/// stages over the device-local communicator, and the run follows one stage's; a checkpoint
/// saved by the stages (each stage's tensors gathered from the GPU to rank 0) resumes.
#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn pipeline_stages_on_one_gpu_reproduce_one_stage() {
    let one = curve(&pipelined(1, 1, 1, F32));
    let pp2 = curve(&pipelined(1, 2, 2, F32));
    assert_close(&pp2, &one, 2e-4, "PP=2 (V=2) vs PP=1 on the GPU");
    let dir = std::env::temp_dir().join(format!("megatron-gpu-pp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut saving = pipelined(2, 2, 1, F32);
    saving.save = Some((dir.clone(), 3));
    let straight = curve(&saving);
    assert_close(&straight, &one, 2e-4, "TP=2 × PP=2 vs PP=1 on the GPU");
    let mut resumed = pipelined(1, 2, 1, F32);
    resumed.load = Some(dir.join("iter_0000003"));
    assert_close(
        &run(&resumed),
        &straight[3..],
        2e-4,
        "resumed at TP=1 × PP=2",
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// gpt-moe-tiny cut to 2 layers on `dp` data-parallel ranks, its experts over `ep` of them.
fn moe_job(dp: usize, ep: usize, device: Placement) -> TrainJob {
    let mut job = job(1, dp, device);
    job.model_name = "gpt-moe-tiny".to_string();
    job.model = (preset("gpt-moe-tiny").expect("gpt-moe-tiny").config)();
    job.model.num_layers = 2;
    if let Some(moe) = &mut job.model.moe {
        moe.router.z_loss_coeff = Some(1e-3);
    }
    job.ep = ep;
    job
}

/// A MoE GPT on the GPU (its router, dispatcher, experts and combine on the device, the
/// all-to-alls between the ranks' device tensors through the device-local communicator)
/// follows the CPU run, and expert parallelism over two thread ranks sharing the GPU follows
/// one rank of every expert, with either dispatcher.
#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn moe_training_on_the_gpu_follows_the_cpu_run() {
    let cpu = curve(&moe_job(2, 2, Placement::Cpu));
    let gpu = curve(&moe_job(2, 2, F32));
    assert_close(&gpu, &cpu, 2e-4, "MoE GPU vs CPU at ep 2");
    let gpu_ep1 = curve(&moe_job(2, 1, F32));
    assert_close(&gpu_ep1, &gpu, 2e-4, "MoE GPU ep 1 vs ep 2");
    let bf16 = curve(&moe_job(2, 2, BF16));
    assert_close(&bf16, &cpu, 3e-2, "MoE bf16 products vs CPU");
    // Each expert's slices over two expert-tensor-parallel ranks (their rows gathered and
    // partial outputs reduce-scattered between device tensors).
    let mut etp = moe_job(2, 1, F32);
    etp.etp = 2;
    assert_close(&curve(&etp), &gpu_ep1, 2e-4, "MoE GPU etp 2 vs etp 1");
    // The all-gather dispatcher: every rank's tokens, weights and map gathered on the device,
    // each rank's experts' rows and slots taken there.
    let mut all_gather = moe_job(2, 2, F32);
    if let Some(moe) = &mut all_gather.model.moe {
        moe.dispatcher = megatron::moe::DispatcherKind::AllGather;
    }
    assert_close(
        &curve(&all_gather),
        &gpu,
        2e-4,
        "MoE GPU all-gather vs all-to-all",
    );
    // With tensor and sequence parallelism: each tensor-parallel rank routes its shard, the
    // device router's load-balancing counts all-reduced over tp.
    let mut sp = moe_job(2, 2, F32);
    sp.tp = 2;
    sp.sequence_parallel = true;
    assert_close(
        &curve(&sp),
        &gpu,
        2e-4,
        "MoE GPU tp 2 with sequence parallelism vs tp 1",
    );
}

/// Mixtral's SwiGLU experts on the GPU (their fc1 of gate and up rows, the SwiGLU kernel and
/// its backward over the experts' rows) follow the CPU run at ep 2, and with each expert's gate
/// and up projection split over two expert-tensor-parallel ranks.
#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn swiglu_experts_on_the_gpu_follow_the_cpu_run() {
    let mixtral = |ep, device| {
        let mut job = moe_job(2, ep, device);
        job.model_name = "mixtral-tiny".to_string();
        job.model = (preset("mixtral-tiny").expect("mixtral-tiny").config)();
        job.model.num_layers = 2;
        job
    };
    let cpu = curve(&mixtral(2, Placement::Cpu));
    assert_close(
        &curve(&mixtral(2, F32)),
        &cpu,
        2e-4,
        "SwiGLU experts: GPU vs CPU at ep 2",
    );
    let mut etp = mixtral(1, F32);
    etp.etp = 2;
    assert_close(&curve(&etp), &cpu, 2e-4, "SwiGLU experts: GPU etp 2 vs CPU");
}

/// DeepSeek-V3's architecture on the GPU (deepseek-v3-tiny cut to 2 layers: multi-latent
/// attention's latents, norms and shared rotary key, YaRN's amplitude in the rope kernel, the
/// general attention, a dense first layer, group-limited sigmoid routing with the expert bias
/// beside a shared expert, a depth of multi-token prediction: its shifted ids and mask, its
/// loss's gradient seeded on the device) follows the CPU run at ep 2, with bf16 products, and at
/// tp 2 with sequence parallelism (the rotary key and the depth's projection gathered between
/// device tensors), and at cp 2.
#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn deepseek_v3_blocks_on_the_gpu_follow_the_cpu_run() {
    let deepseek = |tp, device| {
        let mut job = moe_job(2, 2, device);
        job.model_name = "deepseek-v3-tiny".to_string();
        job.model = (preset("deepseek-v3-tiny").expect("deepseek-v3-tiny").config)();
        job.model.num_layers = 2;
        if let Some(moe) = &mut job.model.moe {
            moe.layer_freq = megatron::models::MoeLayerFreq::Pattern(vec![0, 1]);
        }
        job.model.mtp = Some(megatron::models::MtpConfig::new(1));
        job.tp = tp;
        job.sequence_parallel = tp > 1;
        job
    };
    let cpu = curve(&deepseek(1, Placement::Cpu));
    assert_close(
        &curve(&deepseek(1, F32)),
        &cpu,
        2e-4,
        "DeepSeek-V3 blocks: GPU vs CPU at ep 2",
    );
    assert_close(
        &curve(&deepseek(1, BF16)),
        &cpu,
        3e-2,
        "bf16 products vs CPU",
    );
    assert_close(
        &curve(&deepseek(2, F32)),
        &cpu,
        2e-4,
        "DeepSeek-V3 blocks: GPU at tp 2 with sp vs CPU",
    );
    // Context parallelism 2: the depth's shifted ids and mask take the next chunk's first
    // positions from the other rank (device tensors all-gathered), its mean over both ranks.
    let mut cp = deepseek(1, F32);
    cp.cp = 2;
    assert_close(
        &curve(&cp),
        &cpu,
        2e-4,
        "DeepSeek-V3 blocks: GPU at cp 2 vs CPU",
    );
}

/// LoRA beside Mixtral's experts on the GPU (each expert's adapters merged into its weight on
/// the device, the grouped products on the merged weights, the adapters' gradients from the
/// merged weight's) follows the CPU run at ep 2, with bf16 products, and with each expert's
/// slices over two expert-tensor-parallel ranks (A of fc1 and B of fc2 gathered between device
/// tensors, their gradients reduce-scattered).
#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn lora_beside_experts_on_the_gpu_follows_the_cpu_run() {
    let mixtral = |ep, device| {
        let mut job = moe_job(2, ep, device);
        job.model_name = "mixtral-tiny".to_string();
        job.model = (preset("mixtral-tiny").expect("mixtral-tiny").config)();
        job.model.num_layers = 2;
        job.model.lora = Some(megatron::tensor_parallel::lora::LoraConfig {
            rank: 4,
            alpha: 8.0,
            dropout: 0.0,
            targets: ["attn.qkv", "mlp.experts.fc1", "mlp.experts.fc2"]
                .map(String::from)
                .to_vec(),
        });
        job
    };
    let cpu = curve(&mixtral(2, Placement::Cpu));
    assert!(cpu[4].0 < cpu[0].0, "the adapters train: {cpu:?}");
    assert_close(
        &curve(&mixtral(2, F32)),
        &cpu,
        2e-4,
        "LoRA beside experts: GPU vs CPU at ep 2",
    );
    assert_close(
        &curve(&mixtral(2, BF16)),
        &cpu,
        3e-2,
        "LoRA beside experts: bf16 products vs CPU",
    );
    let mut etp = mixtral(1, F32);
    etp.etp = 2;
    assert_close(
        &curve(&etp),
        &cpu,
        2e-4,
        "LoRA beside experts: GPU etp 2 vs CPU",
    );
}

/// Context parallelism on the GPU (thread ranks sharing it): every comm type at cp 2 (and
/// the hierarchical one at cp 4), attention's blocks computed on the host from the device's
/// projection, the keys and values exchanged by the device communicator, follow the CPU run
/// at cp 1; bf16 products follow it too, more loosely.
#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn context_parallel_training_on_the_gpu_follows_the_cpu_run() {
    use megatron::context_parallel::CpCommType;
    let at = |cp, kind, device| {
        let mut job = job(1, 1, device);
        job.cp = cp;
        job.cp_comm_type = kind;
        job
    };
    let cpu = curve(&job(1, 1, Placement::Cpu));
    for (cp, kind) in [
        (2, CpCommType::P2p),
        (2, CpCommType::AllGather),
        (2, CpCommType::A2a),
        (4, CpCommType::A2aP2p { a2a: 2, p2p: 2 }),
    ] {
        let what = format!("GPU cp {cp} {kind:?} vs CPU cp 1");
        assert_close(&curve(&at(cp, kind, F32)), &cpu, 2e-4, &what);
    }
    let bf16 = curve(&at(2, CpCommType::P2p, BF16));
    assert_close(&bf16, &cpu, 3e-2, "bf16 GPU cp 2 p2p vs CPU");
}

/// A MoE step on the GPU keeps its activations, weights, gradients and routing on the device:
/// the experts' products run on cuBLAS over views of the stacked weights; the dispatcher's
/// permutations, the combine and their backwards on the device's row kernels, with index
/// tables the device computes from the routing's map and the exchanged counts. What crosses the
/// bus for each MoE layer and micro-batch (measured as what two more micro-batches a step add,
/// less what they add to the same model without experts: their tokens) is the routing's counts
/// and metrics read back for the all-to-all's splits and the log (each expert's tokens and
/// drops, the two losses, the counts received) and the auxiliary losses' scale sent for the
/// router's backward. Rank 0's copies on the emulated GPU, a step of 2 micro-batches: 24.6 MB
/// with host experts and dispatcher, 6.0 MB with device experts, 157 kB with host index lists,
/// 6.2 kB now (5.2 kB of it what the same model without experts moves: its tokens, scalars).
#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn moe_steps_move_only_the_routing_counts_across_the_bus() {
    if !device::requested() {
        return not_counted("MoE bytes across the bus");
    }
    let moved = |job: &TrainJob| {
        let (_, launched) = counted(job);
        let step = last_step(&launched).expect("the emulated GPU counts");
        (step.to_device_bytes, step.to_host_bytes)
    };
    let longer = |mut job: TrainJob| {
        job.train_data = windows(16, job.dp);
        job
    };
    let moe = moe_job(2, 2, F32);
    let mut dense = moe_job(2, 1, F32);
    dense.model.moe = None;
    let (moe_up, moe_down) = moved(&moe);
    let (more_up, more_down) = moved(&longer(moe.clone()));
    let (dense_up, dense_down) = moved(&dense);
    let (dense_more_up, dense_more_down) = moved(&longer(dense));
    eprintln!(
        "a MoE step of 2 micro-batches moves {moe_up} bytes to the device and {moe_down} to \
         the host, of 4 {more_up} and {more_down}; without experts {dense_up} and \
         {dense_down}, {dense_more_up} and {dense_more_down}"
    );
    let experts = moe.model.moe.as_ref().expect("experts").router.num_experts as u64;
    // i64 counts of each expert's tokens and drops, the f32 aux and z losses, the i64 counts
    // received from each rank for each local expert (ep · experts / ep); the f32 scale sent.
    let (read_back, sent) = (8 * experts + 8 * experts + 2 * 4 + 8 * experts, 4);
    let calls = 2 * moe.model.num_layers as u64;
    assert_eq!(
        (more_down - moe_down) - (dense_more_down - dense_down),
        calls * read_back,
        "bytes read back by the MoE layers of 2 micro-batches"
    );
    assert_eq!(
        (more_up - moe_up) - (dense_more_up - dense_up),
        calls * sent,
        "bytes sent to the MoE layers of 2 micro-batches"
    );
}

/// `job` without dropout (a graph would replay its capture's masks, which the runtime
/// refuses), capturing `scopes`, for 3 steps: the first use of every (layer, slot) runs
/// eagerly and the second is captured within the first step, so the last step replays only.
fn scoped(mut job: TrainJob, scopes: &[&str]) -> TrainJob {
    job.steps = 3;
    job.model.hidden_dropout = 0.0;
    job.model.attention_dropout = 0.0;
    job.cuda_graph_scope = megatron::cuda_graphs::ScopeSet::parse(scopes).expect("scopes");
    job
}

/// A curve's losses and gradient norms as bits.
fn bits(c: Vec<(f64, f64)>) -> Vec<(u64, u64)> {
    c.iter().map(|(l, n)| (l.to_bits(), n.to_bits())).collect()
}

/// `--cuda-graph-scope` on the GPU: attention and the MLP of every layer, and the MoE router
/// (gate, top-k, capacity, counts, losses, and its backward) with the dispatcher's
/// preprocessing, captured as CUDA graphs per in-flight slot and replayed from the second use
/// on give the eager run's losses and gradient norms bit for bit, without a pipeline and with
/// pp 2, with expert parallelism and with an expert capacity (dropout 0: a graph would replay
/// its capture's masks, which the runtime refuses); what the device-local communicator cannot
/// capture (a collective over more than one rank) is refused. One test: graph-capturing
/// runs in parallel in one process once crashed the emulated GPU (see issue 24's note).
#[test]
#[ignore = "needs a GPU, or the emulated one: MEGATRON_EMULATED_GPU=1"]
fn graph_scopes_on_the_gpu_replay_the_eager_run_bit_for_bit() {
    for (what, make) in [
        ("no pipeline", (|| job(1, 1, F32)) as fn() -> TrainJob),
        ("pp 2", || pipelined(1, 2, 1, F32)),
    ] {
        let (eager, eager_ops) = counted(&scoped(make(), &[]));
        let (graphed, graphed_ops) = counted(&scoped(make(), &["attn", "mlp"]));
        assert_eq!(bits(graphed), bits(eager), "{what}: graphed vs eager");
        // The last step's operations: every scope replayed, none captured.
        match (last_step(&eager_ops), last_step(&graphed_ops)) {
            (Some(e), Some(g)) => {
                eprintln!("{what}: a step queues {e:?} eager, {g:?} with graphs");
                assert!(g.graphs > 0 && e.graphs == 0, "{what}: {e:?} vs {g:?}");
                assert!(g.host_ops < e.host_ops, "{what}: {e:?} vs {g:?}");
            }
            _ => not_counted(what),
        }
    }
    // MoE GPT with its experts over 2 expert-parallel ranks: the router (gate, top-k, losses,
    // counts) and the dispatcher's preprocessing (the tokens laid out expert-major) captured
    // (moe_router, moe_preprocess), the routing read back after the graph, the all-to-alls,
    // experts and combine eager.
    let (eager, eager_ops) = counted(&scoped(moe_job(2, 2, F32), &[]));
    let (graphed, graphed_ops) = counted(&scoped(
        moe_job(2, 2, F32),
        &["attn", "moe_router", "moe_preprocess"],
    ));
    let eager = bits(eager);
    assert_eq!(bits(graphed), eager, "MoE at ep 2: graphed vs eager");
    let eager_step = last_step(&eager_ops);
    match (eager_step, last_step(&graphed_ops)) {
        (Some(e), Some(g)) => {
            eprintln!("MoE at ep 2: a step queues {e:?} eager, {g:?} with graphs");
            assert!(
                g.graphs > 0 && g.host_ops < e.host_ops,
                "MoE: {e:?} vs {g:?}"
            );
        }
        _ => not_counted("MoE at ep 2"),
    }
    // A depth of multi-token prediction after the layers: its layer's scopes are captured and
    // replayed as the stack's are (its sites under the loop's, one graph per depth).
    let mtp = || {
        let mut job = moe_job(2, 2, F32);
        job.model.position_embedding_type = megatron::models::PositionEmbeddingType::Rope;
        job.model.mtp = Some(megatron::models::MtpConfig::new(1));
        job
    };
    let (mtp_eager, mtp_eager_ops) = counted(&scoped(mtp(), &[]));
    let (mtp_graphed, mtp_graphed_ops) =
        counted(&scoped(mtp(), &["attn", "moe_router", "moe_preprocess"]));
    assert_eq!(bits(mtp_graphed), bits(mtp_eager), "MTP: graphed vs eager");
    match (last_step(&mtp_eager_ops), last_step(&mtp_graphed_ops)) {
        (Some(e), Some(g)) => assert!(
            g.graphs > 0 && g.host_ops < e.host_ops,
            "MTP: {e:?} vs {g:?}"
        ),
        _ => not_counted("MTP"),
    }
    // The router's graph alone: the tokens laid out by the dispatcher after the read-back.
    let (router_only, router_ops) = counted(&scoped(moe_job(2, 2, F32), &["moe_router"]));
    assert_eq!(
        bits(router_only),
        eager,
        "MoE, moe_router alone: graphed vs eager"
    );
    match (eager_step, last_step(&router_ops)) {
        (Some(e), Some(r)) => {
            eprintln!("MoE at ep 2, moe_router alone: a step queues {r:?}");
            assert!(
                r.graphs > 0 && r.host_ops < e.host_ops,
                "MoE router only: {r:?} vs {e:?}"
            );
        }
        _ => not_counted("MoE at ep 2, moe_router alone"),
    }
    // MoE with pipeline stages (a layer on each of 2 stages, dp 2 × ep 2 on each) and with an
    // expert capacity.
    let short = |job: TrainJob, scopes: &[&str]| {
        let out = run(&scoped(job, scopes));
        assert_eq!(out.len(), 3);
        bits(out)
    };
    let moe_pp = |scopes: &[&str]| {
        let mut job = moe_job(2, 2, F32);
        job.pipeline = megatron::job::PipelineSettings {
            pp: 2,
            ..Default::default()
        };
        short(job, scopes)
    };
    let all = ["attn", "moe_router", "moe_preprocess"];
    // An expert capacity that drops tokens: the preprocessing's rows go to a buffer of the
    // most the routing can send, the all-to-all sends the routed ones.
    let dropping = |scopes: &[&str]| {
        let mut job = moe_job(2, 2, F32);
        if let Some(moe) = &mut job.model.moe {
            moe.router.capacity_factor = Some(0.75);
        }
        short(job, scopes)
    };
    assert_eq!(
        dropping(&all),
        dropping(&[]),
        "MoE with capacity 0.75: graphed vs eager"
    );
    assert_eq!(
        moe_pp(&all),
        moe_pp(&[]),
        "MoE at pp 2 × ep 2: graphed vs eager"
    );
    // MoE at tp 2 needs sequence parallelism, and then the router's graph holds the
    // load-balancing counts' all-reduce over tp: the device-local communicator refuses to meet
    // the other ranks inside a capture, as for attention's (NCCL captures both).
    let mut moe_tp = scoped(moe_job(2, 2, F32), &all[1..]);
    moe_tp.tp = 2;
    moe_tp.sequence_parallel = true;
    let err = moe_tp
        .run(&mut Vec::new())
        .expect_err("tp 2 inside the router's graph");
    assert!(
        format!("{err:#}").contains("all_reduce inside the capture of graph scope moe_router"),
        "{err:#}"
    );
    // bf16 products with flash attention (the tiled kernels inside the attn graphs).
    let eager = bits(run(&scoped(job(1, 1, FLASH), &[])));
    let graphed = bits(run(&scoped(job(1, 1, FLASH), &["attn", "mlp"])));
    assert_eq!(graphed, eager, "flash attention: graphed vs eager");
    // bf16 parameters with the distributed optimizer over 2 data-parallel ranks: the graphs
    // read the bf16 compute copies and the all-gathered parameters the optimizer rewrote in
    // place after each step.
    let eager = bits(run(&scoped(bf16_job(2, true, true), &[])));
    let graphed = bits(run(&scoped(bf16_job(2, true, true), &["attn", "mlp"])));
    assert_eq!(
        graphed, eager,
        "bf16, distributed optimizer: graphed vs eager"
    );
    // A dropout mask drawn inside a captured scope is refused, not replayed.
    let mut dropping = scoped(job(1, 1, F32), &["attn"]);
    dropping.model.attention_dropout = 0.1;
    device::install_if_requested(std::path::Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/megatron-core"
    )));
    let err = dropping
        .run(&mut Vec::new())
        .expect_err("dropout inside a graph");
    assert!(format!("{err:#}").contains("dropout mask"), "{err:#}");
    // Packed documents are refused in the attention's graph: a replay would keep the
    // boundaries and positions of the microbatch it captured.
    let mut packed = scoped(job(1, 1, F32), &["attn"]);
    packed.train_data = windows(8, 1)
        .with_masks(megatron::training::MaskFlags {
            eod: Some(u32::from(b';')),
            reset_position_ids: true,
            reset_attention_mask: true,
            ..Default::default()
        })
        .expect("masks");
    let err = packed
        .run(&mut Vec::new())
        .expect_err("documents inside a graph");
    assert!(
        format!("{err:#}").contains("graph scope attn with packed documents"),
        "{err:#}"
    );
    // A collective of more than one rank inside a capture is refused: the device-local
    // communicator meets the other ranks on the host, which a replay would skip.
    let err = scoped(job(2, 1, F32), &["attn"])
        .run(&mut Vec::new())
        .expect_err("tp 2 inside a graph");
    assert!(
        format!("{err:#}").contains("all_reduce inside the capture of graph scope attn"),
        "{err:#}"
    );
}
