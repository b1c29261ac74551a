//! A MoE layer written with the DSL (`#[expert_parallel]`: router, all-to-all dispatcher,
//! grouped experts, combine) on thread ranks: expert parallelism over 2 and 4 ranks routes,
//! computes and differentiates exactly as one rank holding every expert (each expert's gradient
//! being the sum of what every rank's tokens give it, as the expert-data-parallel reduction
//! makes it), the all-to-alls move exactly the rows the routing implies, and one expert with
//! top-1 routing is the dense MLP.

mod support;

use megatron::comm::threads::launch;
use megatron::comm::{OpKind, ParallelState};
use megatron::kernels::elementwise::gelu_forward;
use megatron::module::{Builder, Cx, Layer, Module, ParamSpec, Site};
use megatron::moe::{
    DispatcherKind, LoadBalancing, RoutedExperts, RoutedExpertsSpec, RouterConfig,
};
use megatron::parallel::{GroupKind, ParallelConfig, ParallelLayout};
use megatron::prelude::*;
use support::{assert_close_f32, values};

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const EXPERTS: usize = 8;
const HIDDEN: usize = 6;
const FFN: usize = 12;
const SEQ: usize = 5;
const BATCH: usize = 2;
const TOKENS: usize = SEQ * BATCH;

/// The MoE MLP of the tests.
#[megatron::module]
pub struct Moe {
    #[expert_parallel]
    experts: RoutedExperts,
}

#[megatron::module]
impl Moe {
    fn forward(&self, x: Tensor) -> Tensor {
        self.experts(x)
    }
}

/// Routed experts beside shared experts (a dense MLP every token goes through): the input
/// feeds both, so its gradient is the sum of the two.
#[megatron::module]
pub struct SharedMoe {
    #[expert_parallel]
    experts: RoutedExperts,
    #[column_parallel]
    fc1: Linear,
    #[row_parallel]
    fc2: Linear,
}

#[megatron::module]
impl SharedMoe {
    fn forward(&self, x: Tensor) -> Tensor {
        self.experts(x) + self.fc2(gelu(self.fc1(x)))
    }
}

fn spec(router: RouterConfig) -> MoeSpec {
    spec_with(router, DispatcherKind::AllToAll, false)
}

fn spec_with(router: RouterConfig, dispatcher: DispatcherKind, gated: bool) -> MoeSpec {
    MoeSpec {
        experts: RoutedExpertsSpec {
            router,
            hidden: HIDDEN,
            ffn: FFN,
            gated,
            init_std: 0.8,
            out_init_std: 0.5,
            dispatcher,
        },
    }
}

fn router() -> RouterConfig {
    RouterConfig {
        aux_loss_coeff: 0.01,
        z_loss_coeff: Some(0.001),
        load_balancing: LoadBalancing::AuxLoss,
        ..RouterConfig::new(EXPERTS, 2)
    }
}

/// A rank's result: output, input gradient, every parameter's gradient (gate, its experts' fc1
/// and fc2), and the all-to-alls over ep in forward and backward: (calls, bytes sent) counted
/// by the communicator, and the bytes the routing implies.
struct Outcome {
    out: Vec<f32>,
    dx: Vec<f32>,
    grads: Vec<Vec<f32>>,
    specs: Vec<ParamSpec>,
    all_to_all: (u64, u64),
    implied_bytes: u64,
}

/// The layer of an ep group of `ep` thread ranks (every rank one data-parallel rank) on token
/// rank `data_rank`'s tokens, seen from the rank itself.
fn step(
    (ep, etp): (usize, usize),
    data_rank: Option<usize>,
    router: RouterConfig,
    (dispatcher, gated): (DispatcherKind, bool),
) -> R<Vec<Outcome>> {
    let world = ep * etp;
    let layout = ParallelLayout::new(&ParallelConfig::new(world).with_ep(ep).with_etp(etp))?;
    Ok(launch(world, move |w| -> R<Outcome> {
        let ps = ParallelState::new(&w, &layout)?;
        let model = Moe::build(
            &spec_with(router, dispatcher, gated),
            &mut Builder::for_rank(7, ps.groups()),
        )?;
        let rank = data_rank.unwrap_or(ps.groups().rank()) as u64;
        let x = Tensor::from_vec(
            values(TOKENS * HIDDEN, 10 + rank, 2.0),
            [SEQ, BATCH, HIDDEN],
        )?;
        let cx = Cx::new(&ps, 3).with_aux_loss_scale(0.5);
        let before = ps.comm(GroupKind::Ep).stats();
        let (out, saved) = model.forward(&cx, Site::ROOT, &x)?;
        let (sent_rows, received_rows) = saved.experts.plan.sent_and_received();
        let dout = Tensor::from_vec(
            values(TOKENS * HIDDEN, 20 + rank, 1.0),
            [SEQ, BATCH, HIDDEN],
        )?;
        let dx = model.backward(&cx, Site::ROOT, saved, &dout)?;
        let stats = ps.comm(GroupKind::Ep).stats().since(&before);
        let a2a = stats.get(OpKind::AllToAll);
        let (mut grads, mut specs) = (Vec::new(), Vec::new());
        model.visit_params(&mut |p| {
            grads.push(p.grad().to_vec::<f32>().unwrap());
            specs.push(p.spec().clone());
        });
        // Forward: the per-expert counts (one i64 per expert) and the rows out and back;
        // backward: the rows out and back again (f32 rows of HIDDEN values).
        let rows = 2 * (sent_rows + received_rows) * HIDDEN * 4;
        Ok(Outcome {
            out: out.to_vec()?,
            dx: dx.to_vec()?,
            grads,
            specs,
            all_to_all: (a2a.calls, a2a.bytes),
            implied_bytes: (8 * EXPERTS + rows) as u64,
        })
    })?)
}

