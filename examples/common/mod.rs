//! What the DSL examples share: training a pipelined language model written with the DSL on
//! thread ranks at a layout, and checking every layout's losses against the one-rank run.

use std::time::Instant;

use megatron::comm::ParallelState;
use megatron::comm::threads::launch;
use megatron::module::Builder;
use megatron::optimizer::AdamWConfig;
use megatron::parallel::{ParallelConfig, ParallelLayout};
use megatron::pipeline_parallel::PipelineLayout;
use megatron::training::{
    BatchPlan, DecayStyle, LrSchedule, PipelinedLanguageModel, Sampler, TokenStream, TrainConfig,
    Trainer,
};
use megatron::{Error, Result};

/// A layout: tensor, data, pipeline and context parallel sizes, and sequence parallelism.
#[derive(Debug, Clone, Copy)]
pub struct Layout {
    pub tp: usize,
    pub dp: usize,
    pub pp: usize,
    pub cp: usize,
    pub sp: bool,
}

/// One rank.
pub const ONE: Layout = Layout {
    tp: 1,
    dp: 1,
    pp: 1,
    cp: 1,
    sp: false,
};

/// What a run trains: its steps, sequence length, batch and peak learning rate.
#[derive(Debug, Clone, Copy)]
pub struct Run {
    pub steps: u64,
    pub layers: usize,
    pub seq_length: usize,
    pub micro_batch: usize,
    pub global_batch: usize,
    pub max_lr: f64,
    pub seed: u64,
}

/// Trains `M` built from `spec` on `tp × cp × dp × pp` thread ranks over the examples' frozen
/// corpus (examples/data) read as bytes; every step's loss (from the last stage) and the seconds taken.
pub fn train<M>(spec: &M::Spec, run: Run, l: Layout) -> Result<(Vec<f64>, f64)>
where
    M: PipelinedLanguageModel,
    M::Spec: Sync,
{
    let world = l.tp * l.cp * l.dp * l.pp;
    let config = ParallelConfig::new(world)
        .with_tp(l.tp)
        .with_cp(l.cp)
        .with_pp(l.pp);
    let layout = ParallelLayout::new(&config)?;
    let stages = PipelineLayout::new(run.layers, l.pp, 1, None, None)
        .map_err(|e| Error::Invalid(e.to_string()))?;
    let plan = BatchPlan {
        seq_length: run.seq_length,
        micro_batch: run.micro_batch,
        global_batch: run.global_batch,
        dp: l.dp,
    };
    let corpus = TokenStream::from_bytes(include_bytes!("../data/corpus.txt"));
    let data = Sampler::windows(corpus, plan, run.seed)?;
    let config = TrainConfig {
        schedule: LrSchedule {
            max_lr: run.max_lr,
            min_lr: run.max_lr / 10.0,
            warmup_steps: 5,
            decay_steps: run.steps,
            style: DecayStyle::Cosine,
        },
        adam: AdamWConfig::default(),
        clip_grad: 1.0,
        seed: run.seed,
        bucket_elements: 1 << 20,
        distributed_optimizer: false,
        recompute: megatron::module::Recompute::Off,
        precision: megatron::optimizer::Precision::FP32,
        check_for_nan: true,
    };
    let start = Instant::now();
    let per_rank = launch(world, |world| -> Result<(usize, bool, Vec<f64>)> {
        let parallel = ParallelState::new(&world, &layout)?.with_sequence_parallel(l.sp);
        let stage = stages.part(parallel.pp().index(), 0);
        let builder = Builder::for_rank(run.seed, parallel.groups()).with_stage(stage);
        let model = M::build(spec, &mut builder.clone())?;
        let mut trainer = Trainer::pipelined(vec![model], &parallel, data.clone(), config, None)?;
        let losses = (0..run.steps)
            .map(|step| Ok(trainer.step(&parallel, step)?.loss))
            .collect::<Result<Vec<f64>>>()?;
        let first = parallel.groups().tp_rank() == 0 && parallel.groups().cp_rank() == 0;
        Ok((parallel.pp().index(), first, losses))
    })
    .map_err(|e| Error::Invalid(e.to_string()))?;
    // The loss is known on the last stage (summed over the context-parallel ranks).
    let losses = per_rank
        .into_iter()
        .find(|(stage, first, _)| *stage == l.pp - 1 && *first)
        .map(|(_, _, l)| l)
        .unwrap_or_default();
    Ok((losses, start.elapsed().as_secs_f64()))
}

/// Trains `M` at each of `layouts` (the first: one rank), prints the losses side by side, and
/// checks that every layout follows the first run (its first step within `first`, every step
/// within `worst` of it, relative) and that the loss fell by at least 1.
pub fn train_and_compare<M>(
    spec: &M::Spec,
    run: Run,
    layouts: &[(&str, Layout)],
    (first, worst): (f64, f64),
) -> std::result::Result<(), Box<dyn std::error::Error>>
where
    M: PipelinedLanguageModel,
    M::Spec: Sync,
{
    let mut runs = Vec::new();
    for &(name, l) in layouts {
        let (losses, seconds) = train::<M>(spec, run, l)?;
        println!("{name:<12} {} steps in {seconds:.1} s", run.steps);
        runs.push((name, losses));
    }
    let header: String = runs.iter().map(|(n, _)| format!("{n:>13}")).collect();
    println!("\n step {header}");
    let last = run.steps as usize - 1;
    let every = (run.steps as usize / 4).max(1);
    for step in (0..run.steps as usize).step_by(every).chain([last]) {
        let row: String = runs
            .iter()
            .map(|(_, l)| format!("{:>13.4}", l[step]))
            .collect();
        println!("{step:>5} {row}");
    }
    // Layout-invariant initial weights, data and dropout masks: the runs differ only by the
    // order of f32 sums (tensor parallelism's partial products, sequence shards, the gradient
    // norm over stages), which compounds over training.
    let single = &runs[0].1;
    for (name, losses) in &runs[1..] {
        let at_first = (losses[0] - single[0]).abs();
        let at_worst = losses
            .iter()
            .zip(single)
            .map(|(a, b)| (a - b).abs() / b)
            .fold(0.0, f64::max);
        println!(
            "{name}: first step differs by {at_first:.1e}, the worst by {at_worst:.1e} (relative)"
        );
        if losses.len() != run.steps as usize || at_first > first || at_worst > worst {
            return Err(
                format!("{name} does not reproduce one rank: {at_first:e}, {at_worst:e}").into(),
            );
        }
    }
    let (from, to) = (single[0], single[last]);
    if to > from - 1.0 {
        return Err(format!("the loss did not fall: {from:.3} → {to:.3}").into());
    }
    println!("the loss fell from {from:.3} to {to:.3}");
    Ok(())
}
