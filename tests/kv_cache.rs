//! Generation's KV cache (issue 34): a prefill of the first positions and then one position a
//! step gives the logits the model's full forward gives every position, for GPT-2's learned
//! positions, a Llama (rotary embeddings from the cache's offset, grouped-query attention,
//! qk-layernorm, a sliding window) and a Mixtral (routed SwiGLU experts), at tp 1 and tp 2
//! (each rank caching its own heads), with two sequences in the batch.

mod support;

use megatron::comm::ParallelState;
use megatron::comm::threads::launch;
use megatron::inference::KvCache;
use megatron::models::gpt::Gpt;
use megatron::models::{GptConfig, MoeConfig, MoeLayerFreq};
use megatron::module::{Builder, Cx, Module};
use megatron::moe::RouterConfig;
use megatron::parallel::{ParallelConfig, ParallelLayout};
use megatron::tensor::Tensor;

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const SEQ: usize = 11;
const BATCH: usize = 2;
const PREFILL: usize = 4;

/// The test Llama with a sliding window of 3 in its first layer.
fn llama() -> GptConfig {
    let mut c = support::llama_like(0.0);
    c.window_size = Some(3);
    c.window_layers = Some(vec![true, false]);
    c
}

fn mixtral() -> GptConfig {
    llama().with_moe(MoeConfig {
        router: RouterConfig::new(4, 2),
        ffn_hidden_size: 16,
        layer_freq: MoeLayerFreq::Every(1),
        shared_expert_ffn: None,
        dispatcher: Default::default(),
    })
}

/// Each position's logits `[s, b, vocab]`: by one full forward, and by a prefill of the first
/// `PREFILL` positions then one position a step with a cache; rank 0's. With `bf16`, every
/// product of bf16 operands summed in f32 (a `--bf16` run's).
fn full_and_cached(config: &GptConfig, tp: usize, bf16: bool) -> (Vec<f32>, Vec<f32>) {
    let layout = ParallelLayout::new(&ParallelConfig::new(tp).with_tp(tp)).unwrap();
    let tokens = support::token_ids(SEQ, BATCH, 3).to_vec::<i64>().unwrap();
    launch(tp, |w| -> R<(Vec<f32>, Vec<f32>)> {
        let ps = ParallelState::new(&w, &layout)?;
        let _products = megatron::ops::cpu_bf16_products(bf16);
        let model = Gpt::build(&config.spec(), &mut Builder::for_rank(9, ps.groups()))?;
        let cx = Cx::new(&ps, 0).eval();
        let ids = |from: usize, to: usize| -> R<Tensor> {
            Ok(Tensor::from_vec(
                tokens[from * BATCH..to * BATCH].to_vec(),
                [to - from, BATCH],
            )?)
        };
        let full = megatron::generate::logits(&model, &cx, &ids(0, SEQ)?)?.to_vec::<f32>()?;
        let cache = KvCache::new();
        let decode = cx.with_kv_cache(&cache);
        let mut cached = Vec::new();
        let mut at = 0;
        for to in std::iter::once(PREFILL).chain(PREFILL + 1..=SEQ) {
            let logits = megatron::generate::logits(&model, &decode, &ids(at, to)?)?;
            cached.extend(logits.to_vec::<f32>()?);
            cache.advance(to - at);
            at = to;
        }
        assert_eq!(cache.offset(), SEQ);
        Ok((full, cached))
    })
    .unwrap()
    .remove(0)
}

#[test]
fn cached_decoding_gives_the_full_forwards_logits() {
    for (name, config) in [
        ("gpt", support::tiny_gpt(0.0)),
        ("llama", llama()),
        ("mixtral", mixtral()),
    ] {
        for tp in [1, 2] {
            let (full, cached) = full_and_cached(&config, tp, false);
            assert_eq!(full.len(), cached.len(), "{name}");
            // The same products over fewer rows at a time: f32's last places.
            support::assert_close_to_scale(&cached, &full, 1e-5, &format!("{name} tp {tp}"));
        }
    }
}

#[test]
fn cached_bf16_decoding_gives_the_full_bf16_forwards_logits() {
    // In bf16 the cache's attention products round their operands as the full forward's do.
    // Products of bf16 values are exact in f32, and on these small models their sums are too:
    // the two agree to f32's last places as in f32 (attention products left in f32 in the
    // cache would differ by about 1e-3 here).
    for (name, config) in [("gpt", support::tiny_gpt(0.0)), ("llama", llama())] {
        for tp in [1, 2] {
            let (full, cached) = full_and_cached(&config, tp, true);
            support::assert_close_to_scale(&cached, &full, 1e-5, &format!("{name} tp {tp}"));
        }
    }
}

#[test]
fn a_cache_that_does_not_fit_the_forward_is_refused() {
    let layout = ParallelLayout::new(&ParallelConfig::new(1)).unwrap();
    let config = llama();
    launch(1, |w| -> R<()> {
        let ps = ParallelState::new(&w, &layout)?;
        let model = Gpt::build(&config.spec(), &mut Builder::for_rank(9, ps.groups()))?;
        let cx = Cx::new(&ps, 0).eval();
        let cache = KvCache::new();
        let decode = cx.with_kv_cache(&cache);
        let ids = support::token_ids(3, 1, 0);
        megatron::generate::logits(&model, &decode, &ids)?;
        // The caller did not advance the offset: the layers hold 3 positions, the forward
        // would start at 0 again.
        let err = megatron::generate::logits(&model, &decode, &ids).unwrap_err();
        assert!(
            err.to_string()
                .contains("the layer's cache holds 3 positions, the forward starts at position 0"),
            "{err}"
        );
        // A decoding forward keeps nothing for a backward.
        cache.clear();
        let (_, saved) = model.forward(&decode, megatron::module::Site::ROOT, &ids, &ids)?;
        let loss = Tensor::from_vec(vec![1.0f32; 3], [3, 1])?;
        let err = model
            .backward(&decode, megatron::module::Site::ROOT, saved, &loss)
            .unwrap_err();
        assert!(err.to_string().contains("has no backward"), "{err}");
        Ok(())
    })
    .unwrap();
}