#[test]
fn expert_parallelism_equals_one_rank_holding_every_expert() {
    // Gated (SwiGLU) experts: each expert-tensor-parallel rank holds its part of the gate and
    // of the up projection.
    for (ep, etp, dispatcher, gated) in [
        (2, 1, DispatcherKind::AllToAll, false),
        (4, 1, DispatcherKind::AllToAll, false),
        (2, 1, DispatcherKind::AllGather, false),
        (4, 1, DispatcherKind::AllGather, false),
        (2, 2, DispatcherKind::AllToAll, false),
        (1, 2, DispatcherKind::AllToAll, false),
        (2, 2, DispatcherKind::AllGather, false),
        (2, 1, DispatcherKind::AllToAll, true),
        (2, 2, DispatcherKind::AllToAll, true),
        (1, 2, DispatcherKind::AllGather, true),
    ] {
        let kind = (dispatcher, gated);
        let parallel = step((ep, etp), None, router(), kind).unwrap();
        let alone: Vec<Outcome> = (0..ep * etp)
            .map(|r| step((1, 1), Some(r), router(), kind).unwrap().remove(0))
            .collect();
        for (r, (got, want)) in parallel.iter().zip(&alone).enumerate() {
            let what = format!("ep {ep} etp {etp} {dispatcher:?} gated {gated} rank {r}");
            assert_close_f32(&got.out, &want.out, &format!("{what} output"));
            assert_close_f32(&got.dx, &want.dx, &format!("{what} input gradient"));
            assert_close_f32(
                &got.grads[0],
                &want.grads[0],
                &format!("{what} gate gradient"),
            );
            // Rank r's slices of its experts receive every rank's tokens: their gradients are
            // the sum of what each rank alone gives the whole experts, at the slices' logical
            // places.
            for (k, name) in [(1, "fc1"), (2, "fc2")] {
                let mut sum = vec![0.0f32; alone[0].grads[k].len()];
                for a in &alone {
                    for (s, v) in sum.iter_mut().zip(&a.grads[k]) {
                        *s += v;
                    }
                }
                let mine: Vec<f32> = got.specs[k]
                    .part_index()
                    .all_runs()
                    .into_iter()
                    .flat_map(|r| r.logical..r.logical + r.len as u64)
                    .map(|l| sum[l as usize])
                    .collect();
                assert_close_f32(&got.grads[k], &mine, &format!("{what} {name} gradient"));
            }
            // The all-to-alls over ep move exactly what the routing implies.
            if dispatcher == DispatcherKind::AllGather || etp > 1 {
                continue;
            }
            assert_eq!(
                got.all_to_all,
                (5, got.implied_bytes),
                "{what}: all-to-all calls and bytes"
            );
        }
    }
}

