//! What the generated code communicates: every collective one GPT transformer block calls at
//! tensor-parallel size 2, forward then backward, in the order rank 0 calls them, and then those
//! of the whole model (embedding, blocks, the fused cross-entropy) for one microbatch, without
//! and with sequence parallelism. Then
//! every collective of one whole training step (pipeline exchanges, the dispatcher's
//! all-to-alls, the data-parallel reduce-scatter and all-gather, the norms, the found-inf
//! check) on the layout given on the command line, with the line that calls each: for the
//! default layout, what docs/collectives.md holds (`megatron::audit`).
//!
//! The calls are recorded by wrapping the thread world in a `RecordingWorld`, so what is printed
//! is what ran, not a description of it; `docs/expanded-mlp.md` shows the generated code that
//! makes each call. The run checks the block against Megatron-LM's pattern: in forward, one
//! all-reduce of the activations after each row-parallel layer (its g); in backward, one
//! all-reduce of the input gradient before each column-parallel layer (its f). With sequence
//! parallelism: in forward an all-gather of the sequence shards before qkv and fc1 and a
//! reduce-scatter after proj and fc2; in backward the mirror (an all-gather of the output
//! gradient before each row-parallel layer's backward, a reduce-scatter of the input gradient
//! after each column-parallel layer's), and the all-gather of each column-parallel layer's kept
//! input shard before its backward.
//!
//! Then a block's collectives under context parallelism, for each `--cp-comm-type` (the
//! `#[context_parallel]` attention's exchanges of keys and values, with the line in
//! `megatron-core/src/context_parallel/` that makes each), checked against the form: a ring's
//! send of each block before the step's compute and its receive after, in the backward the
//! block's gradients sent after it (on thread ranks, whose sends never wait); an all-gather
//! forward, an all-gather and a reduce-scatter backward; two all-to-alls each way.
//!
//! ```sh
//! cargo run --release --example audit
//! cargo run --release --example audit -- --tp 1 --pp 4 --dp 2 --ep 1 --no-distributed-optimizer
//! ```

use megatron::comm::recording::{Call, RecordingWorld};
use megatron::comm::threads::launch;
use megatron::comm::{OpKind, ParallelState};
use megatron::context_parallel::CpCommType;
use megatron::models::GptConfig;
use megatron::models::gpt::{Block, Gpt};
use megatron::module::{Builder, Cx, Module, Site};
use megatron::parallel::{ParallelConfig, ParallelLayout};
use megatron::tensor::{DType, Tensor};
use megatron::training::LanguageModel;

const TP: usize = 2;
const S: usize = 8;
const B: usize = 2;

/// A call's size in the units of the model: `b·s·h`, `b·s·h/tp` (a shard of the sequence), `b·s`,
/// or elements.
fn size(call: &Call, hidden: usize) -> String {
    let n = call.desc.count;
    if n == B * S * hidden {
        "b·s·h".to_string()
    } else if n * TP == B * S * hidden {
        "b·s·h/tp".to_string()
    } else if n == B * S {
        "b·s".to_string()
    } else {
        format!("{n} elements")
    }
}

fn print_calls(title: &str, calls: &[Call], hidden: usize) {
    println!("{title}");
    if calls.is_empty() {
        println!("    (none)");
    }
    for (i, call) in calls.iter().enumerate() {
        println!(
            "  {:>2}. {:<44} {}",
            i + 1,
            call.to_string(),
            size(call, hidden)
        );
    }
}

/// Rank 0's calls: a block's forward and backward, then the whole model's.
type Recorded = (Vec<Call>, Vec<Call>, Vec<Call>, Vec<Call>);

fn record(config: &GptConfig, sequence_parallel: bool) -> megatron::Result<Recorded> {
    let layout = ParallelLayout::new(&ParallelConfig::new(TP).with_tp(TP))?;
    let spec = config.spec();
    let h = config.hidden_size;
    let ranks = launch(TP, |world| -> megatron::Result<Recorded> {
        let recording = RecordingWorld::new(&world);
        let parallel =
            ParallelState::new(&recording, &layout)?.with_sequence_parallel(sequence_parallel);
        let log = recording.log();
        log.take();
        let cx = Cx::new(&parallel, 0);
        let mut builder = Builder::for_rank(0, parallel.groups());

        let block = Block::build(&spec.blocks[0], &mut builder)?;
        // With sequence parallelism a block takes this rank's shard of the sequence.
        let s = if sequence_parallel { S / TP } else { S };
        let x = Tensor::zeros([s, B, h], DType::F32);
        let (y, saved) = block.forward(&cx, Site::ROOT, &x)?;
        let block_forward = log.take();
        block.backward(&cx, Site::ROOT, saved, &y)?;
        let block_backward = log.take();

        let gpt = Gpt::build(&spec, &mut Builder::for_rank(0, parallel.groups()))?;
        let tokens = Tensor::from_vec((0..(S * B) as i64).collect::<Vec<_>>(), [S, B])?;
        let (losses, saved) = gpt.losses(&cx, &tokens, &tokens)?;
        let model_forward = log.take();
        gpt.backward_losses(&cx, saved, &losses)?;
        let model_backward = log.take();
        Ok((block_forward, block_backward, model_forward, model_backward))
    })
    .map_err(|e| megatron::Error::Invalid(e.to_string()))?;
    Ok(ranks.into_iter().next().expect("rank 0"))
}

