//! `#[megatron::module]` against the same computation written by hand from the layers: the
//! generated forward and backward give exactly the same outputs, input gradients and parameter
//! gradients (same sites, so the same dropout masks), and a generated GPT on tp = 2 matches
//! itself on tp = 1.

mod support;

use std::collections::BTreeMap;

use megatron::comm::threads::launch;
use megatron::comm::{ParallelState, ReduceOp};
use megatron::module::{ParamSpec, assemble_logical};
use megatron::ops;
use megatron::parallel::{ParallelConfig, ParallelLayout};
use megatron::prelude::*;
use megatron::tensor_parallel::{
    self as tp, CausalSelfAttention, Embedding, EmbeddingSpec, LayerNorm, LayerNormSpec, Linear,
    LinearSpec, PositionEmbedding, PositionEmbeddingSpec,
};

type R<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;
/// Parameter gradients by name.
type Grads = BTreeMap<String, Vec<f32>>;
/// One rank's losses and its parameters' specs and gradients.
type RankRun = (Vec<f32>, Vec<(ParamSpec, Vec<f32>)>);

// ---------------------------------------------------------------------------------------------
// The modules, as a user writes them
// ---------------------------------------------------------------------------------------------

/// The feed-forward block.
#[megatron::module]
pub struct Mlp {
    #[column_parallel]
    fc1: Linear,
    #[row_parallel]
    fc2: Linear,
}

#[megatron::module]
impl Mlp {
    fn forward(&self, x: Tensor) -> Tensor {
        let h = gelu(self.fc1(x));
        self.fc2(h)
    }
}

#[megatron::module]
pub struct Attention {
    #[column_parallel]
    qkv: Linear,
    #[op]
    core: CausalSelfAttention,
    #[row_parallel]
    proj: Linear,
}

#[megatron::module]
impl Attention {
    fn forward(&self, x: Tensor) -> Tensor {
        let qkv = self.qkv(x);
        let ctx = self.core(qkv);
        self.proj(ctx)
    }
}

#[megatron::module]
pub struct Block {
    ln1: LayerNorm,
    attn: Attention,
    ln2: LayerNorm,
    mlp: Mlp,
    #[config]
    hidden_dropout: f32,
}

#[megatron::module]
impl Block {
    fn forward(&self, x: Tensor) -> Tensor {
        let h = x + dropout(self.attn(self.ln1(x)), self.hidden_dropout);
        h + dropout(self.mlp(self.ln2(h)), self.hidden_dropout)
    }
}

/// A layer's output used three times: its gradients meet in the layer of its first use.
#[megatron::module]
pub struct Fan {
    a: LayerNorm,
    b: LayerNorm,
}

#[megatron::module]
impl Fan {
    fn forward(&self, x: Tensor) -> Tensor {
        let h = self.a(x);
        let y = self.b(h);
        (y + h) + h
    }
}

#[megatron::module]
pub struct Gpt {
    #[vocab_parallel]
    wte: Embedding,
    wpe: PositionEmbedding,
    blocks: Vec<Block>,
    ln_f: LayerNorm,
    #[config]
    embedding_dropout: f32,
}

#[megatron::module]
impl Gpt {
    fn forward(&self, tokens: Ids, targets: Ids) -> Tensor {
        let x = self.wte(tokens) + self.wpe(tokens);
        let mut h = dropout(x, self.embedding_dropout);
        for block in &self.blocks {
            h = block(h);
        }
        let h = self.ln_f(h);
        cross_entropy(self.wte.logits(h), targets)
    }
}

/// Gathered column output into a row-parallel layer that splits its own input; an unused ids
/// input.
#[megatron::module]
pub struct Pair {
    #[column_parallel(gather_output = true)]
    up: Linear,
    #[row_parallel(input_is_parallel = false)]
    down: Linear,
}

#[megatron::module]
impl Pair {
    fn forward(&self, a: Tensor, ids: Ids, b: Tensor) -> Tensor {
        let u = self.up(a);
        self.down(u + b)
    }
}

/// A lookup without split, a stack fed from an input, reassignment, a sub-module with three
/// inputs, a value used three times and the plain cross-entropy.
#[megatron::module]
pub struct Mixed {
    emb: Embedding,
    stack: Vec<Mlp>,
    pair: Pair,
    #[replicated]
    head: Linear,
    #[config]
    p: f32,
}