#[test]
fn one_expert_with_top_1_is_the_dense_mlp() {
    let router = RouterConfig {
        aux_loss_coeff: 0.0,
        ..RouterConfig::new(1, 1)
    };
    let layout = ParallelLayout::new(&ParallelConfig::new(1)).unwrap();
    let (x, out, fc1, fc2) = launch(1, |w| -> R<_> {
        let ps = ParallelState::new(&w, &layout)?;
        let model = Moe::build(&spec(router), &mut Builder::for_rank(5, ps.groups()))?;
        let x = values(TOKENS * HIDDEN, 5, 2.0);
        let input = Tensor::from_vec(x.clone(), [SEQ, BATCH, HIDDEN])?;
        let (out, _) = model.forward(&Cx::new(&ps, 1), Site::ROOT, &input)?;
        let mut weights = Vec::new();
        model.visit_params(&mut |p| weights.push(p.value().to_vec::<f32>().unwrap()));
        Ok((
            x,
            out.to_vec::<f32>()?,
            weights[1].clone(),
            weights[2].clone(),
        ))
    })
    .unwrap()
    .remove(0);
    for t in 0..TOKENS {
        let xt = &x[t * HIDDEN..(t + 1) * HIDDEN];
        let pre: Vec<f32> = (0..FFN)
            .map(|i| (0..HIDDEN).map(|j| fc1[i * HIDDEN + j] * xt[j]).sum())
            .collect();
        let mut act = vec![0.0; FFN];
        gelu_forward(&pre, &mut act).unwrap();
        let want: Vec<f32> = (0..HIDDEN)
            .map(|i| (0..FFN).map(|j| fc2[i * FFN + j] * act[j]).sum())
            .collect();
        assert_close_f32(
            &out[t * HIDDEN..(t + 1) * HIDDEN],
            &want,
            &format!("token {t}"),
        );
    }
}

#[test]
fn shared_experts_add_a_dense_mlp_on_every_rank() {
    // SharedMoe at ep 2 = the routed experts (Moe, the same parameters by name) plus the MLP
    // written by hand from the same layers; the input's gradient is both gradients' sum.
    let layout = ParallelLayout::new(&ParallelConfig::new(2).with_ep(2)).unwrap();
    launch(2, |w| -> R<()> {
        let ps = ParallelState::new(&w, &layout)?;
        let mlp = |name: &str, b: &mut Builder| -> R<Linear> {
            let spec = if name == "fc1" {
                LinearSpec::new(HIDDEN, 16).with_init_std(0.5)
            } else {
                LinearSpec::new(16, HIDDEN).with_init_std(0.5)
            };
            Ok(b.scoped(name, |b| Linear::build(&spec, b))?)
        };
        let spec = SharedMoeSpec {
            experts: spec(router()).experts,
            fc1: LinearSpec::new(HIDDEN, 16).with_init_std(0.5),
            fc2: LinearSpec::new(16, HIDDEN).with_init_std(0.5),
        };
        let shared = SharedMoe::build(&spec, &mut Builder::for_rank(7, ps.groups()))?;
        let moe = Moe::build(
            &self::spec(router()),
            &mut Builder::for_rank(7, ps.groups()),
        )?;
        let mut b = Builder::for_rank(7, ps.groups());
        let (fc1, fc2) = (mlp("fc1", &mut b)?, mlp("fc2", &mut b)?);
        let rank = ps.groups().rank() as u64;
        let x = Tensor::from_vec(
            values(TOKENS * HIDDEN, 30 + rank, 2.0),
            [SEQ, BATCH, HIDDEN],
        )?;
        let dout = Tensor::from_vec(
            values(TOKENS * HIDDEN, 40 + rank, 1.0),
            [SEQ, BATCH, HIDDEN],
        )?;
        let cx = Cx::new(&ps, 3);
        let (y, saved) = shared.forward(&cx, Site::ROOT, &x)?;
        let dx = shared.backward(&cx, Site::ROOT, saved, &dout)?;
        let (routed, routed_saved) = moe.forward(&cx, Site::ROOT, &x)?;
        let d_routed = moe.backward(&cx, Site::ROOT, routed_saved, &dout)?;
        let (h, h_saved) = Layer::forward(&fc1, &cx, Site::ROOT, &x)?;
        let (a, a_saved) = megatron::ops::gelu(&cx, Site::ROOT, &h)?;
        let (dense, dense_saved) = Layer::forward(&fc2, &cx, Site::ROOT, &a)?;
        let da = Layer::backward(&fc2, &cx, Site::ROOT, dense_saved, &dout)?;
        let dh = megatron::ops::gelu_backward(&cx, Site::ROOT, a_saved, &da)?;
        let d_dense = Layer::backward(&fc1, &cx, Site::ROOT, h_saved, &dh)?;
        let sum = |a: &Tensor, b: &Tensor| -> R<Vec<f32>> {
            Ok(megatron::ops::add(a, b)?.to_vec::<f32>()?)
        };
        assert_close_f32(&y.to_vec::<f32>()?, &sum(&routed, &dense)?, "output");
        assert_close_f32(
            &dx.to_vec::<f32>()?,
            &sum(&d_routed, &d_dense)?,
            "input gradient",
        );
        Ok(())
    })
    .unwrap();
}
