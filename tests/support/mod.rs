//! Helpers shared by the integration tests: running the `megatron` binary, and deterministic
//! values and close comparisons for the numeric ones.

#![allow(dead_code)]

pub mod hf;
pub mod moe_runs;

use std::path::{Path, PathBuf};
use std::process::Command;

/// Runs `megatron` with `args`: (success, stdout, stderr).
pub fn megatron(args: &[&str]) -> (bool, String, String) {
    run(Command::new(env!("CARGO_BIN_EXE_megatron")).args(args))
}

/// Runs `megatron` with `args` in the working directory `dir`: (success, stdout, stderr).
pub fn megatron_in(dir: &Path, args: &[&str]) -> (bool, String, String) {
    run(Command::new(env!("CARGO_BIN_EXE_megatron"))
        .args(args)
        .current_dir(dir))
}

fn run(command: &mut Command) -> (bool, String, String) {
    let out = command.output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A fresh directory under the system's temporary directory, removed when dropped.
pub struct TempDir(PathBuf);

impl TempDir {
    /// `megatron-NAME-PID`, empty.
    pub fn new(name: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!("megatron-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.0
    }

    /// `name` inside the directory, as a string for command lines.
    pub fn join(&self, name: &str) -> String {
        self.0.join(name).to_string_lossy().into_owned()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The JSON objects of a `--log-json` file, one per line.
pub fn log_lines(path: &str) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// A small, fast training run's flags: gpt-tiny cut to one layer and 16-token samples.
pub const SMALL: [&str; 6] = [
    "--num-layers",
    "1",
    "--seq-length",
    "16",
    "--quiet",
    "--micro-batch-size=2",
];

/// `megatron train` with the small run's flags ([`SMALL`]) and `extra`.
pub fn train_small(extra: &[&str]) -> (bool, String, String) {
    let mut args = vec!["train"];
    args.extend(SMALL);
    args.extend(extra);
    megatron(&args)
}

/// Saves a checkpoint of `steps` steps of the small run (with `extra` flags) into `save`.
pub fn small_checkpoint(save: &str, steps: u64, extra: &[&str]) {
    let steps = steps.to_string();
    let mut args = vec!["--train-iters", &steps, "--save", save];
    args.extend(extra);
    let (ok, _, stderr) = train_small(&args);
    assert!(ok, "{stderr}");
}

/// The (step, loss, grad_norm) of every logged step of `megatron` run with `common` then
/// `extra` flags (a `train` command), its log written into `dir` as NAME.jsonl.
pub fn curve(common: &[&str], dir: &TempDir, name: &str, extra: &[&str]) -> Vec<(u64, f64, f64)> {
    let log = dir.join(&format!("{name}.jsonl"));
    let mut args: Vec<&str> = common.to_vec();
    args.extend(extra);
    args.extend(["--log-json", &log]);
    let (ok, stdout, stderr) = megatron(&args);
    assert!(ok, "{extra:?}: {stderr}");
    assert!(stdout.contains("steps of"), "{stdout}");
    log_lines(&log)
        .iter()
        .map(|l| {
            (
                l["step"].as_u64().unwrap(),
                l["loss"].as_f64().unwrap(),
                l["grad_norm"].as_f64().unwrap(),
            )
        })
        .collect()
}

/// `n` deterministic values in [-scale/2, scale/2) (a xorshift stream from `seed`).
pub fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e3779b97f4a7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * scale
        })
        .collect()
}

/// Asserts that `got` and `want` have the same length and agree to 1e-5 (relative, plus 1e-5
/// absolute), naming `what` and the first element that does not.
pub fn assert_close_f32(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
            "{what}[{i}]: {g} vs {w}"
        );
    }
}

/// Asserts that `got` and `want` have the same length and agree to `tol` times the largest
/// magnitude in `want` (at least 1e-6), naming `what` and the first element that does not.
pub fn assert_close_to_scale(got: &[f32], want: &[f32], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let scale = want.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
    for (i, (x, y)) in got.iter().zip(want).enumerate() {
        assert!(
            (x - y).abs() <= tol * scale,
            "{what}[{i}]: {x} vs {y} (scale {scale})"
        );
    }
}