/// Rank 0's calls of one block's forward and backward at context-parallel size `cp` with comm
/// type `kind` (no tensor parallelism).
fn record_cp(
    config: &GptConfig,
    cp: usize,
    kind: CpCommType,
) -> megatron::Result<(Vec<Call>, Vec<Call>)> {
    let layout = ParallelLayout::new(&ParallelConfig::new(cp).with_cp(cp))?;
    let spec = config.spec();
    let h = config.hidden_size;
    let ranks = launch(cp, |world| -> megatron::Result<(Vec<Call>, Vec<Call>)> {
        let recording = RecordingWorld::new(&world);
        let parallel =
            ParallelState::new(&recording, &layout)?.with_cp_comm_type(&recording, kind)?;
        let log = recording.log();
        log.take();
        let cx = Cx::new(&parallel, 0);
        let block = Block::build(
            &spec.blocks[0],
            &mut Builder::for_rank(0, parallel.groups()),
        )?;
        let x = Tensor::zeros([S / cp, B, h], DType::F32);
        let (y, saved) = block.forward(&cx, Site::ROOT, &x)?;
        // The context-parallel groups' calls (the tensor-parallel group of one makes its own).
        let cp_calls = |calls: Vec<Call>| -> Vec<Call> {
            calls
                .into_iter()
                .filter(|c| c.group.starts_with("cp"))
                .collect()
        };
        let forward = cp_calls(log.take());
        block.backward(&cx, Site::ROOT, saved, &y)?;
        Ok((forward, cp_calls(log.take())))
    })
    .map_err(|e| megatron::Error::Invalid(e.to_string()))?;
    Ok(ranks.into_iter().next().expect("rank 0"))
}

/// The context-parallel forms' calls: printed with their lines, checked against each form.
fn audit_context_parallel(
    config: &GptConfig,
) -> std::result::Result<(), Box<dyn std::error::Error>> {
    use OpKind::{AllGather, AllToAll, Recv, ReduceScatter, Send};
    let forms = [
        (
            2,
            CpCommType::P2p,
            vec![Send, Recv],
            vec![Send, Send, Recv, Recv, Send, Recv],
        ),
        (
            2,
            CpCommType::AllGather,
            vec![AllGather],
            vec![AllGather, ReduceScatter],
        ),
        (
            2,
            CpCommType::A2a,
            vec![AllToAll, AllToAll],
            vec![AllToAll, AllToAll],
        ),
        (
            4,
            CpCommType::A2aP2p { a2a: 2, p2p: 2 },
            vec![AllToAll, Send, Recv, AllToAll],
            vec![AllToAll, Send, Send, Recv, Recv, Send, Recv, AllToAll],
        ),
    ];
    for (cp, kind, want_forward, want_backward) in forms {
        let (forward, backward) = record_cp(config, cp, kind)?;
        println!(
            "one transformer block at context-parallel size {cp}, --cp-comm-type {}: rank 0's \
             collectives",
            kind.name()
        );
        for (title, calls) in [("forward", &forward), ("backward", &backward)] {
            println!("  {title}");
            for call in calls.iter() {
                println!("    {:<40} {}", call.to_string(), call.caller);
            }
        }
        let kinds = |calls: &[Call]| -> Vec<OpKind> { calls.iter().map(|c| c.desc.kind).collect() };
        if kinds(&forward) != want_forward || kinds(&backward) != want_backward {
            return Err(format!(
                "{}: forward {:?}, backward {:?}, not the form's {want_forward:?}, \
                 {want_backward:?}",
                kind.name(),
                kinds(&forward),
                kinds(&backward)
            )
            .into());
        }
        if !forward
            .iter()
            .chain(&backward)
            .all(|c| c.caller.file().contains("context_parallel"))
        {
            return Err(format!("{}: a call outside context_parallel/", kind.name()).into());
        }
    }
    println!(
        "
each form makes its collectives, all from megatron-core/src/context_parallel/\n"
    );
    Ok(())
}

