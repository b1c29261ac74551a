//! The training loop on a hand-built model (no macros): data-parallel and tensor-parallel runs
//! reproduce the single-rank run, the loss falls, and the gradient all-reduce is one per bucket;
//! an auxiliary loss (a head predicting the token after next, as multi-token prediction's
//! depths do) trains beside the main one and is reported as its plain computation gives it.

mod support;

use megatron::comm::threads::launch;
use megatron::comm::{OpKind, ParallelState, ReduceOp};
use megatron::module::{Builder, Cx, Layer, Module, Param, Site, VocabParallel};
use megatron::ops::{AuxLossSaved, aux_loss, aux_loss_backward, shift_left};
use megatron::parallel::{GroupKind, ParallelConfig, ParallelLayout};
use megatron::tensor::Tensor;
use megatron::tensor_parallel::{
    Embedding, EmbeddingSaved, EmbeddingSpec, LayerNorm, LayerNormSaved, LayerNormSpec,
    LogitsSaved, VocabParallelCrossEntropySaved, vocab_parallel_cross_entropy,
    vocab_parallel_cross_entropy_backward,
};
use megatron::training::{
    BatchPlan, DecayStyle, LanguageModel, LrSchedule, MaskFlags, Sampler, TokenStream, Trainer,
};

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// A bigram model: embedding (vocab parallel), layer norm, tied logits, cross-entropy; with
/// `aux`, the same logits also predict the token after next, an auxiliary loss of that weight
/// named `mtp_1` (the targets and a mask of ones shifted one position earlier).
struct Bigram {
    wte: Embedding,
    ln: LayerNorm,
    aux: Option<f32>,
}

struct BigramSaved {
    wte: EmbeddingSaved,
    ln: LayerNormSaved,
    logits: LogitsSaved,
    ce: VocabParallelCrossEntropySaved,
    aux: Option<(VocabParallelCrossEntropySaved, AuxLossSaved)>,
}

impl Module for Bigram {
    type Spec = (EmbeddingSpec, LayerNormSpec);
    type Saved = BigramSaved;
    fn build(spec: &Self::Spec, b: &mut Builder) -> megatron::Result<Self> {
        Ok(Bigram {
            wte: b.scoped("wte", |b| Embedding::build_vocab(&spec.0, b))?,
            ln: b.scoped("ln", |b| LayerNorm::build(&spec.1, b))?,
            aux: None,
        })
    }
    fn visit_params<'s>(&'s self, f: &mut dyn FnMut(&'s Param)) {
        self.wte.visit_params(f);
        self.ln.visit_params(f);
    }
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        self.wte.visit_params_mut(f);
        self.ln.visit_params_mut(f);
    }
}

impl LanguageModel for Bigram {
    fn losses(
        &self,
        cx: &Cx,
        tokens: &Tensor,
        targets: &Tensor,
    ) -> megatron::Result<(Tensor, BigramSaved)> {
        let (x, wte) = self.wte.forward_vocab(cx, Site::ROOT, tokens)?;
        cx.tp().all_reduce(&x, ReduceOp::Sum)?;
        let (h, ln) = self.ln.forward(cx, Site::ROOT, &x)?;
        let (logits, lsaved) = self.wte.logits_forward(cx, Site::ROOT, &h)?;
        let (losses, ce) = vocab_parallel_cross_entropy(cx, Site::ROOT, &logits, targets)?;
        let (losses, aux) = match self.aux {
            None => (losses, None),
            Some(weight) => {
                let after_next = shift_left(cx, targets)?;
                let ones = Tensor::from_vec(vec![1.0f32; targets.numel()], targets.dims())?;
                let mask = shift_left(cx, &ones)?;
                let site = Site::ROOT.child("mtp");
                let (aux_losses, aux_ce) =
                    vocab_parallel_cross_entropy(cx, site, &logits, &after_next)?;
                let (losses, kept) =
                    aux_loss(cx, site, "mtp_1", &losses, (&aux_losses, &mask), weight)?;
                (losses, Some((aux_ce, kept)))
            }
        };
        Ok((
            losses,
            BigramSaved {
                wte,
                ln,
                logits: lsaved,
                ce,
                aux,
            },
        ))
    }
    fn backward_losses(&self, cx: &Cx, saved: BigramSaved, d: &Tensor) -> megatron::Result<()> {
        let dlogits = match saved.aux {
            None => vocab_parallel_cross_entropy_backward(cx, Site::ROOT, saved.ce, d)?,
            Some((aux_ce, kept)) => {
                let site = Site::ROOT.child("mtp");
                let (d, d_aux) = aux_loss_backward(cx, site, kept, d)?;
                let main = vocab_parallel_cross_entropy_backward(cx, Site::ROOT, saved.ce, &d)?;
                let aux = vocab_parallel_cross_entropy_backward(cx, site, aux_ce, &d_aux)?;
                megatron::ops::add(&main, &aux)?
            }
        };
        let dh = self
            .wte
            .logits_backward(cx, Site::ROOT, saved.logits, &dlogits)?;
        cx.tp().all_reduce(&dh, ReduceOp::Sum)?;
        let dx = self.ln.backward(cx, Site::ROOT, saved.ln, &dh)?;
        self.wte.backward_vocab(cx, Site::ROOT, saved.wte, &dx)
    }
}

