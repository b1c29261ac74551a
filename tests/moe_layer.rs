//! A MoE layer (router, all-to-all dispatcher, grouped experts) on thread ranks: expert
//! parallelism over 2 and 4 ranks routes, computes and differentiates exactly as one rank
//! holding every expert (each expert's gradient being the sum of what every rank's tokens give
//! it, as the expert-data-parallel reduction makes it), and one expert with top-1 routing is the
//! dense MLP.

mod support;

use megatron::comm::World;
use megatron::comm::threads::launch;
use megatron::kernels::elementwise::gelu_forward;
use megatron::moe::experts::ExpertShape;
use megatron::moe::layer::{MoeGrads, MoeWeights, moe_backward, moe_forward};
use megatron::moe::{LoadBalancing, RouterConfig};
use support::{assert_close_f32, values};

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const EXPERTS: usize = 8;
const HIDDEN: usize = 6;
const FFN: usize = 12;
const SEQ: usize = 5;
const BATCH: usize = 2;
const TOKENS: usize = SEQ * BATCH;

fn config() -> RouterConfig {
    RouterConfig {
        aux_loss_coeff: 0.01,
        z_loss_coeff: Some(0.001),
        load_balancing: LoadBalancing::AuxLoss,
        ..RouterConfig::new(EXPERTS, 2)
    }
}

/// Every expert's weights, by global index: fc1 [E, F, H], fc2 [E, H, F]; and the gate.
fn weights() -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    (
        values(EXPERTS * HIDDEN, 1, 2.0),
        values(EXPERTS * FFN * HIDDEN, 2, 0.8),
        values(EXPERTS * HIDDEN * FFN, 3, 0.8),
    )
}

/// A rank's result: output, input gradient, gate gradient, its experts' fc1 and fc2
/// gradients, aux and z losses.
type Outcome = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>, f32, f32);

/// Token rank `data_rank`'s layer with `ep` ranks of experts, `ep_rank` among them.
fn step(w: &dyn World, data_rank: usize) -> R<Outcome> {
    let ranks: Vec<usize> = (0..w.size()).collect();
    let ep = w.communicator("ep", &ranks)?;
    let local = EXPERTS / w.size();
    let shape = ExpertShape {
        experts: local,
        hidden: HIDDEN,
        ffn: FFN,
    };
    let (gate, fc1, fc2) = weights();
    let mine = |all: &[f32]| {
        let per = all.len() / EXPERTS;
        all[w.rank() * local * per..(w.rank() + 1) * local * per].to_vec()
    };
    let (fc1, fc2) = (mine(&fc1), mine(&fc2));
    let x = values(TOKENS * HIDDEN, 10 + data_rank as u64, 2.0);
    let weights = MoeWeights {
        gate: &gate,
        fc1: &fc1,
        fc2: &fc2,
    };
    let (out, saved) = moe_forward(ep.as_ref(), &config(), &shape, &x, SEQ, weights, None)?;
    let dout = values(TOKENS * HIDDEN, 20 + data_rank as u64, 1.0);
    let (mut dgate, mut dfc1, mut dfc2) = (
        vec![0.0f32; gate.len()],
        vec![0.0f32; fc1.len()],
        vec![0.0f32; fc2.len()],
    );
    let grads = MoeGrads {
        gate: &mut dgate,
        fc1: &mut dfc1,
        fc2: &mut dfc2,
    };
    let dx = moe_backward(
        ep.as_ref(),
        &config(),
        &shape,
        &saved,
        &dout,
        0.5,
        weights,
        grads,
    )?;
    Ok((
        out,
        dx,
        dgate,
        dfc1,
        dfc2,
        saved.routing.aux_loss,
        saved.routing.z_loss,
    ))
}

#[test]
fn expert_parallelism_equals_one_rank_holding_every_expert() {
    for ep in [2, 4] {
        let parallel = launch(ep, |w| step(&w, w.rank())).unwrap();
        let alone: Vec<Outcome> = (0..ep)
            .map(|r| launch(1, move |w| step(&w, r)).unwrap().remove(0))
            .collect();
        let local = EXPERTS / ep;
        for (r, (got, want)) in parallel.iter().zip(&alone).enumerate() {
            let what = format!("ep {ep} rank {r}");
            assert_close_f32(&got.0, &want.0, &format!("{what} output"));
            assert_close_f32(&got.1, &want.1, &format!("{what} input gradient"));
            assert_close_f32(&got.2, &want.2, &format!("{what} gate gradient"));
            assert_eq!((got.5, got.6), (want.5, want.6), "{what} aux and z losses");
            // Rank r's experts receive every rank's tokens: their gradients are the sum of
            // what each rank alone gives them.
            for (k, name) in [(3, "fc1"), (4, "fc2")] {
                let pick = |o: &Outcome| if k == 3 { o.3.clone() } else { o.4.clone() };
                let per = pick(&alone[0]).len() / EXPERTS;
                let span = r * local * per..(r + 1) * local * per;
                let mut sum = vec![0.0f32; span.len()];
                for a in &alone {
                    for (s, v) in sum.iter_mut().zip(&pick(a)[span.clone()]) {
                        *s += v;
                    }
                }
                assert_close_f32(&pick(got), &sum, &format!("{what} {name} gradient"));
            }
        }
    }
}

#[test]
fn one_expert_with_top_1_is_the_dense_mlp() {
    let config = RouterConfig {
        aux_loss_coeff: 0.0,
        ..RouterConfig::new(1, 1)
    };
    let shape = ExpertShape {
        experts: 1,
        hidden: HIDDEN,
        ffn: FFN,
    };
    let x = values(TOKENS * HIDDEN, 5, 2.0);
    let (gate, fc1, fc2) = (
        values(HIDDEN, 6, 1.0),
        values(FFN * HIDDEN, 7, 0.8),
        values(HIDDEN * FFN, 8, 0.8),
    );
    let out = launch(1, |w| -> R<Vec<f32>> {
        let ep = w.communicator("ep", &[0])?;
        let weights = MoeWeights {
            gate: &gate,
            fc1: &fc1,
            fc2: &fc2,
        };
        Ok(moe_forward(ep.as_ref(), &config, &shape, &x, SEQ, weights, None)?.0)
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
