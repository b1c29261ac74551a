//! A loop of several statements over a list of modules, carrying several variables (token ids,
//! a mask, tensors) from one module to the next, reading the parent's own fields and a value from
//! before the loop: multi-token prediction's depths as DeepSeek-V3 and Megatron-LM chain them
//! (with a residual from the model's hidden state besides, to read a value every depth shares). The loop gives exactly what
//! the same depths written out one by one give (losses, reported depth losses and every
//! gradient, bit for bit), and trains at tp 2 × dp 2 and over a pipeline of 2 stages as one
//! rank does.

mod support;

use megatron::comm::ParallelState;
use megatron::comm::threads::launch;
use megatron::module::{Builder, Cx, Module, Site};
use megatron::parallel::{ParallelConfig, ParallelLayout};
use megatron::pipeline_parallel::PipelineLayout;
use megatron::prelude::*;
use megatron::tensor::Tensor;
use megatron::training::{
    BatchPlan, CarriedWidth, DecayStyle, LrSchedule, Sampler, TokenStream, Trainer,
};

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const H: usize = 16;
const VOCAB: usize = 64;

/// A layer norm as a block of the pipeline stack.
#[megatron::module]
pub struct Norm {
    ln: LayerNorm,
}

#[megatron::module]
impl Norm {
    fn forward(&self, x: Tensor) -> Tensor {
        self.ln(x)
    }
}

/// One depth of multi-token prediction: the previous depth's hidden state and the next token's
/// embedding, each normed, side by side, projected back to the hidden size, normed.
#[megatron::module]
pub struct Depth {
    enorm: LayerNorm,
    hnorm: LayerNorm,
    #[column_parallel(gather_output = true)]
    eh_proj: Linear,
    norm: LayerNorm,
}

#[megatron::module]
impl Depth {
    fn forward(&self, h: Tensor, e: Tensor) -> Tensor {
        self.norm(self.eh_proj(cat(self.enorm(e), self.hnorm(h))))
    }
}

/// The depths in a loop: each predicts one token further, with the embedding and the output
/// layer of the model.
#[megatron::module]
pub struct Looped {
    #[vocab_parallel]
    wte: Embedding,
    #[pipeline]
    blocks: Vec<Norm>,
    ln: LayerNorm,
    mtp: Vec<Depth>,
}

#[megatron::module]
impl Looped {
    fn forward(&self, tokens: Ids, targets: Ids) -> Tensor {
        let mut h = self.wte(tokens);
        for block in &self.blocks {
            h = block(h);
        }
        h = self.ln(h);
        let mut losses = cross_entropy(self.wte.logits(h), targets);
        // Read by every depth from before the loop (a residual from the model's last hidden
        // state, here to show a value the iterations share).
        let model = h;
        let mut ids = tokens;
        let mut labels = targets;
        let mut mask = loss_mask(targets);
        for depth in &self.mtp {
            ids = shift_left(ids);
            labels = shift_left(labels);
            mask = shift_left(mask);
            h = depth(h, self.wte(ids)) + model;
            let depth_losses = cross_entropy(self.wte.logits(h), labels);
            losses = aux_loss(losses, depth_losses, mask, 0.3, "mtp");
        }
        losses
    }
}

impl CarriedWidth for Looped {
    fn carried_width(&self) -> usize {
        self.ln.hidden()
    }
}

/// The same two depths written out.
#[megatron::module]
pub struct Unrolled {
    #[vocab_parallel]
    wte: Embedding,
    #[pipeline]
    blocks: Vec<Norm>,
    ln: LayerNorm,
    first: Depth,
    second: Depth,
}

#[megatron::module]
impl Unrolled {
    fn forward(&self, tokens: Ids, targets: Ids) -> Tensor {
        let mut h = self.wte(tokens);
        for block in &self.blocks {
            h = block(h);
        }
        let h = self.ln(h);
        let losses = cross_entropy(self.wte.logits(h), targets);
        let ids = shift_left(tokens);
        let labels = shift_left(targets);
        let mask = shift_left(loss_mask(targets));
        let h1 = self.first(h, self.wte(ids)) + h;
        let l1 = cross_entropy(self.wte.logits(h1), labels);
        let losses = aux_loss(losses, l1, mask, 0.3, "mtp_1");
        let h2 = self.second(h1, self.wte(shift_left(ids))) + h;
        let l2 = cross_entropy(self.wte.logits(h2), shift_left(labels));
        aux_loss(losses, l2, shift_left(mask), 0.3, "mtp_2")
    }
}

impl CarriedWidth for Unrolled {
    fn carried_width(&self) -> usize {
        self.ln.hidden()
    }
}

