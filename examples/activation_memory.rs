//! Activation memory per transformer layer, measured: the bytes one GPT block keeps from its
//! forward for its backward on a rank, at tensor-parallel sizes 1, 2 and 4, with and without
//! sequence parallelism, next to the formulas of Korthikanti et al. ("Reducing Activation
//! Recomputation in Large Transformer Models", 2022, table 2): sbh(10 + 24/t + 5as/(ht)) with
//! tensor parallelism alone and sbh/t·(34 + 5as/h) with sequence parallelism, in the paper's
//! units (2-byte activations, 1-byte dropout masks).
//!
//! The measurement: a counting global allocator (this example's own; the `megatron` binary has
//! none), with megatron's pool of recycled blocks off (`MEGATRON_POOL_BYTES=0`). Every rank builds its block and input, the ranks meet, rank 0 reads the bytes held,
//! the ranks run the forward (dropout on) keeping what it saves, meet again, and rank 0 reads
//! again: the difference, over the ranks, less the outputs, is what a rank keeps. Here
//! activations are f32 (4 bytes) and dropout masks are not kept (they are regenerated from
//! their key in backward), so the paper's counts are shown converted too: its sbh·34 at
//! 4 bytes for the tensors and 0 for the 3 masks' sbh and the attention mask's as²b.
//!
//! `cargo run --release --example activation_memory`

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};

use megatron::comm::ParallelState;
use megatron::comm::threads::launch;
use megatron::models::GptConfig;
use megatron::models::gpt::Block;
use megatron::module::{Builder, Cx, Module, Site};
use megatron::parallel::{ParallelConfig, ParallelLayout};
use megatron::tensor::{DType, Tensor};

/// The system allocator, counting the bytes it holds.
struct Counting;

static HELD: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call goes to the system allocator with the caller's layout; the counter is
// only arithmetic on the sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        HELD.fetch_add(layout.size(), Ordering::Relaxed);
        // SAFETY: the caller's contract for `alloc` is passed on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        HELD.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: the caller's contract for `dealloc` is passed on.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        HELD.fetch_add(layout.size(), Ordering::Relaxed);
        // SAFETY: the caller's contract for `alloc_zeroed` is passed on.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        HELD.fetch_add(new_size, Ordering::Relaxed);
        HELD.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: the caller's contract for `realloc` is passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// s, b: the sequence and batch of the measured block; the model is GPT-2 small's layer.
const S: usize = 512;
const B: usize = 1;

/// Bytes one rank keeps from a block's forward at tensor-parallel size `tp`.
fn kept(config: &GptConfig, tp: usize, sequence_parallel: bool) -> usize {
    let layout = ParallelLayout::new(&ParallelConfig::new(tp).with_tp(tp)).expect("layout");
    let spec = config.spec().blocks.remove(0);
    let h = config.hidden_size;
    let meet = Arc::new(Barrier::new(tp));
    let held = launch(tp, |w| -> megatron::Result<usize> {
        let ps = ParallelState::new(&w, &layout)?.with_sequence_parallel(sequence_parallel);
        let block = Block::build(&spec, &mut Builder::for_rank(3, ps.groups()))?;
        let cx = Cx::new(&ps, 7);
        let s = if sequence_parallel { S / tp } else { S };
        let x = Tensor::full([s, B, h], 0.5, DType::F32);
        meet.wait();
        let before = HELD.load(Ordering::SeqCst);
        meet.wait();
        let (y, saved) = block.forward(&cx, Site::ROOT, &x)?;
        meet.wait();
        let after = HELD.load(Ordering::SeqCst);
        meet.wait();
        drop((saved, y));
        // Every rank's output is s·b·h f32 beside what it saved.
        Ok((after - before) / tp - s * B * h * 4)
    })
    .expect("the ranks");
    held[0]
}

fn main() {
    // Freed tensors go back to the system, not to megatron's pool of recycled blocks, whose
    // reuse would hide allocations from the count.
    // SAFETY: no other thread runs yet.
    unsafe { std::env::set_var("MEGATRON_POOL_BYTES", "0") };
    let mut config = (megatron::models::preset("gpt2-small")
        .expect("gpt2-small is registered")
        .config)();
    config.hidden_dropout = 0.1;
    config.attention_dropout = 0.1;
    let (h, a) = (config.hidden_size, config.num_attention_heads);
    let sbh = (S * B * h) as f64;
    let attention = 5.0 * (a * S) as f64 / h as f64;
    println!(
        "GPT-2 small's layer (h = {h}, a = {a}), s = {S}, b = {B}: bytes a rank keeps from one \
         block's forward (MiB)\n"
    );
    println!(
        "| tp | sequence parallel | measured (f32) | paper, 16-bit | paper, as f32 without masks |"
    );
    println!("|---|---|---|---|---|");
    let mib = |bytes: f64| bytes / (1 << 20) as f64;
    for tp in [1, 2, 4] {
        for sp in [false, true] {
            if sp && tp == 1 {
                continue;
            }
            let t = tp as f64;
            // Table 2 of the paper, and the same terms at 4 bytes with no masks: of the 34·sbh,
            // 3 (the dropout masks, 1 byte each) go, the rest double; of 5as²b, the attention
            // dropout mask's as²b goes, the rest (4as²b: scores' softmax and dropout output)
            // double.
            let (paper, f32_no_masks) = if sp {
                (
                    sbh / t * (34.0 + attention),
                    sbh / t * (2.0 * 31.0 + 2.0 * attention * 4.0 / 5.0),
                )
            } else {
                (
                    sbh * (10.0 + 24.0 / t + attention / t),
                    sbh * (2.0 * 8.0 + 2.0 * 23.0 / t + 2.0 * attention * 4.0 / 5.0 / t),
                )
            };
            let measured = kept(&config, tp, sp) as f64;
            println!(
                "| {tp} | {} | {:.1} | {:.1} | {:.1} |",
                if sp { "yes" } else { "no" },
                mib(measured),
                mib(paper),
                mib(f32_no_masks)
            );
        }
    }
}
