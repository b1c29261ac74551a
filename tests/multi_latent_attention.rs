//! Multi-latent attention as a layer (megatron-models' `LatentAttention` and
//! `LatentKvAttention`): its backward against finite differences of its forward (the input's
//! gradient and every parameter's, with YaRN's frequencies and softmax scale), and the
//! parameter count the config reports against the model it builds.

mod support;

use megatron::comm::ParallelState;
use megatron::comm::threads::launch;
use megatron::models::gpt::Gpt;
use megatron::models::self_attention::{SelfAttention, SelfAttentionSpec};
use megatron::models::{GptConfig, MlaConfig, PositionEmbeddingType};
use megatron::module::{Builder, Cx, Module, Site};
use megatron::parallel::{ParallelConfig, ParallelLayout};
use megatron::tensor::Tensor;
use megatron::tensor_parallel::{Normalization, Yarn};

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// A 2-layer model of hidden 24, 4 heads of multi-latent attention (query latent `q_lora_rank`)
/// with YaRN ×4 from 8 positions, LayerNorm `norm` with biases or RMSNorm without.
fn config(q_lora_rank: Option<usize>, norm: Normalization) -> GptConfig {
    let mut c = GptConfig::new(2, 24, 4, 64, 32);
    c.position_embedding_type = PositionEmbeddingType::Rope;
    c.normalization = norm;
    c.add_bias_linear = norm == Normalization::LayerNorm;
    c.qk_layernorm = true;
    c.attention_dropout = 0.0;
    c.rotary.yarn = Some(Yarn {
        original_max_position_embeddings: 8,
        mscale: 0.8,
        mscale_all_dim: 1.0,
        ..Yarn::megatron(4.0)
    });
    c.mla = Some(MlaConfig {
        q_lora_rank,
        kv_lora_rank: 10,
        qk_head_dim: 6,
        qk_pos_emb_head_dim: 4,
        v_head_dim: 5,
        latent_norm_epsilon: None,
    });
    c
}

#[test]
fn the_backward_matches_finite_differences() {
    for q_lora_rank in [Some(12), None] {
        let c = config(q_lora_rank, Normalization::RmsNorm);
        let spec: SelfAttentionSpec = c.spec().blocks.remove(0).attn;
        let (s, b, h) = (7, 2, c.hidden_size);
        let x = support::values(s * b * h, 3, 2.0);
        let w = support::values(s * b * h, 4, 2.0);
        let layout = ParallelLayout::new(&ParallelConfig::new(1)).unwrap();
        launch(1, |world| -> R<()> {
            let ps = ParallelState::new(&world, &layout)?;
            let cx = Cx::new(&ps, 1);
            let attn = SelfAttention::build(&spec, &mut Builder::new(11))?;
            // Σ w·y in f64: its gradient with respect to y is w.
            let loss = |x: &[f32]| -> f64 {
                let t = Tensor::from_vec(x.to_vec(), [s, b, h]).unwrap();
                let (y, _) = attn.forward(&cx, Site::ROOT, &t).unwrap();
                let y = y.to_vec::<f32>().unwrap();
                y.iter().zip(&w).map(|(a, b)| *a as f64 * *b as f64).sum()
            };
            let t = Tensor::from_vec(x.clone(), [s, b, h])?;
            let (_, saved) = attn.forward(&cx, Site::ROOT, &t)?;
            let dy = Tensor::from_vec(w.clone(), [s, b, h])?;
            let dx = attn
                .backward(&cx, Site::ROOT, saved, &dy)?
                .to_vec::<f32>()?;
            let eps = 1e-3f32;
            // The derivative along a random direction, by central differences.
            let along = |f: &dyn Fn(f32) -> f64| (f(eps) - f(-eps)) / (2.0 * eps as f64);
            let dot = |a: &[f32], v: &[f32]| -> f64 {
                a.iter().zip(v).map(|(a, v)| *a as f64 * *v as f64).sum()
            };
            let dir = support::values(x.len(), 8, 2.0);
            let numeric = along(&|e| {
                let shifted: Vec<f32> = x.iter().zip(&dir).map(|(a, v)| a + e * v).collect();
                loss(&shifted)
            });
            let analytic = dot(&dx, &dir);
            let what = format!("q_lora_rank {q_lora_rank:?}");
            assert!(
                (numeric - analytic).abs() <= 2e-3 * analytic.abs().max(1.0),
                "{what} dx: {numeric} vs {analytic}"
            );
            let mut names = Vec::new();
            attn.visit_params(&mut |p| {
                let name = p.spec().name.clone();
                let value = p.value().to_vec::<f32>().unwrap();
                let grad = p.grad().to_vec::<f32>().unwrap();
                let dir = support::values(value.len(), 9 + names.len() as u64, 2.0);
                let numeric = along(&|e| {
                    let moved: Vec<f32> = value.iter().zip(&dir).map(|(a, v)| a + e * v).collect();
                    p.set_values(&Tensor::from_vec(moved, p.value().shape().clone()).unwrap())
                        .unwrap();
                    let l = loss(&x);
                    p.set_values(
                        &Tensor::from_vec(value.clone(), p.value().shape().clone()).unwrap(),
                    )
                    .unwrap();
                    l
                });
                let analytic = dot(&grad, &dir);
                assert!(
                    (numeric - analytic).abs() <= 3e-3 * analytic.abs().max(1.0),
                    "{what} d{name}: {numeric} vs {analytic}"
                );
                names.push(name);
            });
            let want: &[&str] = match q_lora_rank {
                Some(_) => &[
                    "q_down.weight",
                    "q_norm.weight",
                    "q_up.weight",
                    "kv_down.weight",
                    "kv_norm.weight",
                    "kv_up.weight",
                    "proj.weight",
                ],
                None => &[
                    "q.weight",
                    "kv_down.weight",
                    "kv_norm.weight",
                    "kv_up.weight",
                    "proj.weight",
                ],
            };
            assert_eq!(names, want, "{what}");
            Ok(())
        })
        .unwrap();
    }
}