#[megatron::module]
impl Mixed {
    fn forward(&self, tokens: Ids, x: Tensor) -> Tensor {
        let e = self.emb(tokens);
        let mut h = x;
        for m in &self.stack {
            h = m(h);
        }
        h = h + e + x;
        let y = self.pair(h, tokens, x);
        let z = dropout(y, self.p) + y;
        cross_entropy(self.head(z), tokens)
    }
}

// ---------------------------------------------------------------------------------------------
// Sizes, data, helpers
// ---------------------------------------------------------------------------------------------

const S: usize = 4;
const B: usize = 2;
const H: usize = 8;
const HEADS: usize = 2;
const V: usize = 50;
const LAYERS: usize = 2;
const P: f32 = 0.25;

fn det(len: usize, salt: usize) -> Vec<f32> {
    (0..len)
        .map(|i| (((i * 7919 + salt * 104_729) % 2003) as f32 / 2003.0 - 0.5) * 2.0)
        .collect()
}

fn tensor(data: Vec<f32>, shape: &[usize]) -> Tensor {
    Tensor::from_vec(data, shape).unwrap()
}

fn ids(salt: usize) -> Tensor {
    let v: Vec<i64> = (0..S * B)
        .map(|i| ((i * 17 + salt * 5) % V) as i64)
        .collect();
    Tensor::from_vec(v, [S, B]).unwrap()
}

fn values(t: &Tensor) -> Vec<f32> {
    t.to_vec::<f32>().unwrap()
}

/// Every parameter's gradient, by name.
fn grads_of<M: Module>(m: &M) -> Grads {
    let mut out = BTreeMap::new();
    m.visit_params(&mut |p| {
        out.insert(p.spec().name.clone(), p.grad().to_vec::<f32>().unwrap());
    });
    out
}

/// Every parameter of a layer, in visit order.
fn params_of<M: Module>(m: &M) -> Vec<&Param> {
    let mut out = Vec::new();
    m.visit_params(&mut |p| out.push(p));
    out
}

fn grads_of_params(params: &[&Param]) -> Grads {
    params
        .iter()
        .map(|p| (p.spec().name.clone(), p.grad().to_vec::<f32>().unwrap()))
        .collect()
}

fn mlp_spec(h: usize) -> MlpSpec {
    MlpSpec {
        fc1: LinearSpec::new(h, 4 * h),
        fc2: LinearSpec::new(4 * h, h),
    }
}

fn block_spec() -> BlockSpec {
    BlockSpec {
        ln1: LayerNormSpec::new(H),
        attn: AttentionSpec {
            qkv: LinearSpec::new(H, 3 * H),
            core: CausalSelfAttention::new(HEADS, P),
            proj: LinearSpec::new(H, H),
        },
        ln2: LayerNormSpec::new(H),
        mlp: mlp_spec(H),
        hidden_dropout: P,
    }
}

fn gpt_spec() -> GptSpec {
    GptSpec {
        // No padding, so that tp = 1 and tp = 2 hold the same logical table.
        wte: EmbeddingSpec {
            make_vocab_size_divisible_by: 1,
            ..EmbeddingSpec::new(V, H)
        },
        wpe: PositionEmbeddingSpec::new(S, H),
        blocks: vec![block_spec(); LAYERS],
        ln_f: LayerNormSpec::new(H),
        embedding_dropout: P,
    }
}

// ---------------------------------------------------------------------------------------------
// The same computations by hand
// ---------------------------------------------------------------------------------------------

struct HandMlp {
    fc1: Linear,
    fc2: Linear,
}

type HandMlpSaved = (
    <Linear as Module>::Saved,
    ops::GeluSaved,
    <Linear as Module>::Saved,
);

impl HandMlp {
    fn build(h: usize, b: &mut Builder) -> R<HandMlp> {
        let spec = mlp_spec(h);
        Ok(HandMlp {
            fc1: b.scoped("fc1", |b| Linear::build_column(&spec.fc1, b))?,
            fc2: b.scoped("fc2", |b| Linear::build_row(&spec.fc2, b))?,
        })
    }

