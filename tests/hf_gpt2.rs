//! Hugging Face GPT-2 checkpoints: a small random one written here in HF's layout is imported,
//! gives the logits an independent plain implementation of HF's GPT-2 computes (at tp 1 and 2),
//! and exports back to the same tensors.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use megatron::checkpoint::{load_params, open_checkpoint};
use megatron::comm::ParallelState;
use megatron::comm::threads::launch;
use megatron::convert::hf_gpt2;
use megatron::models::GptConfig;
use megatron::models::gpt::Gpt;
use megatron::module::{Builder, Cx, Module as _};
use megatron::parallel::{ParallelConfig, ParallelLayout};
use megatron::tensor::Tensor;
use safetensors::tensor::{Dtype, TensorView};

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const V: usize = 50;
const H: usize = 16;
const HEADS: usize = 4;
const LAYERS: usize = 2;
const POS: usize = 12;

fn values(n: usize, salt: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|i| ((((i * 7919 + salt * 104_729) % 1999) as f32 / 1999.0) - 0.5) * scale)
        .collect()
}

/// A random GPT-2 in Hugging Face's layout: name → (shape, values).
fn hf_weights() -> BTreeMap<String, (Vec<usize>, Vec<f32>)> {
    let mut w = BTreeMap::new();
    let mut salt = 0;
    let mut add = |name: String, shape: Vec<usize>, scale: f32, offset: f32| {
        salt += 1;
        let n = shape.iter().product();
        let v = values(n, salt, scale)
            .into_iter()
            .map(|x| x + offset)
            .collect();
        w.insert(name, (shape, v));
    };
    add("transformer.wte.weight".into(), vec![V, H], 0.5, 0.0);
    add("transformer.wpe.weight".into(), vec![POS, H], 0.2, 0.0);
    for i in 0..LAYERS {
        let n = |s: &str| format!("transformer.h.{i}.{s}");
        add(n("ln_1.weight"), vec![H], 0.2, 1.0);
        add(n("ln_1.bias"), vec![H], 0.2, 0.0);
        add(n("attn.c_attn.weight"), vec![H, 3 * H], 0.6, 0.0);
        add(n("attn.c_attn.bias"), vec![3 * H], 0.2, 0.0);
        add(n("attn.c_proj.weight"), vec![H, H], 0.4, 0.0);
        add(n("attn.c_proj.bias"), vec![H], 0.1, 0.0);
        add(n("ln_2.weight"), vec![H], 0.2, 1.0);
        add(n("ln_2.bias"), vec![H], 0.2, 0.0);
        add(n("mlp.c_fc.weight"), vec![H, 4 * H], 0.4, 0.0);
        add(n("mlp.c_fc.bias"), vec![4 * H], 0.1, 0.0);
        add(n("mlp.c_proj.weight"), vec![4 * H, H], 0.3, 0.0);
        add(n("mlp.c_proj.bias"), vec![H], 0.1, 0.0);
    }
    add("transformer.ln_f.weight".into(), vec![H], 0.2, 1.0);
    add("transformer.ln_f.bias".into(), vec![H], 0.2, 0.0);
    w
}

fn write_hf(
    dir: &Path,
    weights: &BTreeMap<String, (Vec<usize>, Vec<f32>)>,
    config: serde_json::Value,
) {
    std::fs::create_dir_all(dir).unwrap();
    let mut views: Vec<(String, TensorView)> = weights
        .iter()
        .map(|(n, (s, v))| {
            (
                n.clone(),
                TensorView::new(Dtype::F32, s.clone(), bytemuck::cast_slice(v)).unwrap(),
            )
        })
        .collect();
    // The causal-mask buffer older checkpoints carry.
    let mask = vec![1.0f32; POS * POS];
    views.push((
        "transformer.h.0.attn.bias".into(),
        TensorView::new(
            Dtype::F32,
            vec![1, 1, POS, POS],
            bytemuck::cast_slice(&mask),
        )
        .unwrap(),
    ));
    let bytes = safetensors::serialize(views, None::<HashMap<String, String>>).unwrap();
    std::fs::write(dir.join("model.safetensors"), bytes).unwrap();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
}

