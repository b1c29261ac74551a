//! Activation memory of one transformer layer, measured: the bytes of host tensor storage one
//! GPT block keeps from its forward for its backward on a rank (the storage counters of
//! `megatron::tensor::host_memory`, which count a tensor's allocation whether megatron's pool
//! recycled it or not), at a tensor-parallel size, with or without sequence parallelism, and at
//! a context-parallel size.

use std::sync::{Arc, Barrier};

use anyhow::Result;
use megatron_core::comm::ParallelState;
use megatron_core::comm::threads::launch;
use megatron_core::context_parallel::CpCommType;
use megatron_core::module::{Builder, Cx, Module, Recompute, Site};
use megatron_core::parallel::{ParallelConfig, ParallelLayout};
use megatron_core::tensor::host_memory::live_bytes;
use megatron_core::tensor::{DType, Tensor};
use megatron_models::GptConfig;
use megatron_models::gpt::Block;

/// The bytes one rank keeps from the forward of `config`'s first block on `[seq, batch, h]`
/// tokens (dropout as `config` says) at tensor-parallel size `tp`: the ranks build their parts
/// and inputs, meet, run the forward keeping what it saves, and meet again; the storage alive
/// in between, less the outputs, shared by the ranks. Nothing else may run in the process
/// meanwhile (the counters are process-wide).
pub fn layer_bytes(
    config: &GptConfig,
    (seq, batch): (usize, usize),
    tp: usize,
    sequence_parallel: bool,
) -> Result<usize> {
    layer_bytes_with_cp(
        config,
        (seq, batch),
        (tp, sequence_parallel),
        (1, CpCommType::default()),
        Recompute::Off,
    )
}

/// [`layer_bytes`] at context-parallel size `cp` with comm type `kind` as well: each of the
/// `tp·cp` ranks holds its chunks of the sequence (`seq / cp` positions, `seq / (cp·tp)` with
/// sequence parallelism), and with `recompute` (selective: attention keeps its inputs, not its
/// weights).
pub fn layer_bytes_with_cp(
    config: &GptConfig,
    (seq, batch): (usize, usize),
    (tp, sequence_parallel): (usize, bool),
    (cp, kind): (usize, CpCommType),
    recompute: Recompute,
) -> Result<usize> {
    let ranks = tp * cp;
    let layout = ParallelLayout::new(&ParallelConfig::new(ranks).with_tp(tp).with_cp(cp))?;
    let spec = config.spec().blocks.remove(0);
    let h = config.hidden_size;
    let sequence_parallel = sequence_parallel && tp > 1;
    if cp > 1 && !seq.is_multiple_of(2 * cp) {
        anyhow::bail!(
            "context parallelism cuts --seq-length {seq} into 2·cp = {} chunks: it does not \
             divide",
            2 * cp
        );
    }
    let local = seq / cp;
    if sequence_parallel && !local.is_multiple_of(tp) {
        anyhow::bail!(
            "sequence parallelism splits the {local} positions of a rank over tp = {tp}: it does \
             not divide"
        );
    }
    let shard = if sequence_parallel { local / tp } else { local };
    let meet = Arc::new(Barrier::new(ranks));
    let held = launch(ranks, |w| -> megatron_core::Result<usize> {
        let ps = ParallelState::new(&w, &layout)?
            .with_sequence_parallel(sequence_parallel)
            .with_cp_comm_type(&w, kind)?;
        let block = Block::build(&spec, &mut Builder::for_rank(3, ps.groups()))?;
        let cx = Cx::new(&ps, 7).with_recompute(recompute);
        let x = Tensor::full([shard, batch, h], 0.5, DType::F32);
        meet.wait();
        let before = live_bytes();
        meet.wait();
        let (y, saved) = block.forward(&cx, Site::ROOT, &x)?;
        meet.wait();
        let after = live_bytes();
        meet.wait();
        let out = y.numel() * y.dtype().size();
        drop((saved, y));
        Ok(((after.saturating_sub(before)) / ranks).saturating_sub(out))
    })
    .map_err(anyhow::Error::msg)?;
    Ok(held[0])
}