    fn forward(&self, cx: &Cx, site: Site, x: &Tensor) -> R<(Tensor, HandMlpSaved)> {
        let (a, s1) = self.fc1.forward_column(cx, site.child("fc1"), x)?;
        let (g, s2) = ops::gelu(cx, site.child("gelu"), &a)?;
        let (y, s3) = self.fc2.forward_row(cx, site.child("fc2"), &g)?;
        cx.tp().all_reduce(&y, ReduceOp::Sum)?;
        self.fc2.add_bias(cx, &y)?;
        Ok((y, (s1, s2, s3)))
    }

    fn backward(&self, cx: &Cx, site: Site, saved: HandMlpSaved, dy: &Tensor) -> R<Tensor> {
        let (s1, s2, s3) = saved;
        let dg = self.fc2.backward_row(cx, site.child("fc2"), s3, dy)?;
        let da = ops::gelu_backward(cx, site.child("gelu"), s2, &dg)?;
        let dx = self.fc1.backward_column(cx, site.child("fc1"), s1, &da)?;
        cx.tp().all_reduce(&dx, ReduceOp::Sum)?;
        Ok(dx)
    }

    fn params(&self) -> Vec<&Param> {
        vec![
            self.fc1.weight(),
            self.fc1.bias().unwrap(),
            self.fc2.weight(),
            self.fc2.bias().unwrap(),
        ]
    }
}

struct HandBlock {
    ln1: LayerNorm,
    qkv: Linear,
    core: CausalSelfAttention,
    proj: Linear,
    ln2: LayerNorm,
    mlp: HandMlp,
}

struct HandBlockSaved {
    ln1: <LayerNorm as Module>::Saved,
    qkv: <Linear as Module>::Saved,
    core: <CausalSelfAttention as Op>::Saved,
    proj: <Linear as Module>::Saved,
    drop1: ops::DropoutSaved,
    ln2: <LayerNorm as Module>::Saved,
    mlp: HandMlpSaved,
    drop2: ops::DropoutSaved,
}

impl HandBlock {
    fn build(b: &mut Builder) -> R<HandBlock> {
        let spec = block_spec();
        Ok(HandBlock {
            ln1: b.scoped("ln1", |b| LayerNorm::build(&spec.ln1, b))?,
            qkv: b.scoped("attn", |b| {
                b.scoped("qkv", |b| Linear::build_column(&spec.attn.qkv, b))
            })?,
            core: spec.attn.core.clone(),
            proj: b.scoped("attn", |b| {
                b.scoped("proj", |b| Linear::build_row(&spec.attn.proj, b))
            })?,
            ln2: b.scoped("ln2", |b| LayerNorm::build(&spec.ln2, b))?,
            mlp: b
                .scoped("mlp", |b| {
                    HandMlp::build(H, b).map_err(|e| megatron::Error::Invalid(e.to_string()))
                })
                .unwrap(),
        })
    }

    fn forward(&self, cx: &Cx, site: Site, x: &Tensor) -> R<(Tensor, HandBlockSaved)> {
        let (a, ln1) = self.ln1.forward(cx, site.child("ln1"), x)?;
        let attn = site.child("attn");
        let (q, qkv) = self.qkv.forward_column(cx, attn.child("qkv"), &a)?;
        let (c, core) = Op::forward(&self.core, cx, attn.child("core"), &q)?;
        let (o, proj) = self.proj.forward_row(cx, attn.child("proj"), &c)?;
        cx.tp().all_reduce(&o, ReduceOp::Sum)?;
        self.proj.add_bias(cx, &o)?;
        let (d1, drop1) = ops::dropout(cx, site.child("dropout"), &o, P, Sharding::Replicated)?;
        let h = ops::add(x, &d1)?;
        let (n, ln2) = self.ln2.forward(cx, site.child("ln2"), &h)?;
        let (m, mlp) = self.mlp.forward(cx, site.child("mlp"), &n)?;
        let (d2, drop2) = ops::dropout(cx, site.child("dropout_1"), &m, P, Sharding::Replicated)?;
        let y = ops::add(&h, &d2)?;
        let saved = HandBlockSaved {
            ln1,
            qkv,
            core,
            proj,
            drop1,
            ln2,
            mlp,
            drop2,
        };
        Ok((y, saved))
    }

