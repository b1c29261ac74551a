//! Packed documents and Megatron-LM's masking flags (`--eod-mask-loss`,
//! `--reset-position-ids`, `--reset-attention-mask`, `--calculate-per-token-loss`):
//!
//! * a sequence of several packed documents with positions and attention reset gives each
//!   document the per-token losses and the parameter gradients it has alone (learned
//!   positions, rotary embeddings with grouped queries and query/key norms, a sliding window,
//!   attention dropout drawn per document);
//! * training on packed, masked data gives the same losses and gradient norms at every layout
//!   as on one rank (tp with and without sequence parallelism, pipelines with virtual stages,
//!   dp with the distributed optimizer, every cp form, ep with MoE, recompute, bf16), with both loss
//!   normalizations, and with attention dropout under context parallelism;
//! * a microbatch that counts no token adds nothing and says so, and the loss is the mean over
//!   the counted tokens.

mod support;

use std::sync::Arc;

use megatron::comm::ParallelState;
use megatron::comm::threads::launch;
use megatron::context_parallel::CpCommType;
use megatron::data::SampleSource;
use megatron::documents::Documents;
use megatron::models::gpt::Gpt;
use megatron::models::{GptConfig, MoeConfig, MoeLayerFreq};
use megatron::module::{Builder, Cx, Module, Recompute};
use megatron::moe::RouterConfig;
use megatron::optimizer::{Precision, PrecisionFlags};
use megatron::parallel::{ParallelConfig, ParallelLayout};
use megatron::pipeline_parallel::PipelineLayout;
use megatron::tensor::{DType, Tensor};
use megatron::training::{
    BatchPlan, DecayStyle, LanguageModel, LrSchedule, MaskFlags, Sampler, TokenStream, TrainConfig,
    Trainer, Windows,
};

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// The end-of-document token of the tests' data (a byte: the newline).
const EOD: u32 = b'\n' as u32;
const SEQ: usize = 16;

/// Two samples of 16 tokens (sequence first): the first packs documents of 5, 7 and 4
/// tokens, the second of 9 and 7; each document but the last ends with `EOD`.
fn packed() -> (Vec<i64>, Vec<i64>, Vec<Vec<std::ops::Range<usize>>>) {
    let lengths = [vec![5, 7, 4], vec![9, 7]];
    let mut samples = Vec::new();
    let mut docs = Vec::new();
    for (j, lens) in lengths.iter().enumerate() {
        let mut s = Vec::new();
        let mut ranges = Vec::new();
        for (d, &len) in lens.iter().enumerate() {
            let start = s.len();
            for i in 0..len {
                s.push(((start + i) * 29 + j * 7 + d * 13) as i64 % 200 + 20);
            }
            if d + 1 < lens.len() {
                *s.last_mut().unwrap() = i64::from(EOD);
            }
            ranges.push(start..s.len());
        }
        samples.push(s);
        docs.push(ranges);
    }
    let seq_first = |v: &dyn Fn(usize, usize) -> i64| -> Vec<i64> {
        (0..SEQ)
            .flat_map(|i| (0..2).map(move |j| (i, j)))
            .map(|(i, j)| v(i, j))
            .collect()
    };
    let tokens = seq_first(&|i, j| samples[j][i]);
    let targets = seq_first(&|i, j| (samples[j][i] * 3 + 1) % 250);
    (tokens, targets, docs)
}

/// Per-token losses (sequence first) and every parameter gradient of one forward and
/// backward of `config` on `tokens`/`targets` (`[len, batch]`), with `documents` if any.
fn run(
    model: &Gpt,
    ps: &ParallelState,
    (tokens, targets): (Tensor, Tensor),
    documents: Option<&Documents>,
) -> R<Vec<f32>> {
    let cx = Cx::new(ps, 5).at(1, 2);
    let cx = match documents {
        Some(d) => cx.with_documents(d),
        None => cx,
    };
    let (losses, saved) = model.losses(&cx, &tokens, &targets)?;
    let out = losses.to_vec_f32()?;
    let ones = Tensor::zeros(losses.shape().clone(), DType::F32);
    ones.fill(1.0)?;
    model.backward_losses(&cx, saved, &ones)?;
    Ok(out)
}

fn grads(model: &Gpt) -> Vec<Vec<f32>> {
    let mut g = Vec::new();
    model.visit_params(&mut |p| g.push(p.grad().to_vec::<f32>().unwrap()));
    g
}

fn assert_close(a: &[f32], b: &[f32], what: &str) {
    let scale = b.iter().fold(1e-3f32, |m, v| m.max(v.abs()));
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= 2e-5 * scale,
            "{what}[{i}]: {x} vs {y} (scale {scale})"
        );
    }
}

