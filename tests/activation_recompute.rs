//! Activation recompute (`--recompute-granularity full|selective`, `--recompute-method
//! uniform|block`, `--recompute-num-layers`): what the stack keeps, and gradients bit-identical
//! to a run that keeps every activation, with tensor and pipeline parallelism.

mod support;

use megatron::comm::ParallelState;
use megatron::comm::threads::launch;
use megatron::models::GptConfig;
use megatron::models::gpt::Gpt;
use megatron::module::{Builder, Cx, Module, Recompute};
use megatron::parallel::{ParallelConfig, ParallelLayout};
use megatron::pipeline_parallel::PipelineLayout;
use megatron::tensor::{DType, Tensor};
use megatron::training::{
    BatchPlan, DecayStyle, LanguageModel, LrSchedule, Sampler, TokenStream, TrainConfig, Trainer,
};

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const LAYERS: usize = 4;

fn config() -> GptConfig {
    let mut c = GptConfig::new(LAYERS, 32, 4, 256, 32);
    c.hidden_dropout = 0.1;
    c.attention_dropout = 0.1;
    c
}

const SETTINGS: [Recompute; 6] = [
    Recompute::Uniform(1),
    Recompute::Uniform(2),
    Recompute::Uniform(3),
    Recompute::Block(1),
    Recompute::Block(4),
    Recompute::Selective,
];

/// Every parameter gradient of one forward and backward of the whole GPT on one rank, and how
/// many of the stack's layers kept what they saved.
fn gradients(recompute: Recompute) -> (Vec<Vec<f32>>, usize) {
    let layout = ParallelLayout::new(&ParallelConfig::new(1)).unwrap();
    launch(1, |w| -> R<_> {
        let ps = ParallelState::new(&w, &layout)?;
        let model = Gpt::build(&config().spec(), &mut Builder::for_rank(3, ps.groups()))?;
        let ids: Vec<i64> = (0..32).map(|i| (i * 37 % 251) as i64).collect();
        let tokens = Tensor::from_vec(ids[..16].to_vec(), [8, 2])?;
        let targets = Tensor::from_vec(ids[16..].to_vec(), [8, 2])?;
        let cx = Cx::new(&ps, 11).at(2, 5).with_recompute(recompute);
        let (losses, saved) = model.losses(&cx, &tokens, &targets)?;
        let kept = saved.blocks.kept_layers();
        let dlosses = Tensor::zeros(losses.shape().clone(), DType::F32);
        dlosses.fill(1.0 / 16.0)?;
        model.backward_losses(&cx, saved, &dlosses)?;
        let mut grads = Vec::new();
        model.visit_params(&mut |p| grads.push(p.grad().to_vec::<f32>().unwrap()));
        Ok((grads, kept))
    })
    .unwrap()
    .remove(0)
}

#[test]
fn recompute_keeps_less_and_gives_the_same_gradients_bit_for_bit() {
    let (reference, kept) = gradients(Recompute::Off);
    assert_eq!(kept, LAYERS);
    for recompute in SETTINGS {
        let (grads, kept) = gradients(recompute);
        assert_eq!(grads, reference, "{recompute:?}");
        let expected = match recompute {
            Recompute::Uniform(_) => 0,
            Recompute::Block(n) => LAYERS - n,
            _ => LAYERS,
        };
        assert_eq!(kept, expected, "{recompute:?}");
    }
}

/// Losses and gradient norms of 3 training steps, and rank 0's parameters.
fn train(tp: usize, pp: usize, vpp: usize, recompute: Recompute) -> (Vec<(f64, f64)>, Vec<f32>) {
    let layout =
        ParallelLayout::new(&ParallelConfig::new(tp * pp).with_tp(tp).with_pp(pp)).unwrap();
    let stages = PipelineLayout::new(LAYERS, pp, vpp, None, None).unwrap();
    let spec = config().spec();
    let text = "Recompute trades compute for memory: the backward reruns the forward. ".repeat(20);
    launch(tp * pp, |w| -> R<_> {
        let ps = ParallelState::new(&w, &layout)?;
        let sampler = Sampler::windows(
            TokenStream::from_bytes(text.as_bytes()),
            BatchPlan {
                seq_length: 16,
                micro_batch: 1,
                global_batch: 4,
                dp: 1,
            },
            3,
        )?;
        let train = TrainConfig {
            recompute,
            ..support::train_config(
                LrSchedule {
                    max_lr: 3e-3,
                    min_lr: 3e-4,
                    warmup_steps: 1,
                    decay_steps: 3,
                    style: DecayStyle::Cosine,
                },
                9,
                10_000,
            )
        };
        let mut trainer = if pp == 1 {
            let model = Gpt::build(&spec, &mut Builder::for_rank(4, ps.groups()))?;
            Trainer::new(model, &ps, sampler, train)?
        } else {
            let rank = ps.pp().index();
            let chunks = (0..vpp)
                .map(|c| {
                    let b = Builder::for_rank(4, ps.groups()).with_stage(stages.part(rank, c));
                    Gpt::build(&spec, &mut { b })
                })
                .collect::<megatron::Result<Vec<_>>>()?;
            Trainer::pipelined(chunks, &ps, sampler, train, None)?
        };
        let curve = (0..3)
            .map(|s| {
                let m = trainer.step(&ps, s)?;
                Ok((m.loss, m.grad_norm))
            })
            .collect::<R<Vec<_>>>()?;
        Ok((curve, trainer.buffers().values().to_vec::<f32>()?))
    })
    .unwrap()
    .remove(0)
}

#[test]
fn training_with_recompute_is_bit_identical_with_tensor_and_pipeline_parallelism() {
    for (tp, pp, vpp) in [(2, 1, 1), (1, 2, 2)] {
        let reference = train(tp, pp, vpp, Recompute::Off);
        for recompute in [
            Recompute::Uniform(1),
            Recompute::Block(1),
            Recompute::Selective,
        ] {
            let run = train(tp, pp, vpp, recompute);
            assert_eq!(run, reference, "tp {tp} pp {pp} vpp {vpp} {recompute:?}");
        }
    }
}

#[test]
fn the_recompute_flags_are_checked_with_their_numbers() {
    let common = [
        "train",
        "--num-layers",
        "4",
        "--pp",
        "2",
        "--train-iters",
        "1",
    ];
    for (flags, expected) in [
        (
            &[
                "--recompute-granularity",
                "full",
                "--recompute-method",
                "block",
                "--recompute-num-layers",
                "3",
            ][..],
            "--recompute-num-layers 3 is more than the 2 layers of a pipeline stage",
        ),
        (
            &[
                "--recompute-granularity",
                "full",
                "--recompute-num-layers",
                "1",
            ][..],
            "--recompute-granularity full needs --recompute-method uniform or block",
        ),
        (
            &[
                "--recompute-granularity",
                "full",
                "--recompute-method",
                "uniform",
            ][..],
            "needs --recompute-num-layers between 1 and the layers per pipeline stage (2)",
        ),
        (
            &[
                "--recompute-granularity",
                "selective",
                "--recompute-num-layers",
                "1",
            ][..],
            "--recompute-granularity selective takes no --recompute-num-layers",
        ),
        (
            &["--recompute-granularity", "partial"][..],
            "--recompute-granularity \"partial\": use full or selective",
        ),
        (
            &["--recompute-method", "block"][..],
            "--recompute-method needs --recompute-granularity full",
        ),
    ] {
        let mut args = common.to_vec();
        args.extend(flags);
        let (ok, _, stderr) = support::megatron(&args);
        assert!(!ok && stderr.contains(expected), "{flags:?}: {stderr}");
    }
}