    fn backward(&self, cx: &Cx, site: Site, s: HandBlockSaved, dy: &Tensor) -> R<Tensor> {
        let attn = site.child("attn");
        let dm = ops::dropout_backward(cx, site.child("dropout_1"), s.drop2, dy)?;
        let dn = self.mlp.backward(cx, site.child("mlp"), s.mlp, &dm)?;
        let dh2 = self.ln2.backward(cx, site.child("ln2"), s.ln2, &dn)?;
        let dh = ops::add(dy, &dh2)?;
        let do_ = ops::dropout_backward(cx, site.child("dropout"), s.drop1, &dh)?;
        let dc = self
            .proj
            .backward_row(cx, attn.child("proj"), s.proj, &do_)?;
        let dq = Op::backward(&self.core, cx, attn.child("core"), s.core, &dc)?;
        let da = self
            .qkv
            .backward_column(cx, attn.child("qkv"), s.qkv, &dq)?;
        cx.tp().all_reduce(&da, ReduceOp::Sum)?;
        let dx2 = self.ln1.backward(cx, site.child("ln1"), s.ln1, &da)?;
        Ok(ops::add(&dh, &dx2)?)
    }

    fn params(&self) -> Vec<&Param> {
        let mut out = params_of(&self.ln1);
        out.extend(params_of(&self.qkv));
        out.extend(params_of(&self.proj));
        out.extend(params_of(&self.ln2));
        out.extend(self.mlp.params());
        out
    }
}

// ---------------------------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------------------------

#[test]
fn modules_say_whether_their_backward_only_multiplies_the_output_gradient() {
    // A row-parallel layer's output: the gradient goes to its products (the residual branch's
    // gradient may then come in their dtype). A sum, a loss or a module whose output is
    // another's sum: no.
    use megatron::module::{Module, VocabParallel};
    let said = [
        ("Mlp", <Mlp as Module>::GRADIENT_FEEDS_PRODUCTS),
        ("Attention", <Attention as Module>::GRADIENT_FEEDS_PRODUCTS),
        ("Block", <Block as Module>::GRADIENT_FEEDS_PRODUCTS),
        ("Gpt", <Gpt as Module>::GRADIENT_FEEDS_PRODUCTS),
        ("Linear", <Linear as Module>::GRADIENT_FEEDS_PRODUCTS),
        ("LayerNorm", <LayerNorm as Module>::GRADIENT_FEEDS_PRODUCTS),
        (
            "Embedding's logits",
            <Embedding as VocabParallel>::LOGITS_GRADIENT_FEEDS_PRODUCTS,
        ),
    ];
    let want = [
        ("Mlp", true),
        ("Attention", true),
        ("Block", false),
        ("Gpt", false),
        ("Linear", true),
        ("LayerNorm", false),
        ("Embedding's logits", true),
    ];
    assert_eq!(said, want);
}

#[test]
fn mlp_matches_the_hand_written_one() -> R<()> {
    let ps = ParallelState::solo();
    let cx = Cx::new(&ps, 5);
    let site = Site::ROOT.child("mlp");
    let mlp = Mlp::build(&mlp_spec(H), &mut Builder::new(3))?;
    let hand = HandMlp::build(H, &mut Builder::new(3))?;
    let x = tensor(det(S * B * H, 1), &[S, B, H]);
    let dy = tensor(det(S * B * H, 2), &[S, B, H]);

    let (y, saved) = mlp.forward(&cx, site, &x)?;
    let dx = mlp.backward(&cx, site, saved, &dy)?;
    let (y_ref, saved_ref) = hand.forward(&cx, site, &x)?;
    let dx_ref = hand.backward(&cx, site, saved_ref, &dy)?;

    assert_eq!(values(&y), values(&y_ref));
    assert_eq!(values(&dx), values(&dx_ref));
    assert_eq!(grads_of(&mlp), grads_of_params(&hand.params()));
    let names: Vec<_> = grads_of(&mlp).into_keys().collect();
    assert_eq!(names, ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]);
    Ok(())
}

