//! bf16 weight copies next to f32 values (Megatron-LM's bf16 parameters with fp32 main
//! parameters), run on the CPU where the products widen the copies back to f32: linear layers
//! multiply by the rounded weights (checked against plain loops, and shown to differ from the
//! f32 product), the weight gradient still comes from the f32 activations, the optimizer updates
//! the f32 values, and the copies follow every step and every checkpoint load.

mod support;

use half::bf16;
use megatron::checkpoint::SaveInfo;
use megatron::comm::ParallelState;
use megatron::comm::threads::launch;
use megatron::distributed::ParamBuffers;
use megatron::models::GptConfig;
use megatron::models::gpt::Gpt;
use megatron::module::{Builder, Cx, Layer, Module, Param, Site};
use megatron::parallel::{ParallelConfig, ParallelLayout};
use megatron::tensor::{DType, Tensor};
use megatron::tensor_parallel::{Linear, LinearSpec};
use megatron::training::{BatchPlan, DecayStyle, LrSchedule, Sampler, TokenStream, Trainer};

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

fn round(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| bf16::from_f32(x).to_f32()).collect()
}

/// `x[rows, k] · w[n, k]ᵀ (+ bias)` in f64, rounded to f32.
fn product(x: &[f32], w: &[f32], bias: Option<&[f32]>, rows: usize, k: usize) -> Vec<f32> {
    let n = w.len() / k;
    let mut y = vec![0.0; rows * n];
    for r in 0..rows {
        for c in 0..n {
            let dot: f64 = (0..k)
                .map(|i| f64::from(x[r * k + i]) * f64::from(w[c * k + i]))
                .sum();
            y[r * n + c] = (dot + bias.map_or(0.0, |b| f64::from(b[c]))) as f32;
        }
    }
    y
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Every compute copy of `model` is its values rounded to bf16.
fn assert_copies_follow<M: Module>(model: &M) {
    model.visit_params(&mut |p: &Param| {
        let copy = p.compute_value();
        assert_eq!(copy.dtype(), DType::BF16, "{}", p.spec().name);
        let want = round(&p.value().to_vec::<f32>().unwrap());
        let got = copy.to_vec_f32().unwrap();
        if let Some(i) = (0..want.len()).find(|&i| got[i] != want[i]) {
            panic!(
                "{}[{i}]: copy {} but the value rounds to {}",
                p.spec().name,
                got[i],
                want[i]
            );
        }
    });
}

#[test]
fn linear_layers_multiply_by_the_bf16_copies() {
    let layout = ParallelLayout::new(&ParallelConfig::new(1)).unwrap();
    launch(1, |w| -> R<()> {
        let ps = ParallelState::new(&w, &layout)?;
        let cx = Cx::new(&ps, 1);
        let (rows, k, n) = (5, 24, 7);
        let spec = LinearSpec::new(k, n).with_init_std(0.7);
        let mut linear = Linear::build(&spec, &mut Builder::new(9))?;
        let mut buffers =
            ParamBuffers::pack(&mut linear, &megatron::distributed::PackLayout::plain())?;
        let weight = linear.weight().value().to_vec::<f32>()?;
        buffers.keep_compute_copies(&mut linear, DType::BF16)?;
        assert_copies_follow(&linear);

        let x: Vec<f32> = (0..rows * k)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 13.0)
            .collect();
        let xt = Tensor::from_vec(x.clone(), [rows, k])?;
        let (y, saved) = linear.forward(&cx, Site::ROOT, &xt)?;
        let got = y.to_vec::<f32>()?;
        let bias = linear.bias().expect("a bias").value().to_vec::<f32>()?;
        let want = product(&x, &round(&weight), Some(&bias), rows, k);
        let f32_product = product(&x, &weight, Some(&bias), rows, k);
        assert!(max_diff(&got, &want) < 1e-4, "{got:?} vs {want:?}");
        assert!(
            max_diff(&got, &f32_product) > 1e-3,
            "the f32 weights were multiplied, not their bf16 copies"
        );

        // dx = dy · round(W); dW = dyᵀ · x with the f32 input.
        let dy: Vec<f32> = (0..rows * n)
            .map(|i| ((i * 11 % 17) as f32 - 8.0) / 5.0)
            .collect();
        let dx = linear.backward(
            &cx,
            Site::ROOT,
            saved,
            &Tensor::from_vec(dy.clone(), [rows, n])?,
        )?;
        let transposed = |m: &[f32], r: usize, c: usize| -> Vec<f32> {
            (0..c * r).map(|i| m[(i % r) * c + i / r]).collect()
        };
        let want_dx = product(&dy, &transposed(&round(&weight), n, k), None, rows, n);
        assert!(max_diff(&dx.to_vec::<f32>()?, &want_dx) < 1e-4);
        let want_dw = product(
            &transposed(&dy, rows, n),
            &transposed(&x, rows, k),
            None,
            n,
            rows,
        );
        assert!(max_diff(&linear.weight().grad().to_vec::<f32>()?, &want_dw) < 1e-4);

        // New values reach the products only once the copies are refreshed.
        let doubled: Vec<f32> = buffers
            .values()
            .to_vec::<f32>()?
            .iter()
            .map(|v| v * 3.1)
            .collect();
        buffers
            .values()
            .copy_from(&Tensor::from_vec(doubled, [buffers.values().numel()])?)?;
        buffers.refresh_compute_copies()?;
        assert_copies_follow(&linear);
        Ok(())
    })
    .unwrap();
}

