//! `#[recompute]` on a module's forward: the module keeps only its input, and its generated
//! backward reruns the forward (the same sites, so the same dropout masks) before running the
//! backward. Against the same module without it: the same output, input gradient and parameter
//! gradients, bit for bit; and the same through a stack of such modules, whatever the run-time
//! recompute setting.

use megatron::comm::ParallelState;
use megatron::comm::threads::launch;
use megatron::module::{Builder, Cx, Module, Recompute, Site};
use megatron::parallel::{ParallelConfig, ParallelLayout};
use megatron::prelude::*;
use megatron::tensor_parallel::{
    CausalSelfAttention, LayerNorm, LayerNormSpec, Linear, LinearSpec,
};

type R<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

const H: usize = 16;
const P: f32 = 0.2;

#[megatron::module]
pub struct Block {
    ln: LayerNorm,
    #[column_parallel]
    qkv: Linear,
    #[op]
    core: CausalSelfAttention,
    #[row_parallel]
    proj: Linear,
    #[config]
    p: f32,
}

#[megatron::module]
impl Block {
    fn forward(&self, x: Tensor) -> Tensor {
        let h = self.proj(self.core(self.qkv(self.ln(x))));
        x + dropout(h, self.p)
    }
}

/// The same block, recomputed.
#[megatron::module]
pub struct Recomputed {
    ln: LayerNorm,
    #[column_parallel]
    qkv: Linear,
    #[op]
    core: CausalSelfAttention,
    #[row_parallel]
    proj: Linear,
    #[config]
    p: f32,
}

#[megatron::module]
impl Recomputed {
    /// A block that keeps only its input.
    #[recompute]
    fn forward(&self, x: Tensor) -> Tensor {
        let h = self.proj(self.core(self.qkv(self.ln(x))));
        x + dropout(h, self.p)
    }
}

#[megatron::module]
pub struct Tower {
    blocks: Vec<Recomputed>,
}

#[megatron::module]
impl Tower {
    fn forward(&self, x: Tensor) -> Tensor {
        let mut h = x;
        for block in &self.blocks {
            h = block(h);
        }
        h
    }
}

fn block_spec() -> BlockSpec {
    BlockSpec {
        ln: LayerNormSpec::new(H),
        qkv: LinearSpec::new(H, 3 * H),
        core: CausalSelfAttention::new(2, P),
        proj: LinearSpec::new(H, H),
        p: P,
    }
}

fn recomputed_spec() -> RecomputedSpec {
    RecomputedSpec {
        ln: LayerNormSpec::new(H),
        qkv: LinearSpec::new(H, 3 * H),
        core: CausalSelfAttention::new(2, P),
        proj: LinearSpec::new(H, H),
        p: P,
    }
}

fn input() -> R<Tensor> {
    let x: Vec<f32> = (0..8 * 2 * H)
        .map(|i| ((i * 29 % 97) as f32 - 48.0) / 31.0)
        .collect();
    Ok(Tensor::from_vec(x, [8, 2, H])?)
}

/// Output, input gradient and every parameter gradient of one forward and backward.
type Run = (Vec<f32>, Vec<f32>, Vec<Vec<f32>>);

fn run<M: Module>(
    model: &M,
    forward: impl Fn(&M, &Cx, &Tensor) -> megatron::Result<(Tensor, M::Saved)>,
    backward: impl Fn(&M, &Cx, M::Saved, &Tensor) -> megatron::Result<Tensor>,
    cx: &Cx,
) -> R<Run> {
    let x = input()?;
    let (y, saved) = forward(model, cx, &x)?;
    let dy = Tensor::full(y.shape().clone(), 0.5, megatron::tensor::DType::F32);
    let dx = backward(model, cx, saved, &dy)?;
    let mut grads = Vec::new();
    model.visit_params(&mut |p| grads.push(p.grad().to_vec::<f32>().unwrap()));
    Ok((y.to_vec::<f32>()?, dx.to_vec::<f32>()?, grads))
}

#[test]
fn a_recomputed_module_keeps_its_input_and_gives_the_same_gradients() {
    let layout = ParallelLayout::new(&ParallelConfig::new(2).with_tp(2)).unwrap();
    launch(2, |w| -> R<()> {
        let ps = ParallelState::new(&w, &layout)?;
        let cx = Cx::new(&ps, 7).at(1, 3);
        let plain = Block::build(&block_spec(), &mut Builder::for_rank(5, ps.groups()))?;
        let recomputed =
            Recomputed::build(&recomputed_spec(), &mut Builder::for_rank(5, ps.groups()))?;
        let site = Site::ROOT.child("block");
        let a = run(
            &plain,
            |m, cx, x| m.forward(cx, site, x),
            |m, cx, s, dy| m.backward(cx, site, s, dy),
            &cx,
        )?;
        let b = run(
            &recomputed,
            |m, cx, x| {
                let (y, saved) = m.forward(cx, site, x)?;
                // All it keeps is its input.
                let RecomputedSaved { input } = &saved;
                assert_eq!(input.to_vec::<f32>()?, x.to_vec::<f32>()?);
                Ok((y, saved))
            },
            |m, cx, s, dy| m.backward(cx, site, s, dy),
            &cx,
        )?;
        assert_eq!(a, b);
        Ok(())
    })
    .unwrap();
}

#[test]
fn a_stack_of_recomputed_modules_trains_alike_under_every_recompute_setting() {
    let layout = ParallelLayout::new(&ParallelConfig::new(1)).unwrap();
    launch(1, |w| -> R<()> {
        let ps = ParallelState::new(&w, &layout)?;
        let spec = TowerSpec {
            blocks: vec![recomputed_spec(); 3],
        };
        let mut reference = None;
        for recompute in [Recompute::Off, Recompute::Uniform(2), Recompute::Block(1)] {
            let tower = Tower::build(&spec, &mut Builder::for_rank(5, ps.groups()))?;
            let cx = Cx::new(&ps, 7).at(1, 3).with_recompute(recompute);
            let got = run(
                &tower,
                |m, cx, x| m.forward(cx, Site::ROOT, x),
                |m, cx, s, dy| m.backward(cx, Site::ROOT, s, dy),
                &cx,
            )?;
            match &reference {
                None => reference = Some(got),
                Some(r) => assert_eq!(&got, r, "{recompute:?}"),
            }
        }
        Ok(())
    })
    .unwrap();
}