fn corpus() -> TokenStream {
    let text = "the quick brown fox jumps over the lazy dog. ".repeat(40);
    TokenStream::from_bytes(text.as_bytes())
}

/// Losses of `steps` steps, and rank 0's communication in the last step.
fn train(
    tp: usize,
    dp: usize,
    steps: u64,
    bucket: usize,
) -> (Vec<f64>, Vec<(GroupKind, megatron::comm::CommStats)>) {
    let t = train_model(tp, dp, steps, bucket, false, |ps| hand_built(ps, None));
    (t.losses, t.comm)
}

/// The hand-built bigram on this rank, with the auxiliary head of weight `aux` if any.
fn hand_built(ps: &ParallelState, aux: Option<f32>) -> megatron::Result<Bigram> {
    let mut model = Bigram::build(&(embedding(), LayerNormSpec::new(16)), &mut builder(ps))?;
    model.aux = aux;
    Ok(model)
}

fn embedding() -> EmbeddingSpec {
    EmbeddingSpec {
        vocab_size: 256,
        hidden: 16,
        init_std: 0.02,
        make_vocab_size_divisible_by: 64,
        untied: false,
    }
}

fn builder(ps: &ParallelState) -> Builder {
    Builder::for_rank(3, ps.groups())
}

/// What a run gave: each step's loss, rank 0's communication in the last step, each step's
/// reported `mtp_1` loss, and step 0's auxiliary loss as its plain computation gives it
/// before any update (the main loss of the same model on the targets shifted on the host,
/// over every position but the last, averaged over the micro-batches).
struct Trained {
    losses: Vec<f64>,
    comm: Vec<(GroupKind, megatron::comm::CommStats)>,
    aux: Vec<f64>,
    plain: f64,
}

/// Trains the model `build` makes on `tp × dp` thread ranks for `steps` steps, reporting the
/// auxiliary loss `mtp_1` when `aux`.
fn train_model<M: LanguageModel>(
    tp: usize,
    dp: usize,
    steps: u64,
    bucket: usize,
    aux: bool,
    build: impl Fn(&ParallelState) -> megatron::Result<M> + Sync,
) -> Trained {
    train_masked(tp, dp, (steps, bucket), aux, None, build)
}

