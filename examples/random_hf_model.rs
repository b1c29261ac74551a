//! A Hugging Face Llama directory of random bf16 weights at a real model's shape, written a
//! tensor at a time (nothing downloaded): what BENCHMARKS.md measures `megatron convert`'s and
//! `megatron train --load`'s peak memory on.
//!
//! ```sh
//! cargo run --release --example random_hf_model -- DIR [llama-3.2-3b | tinyllama-1.1b | small]
//! ```
//!
//! `llama-3.2-3b` is Llama 3.2 3B's shape (3.2 billion parameters, 6.4 GB in bf16, tied head),
//! `tinyllama-1.1b` TinyLlama's (1.1 billion, 2.2 GB), `small` a 0.3 GB model that training
//! on this CPU holds. Shards of at most 2 GB, as the model's authors save them; the values are a
//! fixed pseudo-random sequence of standard deviation 0.02 (1 for the norms).

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use megatron::convert::stream::{OutTensor, write_sharded};
use safetensors::Dtype;
use serde_json::json;

/// A model's shape: layers, hidden, heads, key/value heads, MLP width, vocabulary, tied head.
struct Shape {
    layers: usize,
    hidden: usize,
    heads: usize,
    groups: usize,
    ffn: usize,
    vocab: usize,
    tied: bool,
}

fn shape(name: &str) -> Result<Shape> {
    Ok(match name {
        "llama-3.2-3b" => Shape {
            layers: 28,
            hidden: 3072,
            heads: 24,
            groups: 8,
            ffn: 8192,
            vocab: 128256,
            tied: true,
        },
        "tinyllama-1.1b" => Shape {
            layers: 22,
            hidden: 2048,
            heads: 32,
            groups: 4,
            ffn: 5632,
            vocab: 32000,
            tied: false,
        },
        "small" => Shape {
            layers: 8,
            hidden: 1024,
            heads: 16,
            groups: 4,
            ffn: 2816,
            vocab: 32000,
            tied: false,
        },
        other => bail!("unknown shape `{other}`: llama-3.2-3b, tinyllama-1.1b or small"),
    })
}

/// `n` values of a fixed pseudo-random sequence (seeded by `seed`), uniform with standard
/// deviation `std` around `mean`.
fn random(n: usize, seed: u64, mean: f32, std: f32) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let u = (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            mean + u * std * 12f32.sqrt()
        })
        .collect()
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (dir, name) = match args.as_slice() {
        [dir] => (PathBuf::from(dir), "llama-3.2-3b"),
        [dir, name] => (PathBuf::from(dir), name.as_str()),
        _ => bail!("usage: random_hf_model DIR [llama-3.2-3b | tinyllama-1.1b | small]"),
    };
    let s = shape(name)?;
    let d = s.hidden / s.heads;
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut tensors = Vec::new();
    let mut add = |name: String, dims: Vec<usize>, mean: f32, std: f32| {
        let seed = tensors.len() as u64 + 1;
        let n: usize = dims.iter().product();
        tensors.push(OutTensor::computed(name, Dtype::BF16, dims, move || {
            Ok(random(n, seed, mean, std))
        }));
    };
    add(
        "model.embed_tokens.weight".into(),
        vec![s.vocab, s.hidden],
        0.0,
        0.02,
    );
    for i in 0..s.layers {
        let p = |t: &str| format!("model.layers.{i}.{t}");
        add(
            p("self_attn.q_proj.weight"),
            vec![s.heads * d, s.hidden],
            0.0,
            0.02,
        );
        add(
            p("self_attn.k_proj.weight"),
            vec![s.groups * d, s.hidden],
            0.0,
            0.02,
        );
        add(
            p("self_attn.v_proj.weight"),
            vec![s.groups * d, s.hidden],
            0.0,
            0.02,
        );
        add(
            p("self_attn.o_proj.weight"),
            vec![s.hidden, s.heads * d],
            0.0,
            0.02,
        );
        add(p("mlp.gate_proj.weight"), vec![s.ffn, s.hidden], 0.0, 0.02);
        add(p("mlp.up_proj.weight"), vec![s.ffn, s.hidden], 0.0, 0.02);
        add(p("mlp.down_proj.weight"), vec![s.hidden, s.ffn], 0.0, 0.02);
        add(p("input_layernorm.weight"), vec![s.hidden], 1.0, 0.02);
        add(
            p("post_attention_layernorm.weight"),
            vec![s.hidden],
            1.0,
            0.02,
        );
    }
    add("model.norm.weight".into(), vec![s.hidden], 1.0, 0.02);
    if !s.tied {
        add("lm_head.weight".into(), vec![s.vocab, s.hidden], 0.0, 0.02);
    }
    let files = write_sharded(&dir, &tensors, 2_000_000_000)?;
    let params: usize = tensors.iter().map(OutTensor::numel).sum();
    let config = json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": s.vocab,
        "hidden_size": s.hidden,
        "intermediate_size": s.ffn,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.groups,
        "head_dim": d,
        "hidden_act": "silu",
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": s.tied,
        "attention_bias": false,
        "mlp_bias": false,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "dtype": "bfloat16",
    });
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&config)?,
    )?;
    println!(
        "wrote {} ({name}: {:.2} billion parameters, {:.2} GB in bf16) as {}",
        dir.display(),
        params as f64 / 1e9,
        params as f64 * 2.0 / 1e9,
        files.join(", ")
    );
    Ok(())
}
