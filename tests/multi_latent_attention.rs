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