fn hf_config() -> serde_json::Value {
    serde_json::json!({
        "model_type": "gpt2", "vocab_size": V, "n_positions": POS, "n_embd": H, "n_layer": LAYERS,
        "n_head": HEADS, "n_inner": null, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
    })
}

/// Hugging Face's GPT-2 forward, written plainly in f64 from HF's tensors: logits `[T, V]`.
fn reference_logits(w: &BTreeMap<String, (Vec<usize>, Vec<f32>)>, tokens: &[usize]) -> Vec<f64> {
    let g = |n: &str| -> Vec<f64> {
        w[&format!("transformer.{n}")]
            .1
            .iter()
            .map(|&x| f64::from(x))
            .collect()
    };
    let t = tokens.len();
    let d = H / HEADS;
    let ln = |x: &[f64], gamma: &[f64], beta: &[f64]| -> Vec<f64> {
        x.chunks(H)
            .flat_map(|row| {
                let mean = row.iter().sum::<f64>() / H as f64;
                let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / H as f64;
                let r = 1.0 / (var + 1e-5).sqrt();
                row.iter()
                    .enumerate()
                    .map(move |(j, v)| (v - mean) * r * gamma[j] + beta[j])
                    .collect::<Vec<_>>()
            })
            .collect()
    };
    // Conv1D: y = x·W + b with W [in, out].
    let conv = |x: &[f64], wt: &[f64], b: &[f64], inp: usize, out: usize| -> Vec<f64> {
        x.chunks(inp)
            .flat_map(|row| {
                (0..out)
                    .map(move |o| b[o] + (0..inp).map(|i| row[i] * wt[i * out + o]).sum::<f64>())
            })
            .collect()
    };
    let gelu = |x: f64| {
        0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh())
    };
    let (wte, wpe) = (g("wte.weight"), g("wpe.weight"));
    let mut x: Vec<f64> = (0..t)
        .flat_map(|p| (0..H).map(move |j| (p, j)))
        .map(|(p, j)| wte[tokens[p] * H + j] + wpe[p * H + j])
        .collect();
    for l in 0..LAYERS {
        let n = |s: &str| g(&format!("h.{l}.{s}"));
        let a = ln(&x, &n("ln_1.weight"), &n("ln_1.bias"));
        let qkv = conv(
            &a,
            &n("attn.c_attn.weight"),
            &n("attn.c_attn.bias"),
            H,
            3 * H,
        );
        let mut ctx = vec![0.0; t * H];
        for head in 0..HEADS {
            for i in 0..t {
                let q = |p: usize, k: usize| qkv[p * 3 * H + head * d + k];
                let key = |p: usize, k: usize| qkv[p * 3 * H + H + head * d + k];
                let val = |p: usize, k: usize| qkv[p * 3 * H + 2 * H + head * d + k];
                let scores: Vec<f64> = (0..=i)
                    .map(|j| (0..d).map(|k| q(i, k) * key(j, k)).sum::<f64>() / (d as f64).sqrt())
                    .collect();
                let m = scores.iter().cloned().fold(f64::MIN, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for k in 0..d {
                    ctx[i * H + head * d + k] = (0..=i).map(|j| e[j] / z * val(j, k)).sum::<f64>();
                }
            }
        }
        let proj = conv(&ctx, &n("attn.c_proj.weight"), &n("attn.c_proj.bias"), H, H);
        x.iter_mut().zip(&proj).for_each(|(a, b)| *a += b);
        let m = ln(&x, &n("ln_2.weight"), &n("ln_2.bias"));
        let hidden: Vec<f64> = conv(&m, &n("mlp.c_fc.weight"), &n("mlp.c_fc.bias"), H, 4 * H)
            .into_iter()
            .map(gelu)
            .collect();
        let out = conv(
            &hidden,
            &n("mlp.c_proj.weight"),
            &n("mlp.c_proj.bias"),
            4 * H,
            H,
        );
        x.iter_mut().zip(&out).for_each(|(a, b)| *a += b);
    }
    let x = ln(&x, &g("ln_f.weight"), &g("ln_f.bias"));
    let wte = &wte;
    x.chunks(H)
        .flat_map(|row| (0..V).map(move |v| (0..H).map(|j| row[j] * wte[v * H + j]).sum::<f64>()))
        .collect()
}