/// The model without depths, to compare an empty list with.
#[megatron::module]
pub struct Plain {
    #[vocab_parallel]
    wte: Embedding,
    #[pipeline]
    blocks: Vec<Norm>,
    ln: LayerNorm,
}

#[megatron::module]
impl Plain {
    fn forward(&self, tokens: Ids, targets: Ids) -> Tensor {
        let mut h = self.wte(tokens);
        for block in &self.blocks {
            h = block(h);
        }
        h = self.ln(h);
        cross_entropy(self.wte.logits(h), targets)
    }
}

impl CarriedWidth for Plain {
    fn carried_width(&self) -> usize {
        self.ln.hidden()
    }
}

fn depth() -> DepthSpec {
    DepthSpec {
        enorm: LayerNormSpec::new(H),
        hnorm: LayerNormSpec::new(H),
        eh_proj: LinearSpec::new(2 * H, H).with_bias(false),
        norm: LayerNormSpec::new(H),
    }
}

fn looped_spec(blocks: usize) -> LoopedSpec {
    LoopedSpec {
        wte: EmbeddingSpec::new(VOCAB, H),
        blocks: vec![
            NormSpec {
                ln: LayerNormSpec::new(H)
            };
            blocks
        ],
        ln: LayerNormSpec::new(H),
        mtp: vec![depth(), depth()],
    }
}

fn ids(salt: usize) -> Tensor {
    let v: Vec<i64> = (0..8 * 2)
        .map(|i| ((i * 7 + salt * 3) % VOCAB) as i64)
        .collect();
    Tensor::from_vec(v, [8, 2]).unwrap()
}

/// Every parameter's value or gradient, in visiting order.
fn params<M: Module>(m: &M, grads: bool) -> Vec<Vec<f32>> {
    let mut out = Vec::new();
    m.visit_params(&mut |p| {
        let t = if grads { p.grad() } else { p.value() };
        out.push(t.to_vec::<f32>().unwrap());
    });
    out
}

#[test]
fn the_loop_computes_what_the_depths_written_out_compute() {
    let layout = ParallelLayout::new(&ParallelConfig::new(1)).unwrap();
    launch(1, |w| -> R<()> {
        let ps = ParallelState::new(&w, &layout)?;
        let looped = Looped::build(&looped_spec(1), &mut Builder::for_rank(5, ps.groups()))?;
        let spec = UnrolledSpec {
            wte: EmbeddingSpec::new(VOCAB, H),
            blocks: vec![NormSpec {
                ln: LayerNormSpec::new(H),
            }],
            ln: LayerNormSpec::new(H),
            first: depth(),
            second: depth(),
        };
        let mut unrolled = Unrolled::build(&spec, &mut Builder::for_rank(6, ps.groups()))?;
        // The same weights, in the same visiting order.
        let values = params(&looped, false);
        let mut k = 0;
        unrolled.visit_params_mut(&mut |p| {
            p.value()
                .copy_from(&Tensor::from_vec(values[k].clone(), p.value().dims().to_vec()).unwrap())
                .unwrap();
            k += 1;
        });
        assert_eq!(k, values.len());
        let cx = Cx::new(&ps, 9);
        let (tokens, targets) = (ids(1), ids(2));
        let (a, sa) = looped.forward(&cx, Site::ROOT, &tokens, &targets)?;
        let (b, sb) = unrolled.forward(&cx, Site::ROOT, &tokens, &targets)?;
        assert_eq!(a.to_vec::<f32>()?, b.to_vec::<f32>()?);
        let d = Tensor::from_vec(vec![1.0f32 / 16.0; 16], [8, 2])?;
        looped.backward(&cx, Site::ROOT, sa, &d)?;
        unrolled.backward(&cx, Site::ROOT, sb, &d)?;
        let (ga, gb) = (params(&looped, true), params(&unrolled, true));
        assert_eq!(ga.len(), gb.len());
        for (i, (x, y)) in ga.iter().zip(&gb).enumerate() {
            assert_eq!(x, y, "parameter {i}'s gradient");
        }
        // The depths' parameters have gradients (the auxiliary losses reached them).
        assert!(ga.last().unwrap().iter().any(|&g| g != 0.0));
        Ok(())
    })
    .unwrap();
}