/// [`train_model`] on data whose loss mask drops the targets after the token `eod`, when given
/// (Megatron-LM's `--eod-mask-loss`).
fn train_masked<M: LanguageModel>(
    tp: usize,
    dp: usize,
    (steps, bucket): (u64, usize),
    aux: bool,
    eod: Option<u32>,
    build: impl Fn(&ParallelState) -> megatron::Result<M> + Sync,
) -> Trained {
    let layout = ParallelLayout::new(&ParallelConfig::new(tp * dp).with_tp(tp)).unwrap();
    let out = launch(tp * dp, |w| -> R<_> {
        let ps = ParallelState::new(&w, &layout)?;
        let model = build(&ps)?;
        let plan = BatchPlan {
            seq_length: 16,
            micro_batch: 2,
            global_batch: 8,
            dp,
        };
        let mut sampler = Sampler::windows(corpus(), plan, 11)?;
        if eod.is_some() {
            sampler = sampler.with_masks(MaskFlags {
                eod,
                eod_mask_loss: true,
                ..MaskFlags::default()
            })?;
        }
        let schedule = LrSchedule {
            max_lr: 3e-2,
            min_lr: 3e-3,
            warmup_steps: 2,
            decay_steps: steps,
            style: DecayStyle::Cosine,
        };
        let (s, b) = (plan.seq_length, plan.micro_batch);
        let mut plain = 0.0;
        for micro in 0..plan.microbatches() {
            let batch = sampler.batch(0, ps.groups().dp_rank(), micro)?;
            let t = batch.targets.to_vec::<i64>()?;
            let later = (0..s * b)
                .map(|i| t.get(i + b).copied().unwrap_or(0))
                .collect();
            let later = Tensor::from_vec::<i64>(later, [s, b])?;
            let (l, _) = model.losses(&Cx::new(&ps, 5), &batch.tokens, &later)?;
            let l = l.to_vec::<f32>()?;
            // The token after next counts where the next one's target does (the mask one
            // position on), and never at the last position.
            let mask = batch.loss_mask.unwrap_or_else(|| vec![1.0; s * b]);
            let weight = |i: usize| f64::from(mask.get(i + b).copied().unwrap_or(0.0));
            let sum: f64 = (0..s * b).map(|i| weight(i) * f64::from(l[i])).sum();
            let tokens: f64 = (0..s * b).map(weight).sum();
            plain += sum / tokens;
        }
        let plain = plain / plan.microbatches() as f64;
        let config = support::train_config(schedule, 5, bucket);
        let mut trainer = Trainer::new(model, &ps, sampler, config)?;
        if aux {
            trainer.log_aux_losses(vec!["mtp_1".to_string()]);
        }
        let (mut losses, mut reported) = (Vec::new(), Vec::new());
        let mut comm = Vec::new();
        for step in 0..steps {
            let m = trainer.step(&ps, step)?;
            losses.push(m.loss);
            reported.extend(m.aux_losses.iter().map(|(_, v)| *v));
            comm = m.comm;
        }
        Ok(Trained {
            losses,
            comm,
            aux: reported,
            plain,
        })
    })
    .unwrap();
    out.into_iter().next().unwrap()
}

/// The bigram with its auxiliary head written with the DSL: the same parameters under the same
/// names (no blocks in its pipeline stack), the head's targets and mask shifted by the
/// builtins, the loss carried by `aux_loss`.
mod dsl {
    use megatron::prelude::*;
    use megatron::training::CarriedWidth;

    /// A layer norm as a block (the stack is empty here).
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

    #[megatron::module]
    pub struct AuxBigram {
        #[vocab_parallel]
        wte: Embedding,
        #[pipeline]
        blocks: Vec<Norm>,
        ln: LayerNorm,
    }

    #[megatron::module]
    impl AuxBigram {
        fn forward(&self, tokens: Ids, targets: Ids) -> Tensor {
            let mut h = self.wte(tokens);
            for block in &self.blocks {
                h = block(h);
            }
            let logits = self.wte.logits(self.ln(h));
            let losses = cross_entropy(logits, targets);
            let after_next = cross_entropy(logits, shift_left(targets));
            aux_loss(
                losses,
                after_next,
                shift_left(loss_mask(targets)),
                0.5,
                "mtp_1",
            )
        }
    }

    impl CarriedWidth for AuxBigram {
        fn carried_width(&self) -> usize {
            self.ln.hidden()
        }
    }
}

fn dsl_built(ps: &ParallelState) -> megatron::Result<dsl::AuxBigram> {
    let spec = dsl::AuxBigramSpec {
        wte: embedding(),
        blocks: Vec::new(),
        ln: LayerNormSpec::new(16),
    };
    dsl::AuxBigram::build(&spec, &mut builder(ps))
}

#[test]
fn data_and_tensor_parallel_runs_reproduce_the_single_rank_run() {
    let (reference, _) = train(1, 1, 12, usize::MAX);
    assert!(
        reference[11] < reference[0] * 0.8,
        "loss should fall: {reference:?}"
    );
    for (tp, dp) in [(1, 2), (2, 1), (2, 2), (4, 1)] {
        let (losses, _) = train(tp, dp, 12, usize::MAX);
        for (i, (a, b)) in losses.iter().zip(&reference).enumerate() {
            assert!(
                (a - b).abs() <= 1e-4 * b.abs(),
                "tp {tp} dp {dp} step {i}: {a} vs {b}"
            );
        }
    }
}