#[test]
fn block_with_residuals_and_dropout_matches_the_hand_written_one() -> R<()> {
    let ps = ParallelState::solo();
    let cx = Cx::new(&ps, 11).at(2, 1);
    let site = Site::ROOT.child("blocks").index(1);
    let block = Block::build(&block_spec(), &mut Builder::new(8))?;
    let hand = HandBlock::build(&mut Builder::new(8))?;
    let x = tensor(det(S * B * H, 3), &[S, B, H]);
    let dy = tensor(det(S * B * H, 4), &[S, B, H]);

    let (y, saved) = block.forward(&cx, site, &x)?;
    let dx = block.backward(&cx, site, saved, &dy)?;
    let (y_ref, saved_ref) = hand.forward(&cx, site, &x)?;
    let dx_ref = hand.backward(&cx, site, saved_ref, &dy)?;

    assert_eq!(values(&y), values(&y_ref));
    assert_eq!(values(&dx), values(&dx_ref));
    assert_eq!(grads_of(&block), grads_of_params(&hand.params()));
    // Dropout was active: some elements of the output differ from a run without it.
    let (y_eval, _) = block.forward(&cx.eval(), site, &x)?;
    assert_ne!(values(&y), values(&y_eval));
    Ok(())
}

#[test]
fn a_value_used_three_times_matches_the_hand_written_sums() -> R<()> {
    let ps = ParallelState::solo();
    let cx = Cx::new(&ps, 2);
    let site = Site::ROOT.child("fan");
    let spec = FanSpec {
        a: LayerNormSpec::new(H),
        b: LayerNormSpec::new(H),
    };
    let fan = Fan::build(&spec, &mut Builder::new(4))?;
    let mut bld = Builder::new(4);
    let a = bld.scoped("a", |b| LayerNorm::build(&spec.a, b))?;
    let b = bld.scoped("b", |b| LayerNorm::build(&spec.b, b))?;
    // Non-trivial scales and shifts, the same on both.
    for (i, p) in params_of(&fan).into_iter().enumerate() {
        p.value().copy_from(&tensor(det(H, 40 + i), &[H]))?;
    }
    let hand: Vec<&Param> = params_of(&a).into_iter().chain(params_of(&b)).collect();
    for (i, p) in hand.iter().enumerate() {
        p.value().copy_from(&tensor(det(H, 40 + i), &[H]))?;
    }
    let x = tensor(det(S * B * H, 5), &[S, B, H]);
    let dy = tensor(det(S * B * H, 6), &[S, B, H]);

    let (out, saved) = fan.forward(&cx, site, &x)?;
    let dx = fan.backward(&cx, site, saved, &dy)?;

    let (h, s_a) = Layer::forward(&a, &cx, site.child("a"), &x)?;
    let (y, s_b) = Layer::forward(&b, &cx, site.child("b"), &h)?;
    let out_ref = ops::add(&ops::add(&y, &h)?, &h)?;
    // h's gradients in reverse order of use: the outer sum's, the inner sum's, then b's.
    let d_h_b = Layer::backward(&b, &cx, site.child("b"), s_b, &dy)?;
    let d_h = ops::add(&ops::add(&dy, &dy)?, &d_h_b)?;
    let dx_ref = Layer::backward(&a, &cx, site.child("a"), s_a, &d_h)?;

    assert_eq!(values(&out), values(&out_ref));
    assert_eq!(values(&dx), values(&dx_ref));
    assert_eq!(grads_of(&fan), grads_of_params(&hand));
    Ok(())
}