/// Logits `[s, b, V]` of the imported checkpoint on a tp-way world, from rank 0.
fn our_logits(
    ckpt: &Path,
    config: &GptConfig,
    tokens: &[i64],
    seq: usize,
    batch: usize,
    tp: usize,
) -> Vec<f32> {
    let layout = ParallelLayout::new(&ParallelConfig::new(tp).with_tp(tp)).unwrap();
    launch(tp, |w| -> R<Vec<f32>> {
        let ps = ParallelState::new(&w, &layout)?;
        // Another seed than anything: every value must come from the checkpoint.
        let model = Gpt::build(&config.spec(), &mut Builder::for_rank(77, ps.groups()))?;
        load_params(&model, &open_checkpoint(&ps, ckpt)?)?;
        let cx = Cx::new(&ps, 0).eval();
        Ok(
            megatron::generate::logits(&model, &cx, &Tensor::from_slice(tokens, [seq, batch])?)?
                .to_vec::<f32>()?,
        )
    })
    .unwrap()
    .remove(0)
}

#[test]
fn imported_gpt2_gives_the_reference_logits_and_exports_back() {
    let dir = std::env::temp_dir().join(format!("megatron-hf-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let weights = hf_weights();
    write_hf(&dir.join("hf"), &weights, hf_config());
    let config = hf_gpt2::import(&dir.join("hf"), &dir.join("ckpt"))
        .unwrap()
        .config;
    assert_eq!(
        (config.vocab_size, config.hidden_size, config.num_layers),
        (V, H, LAYERS)
    );
    // Two sequences of 7 tokens, sequence-first as megatron-rs lays activations out.
    let (seq, batch) = (7, 2);
    let seqs: [Vec<usize>; 2] = [vec![3, 17, 42, 8, 8, 0, 49], vec![10, 11, 12, 13, 1, 2, 30]];
    let tokens: Vec<i64> = (0..seq)
        .flat_map(|s| seqs.iter().map(move |q| q[s] as i64))
        .collect();
    for tp in [1, 2] {
        let ours = our_logits(&dir.join("ckpt"), &config, &tokens, seq, batch, tp);
        for (b, q) in seqs.iter().enumerate() {
            let want = reference_logits(&weights, q);
            for s in 0..seq {
                for v in 0..V {
                    let got = f64::from(ours[(s * batch + b) * V + v]);
                    let w = want[s * V + v];
                    assert!(
                        (got - w).abs() <= 1e-4 * (1.0 + w.abs()),
                        "tp {tp} seq {b} pos {s} token {v}: {got} vs {w}"
                    );
                }
            }
        }
    }
    // Back to Hugging Face: the same tensors, bit for bit, and the config.
    hf_gpt2::export(&dir.join("ckpt"), &dir.join("hf_out"), &Default::default()).unwrap();
    let bytes = std::fs::read(dir.join("hf_out/model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    for (name, (shape, values)) in &weights {
        let t = st.tensor(name).unwrap_or_else(|_| panic!("{name} missing"));
        assert_eq!(t.shape(), shape.as_slice(), "{name}");
        let got: Vec<f32> = t
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        assert_eq!(&got, values, "{name}");
    }
    assert_eq!(
        st.len(),
        weights.len(),
        "no other tensors (the head is tied)"
    );
    let out_config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("hf_out/config.json")).unwrap()).unwrap();
    assert_eq!(hf_gpt2::config_from_hf(&out_config).unwrap(), config);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn unsupported_or_broken_hf_checkpoints_are_clear_errors() {
    let dir = std::env::temp_dir().join(format!("megatron-hf-bad-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut config = hf_config();
    config["activation_function"] = "relu".into();
    write_hf(&dir.join("a"), &hf_weights(), config);
    let err = hf_gpt2::import(&dir.join("a"), &dir.join("out"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("activation `relu`"), "{err}");
    let mut weights = hf_weights();
    weights.remove("transformer.h.1.mlp.c_fc.bias");
    write_hf(&dir.join("b"), &weights, hf_config());
    let err = hf_gpt2::import(&dir.join("b"), &dir.join("out"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("no tensor `h.1.mlp.c_fc.bias`"), "{err}");
    assert!(
        !dir.join("out")
            .join("latest_checkpointed_iteration.txt")
            .exists()
    );
    std::fs::remove_dir_all(&dir).ok();
}