fn corpus() -> TokenStream {
    let text = "a mixed precision run keeps master weights in f32. ".repeat(30);
    TokenStream::from_bytes(text.as_bytes())
}

/// Losses of `steps` steps of a tiny GPT, with or without bf16 copies; the copies are checked
/// after every step and after loading the last step's checkpoint.
fn train(copies: bool, steps: u64) -> Vec<f64> {
    let layout = ParallelLayout::new(&ParallelConfig::new(1)).unwrap();
    let mut config = GptConfig::new(2, 32, 4, 256, 16);
    config.hidden_dropout = 0.0;
    config.attention_dropout = 0.0;
    launch(1, |w| -> R<Vec<f64>> {
        let ps = ParallelState::new(&w, &layout)?;
        let model = Gpt::build(&config.spec(), &mut Builder::for_rank(4, ps.groups()))?;
        let plan = BatchPlan {
            seq_length: 16,
            micro_batch: 2,
            global_batch: 4,
            dp: 1,
        };
        let sampler = Sampler::windows(corpus(), plan, 3)?;
        let train = support::train_config(
            LrSchedule {
                max_lr: 1e-2,
                min_lr: 1e-3,
                warmup_steps: 1,
                decay_steps: steps,
                style: DecayStyle::Cosine,
            },
            5,
            usize::MAX,
        );
        let mut trainer = Trainer::new(model, &ps, sampler, train)?;
        if copies {
            trainer.keep_compute_copies(DType::BF16)?;
        }
        let mut losses = Vec::new();
        for step in 0..steps {
            losses.push(trainer.step(&ps, step)?.loss);
            if copies {
                assert_copies_follow(trainer.model());
            }
        }
        if copies {
            let path = std::env::temp_dir().join(format!("megatron-mixed-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&path);
            let info = SaveInfo {
                model: serde_json::json!({"test": true}),
                run: serde_json::Value::Null,
                files: Vec::new(),
                base: None,
            };
            trainer.save_checkpoint(&ps, &path, steps, &info)?;
            let values = trainer.buffers().values().to_vec::<f32>()?;
            let zeros = Tensor::zeros([values.len()], DType::F32);
            trainer.buffers().values().copy_from(&zeros)?;
            trainer.buffers().refresh_compute_copies()?;
            trainer.load_checkpoint(&ps, &path)?;
            assert_eq!(trainer.buffers().values().to_vec::<f32>()?, values);
            assert_copies_follow(trainer.model());
            std::fs::remove_dir_all(&path)?;
        }
        Ok(losses)
    })
    .unwrap()
    .remove(0)
}

#[test]
fn training_with_bf16_copies_follows_the_f32_run_and_keeps_them_current() {
    let full = train(false, 6);
    let mixed = train(true, 6);
    assert!(mixed[5] < mixed[0], "the loss falls: {mixed:?}");
    for (i, (a, b)) in mixed.iter().zip(&full).enumerate() {
        assert!((a - b).abs() <= 2e-2 * b.abs(), "step {i}: {a} vs {b}");
    }
    assert_ne!(mixed, full, "the copies took no part in the products");
}