/// The Gpt computation by hand, on the layers of a generated Gpt (its fields are private to
/// this file's modules, so the test reaches them through `visit_params` names only).
fn gpt_by_hand(
    cx: &Cx,
    b: &mut Builder,
    tokens: &Tensor,
    targets: &Tensor,
    d_loss: &Tensor,
) -> R<(Vec<f32>, Grads)> {
    let spec = gpt_spec();
    let wte = b.scoped("wte", |b| Embedding::build_vocab(&spec.wte, b))?;
    let wpe = b.scoped("wpe", |b| PositionEmbedding::build(&spec.wpe, b))?;
    let mut blocks = Vec::new();
    for i in 0..LAYERS {
        let block = b.scoped("blocks", |b| {
            b.scoped(&i.to_string(), |b| {
                HandBlock::build(b).map_err(|e| megatron::Error::Invalid(e.to_string()))
            })
        })?;
        blocks.push(block);
    }
    let ln_f = b.scoped("ln_f", |b| LayerNorm::build(&spec.ln_f, b))?;
    let site = Site::ROOT;

    let (e, s_wte) = wte.forward_vocab(cx, site.child("wte"), tokens)?;
    cx.tp().all_reduce(&e, ReduceOp::Sum)?;
    let (pe, s_wpe) = Lookup::forward(&wpe, cx, site.child("wpe"), tokens)?;
    let x = ops::add(&e, &pe)?;
    let (mut h, s_drop) = ops::dropout(cx, site.child("dropout"), &x, P, Sharding::Replicated)?;
    let mut s_blocks = Vec::new();
    for (i, block) in blocks.iter().enumerate() {
        let (out, s) = block.forward(cx, site.child("blocks").index(i), &h)?;
        h = out;
        s_blocks.push(s);
    }
    let (h, s_ln) = ln_f.forward(cx, site.child("ln_f"), &h)?;
    let (logits, s_logits) = wte.logits_forward(cx, site.child("wte_logits"), &h)?;
    let (loss, s_ce) =
        tp::vocab_parallel_cross_entropy(cx, site.child("cross_entropy"), &logits, targets)?;

    let d_logits =
        tp::vocab_parallel_cross_entropy_backward(cx, site.child("cross_entropy"), s_ce, d_loss)?;
    let d_h = wte.logits_backward(cx, site.child("wte_logits"), s_logits, &d_logits)?;
    cx.tp().all_reduce(&d_h, ReduceOp::Sum)?;
    let mut d_h = ln_f.backward(cx, site.child("ln_f"), s_ln, &d_h)?;
    for (i, (block, s)) in blocks.iter().zip(s_blocks).enumerate().rev() {
        d_h = block.backward(cx, site.child("blocks").index(i), s, &d_h)?;
    }
    let d_x = ops::dropout_backward(cx, site.child("dropout"), s_drop, &d_h)?;
    Lookup::backward(&wpe, cx, site.child("wpe"), s_wpe, &d_x)?;
    wte.backward_vocab(cx, site.child("wte"), s_wte, &d_x)?;

    let mut params = vec![wte.weight()];
    params.extend(params_of(&wpe));
    for block in &blocks {
        params.extend(block.params());
    }
    params.extend(params_of(&ln_f));
    Ok((values(&loss), grads_of_params(&params)))
}

#[test]
fn gpt_matches_the_hand_written_one() -> R<()> {
    let ps = ParallelState::solo();
    let cx = Cx::new(&ps, 21).at(1, 3);
    let tokens = ids(1);
    let targets = ids(2);
    let d_loss = tensor(det(S * B, 5), &[S, B]);

    let gpt = Gpt::build(&gpt_spec(), &mut Builder::new(4))?;
    let (loss, saved) = gpt.forward(&cx, Site::ROOT, &tokens, &targets)?;
    let ((), ()) = gpt.backward(&cx, Site::ROOT, saved, &d_loss)?;

    let (loss_ref, grads_ref) = gpt_by_hand(&cx, &mut Builder::new(4), &tokens, &targets, &d_loss)?;
    assert_eq!(values(&loss), loss_ref);
    let grads = grads_of(&gpt);
    assert_eq!(grads.len(), 2 + LAYERS * 12 + 2);
    assert_eq!(grads, grads_ref);
    assert!(grads.contains_key("blocks.1.attn.qkv.weight"));
    Ok(())
}