/// Asserts that two runs' (loss, gradient norm) curves agree step by step to `rel` of the
/// second's values (of at least `floor` in magnitude), naming `what`, the step and the value.
pub fn assert_curves_close(
    got: &[(f64, f64)],
    want: &[(f64, f64)],
    rel: f64,
    floor: f64,
    what: &str,
) {
    for (i, (x, y)) in got.iter().zip(want).enumerate() {
        for (u, v, name) in [(x.0, y.0, "loss"), (x.1, y.1, "grad norm")] {
            assert!(
                (u - v).abs() <= rel * v.abs().max(floor),
                "{what}: step {i} {name} {u} vs {v}"
            );
        }
    }
}

/// The training settings the tests share: AdamW's defaults, clipping at norm 1, the plain
/// optimizer, no recompute, fp32, NaN checks on; with each test's schedule, dropout seed and
/// bucket size. A test that differs says so with struct update syntax
/// (`TrainConfig { clip_grad: 0.5, ..train_config(..) }`).
pub fn train_config(
    schedule: megatron::training::LrSchedule,
    seed: u64,
    bucket_elements: usize,
) -> megatron::training::TrainConfig {
    megatron::training::TrainConfig {
        schedule,
        adam: megatron::optimizer::AdamWConfig::default(),
        clip_grad: 1.0,
        seed,
        bucket_elements,
        distributed_optimizer: false,
        recompute: megatron::module::Recompute::Off,
        precision: megatron::optimizer::Precision::FP32,
        check_for_nan: true,
    }
}

/// Losses and gradient norms of `steps` training steps of the DSL's GPT `config` on `tp × dp`
/// thread ranks, with sequence parallelism when `sequence_parallel` says: sequences of `seq`
/// tokens of a repeated sentence, micro-batches of 2, 8 sequences a step, a warmed-up cosine
/// schedule, rank 0's values.
pub fn gpt_curve(
    config: &megatron::models::GptConfig,
    (tp, dp): (usize, usize),
    sequence_parallel: bool,
    seq: usize,
    steps: u64,
) -> Vec<(f64, f64)> {
    use megatron::comm::ParallelState;
    use megatron::module::{Builder, Module};
    use megatron::parallel::{ParallelConfig, ParallelLayout};
    use megatron::training::{BatchPlan, DecayStyle, LrSchedule, Sampler, TokenStream, Trainer};
    let layout = ParallelLayout::new(&ParallelConfig::new(tp * dp).with_tp(tp)).unwrap();
    let text = "Megatron-LM splits each transformer layer over tensor-parallel ranks. ".repeat(30);
    type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;
    megatron::comm::threads::launch(tp * dp, |w| -> R<Vec<(f64, f64)>> {
        let ps = ParallelState::new(&w, &layout)?.with_sequence_parallel(sequence_parallel);
        let model = megatron::models::gpt::Gpt::build(
            &config.spec(),
            &mut Builder::for_rank(17, ps.groups()),
        )?;
        let sampler = Sampler::windows(
            TokenStream::from_bytes(text.as_bytes()),
            BatchPlan {
                seq_length: seq,
                micro_batch: 2,
                global_batch: 8,
                dp,
            },
            3,
        )?;
        let schedule = LrSchedule {
            max_lr: 2e-3,
            min_lr: 2e-4,
            warmup_steps: 3,
            decay_steps: steps,
            style: DecayStyle::Cosine,
        };
        let mut trainer = Trainer::new(model, &ps, sampler, train_config(schedule, 9, 10_000))?;
        (0..steps)
            .map(|s| {
                let m = trainer.step(&ps, s)?;
                Ok((m.loss, m.grad_norm))
            })
            .collect()
    })
    .unwrap()
    .remove(0)
}

/// A 2-layer GPT of hidden 32, 4 heads, a byte vocabulary and 32 positions, with `dropout` on
/// its hidden states and attention.
pub fn tiny_gpt(dropout: f32) -> megatron::models::GptConfig {
    let mut c = megatron::models::GptConfig::new(2, 32, 4, 256, 32);
    c.hidden_dropout = dropout;
    c.attention_dropout = dropout;
    c
}

/// Deterministic byte token ids `[seq, batch]`, varied by `salt`.
pub fn token_ids(seq: usize, batch: usize, salt: i64) -> megatron::tensor::Tensor {
    megatron::tensor::Tensor::from_vec(
        (0..(seq * batch) as i64)
            .map(|i| (i * 37 + salt * 11) % 256)
            .collect::<Vec<_>>(),
        [seq, batch],
    )
    .unwrap()
}