/// Packed documents against each alone, for `config`.
fn documents_alone(config: &GptConfig) {
    let (tokens, targets, docs) = packed();
    let layout = ParallelLayout::new(&ParallelConfig::new(1)).unwrap();
    let spec = config.spec();
    launch(1, |w| -> R<()> {
        let ps = ParallelState::new(&w, &layout)?;
        let documents = Documents::from_tokens(&tokens, SEQ, 2, EOD, true, true)?;
        let packed_model = Gpt::build(&spec, &mut Builder::for_rank(3, ps.groups()))?;
        let whole = |v: &[i64]| Tensor::from_vec(v.to_vec(), [SEQ, 2]);
        let losses = run(
            &packed_model,
            &ps,
            (whole(&tokens)?, whole(&targets)?),
            Some(&documents),
        )?;
        let plain_model = Gpt::build(&spec, &mut Builder::for_rank(3, ps.groups()))?;
        let plain = run(&plain_model, &ps, (whole(&tokens)?, whole(&targets)?), None)?;
        let alone_model = Gpt::build(&spec, &mut Builder::for_rank(3, ps.groups()))?;
        let mut differs = false;
        for (j, ranges) in docs.iter().enumerate() {
            for r in ranges {
                let pick = |v: &[i64]| -> Vec<i64> { r.clone().map(|i| v[i * 2 + j]).collect() };
                let part = |v: &[i64]| Tensor::from_vec(pick(v), [r.len(), 1]);
                let alone = run(&alone_model, &ps, (part(&tokens)?, part(&targets)?), None)?;
                let packed: Vec<f32> = r.clone().map(|i| losses[i * 2 + j]).collect();
                assert_close(
                    &packed,
                    &alone,
                    &format!("sample {j} document {r:?} losses"),
                );
                let unmasked: Vec<f32> = r.clone().map(|i| plain[i * 2 + j]).collect();
                differs |= r.start > 0
                    && unmasked
                        .iter()
                        .zip(&alone)
                        .any(|(a, b)| (a - b).abs() > 1e-4);
            }
        }
        // Without the documents the later ones see the earlier: the test can fail.
        assert!(differs, "the plain run gave every document its own losses");
        for (k, (p, a)) in grads(&packed_model)
            .iter()
            .zip(grads(&alone_model))
            .enumerate()
        {
            assert_close(p, &a, &format!("gradient {k}"));
        }
        Ok(())
    })
    .unwrap();
}

#[test]
fn packed_documents_have_the_losses_and_gradients_they_have_alone() {
    let mut gpt = support::tiny_gpt(0.0);
    gpt.max_position_embeddings = SEQ;
    documents_alone(&gpt);
    documents_alone(&support::llama_like(0.0));
    let mut window = support::llama_like(0.0);
    window.window_size = Some(3);
    documents_alone(&window);
}

/// Windows of newline-separated lines of different lengths (many documents a sample).
fn lines() -> TokenStream {
    let text: String = (0..400)
        .map(|i| {
            let words = ["pack", "the", "documents", "apart", "mask", "loss"];
            let n = 1 + (i * 7) % 5;
            let line: Vec<&str> = (0..n).map(|k| words[(i + k) % words.len()]).collect();
            format!("{}\n", line.join(" "))
        })
        .collect();
    TokenStream::from_bytes(text.as_bytes())
}

/// Packed samples of documents 4, 8 or 16 positions long, in turn [8, 8], [4, 4, 8], [16] and
/// [4, 12]: at cp 2 every sample is cut document by document (`thd`), at cp 4 the first and
/// third (the others as one sequence).
struct Aligned;

impl SampleSource for Aligned {
    fn len(&self) -> usize {
        64
    }

    fn sample(&self, i: u64) -> megatron::data::Result<Vec<u32>> {
        let words = b"aligned documents cut into chunks of every rank ";
        Ok((0..=SEQ as u64)
            .map(|k| u32::from(words[((i * 7 + k * 3) % words.len() as u64) as usize]))
            .collect())
    }

    fn documents(&self, i: u64) -> megatron::data::Result<Option<Vec<usize>>> {
        let starts: &[usize] = [&[8][..], &[4, 8], &[], &[4]][(i % 4) as usize];
        Ok(Some(starts.to_vec()))
    }

    fn has_documents(&self) -> bool {
        true
    }
}