#[test]
fn gradients_are_reduced_once_per_bucket() {
    // 256·16 embedding + 2·16 norm = 4128 elements. Megatron-LM closes a bucket after the
    // parameter that takes it to the bucket size, going backwards: the norm's bias and weight
    // (32 ≥ 20 elements), then the embedding: 2 buckets.
    let (_, comm) = train(1, 2, 1, 20);
    let dp = comm
        .iter()
        .find(|(k, _)| *k == GroupKind::Dp)
        .unwrap()
        .1
        .get(OpKind::AllReduce);
    assert_eq!(dp.calls, 2 + 1, "2 gradient buckets and the reported loss");
    assert_eq!(dp.bytes, 4128 * 4 + 4);
}

#[test]
fn an_auxiliary_loss_trains_beside_the_main_one_at_every_layout() {
    let steps = 6;
    let last = steps as usize - 1;
    let plain = train_model(1, 1, steps, usize::MAX, false, |ps| hand_built(ps, None));
    let reference = train_model(1, 1, steps, usize::MAX, true, |ps| {
        hand_built(ps, Some(0.5))
    });
    // The first step's forward is the plain model's; the auxiliary gradient changes the updates.
    assert_eq!(reference.losses[0], plain.losses[0]);
    assert!((reference.losses[last] - plain.losses[last]).abs() > 1e-4);
    assert_eq!(reference.aux.len(), steps as usize);
    let aux = &reference.aux;
    assert!(aux[last] < aux[0], "the auxiliary loss falls too: {aux:?}");
    // The first step's report is the plain computation's.
    let first = reference.plain;
    assert!((aux[0] - first).abs() < 1e-5, "{} vs {first}", aux[0]);
    let close = |t: &Trained, what: &str| {
        let pairs = t.losses.iter().zip(&reference.losses);
        for (i, (a, b)) in pairs.chain(t.aux.iter().zip(aux)).enumerate() {
            assert!(
                (a - b).abs() <= 1e-4 * b.abs(),
                "{what} value {i}: {a} vs {b}"
            );
        }
    };
    for (tp, dp) in [(2, 1), (1, 2), (2, 2)] {
        let t = train_model(tp, dp, steps, usize::MAX, true, |ps| {
            hand_built(ps, Some(0.5))
        });
        close(&t, &format!("tp {tp} dp {dp}"));
    }
    // The DSL's shift_left, loss_mask and aux_loss write what the hand-built model does: on
    // one rank the same numbers, bit for bit.
    let t = train_model(1, 1, steps, usize::MAX, true, dsl_built);
    assert_eq!((&t.losses, &t.aux), (&reference.losses, aux));
    let t = train_model(2, 2, steps, usize::MAX, true, dsl_built);
    close(&t, "the DSL's model at tp 2 dp 2");
}

/// On masked data (the targets after a space dropped, as `--eod-mask-loss` drops those after
/// the end of a document) the DSL's `loss_mask(targets)` is the data's mask: the reported
/// auxiliary loss is the masked mean of the token-after-next losses, its mask shifted with its
/// targets, and the model trains at tp 2 × dp 2 as on one rank.
#[test]
fn an_auxiliary_loss_on_masked_data_counts_what_the_mask_counts() {
    let steps = 3;
    let space = Some(u32::from(b' '));
    let one = train_masked(1, 1, (steps, usize::MAX), true, space, dsl_built);
    assert!(
        (one.aux[0] - one.plain).abs() < 1e-5,
        "{} vs {}",
        one.aux[0],
        one.plain
    );
    // Not the unmasked mean: the mask changes what counts.
    let unmasked = train_model(1, 1, steps, usize::MAX, true, dsl_built);
    assert!((one.aux[0] - unmasked.aux[0]).abs() > 1e-4);
    let split = train_masked(2, 2, (steps, usize::MAX), true, space, dsl_built);
    for (i, (a, b)) in split
        .losses
        .iter()
        .chain(&split.aux)
        .zip(one.losses.iter().chain(&one.aux))
        .enumerate()
    {
        assert!((a - b).abs() <= 1e-4 * b.abs(), "value {i}: {a} vs {b}");
    }
}