/// [`tiny_gpt`] as a Llama: RMSNorm, a SwiGLU MLP of 48, no biases, rotary embeddings, 2
/// key/value groups, the query and key norms, an untied output layer.
pub fn llama_like(dropout: f32) -> megatron::models::GptConfig {
    let mut c = tiny_gpt(dropout);
    c.normalization = megatron::tensor_parallel::Normalization::RmsNorm;
    c.swiglu = true;
    c.ffn_hidden_size = 48;
    c.add_bias_linear = false;
    c.position_embedding_type = megatron::models::PositionEmbeddingType::Rope;
    c.untie_embeddings_and_output_weights = true;
    c.num_query_groups = Some(2);
    c.qk_layernorm = true;
    c
}

/// One step of plain gradient descent, `w -= lr · g`, on every parameter of `model`, its
/// gradients zeroed after (the tests that train a module by hand).
pub fn descend<M: megatron::module::Module>(model: &M, lr: f32) {
    use megatron::tensor::Tensor;
    model.visit_params(&mut |p| {
        let (v, g) = (
            p.value().to_vec::<f32>().unwrap(),
            p.grad().to_vec::<f32>().unwrap(),
        );
        let next: Vec<f32> = v.iter().zip(&g).map(|(v, g)| v - lr * g).collect();
        p.value()
            .copy_from(&Tensor::from_vec(next, p.value().shape().clone()).unwrap())
            .unwrap();
        p.grad().fill(0.0).unwrap();
    });
}

/// The largest absolute difference between `got` and `want`, which must be as long.
pub fn max_abs_diff(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len(), "lengths differ");
    got.iter()
        .zip(want)
        .map(|(g, w)| (g - w).abs())
        .fold(0f32, f32::max)
}

/// Megatron-LM's indexed dataset `tokens` in `dir` of `docs` documents of `len` tokens below 64
/// (the golden Hugging Face models' vocabulary): a few repeated phrases, so that a loss has
/// something to learn. Returns its prefix.
pub fn token_dataset(dir: &TempDir, docs: u32, len: u32) -> String {
    use megatron::data::{DType, IndexedDatasetBuilder};
    let prefix = dir.join("tokens");
    let mut b = IndexedDatasetBuilder::create(&prefix, DType::U16).unwrap();
    for d in 0..docs {
        let tokens: Vec<u32> = (0..len).map(|j| (d * 7 + (j % 12) * 5) % 64).collect();
        b.add_document(&tokens, &[tokens.len()]).unwrap();
    }
    b.finish().unwrap();
    prefix
}

/// Imports golden model `name` (`tests/data/hf/NAME`) into `dir`'s `to` with `megatron
/// convert`; returns the checkpoint's path.
pub fn import_golden(dir: &TempDir, name: &str, to: &str) -> String {
    let hf = format!("{}/tests/data/hf/{name}", env!("CARGO_MANIFEST_DIR"));
    let ckpt = dir.join(to);
    let (ok, _, stderr) = megatron(&["convert", "--from", "hf", &hf, "--to", &ckpt]);
    assert!(ok, "{name}: {stderr}");
    ckpt
}

/// The (step, loss, grad norm) of `got` against `want`, step by step, within relative
/// `loss_tol` and `norm_tol`.
pub fn assert_follows(
    got: &[(u64, f64, f64)],
    want: &[(u64, f64, f64)],
    (loss_tol, norm_tol): (f64, f64),
    what: &str,
) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (g, w) in got.iter().zip(want) {
        assert!(
            (g.1 - w.1).abs() <= loss_tol * w.1,
            "{what}: loss {g:?} vs {w:?}"
        );
        assert!(
            (g.2 - w.2).abs() <= norm_tol * w.2,
            "{what}: grad norm {g:?} vs {w:?}"
        );
    }
}

/// Rewrites the safetensors file `path` with tensor `name` replaced, in its shape, by what
/// `edit` makes of its bytes: a dtype and bytes.
pub fn edit_tensor(
    path: &Path,
    name: &str,
    edit: impl Fn(Vec<u8>) -> (safetensors::Dtype, Vec<u8>),
) {
    use safetensors::tensor::TensorView;
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let old = st.tensor(name).unwrap();
    let (dtype, new) = edit(old.data().to_vec());
    let mut views: Vec<(String, TensorView)> = st
        .tensors()
        .into_iter()
        .filter(|(n, _)| n != name)
        .collect();
    views.push((
        name.to_string(),
        TensorView::new(dtype, old.shape().to_vec(), &new).unwrap(),
    ));
    std::fs::write(path, safetensors::serialize(views, None).unwrap()).unwrap();
}
