//! Activation recompute saves memory: the most host tensor memory alive at once during one
//! forward and backward of a GPT at sequence 256, measured (`tensor::host_memory`), falls with
//! selective recompute (the attention weights) and more with full recompute of every layer.
//! One test in this binary, so that no other test's tensors are counted.

use megatron::comm::ParallelState;
use megatron::comm::threads::launch;
use megatron::models::GptConfig;
use megatron::models::gpt::Gpt;
use megatron::module::{Builder, Cx, Module, Recompute};
use megatron::parallel::{ParallelConfig, ParallelLayout};
use megatron::tensor::{DType, Tensor, host_memory};
use megatron::training::LanguageModel;

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// The peak bytes of host tensors during one forward and backward, over those alive before.
fn peak(recompute: Recompute) -> usize {
    let layout = ParallelLayout::new(&ParallelConfig::new(1)).unwrap();
    let seq = 256;
    launch(1, |w| -> R<_> {
        let ps = ParallelState::new(&w, &layout)?;
        let config = GptConfig::new(4, 64, 4, 256, seq);
        let model = Gpt::build(&config.spec(), &mut Builder::for_rank(3, ps.groups()))?;
        let ids: Vec<i64> = (0..2 * seq).map(|i| (i * 37 % 251) as i64).collect();
        let tokens = Tensor::from_vec(ids[..seq].to_vec(), [seq, 1])?;
        let targets = Tensor::from_vec(ids[seq..].to_vec(), [seq, 1])?;
        let cx = Cx::new(&ps, 11).with_recompute(recompute);
        let before = host_memory::live_bytes();
        host_memory::reset_peak();
        let (losses, saved) = model.losses(&cx, &tokens, &targets)?;
        let dlosses = Tensor::zeros(losses.shape().clone(), DType::F32);
        dlosses.fill(1.0 / seq as f32)?;
        model.backward_losses(&cx, saved, &dlosses)?;
        Ok(host_memory::peak_bytes() - before)
    })
    .unwrap()
    .remove(0)
}

#[test]
fn recompute_lowers_the_peak_of_activation_memory() {
    let off = peak(Recompute::Off);
    let selective = peak(Recompute::Selective);
    let full = peak(Recompute::Uniform(1));
    // Four layers of 4 heads × 256² f32 attention weights (1 MiB each) the selective run does
    // not keep, less the one its backward holds again at a time: 3 MiB. Full recompute keeps
    // one layer's activations at a time.
    assert!(off - selective >= 3 << 20, "selective {selective} vs {off}");
    assert!(full < selective, "full {full} vs selective {selective}");
    // Recomputing a group of all four layers at once holds them all again in the backward.
    let one_group = peak(Recompute::Uniform(4));
    assert!(one_group > full, "{one_group} vs {full}");
}