/// Each step's loss and the two depths' reported losses, rank 0's, at `tp × dp × pp` (sequence
/// parallelism with tp 2).
fn train(tp: usize, dp: usize, pp: usize) -> Vec<(f64, f64, f64)> {
    let layout =
        ParallelLayout::new(&ParallelConfig::new(tp * dp * pp).with_tp(tp).with_pp(pp)).unwrap();
    let blocks = 2;
    let stages = PipelineLayout::new(blocks, pp, 1, None, None).unwrap();
    let text = "Each depth predicts one token further than the one before it. ".repeat(20);
    let mut out = launch(tp * dp * pp, |w| -> R<Vec<(f64, f64, f64)>> {
        let ps = ParallelState::new(&w, &layout)?.with_sequence_parallel(tp > 1);
        let plan = BatchPlan {
            seq_length: 16,
            micro_batch: 2,
            global_batch: 8,
            dp,
        };
        let bytes: Vec<u8> = text.bytes().map(|b| b % VOCAB as u8).collect();
        let sampler = Sampler::windows(TokenStream::from_bytes(&bytes), plan, 7)?;
        let schedule = LrSchedule {
            max_lr: 1e-2,
            min_lr: 1e-3,
            warmup_steps: 1,
            decay_steps: 6,
            style: DecayStyle::Cosine,
        };
        let config = support::train_config(schedule, 3, usize::MAX);
        let b = Builder::for_rank(5, ps.groups()).with_stage(stages.part(ps.pp().index(), 0));
        let model = Looped::build(&looped_spec(blocks), &mut { b })?;
        let mut trainer = Trainer::pipelined(vec![model], &ps, sampler, config, None)?;
        trainer.log_aux_losses(vec!["mtp_1".into(), "mtp_2".into()]);
        (0..6)
            .map(|s| {
                let m = trainer.step(&ps, s)?;
                Ok((m.loss, m.aux_losses[0].1, m.aux_losses[1].1))
            })
            .collect()
    })
    .unwrap();
    out.remove(0)
}

#[test]
fn depths_in_a_loop_train_at_every_layout_as_one_rank() {
    let one = train(1, 1, 1);
    assert!(one[5].0 < one[0].0 && one[5].1 < one[0].1, "{one:?}");
    // The second depth predicts further: a higher loss.
    assert!(one[0].2 > one[0].0, "{one:?}");
    for (tp, dp, pp) in [(2, 2, 1), (1, 1, 2), (2, 1, 2)] {
        let got = train(tp, dp, pp);
        for (step, (a, b)) in got.iter().zip(&one).enumerate() {
            for (x, y) in [(a.0, b.0), (a.1, b.1), (a.2, b.2)] {
                assert!(
                    (x - y).abs() <= 1e-5 * y.abs(),
                    "tp {tp} dp {dp} pp {pp} step {step}: {a:?} vs {b:?}"
                );
            }
        }
    }
}

/// Over an empty list the loop leaves its carried variables as they came, and what it would
/// have read gets no gradient from it: the model computes what it computes without the loop,
/// bit for bit (no zeros added to the gradients the loop would have given).
#[test]
fn an_empty_list_runs_no_body() {
    let layout = ParallelLayout::new(&ParallelConfig::new(1)).unwrap();
    launch(1, |w| -> R<()> {
        let ps = ParallelState::new(&w, &layout)?;
        let spec = LoopedSpec {
            mtp: Vec::new(),
            ..looped_spec(1)
        };
        let with = Looped::build(&looped_spec(1), &mut Builder::for_rank(5, ps.groups()))?;
        let without = Looped::build(&spec, &mut Builder::for_rank(5, ps.groups()))?;
        let plain_spec = PlainSpec {
            wte: spec.wte.clone(),
            blocks: spec.blocks.clone(),
            ln: spec.ln.clone(),
        };
        let plain = Plain::build(&plain_spec, &mut Builder::for_rank(5, ps.groups()))?;
        let cx = Cx::new(&ps, 9);
        let (tokens, targets) = (ids(1), ids(2));
        let (a, sa) = with.forward(&cx, Site::ROOT, &tokens, &targets)?;
        let (b, sb) = without.forward(&cx, Site::ROOT, &tokens, &targets)?;
        let (c, sc) = plain.forward(&cx, Site::ROOT, &tokens, &targets)?;
        // The depths' losses ride on the model's without changing them.
        assert_eq!(a.to_vec::<f32>()?, b.to_vec::<f32>()?);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&b.to_vec::<f32>()?), bits(&c.to_vec::<f32>()?));
        let d = Tensor::from_vec(vec![1.0f32 / 16.0; 16], [8, 2])?;
        with.backward(&cx, Site::ROOT, sa, &d)?;
        without.backward(&cx, Site::ROOT, sb, &d)?;
        plain.backward(&cx, Site::ROOT, sc, &d)?;
        let (ga, gb, gc) = (
            params(&with, true),
            params(&without, true),
            params(&plain, true),
        );
        assert_eq!(gb.len(), 5, "wte, the block's and the final norm's");
        for (i, (x, y)) in gb.iter().zip(&gc).enumerate() {
            assert_eq!(bits(x), bits(y), "parameter {i}'s gradient");
        }
        // Without depths, the embedding's gradient is the main loss's alone.
        assert_ne!(ga[0], gb[0]);
        Ok(())
    })
    .unwrap();
}