/// A layout of a training run.
#[derive(Debug, Clone, Copy, Default)]
struct Layout {
    tp: usize,
    sp: bool,
    pp: usize,
    vpp: usize,
    dp: usize,
    cp: usize,
    distopt: bool,
    recompute: Option<Recompute>,
    /// Hidden and attention dropout of 0.1 (attention's drawn per document).
    dropout: bool,
    /// How context-parallel attention exchanges keys and values.
    cp_kind: CpCommType,
    /// Expert parallelism (with MoE MLPs: 4 experts, top 2, in every layer).
    ep: usize,
    moe: bool,
    /// Mixed precision, bf16.
    bf16: bool,
    /// Packed samples one a microbatch whose documents are multiples of 4 (some of 8) long:
    /// context parallelism cuts them one by one (`thd`) where 2·cp divides them.
    aligned: bool,
}

fn one() -> Layout {
    Layout {
        tp: 1,
        pp: 1,
        vpp: 1,
        dp: 1,
        cp: 1,
        ep: 1,
        ..Layout::default()
    }
}

/// Losses, gradient norms and counted tokens of 3 steps of the Llama-like model on packed,
/// masked lines.
fn train(layout: Layout, flags: MaskFlags) -> Vec<(f64, f64, Option<usize>)> {
    try_train(layout, flags).unwrap()
}

/// [`train`], or the first rank's error.
fn try_train(layout: Layout, flags: MaskFlags) -> R<Vec<(f64, f64, Option<usize>)>> {
    let Layout {
        tp,
        sp,
        pp,
        vpp,
        dp,
        cp,
        distopt,
        recompute,
        dropout,
        cp_kind,
        ep,
        moe,
        bf16,
        aligned,
    } = layout;
    let world = tp * pp * dp * cp;
    let parallel = ParallelLayout::new(
        &ParallelConfig::new(world)
            .with_tp(tp)
            .with_pp(pp)
            .with_cp(cp)
            .with_ep(ep),
    )
    .unwrap();
    let mut config = support::llama_like(if dropout { 0.1 } else { 0.0 });
    config.num_layers = 4;
    if moe {
        config = config.with_moe(MoeConfig {
            router: RouterConfig::new(4, 2),
            ffn_hidden_size: 16,
            layer_freq: MoeLayerFreq::Every(1),
            shared_expert_ffn: None,
            dispatcher: Default::default(),
        });
    }
    let spec = config.spec();
    let stages = PipelineLayout::new(4, pp, vpp, None, None).unwrap();
    launch(world, |w| -> R<_> {
        let ps = ParallelState::new(&w, &parallel)?
            .with_sequence_parallel(sp)
            .with_cp_comm_type(&w, cp_kind)?;
        let plan = BatchPlan {
            seq_length: SEQ,
            micro_batch: if aligned { 1 } else { 2 },
            global_batch: 8,
            dp,
        };
        let source: Arc<dyn SampleSource> = match aligned {
            true => Arc::new(Aligned),
            false => Arc::new(Windows::new(lines(), SEQ, 3)?),
        };
        let sampler = Sampler::new(source, plan)?.with_masks(flags)?;
        let train = TrainConfig {
            distributed_optimizer: distopt,
            recompute: recompute.unwrap_or(Recompute::Off),
            precision: match bf16 {
                true => Precision::from_flags(&PrecisionFlags {
                    bf16: true,
                    ..PrecisionFlags::default()
                })?,
                false => Precision::FP32,
            },
            ..support::train_config(
                LrSchedule {
                    max_lr: 3e-3,
                    min_lr: 3e-4,
                    warmup_steps: 1,
                    decay_steps: 3,
                    style: DecayStyle::Cosine,
                },
                9,
                10_000,
            )
        };
        let mut trainer = if pp == 1 {
            let model = Gpt::build(&spec, &mut Builder::for_rank(4, ps.groups()))?;
            Trainer::new(model, &ps, sampler, train)?
        } else {
            let rank = ps.pp().index();
            let chunks = (0..vpp)
                .map(|c| {
                    let b = Builder::for_rank(4, ps.groups()).with_stage(stages.part(rank, c));
                    Gpt::build(&spec, &mut { b })
                })
                .collect::<megatron::Result<Vec<_>>>()?;
            Trainer::pipelined(chunks, &ps, sampler, train, None)?
        };
        (0..3)
            .map(|s| {
                let m = trainer.step(&ps, s)?;
                Ok((m.loss, m.grad_norm, m.counted_tokens))
            })
            .collect()
    })
    .map(|mut ranks| ranks.remove(0))
    .map_err(Into::into)
}