#[test]
fn the_config_counts_the_parameters_the_model_builds() {
    for (q_lora_rank, norm) in [
        (Some(12), Normalization::RmsNorm),
        (None, Normalization::RmsNorm),
        (Some(12), Normalization::LayerNorm),
    ] {
        let c = config(q_lora_rank, norm);
        let model = Gpt::build(&c.spec(), &mut Builder::new(3)).unwrap();
        let mut built = 0;
        model.visit_params(&mut |p| built += p.spec().logical.numel());
        assert_eq!(built, c.num_params(1), "{q_lora_rank:?} {norm:?}");
    }
}

/// Decoding with the compressed cache (a prefill of 5 positions, then one at a time) gives the
/// logits the full forward gives each position, with and without a query latent, at tp 1 and 2
/// (each rank caching its latents whole and attending with its own heads).
#[test]
fn decoding_with_the_compressed_cache_gives_the_full_forward_logits() {
    use megatron::inference::KvCache;
    for q_lora_rank in [Some(12), None] {
        let mut c = config(q_lora_rank, Normalization::RmsNorm);
        c.untie_embeddings_and_output_weights = true;
        let tokens: Vec<i64> = (0..11).map(|i| (i * 7 + 3) % 64).collect();
        for tp in [1, 2] {
            let layout = ParallelLayout::new(&ParallelConfig::new(tp).with_tp(tp)).unwrap();
            let (full, decoded, bytes) = launch(tp, |w| -> R<(Vec<f32>, Vec<f32>, usize)> {
                let ps = ParallelState::new(&w, &layout)?;
                let model = Gpt::build(&c.spec(), &mut Builder::for_rank(5, ps.groups()))?;
                let cx = Cx::new(&ps, 0).eval();
                let ids = |t: &[i64]| Tensor::from_slice(t, [t.len(), 1]);
                let full = megatron::generate::logits(&model, &cx, &ids(&tokens)?)?;
                let cache = KvCache::new();
                let decode = cx.with_kv_cache(&cache);
                let mut decoded = Vec::new();
                let mut at = 0;
                for len in [5, 1, 1, 1, 1, 1, 1] {
                    let part =
                        megatron::generate::logits(&model, &decode, &ids(&tokens[at..at + len])?)?;
                    decoded.extend(part.to_vec::<f32>()?);
                    cache.advance(len);
                    at += len;
                }
                Ok((full.to_vec::<f32>()?, decoded, cache.bytes_per_token()))
            })
            .unwrap()
            .remove(0);
            let what = format!("q_lora_rank {q_lora_rank:?} tp {tp}");
            assert_eq!(full.len(), decoded.len(), "{what}");
            support::assert_close_to_scale(&decoded, &full[..decoded.len()], 1e-5, &what);
            // Per layer the latent (10) and the rotary key (4), f32, on each rank: not the
            // heads' keys and values (2 heads · (6 + 4 + 5) at tp 2).
            assert_eq!(bytes, 2 * 4 * (10 + 4), "{what}");
        }
    }
}