#[test]
fn gpt_on_two_tensor_parallel_ranks_matches_one() -> R<()> {
    let tokens = ids(3);
    let targets = ids(4);
    let d_loss = tensor(det(S * B, 6), &[S, B]);
    let run = |tp: usize| -> Vec<RankRun> {
        let layout = ParallelLayout::new(&ParallelConfig::new(tp).with_tp(tp)).unwrap();
        launch(tp, |w| -> R<_> {
            let ps = ParallelState::new(&w, &layout)?;
            let cx = Cx::new(&ps, 77);
            let mut b = Builder::for_rank(9, ps.groups());
            let gpt = Gpt::build(&gpt_spec(), &mut b)?;
            let (loss, saved) = gpt.forward(&cx, Site::ROOT, &tokens, &targets)?;
            gpt.backward(&cx, Site::ROOT, saved, &d_loss)?;
            let mut grads = Vec::new();
            gpt.visit_params(&mut |p| grads.push((p.spec().clone(), values(p.grad()))));
            Ok((values(&loss), grads))
        })
        .unwrap()
    };
    let one = run(1);
    let two = run(2);
    for rank in &two {
        support::assert_close_to_scale(&rank.0, &one[0].0, 1e-5, "loss");
    }
    for i in 0..one[0].1.len() {
        let parts: Vec<(&ParamSpec, &[f32])> = two
            .iter()
            .map(|r| (&r.1[i].0, r.1[i].1.as_slice()))
            .collect();
        let whole = assemble_logical(&parts)?;
        let name = &one[0].1[i].0.name;
        support::assert_close_to_scale(&whole, &one[0].1[i].1, 1e-4, name);
    }
    Ok(())
}

#[test]
fn gathers_splits_fan_out_and_multi_input_sub_modules_match_the_hand_written_ones() -> R<()> {
    let ps = ParallelState::solo();
    let cx = Cx::new(&ps, 2);
    let spec = MixedSpec {
        emb: EmbeddingSpec::new(V, H),
        stack: vec![mlp_spec(H), mlp_spec(H)],
        pair: PairSpec {
            up: LinearSpec::new(H, H),
            down: LinearSpec::new(H, H),
        },
        head: LinearSpec::new(H, V),
        p: P,
    };
    let mixed = Mixed::build(&spec, &mut Builder::new(6))?;
    let tokens = ids(7);
    let x = tensor(det(S * B * H, 8), &[S, B, H]);
    let d_loss = tensor(det(S * B, 9), &[S, B]);
    let (loss, saved) = mixed.forward(&cx, Site::ROOT, &tokens, &x)?;
    let ((), dx) = mixed.backward(&cx, Site::ROOT, saved, &d_loss)?;

    // By hand.
    let b = &mut Builder::new(6);
    let emb = b.scoped("emb", |b| Embedding::build(&spec.emb, b))?;
    let stack = [0, 1].map(|i| {
        b.scoped("stack", |b| {
            b.scoped(&i.to_string(), |b| {
                HandMlp::build(H, b).map_err(|e| megatron::Error::Invalid(e.to_string()))
            })
        })
        .unwrap()
    });
    let up = b.scoped("pair", |b| {
        b.scoped("up", |b| Linear::build_column(&spec.pair.up, b))
    })?;
    let down = b.scoped("pair", |b| {
        b.scoped("down", |b| Linear::build_row(&spec.pair.down, b))
    })?;
    let head = b.scoped("head", |b| Linear::build(&spec.head, b))?;
    let site = Site::ROOT;
    let pair = site.child("pair");

    let (e, s_emb) = Lookup::forward(&emb, &cx, site.child("emb"), &tokens)?;
    let mut h = x.clone();
    let mut s_stack = Vec::new();
    for (i, m) in stack.iter().enumerate() {
        let (out, s) = m.forward(&cx, site.child("stack").index(i), &h)?;
        h = out;
        s_stack.push(s);
    }
    let h = ops::add(&ops::add(&h, &e)?, &x)?;
    let (u_local, s_up) = up.forward_column(&cx, pair.child("up"), &h)?;
    let u = tp::gather_last_dim(&cx, &u_local)?;
    let v = ops::add(&u, &x)?;
    let v_local = tp::split_last_dim(&cx, &v)?;
    let (y, s_down) = down.forward_row(&cx, pair.child("down"), &v_local)?;
    cx.tp().all_reduce(&y, ReduceOp::Sum)?;
    down.add_bias(&cx, &y)?;
    let (dr, s_drop) = ops::dropout(&cx, site.child("dropout"), &y, P, Sharding::Replicated)?;
    let z = ops::add(&dr, &y)?;
    let (logits, s_head) = Layer::forward(&head, &cx, site.child("head"), &z)?;
    let (loss_ref, s_ce) = ops::cross_entropy(&cx, site.child("cross_entropy"), &logits, &tokens)?;

    let d_logits = ops::cross_entropy_backward(&cx, site.child("cross_entropy"), s_ce, &d_loss)?;
    let d_z = Layer::backward(&head, &cx, site.child("head"), s_head, &d_logits)?;
    let d_y1 = ops::dropout_backward(&cx, site.child("dropout"), s_drop, &d_z)?;
    let d_y = ops::add(&d_z, &d_y1)?;
    let d_v_local = down.backward_row(&cx, pair.child("down"), s_down, &d_y)?;
    let d_v = tp::gather_last_dim(&cx, &d_v_local)?;
    let d_u_local = tp::split_last_dim(&cx, &d_v)?;
    let d_h = up.backward_column(&cx, pair.child("up"), s_up, &d_u_local)?;
    cx.tp().all_reduce(&d_h, ReduceOp::Sum)?;
    Lookup::backward(&emb, &cx, site.child("emb"), s_emb, &d_h)?;
    let mut d_hs = d_h.clone();
    for (i, (m, s)) in stack.iter().zip(s_stack).enumerate().rev() {
        d_hs = m.backward(&cx, site.child("stack").index(i), s, &d_hs)?;
    }
    // x's gradient: contributions in reverse order of use (pair's `+ b`, then `+ x`, then the
    // stack), summed in that order.
    let d_x = ops::add(&ops::add(&d_v, &d_h)?, &d_hs)?;

    assert_eq!(values(&loss), values(&loss_ref));
    assert_eq!(values(&dx), values(&d_x));
    let mut params = vec![emb.weight()];
    for m in &stack {
        params.extend(m.params());
    }
    params.extend([
        up.weight(),
        up.bias().unwrap(),
        down.weight(),
        down.bias().unwrap(),
        head.weight(),
        head.bias().unwrap(),
    ]);
    assert_eq!(grads_of(&mixed), grads_of_params(&params));
    Ok(())
}