fn assert_same_curve(a: &[(f64, f64, Option<usize>)], b: &[(f64, f64, Option<usize>)], what: &str) {
    for (s, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(x.2, y.2, "{what} step {s}: counted tokens");
        assert!(
            (x.0 - y.0).abs() <= 1e-5 * y.0.abs(),
            "{what} step {s} loss: {x:?} vs {y:?}"
        );
        assert!(
            (x.1 - y.1).abs() <= 1e-4 * y.1.abs(),
            "{what} step {s} norm: {x:?} vs {y:?}"
        );
    }
}

/// [`assert_same_curve`] to a relative `tolerance` (bf16's products round in other orders).
fn assert_close_curve(
    a: &[(f64, f64, Option<usize>)],
    b: &[(f64, f64, Option<usize>)],
    tolerance: f64,
    what: &str,
) {
    for (s, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(x.2, y.2, "{what} step {s}: counted tokens");
        assert!(
            (x.0 - y.0).abs() <= tolerance * y.0.abs(),
            "{what} step {s}: {x:?} vs {y:?}"
        );
        assert!(
            (x.1 - y.1).abs() <= 10.0 * tolerance * y.1.abs(),
            "{what} step {s}: {x:?} vs {y:?}"
        );
    }
}

fn all_flags(per_token: bool) -> MaskFlags {
    MaskFlags {
        eod: Some(EOD),
        eod_mask_loss: true,
        reset_position_ids: true,
        reset_attention_mask: true,
        calculate_per_token_loss: per_token,
    }
}

#[test]
fn packed_masked_data_trains_alike_at_every_layout() {
    for per_token in [false, true] {
        let flags = all_flags(per_token);
        let reference = train(one(), flags);
        // The masks count fewer tokens than the batch holds, and change the loss.
        let counted = reference[0].2.unwrap();
        assert!(counted < 8 * SEQ && counted > 4 * SEQ, "{counted}");
        let plain = train(one(), MaskFlags::default());
        assert!((plain[0].0 - reference[0].0).abs() > 1e-3);
        let layouts = [
            Layout { tp: 2, ..one() },
            Layout {
                tp: 2,
                sp: true,
                ..one()
            },
            Layout {
                pp: 2,
                vpp: 2,
                ..one()
            },
            Layout {
                dp: 2,
                distopt: true,
                ..one()
            },
            Layout {
                recompute: Some(Recompute::Selective),
                ..one()
            },
            Layout {
                recompute: Some(Recompute::Uniform(1)),
                ..one()
            },
        ];
        for layout in layouts {
            assert_same_curve(
                &train(layout, flags),
                &reference,
                &format!("{layout:?} {per_token}"),
            );
        }
    }
    // Expert parallelism (MoE MLPs, experts over 2 ranks of dp 2), and bf16.
    let flags = all_flags(true);
    let moe = Layout { moe: true, ..one() };
    let reference = train(moe, flags);
    assert_same_curve(
        &train(
            Layout {
                ep: 2,
                dp: 2,
                ..moe
            },
            flags,
        ),
        &reference,
        "ep 2",
    );
    let bf16 = Layout {
        bf16: true,
        ..one()
    };
    let reference = train(bf16, flags);
    for layout in [
        Layout { tp: 2, ..bf16 },
        Layout {
            dp: 2,
            distopt: true,
            ..bf16
        },
    ] {
        assert_close_curve(
            &train(layout, flags),
            &reference,
            2e-3,
            &format!("{layout:?}"),
        );
    }
    // Attention dropout drawn per document is the same on every tensor-parallel layout.
    let flags = all_flags(true);
    let dropped = train(
        Layout {
            dropout: true,
            ..one()
        },
        flags,
    );
    assert!((dropped[0].0 - train(one(), flags)[0].0).abs() > 1e-4);
    for layout in [
        Layout { tp: 2, ..one() },
        Layout {
            tp: 2,
            sp: true,
            ..one()
        },
    ] {
        let layout = Layout {
            dropout: true,
            ..layout
        };
        assert_same_curve(&train(layout, flags), &dropped, &format!("{layout:?}"));
    }
}

#[test]
fn a_step_that_counts_no_token_adds_nothing_and_says_so() {
    let layout = ParallelLayout::new(&ParallelConfig::new(1)).unwrap();
    let spec = support::llama_like(0.0).spec();
    let metrics = launch(1, |w| -> R<_> {
        let ps = ParallelState::new(&w, &layout)?;
        let only_ends = TokenStream::from_bytes(&[b'\n'; 200]);
        let plan = BatchPlan {
            seq_length: SEQ,
            micro_batch: 2,
            global_batch: 4,
            dp: 1,
        };
        let sampler = Sampler::windows(only_ends, plan, 1)?.with_masks(all_flags(true))?;
        let schedule = LrSchedule {
            max_lr: 1e-3,
            min_lr: 1e-4,
            warmup_steps: 0,
            decay_steps: 1,
            style: DecayStyle::Cosine,
        };
        let model = Gpt::build(&spec, &mut Builder::for_rank(4, ps.groups()))?;
        let mut trainer = Trainer::new(
            model,
            &ps,
            sampler,
            support::train_config(schedule, 9, 10_000),
        )?;
        Ok(trainer.step(&ps, 0)?)
    })
    .unwrap()
    .remove(0);
    assert_eq!(metrics.counted_tokens, Some(0));
    assert_eq!(metrics.empty_microbatches, 2);
    assert_eq!((metrics.loss, metrics.grad_norm), (0.0, 0.0));
}

