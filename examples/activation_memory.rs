//! Activation memory per transformer layer, measured: the bytes one GPT block keeps from its
//! forward for its backward on a rank, at tensor-parallel sizes 1, 2 and 4, with and without
//! sequence parallelism, next to the formulas of Korthikanti et al. ("Reducing Activation
//! Recomputation in Large Transformer Models", 2022, table 2): sbh(10 + 24/t + 5as/(ht)) with
//! tensor parallelism alone and sbh/t·(34 + 5as/h) with sequence parallelism, in the paper's
//! units (2-byte activations, 1-byte dropout masks).
//!
//! The measurement (`megatron::bench::activations`, also behind `megatron inspect`): the host
//! tensor storage alive, as megatron's storage counters count it. Every rank builds its block
//! and input, the ranks meet, the bytes alive are read, the ranks run the forward (dropout on)
//! keeping what it saves, meet again, and the bytes are read again: the difference, over the
//! ranks, less the outputs, is what a rank keeps. Here
//! activations are f32 (4 bytes) and dropout masks are not kept (they are regenerated from
//! their key in backward), so the paper's counts are shown converted too: its sbh·34 at
//! 4 bytes for the tensors and 0 for the 3 masks' sbh and the attention mask's as²b.
//!
//! The run checks what it shows: with sequence parallelism a rank keeps 1/t of the tp 1 layer.
//!
//! `cargo run --release --example activation_memory`

use megatron::bench::activations::layer_bytes;

/// s, b: the sequence and batch of the measured block; the model is GPT-2 small's layer.
const S: usize = 512;
const B: usize = 1;

fn main() {
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
    let mut measured_at = std::collections::HashMap::new();
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
            let measured = layer_bytes(&config, (S, B), tp, sp).expect("the measurement") as f64;
            measured_at.insert((tp, sp), measured);
            println!(
                "| {tp} | {} | {:.1} | {:.1} | {:.1} |",
                if sp { "yes" } else { "no" },
                mib(measured),
                mib(paper),
                mib(f32_no_masks)
            );
        }
    }
    // What the table shows, checked: with sequence parallelism a rank keeps 1/t of the tp 1
    // layer (to 2%), and less than without it.
    let one = measured_at[&(1, false)];
    for tp in [2, 4] {
        let (with, without) = (measured_at[&(tp, true)], measured_at[&(tp, false)]);
        assert!(
            (with * tp as f64 - one).abs() <= 0.02 * one && with < without,
            "tp {tp}: {with} bytes with sequence parallelism, {without} without, {one} at tp 1"
        );
    }
    println!("\nwith sequence parallelism a rank keeps 1/t of the tp 1 layer: checked");
}