/// The step's layout (the block's is tensor-parallel size 2).
#[derive(clap::Parser)]
struct Args {
    /// Tensor-parallel size.
    #[arg(long, default_value_t = 2)]
    tp: usize,
    /// Pipeline stages.
    #[arg(long, default_value_t = 2)]
    pp: usize,
    /// Data-parallel size.
    #[arg(long, default_value_t = 2)]
    dp: usize,
    /// Expert-parallel size.
    #[arg(long, default_value_t = 2)]
    ep: usize,
    /// Expert-tensor-parallel size.
    #[arg(long, default_value_t = 1)]
    etp: usize,
    /// Microbatches per data-parallel rank.
    #[arg(long, default_value_t = 2)]
    microbatches: usize,
    /// Adam's state whole on every data-parallel rank.
    #[arg(long)]
    no_distributed_optimizer: bool,
    /// No sequence parallelism in the step (the audited model's MoE layers need it with tp > 1).
    #[arg(long)]
    no_sequence_parallel: bool,
}

/// Checks a block's calls against Megatron-LM's pattern (see the module's documentation).
fn check_block(
    sequence_parallel: bool,
    forward: &[Call],
    backward: &[Call],
    h: usize,
) -> std::result::Result<(), Box<dyn std::error::Error>> {
    let kinds = |calls: &[Call]| -> Vec<OpKind> { calls.iter().map(|c| c.desc.kind).collect() };
    let on_tp = |calls: &[Call]| calls.iter().all(|c| c.group == "tp");
    let (gather, scatter, reduce) = (OpKind::AllGather, OpKind::ReduceScatter, OpKind::AllReduce);
    let (want_forward, want_backward, sizes_fit) = if sequence_parallel {
        // All-gathers pass this rank's shard; reduce-scatters leave one: b·s·h/tp each.
        let shards = |calls: &[Call]| calls.iter().all(|c| c.desc.count * TP == B * S * h);
        // Backward: the output gradient's gather before each row-parallel layer, the kept
        // input's shards gathered again before each column-parallel layer's, its input
        // gradient's reduce-scatter.
        (
            vec![gather, scatter, gather, scatter],
            vec![gather, gather, scatter, gather, gather, scatter],
            shards(forward) && shards(backward),
        )
    } else {
        let whole = |calls: &[Call]| calls.iter().all(|c| c.desc.count == B * S * h);
        (
            vec![reduce, reduce],
            vec![reduce, reduce],
            whole(forward) && whole(backward),
        )
    };
    if kinds(forward) != want_forward
        || kinds(backward) != want_backward
        || !sizes_fit
        || !on_tp(forward)
        || !on_tp(backward)
    {
        return Err(format!(
            "the block's collectives{} are not Megatron-LM's: forward {:?}, backward {:?}",
            if sequence_parallel {
                " with sequence parallelism"
            } else {
                ""
            },
            kinds(forward),
            kinds(backward)
        )
        .into());
    }
    if sequence_parallel {
        println!(
            "\nthe block makes Megatron-LM's collectives with sequence parallelism: an all-gather \
             before qkv and fc1 and a reduce-scatter after proj and fc2 forward, the mirror \
             backward with qkv's and fc1's inputs gathered again (their shards are what they \
             keep), each of b·s·h (a shard of b·s·h/tp per rank)"
        );
    } else {
        println!(
            "\nthe block makes Megatron-LM's collectives: 2 all-reduces of b·s·h forward, 2 \
             backward"
        );
    }
    Ok(())
}

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let args = <Args as clap::Parser>::parse();
    let config = (megatron::models::preset("gpt-tiny")
        .ok_or("gpt-tiny is registered")?
        .config)();
    let h = config.hidden_size;
    for sequence_parallel in [false, true] {
        let (block_forward, block_backward, model_forward, model_backward) =
            record(&config, sequence_parallel)?;
        let with = if sequence_parallel {
            " with sequence parallelism"
        } else {
            ""
        };
        println!(
            "gpt-tiny at tensor-parallel size {TP}{with}, s = {S}, b = {B}, h = {h}: rank 0's \
             collectives\n"
        );
        print_calls("one transformer block, forward", &block_forward, h);
        print_calls("one transformer block, backward", &block_backward, h);
        println!();
        print_calls(
            &format!(
                "the whole model ({} blocks), forward with the loss",
                config.num_layers
            ),
            &model_forward,
            h,
        );
        print_calls("the whole model, backward", &model_backward, h);
        check_block(sequence_parallel, &block_forward, &block_backward, h)?;
        println!();
    }

    audit_context_parallel(&config)?;

    let layout = megatron::audit::AuditLayout {
        tp: args.tp,
        sequence_parallel: !args.no_sequence_parallel,
        pp: args.pp,
        dp: args.dp,
        ep: args.ep,
        etp: args.etp,
        distributed_optimizer: !args.no_distributed_optimizer,
        microbatches: args.microbatches,
    };
    let job = megatron::audit::job(&layout)?;
    let ranks = megatron::audit::record_step(&job)?;
    println!();
    print!("{}", megatron::audit::document(&layout, &ranks));
    Ok(())
}