#[test]
fn context_parallel_ranks_keep_documents_apart_as_one_rank_in_every_form() {
    let flags = all_flags(true);
    let reference = train(one(), flags);
    for kind in [CpCommType::P2p, CpCommType::AllGather, CpCommType::A2a] {
        let layout = Layout {
            cp: 2,
            cp_kind: kind,
            ..one()
        };
        assert_same_curve(&train(layout, flags), &reference, &format!("cp 2 {kind:?}"));
    }
    let layout = Layout {
        cp: 4,
        cp_kind: CpCommType::A2aP2p { a2a: 2, p2p: 2 },
        ..one()
    };
    assert_same_curve(&train(layout, flags), &reference, "cp 4 a2a+p2p");
    // With tensor and sequence parallelism too.
    let layout = Layout {
        cp: 2,
        tp: 2,
        sp: true,
        ..one()
    };
    assert_same_curve(&train(layout, flags), &reference, "cp 2 tp 2 sp");
}

#[test]
fn the_two_normalizations_differ_and_each_is_the_mean_megatron_takes() {
    // One step's loss is the mean over counted tokens either way; the gradients (norms)
    // differ when microbatches count different numbers of tokens.
    let default = train(one(), all_flags(false));
    let per_token = train(one(), all_flags(true));
    assert!((default[0].0 - per_token[0].0).abs() < 1e-6);
    assert!((default[0].1 - per_token[0].1).abs() > 1e-6 * per_token[0].1);
}

#[test]
fn attention_dropout_with_documents_under_context_parallelism_draws_as_one_rank() {
    // Each document's weights are dropped from its own stream at its own places, whichever
    // rank holds which chunk of it.
    let flags = all_flags(false);
    let dropped = Layout {
        dropout: true,
        ..one()
    };
    let reference = train(dropped, flags);
    for (cp, kind) in [
        (2, CpCommType::P2p),
        (2, CpCommType::A2a),
        (4, CpCommType::A2aP2p { a2a: 2, p2p: 2 }),
    ] {
        let layout = Layout {
            cp,
            cp_kind: kind,
            ..dropped
        };
        assert_same_curve(&train(layout, flags), &reference, &format!("{layout:?}"));
    }
}

#[test]
fn context_parallel_ranks_cut_aligned_documents_one_by_one_as_one_rank_in_every_form() {
    // One packed sample a microbatch, its documents multiples of 2·cp long: each rank holds
    // chunks r and 2·cp − 1 − r of every document (Transformer Engine's thd), and every form
    // gives cp 1's losses and gradient norms, with tensor and sequence parallelism, with
    // pipeline stages, and with attention dropout drawn per document.
    let flags = all_flags(true);
    let aligned = Layout {
        aligned: true,
        ..one()
    };
    let reference = train(aligned, flags);
    for (cp, kind) in [
        (2, CpCommType::P2p),
        (2, CpCommType::AllGather),
        (2, CpCommType::A2a),
        (4, CpCommType::A2aP2p { a2a: 2, p2p: 2 }),
    ] {
        let layout = Layout {
            cp,
            cp_kind: kind,
            ..aligned
        };
        assert_same_curve(&train(layout, flags), &reference, &format!("{layout:?}"));
    }
    let layout = Layout {
        cp: 2,
        tp: 2,
        sp: true,
        ..aligned
    };
    assert_same_curve(&train(layout, flags), &reference, "cp 2 tp 2 sp, thd");
    // Pipeline stages cut each microbatch's documents as the first stage does.
    let layout = Layout {
        cp: 2,
        pp: 2,
        vpp: 2,
        ..aligned
    };
    assert_same_curve(&train(layout, flags), &reference, "cp 2 pp 2 vpp 2, thd");
    let dropped = Layout {
        dropout: true,
        ..aligned
    };
    let reference = train(dropped, flags);
    let layout = Layout { cp: 2, ..dropped };
    assert_same_curve(&train(layout, flags), &reference, "cp 2 thd with dropout");
}