#[test]
fn specs_and_parameter_names_follow_the_fields() -> R<()> {
    let spec = gpt_spec();
    let debug = format!("{spec:?}");
    assert!(debug.starts_with("GptSpec { wte: EmbeddingSpec"), "{debug}");
    let gpt = Gpt::build(&spec, &mut Builder::new(0))?;
    let mut names = Vec::new();
    gpt.visit_params(&mut |p| names.push(p.spec().name.clone()));
    assert_eq!(
        names[..4],
        [
            "wte.weight",
            "wpe.weight",
            "blocks.0.ln1.weight",
            "blocks.0.ln1.bias"
        ]
    );
    assert_eq!(names.last().map(String::as_str), Some("ln_f.bias"));
    let mut count = 0;
    let mut gpt = gpt;
    gpt.visit_params_mut(&mut |_| count += 1);
    assert_eq!(count, names.len());
    Ok(())
}

/// With sequence parallelism a row-parallel layer that splits a whole input is refused, naming
/// the field, as Megatron-LM refuses it (a gathered column output runs: its features gathered,
/// then this rank's shard of the sequence kept, `tests/lora.rs`).
#[test]
fn sequence_parallelism_refuses_a_row_parallel_layer_splitting_a_whole_input_by_name() {
    let layout = ParallelLayout::new(&ParallelConfig::new(2).with_tp(2)).unwrap();
    let errors = launch(2, |w| -> R<String> {
        let ps = ParallelState::new(&w, &layout)?.with_sequence_parallel(true);
        let cx = Cx::new(&ps, 1);
        let spec = PairSpec {
            up: LinearSpec::new(H, H),
            down: LinearSpec::new(H, H),
        };
        let pair = Pair::build(&spec, &mut Builder::for_rank(1, ps.groups()))?;
        let x = tensor(det(S / 2 * B * H, 1), &[S / 2, B, H]);
        let Err(err) = pair.forward(&cx, Site::ROOT, &x, &ids(1), &x) else {
            panic!("a row-parallel layer splitting a whole input with sequence parallelism")
        };
        Ok(err.to_string())
    })
    .unwrap();
    for err in errors {
        assert!(
            err.contains("input_is_parallel = false")
                && err.contains("`down`")
                && err.contains("sequence parallelism"),
            "{err}"
        );
    }
}
