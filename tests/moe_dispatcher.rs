//! The token dispatchers (all-to-all and all-gather) on thread ranks: tokens routed to experts
//! held by other ranks of the expert-parallel group, each expert applied there, and brought back
//! weighted by the routing probabilities equal the same experts applied on the token's own
//! rank, at every expert-parallel size; the backward gives the gradients the routed sum
//! implies; the all-to-alls move exactly the rows the routing implies.

mod support;

use megatron::comm::threads::launch;
use megatron::comm::{OpKind, World};
use megatron::moe::dispatcher::{
    DispatcherKind, combine, combine_backward, dispatch, dispatch_backward,
};
use megatron::moe::{RouterConfig, route};
use megatron::tensor::Tensor;

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const EXPERTS: usize = 8;
const TOKENS: usize = 12;
const HIDDEN: usize = 5;

fn values(n: usize, seed: u64) -> Vec<f32> {
    support::values(n, seed, 2.0)
}

/// Expert `e`'s function, and its derivative (a scale).
fn expert(e: usize, v: f32) -> f32 {
    v * (e as f32 + 1.0) + e as f32
}

/// What each rank computes: its output, its input gradient and its probabilities' gradient,
/// the rows it sent and received, the all-to-all bytes it recorded, and its calls of
/// all-to-all, all-gather and reduce-scatter.
type Outcome = (
    Vec<f32>,
    Vec<f32>,
    Vec<f32>,
    (usize, usize),
    u64,
    (u64, u64, u64),
);

fn run(ep: usize, capacity: Option<f32>, kind: DispatcherKind) -> Vec<Outcome> {
    launch(ep, |w| -> R<Outcome> {
        let ranks: Vec<usize> = (0..w.size()).collect();
        let c = w.communicator("ep", &ranks)?;
        let me = w.rank();
        let config = RouterConfig {
            capacity_factor: capacity,
            ..RouterConfig::new(EXPERTS, 2)
        };
        let logits = values(TOKENS * EXPERTS, 100 + me as u64);
        let routing = route(&logits, TOKENS, &config, None)?;
        let x = Tensor::from_vec(values(TOKENS * HIDDEN, 200 + me as u64), [TOKENS, HIDDEN])?;
        let routing = routing.placed(&x)?;
        let before = c.stats();
        let (rows, plan) = dispatch(c.as_ref(), kind, &x, &routing, None)?;
        // Each local expert applies its function to its contiguous rows.
        let local = EXPERTS / w.size();
        let mut y = rows.to_vec::<f32>()?;
        let mut at = 0;
        for (le, n) in plan.rows_per_local_expert().into_iter().enumerate() {
            let e = me * local + le;
            for v in &mut y[at * HIDDEN..(at + n) * HIDDEN] {
                *v = expert(e, *v);
            }
            at += n;
        }
        let y = Tensor::from_vec(y, [plan.rows(), HIDDEN])?;
        let (out, saved) = combine(c.as_ref(), &plan, &y, &routing)?;
        let dout = Tensor::from_vec(values(TOKENS * HIDDEN, 300 + me as u64), [TOKENS, HIDDEN])?;
        let (dy, dprobs) = combine_backward(c.as_ref(), &plan, &saved, &routing, &dout)?;
        let mut drows = dy.to_vec::<f32>()?;
        let mut at = 0;
        for (le, n) in plan.rows_per_local_expert().into_iter().enumerate() {
            let e = me * local + le;
            for v in &mut drows[at * HIDDEN..(at + n) * HIDDEN] {
                *v *= e as f32 + 1.0;
            }
            at += n;
        }
        let dx = dispatch_backward(
            c.as_ref(),
            &plan,
            &Tensor::from_vec(drows, [plan.rows(), HIDDEN])?,
        )?;
        let stats = c.stats().since(&before);
        let calls = |kind| stats.get(kind).calls;
        Ok((
            out.to_vec()?,
            dx.to_vec()?,
            dprobs.to_vec()?,
            plan.sent_and_received(),
            stats.get(OpKind::AllToAll).bytes,
            (
                calls(OpKind::AllToAll),
                calls(OpKind::AllGather),
                calls(OpKind::ReduceScatter),
            ),
        ))
    })
    .unwrap()
}

/// The same on one rank without any exchange: Σ_e p[t, e]·expert_e(x[t]).
fn reference(rank: usize, capacity: Option<f32>) -> (Vec<f32>, Vec<f32>, Vec<f32>, usize) {
    let config = RouterConfig {
        capacity_factor: capacity,
        ..RouterConfig::new(EXPERTS, 2)
    };
    let routing = route(
        &values(TOKENS * EXPERTS, 100 + rank as u64),
        TOKENS,
        &config,
        None,
    )
    .unwrap();
    let x = values(TOKENS * HIDDEN, 200 + rank as u64);
    let dout = values(TOKENS * HIDDEN, 300 + rank as u64);
    let (mut out, mut dx) = (vec![0.0f32; TOKENS * HIDDEN], vec![0.0f32; TOKENS * HIDDEN]);
    let mut dprobs = vec![0.0f32; TOKENS * EXPERTS];
    for e in 0..EXPERTS {
        for t in 0..TOKENS {
            if !routing.map[t * EXPERTS + e] {
                continue;
            }
            let p = routing.probs[t * EXPERTS + e];
            let mut dot = 0.0;
            for i in 0..HIDDEN {
                let (v, d) = (x[t * HIDDEN + i], dout[t * HIDDEN + i]);
                out[t * HIDDEN + i] += p * expert(e, v);
                dx[t * HIDDEN + i] += p * d * (e as f32 + 1.0);
                dot += expert(e, v) * d;
            }
            dprobs[t * EXPERTS + e] = dot;
        }
    }
    let pairs = routing.map.iter().filter(|&&m| m).count();
    (out, dx, dprobs, pairs)
}

/// Asserts that a rank's output, input gradient and probabilities' gradient are the
/// [`reference`]'s; returns the routed pairs.
fn assert_as_on_the_tokens_rank(
    (out, dx, dprobs): (&[f32], &[f32], &[f32]),
    rank: usize,
    capacity: Option<f32>,
    what: &str,
) -> usize {
    let (want_out, want_dx, want_dprobs, pairs) = reference(rank, capacity);
    support::assert_close_f32(out, &want_out, &format!("{what} output"));
    support::assert_close_f32(dx, &want_dx, &format!("{what} input gradient"));
    support::assert_close_f32(
        dprobs,
        &want_dprobs,
        &format!("{what} probability gradient"),
    );
    pairs
}

#[test]
fn experts_on_other_ranks_give_what_they_give_on_the_tokens_rank() {
    for capacity in [None, Some(1.0)] {
        for ep in [1, 2, 4] {
            let outcomes = run(ep, capacity, DispatcherKind::AllToAll);
            let mut rows_sent = 0;
            let mut rows_received = 0;
            for (rank, (out, dx, dprobs, (sent, received), bytes, _)) in outcomes.iter().enumerate()
            {
                let what = format!("ep {ep} capacity {capacity:?} rank {rank}");
                let pairs = assert_as_on_the_tokens_rank((out, dx, dprobs), rank, capacity, &what);
                // Every routed (token, expert) pair leaves once, as a row of HIDDEN f32: in
                // the dispatch, the combine, and both backwards (plus the counts' exchange).
                assert_eq!(*sent, pairs, "{what}");
                let counts = (EXPERTS * 8) as u64;
                let row_bytes = (pairs * HIDDEN * 4) as u64;
                assert_eq!(
                    *bytes,
                    counts + 2 * row_bytes + (2 * received * HIDDEN * 4) as u64,
                    "{what}"
                );
                rows_sent += sent;
                rows_received += received;
            }
            assert_eq!(rows_sent, rows_received, "ep {ep}");
        }
    }
}

#[test]
fn the_all_gather_dispatcher_gives_what_the_experts_give_on_the_tokens_rank() {
    for capacity in [None, Some(1.0)] {
        for ep in [1, 2, 4] {
            let outcomes = run(ep, capacity, DispatcherKind::AllGather);
            for (rank, (out, dx, dprobs, (sent, received), _, calls)) in outcomes.iter().enumerate()
            {
                let what = format!("ep {ep} capacity {capacity:?} rank {rank}");
                assert_as_on_the_tokens_rank((out, dx, dprobs), rank, capacity, &what);
                // Every rank's tokens reach every rank: the tokens, probabilities and map
                // gathered forward and the output gradient backward; the outputs, the
                // probabilities' gradients and the input gradients reduce-scattered back.
                assert_eq!((*sent, *received), (TOKENS, TOKENS * ep), "{what}");
                assert_eq!(
                    *calls,
                    (0, 4, 3),
                    "{what}: all-to-all, all-gather, reduce-scatter"
                );
            }
        }
    }
}

/// Rows the caller already laid out expert-major (as the GPU router does, in a buffer with room
/// to spare) are sent as they are: the dispatch equals the one that lays them out itself; a
/// buffer shorter than the routed rows is refused with the numbers.
#[test]
fn rows_laid_out_before_the_dispatch_are_sent_as_they_are() {
    let out = launch(2, |w| -> R<()> {
        let ranks: Vec<usize> = (0..w.size()).collect();
        let c = w.communicator("ep", &ranks)?;
        let me = w.rank();
        let config = RouterConfig::new(EXPERTS, 2);
        let routing = route(
            &values(TOKENS * EXPERTS, 100 + me as u64),
            TOKENS,
            &config,
            None,
        )?;
        let tokens = values(TOKENS * HIDDEN, 200 + me as u64);
        let x = Tensor::from_vec(tokens.clone(), [TOKENS, HIDDEN])?;
        // Expert-major, each expert's tokens in order, then one spare row of zeros.
        let mut laid = Vec::new();
        for e in 0..EXPERTS {
            for t in (0..TOKENS).filter(|&t| routing.map[t * EXPERTS + e]) {
                laid.extend_from_slice(&tokens[t * HIDDEN..(t + 1) * HIDDEN]);
            }
        }
        let routed = laid.len() / HIDDEN;
        laid.extend_from_slice(&[0.0; HIDDEN]);
        let laid = Tensor::from_vec(laid, [routed + 1, HIDDEN])?;
        let kind = DispatcherKind::AllToAll;
        let routing = routing.placed(&x)?;
        let (want, want_plan) = dispatch(c.as_ref(), kind, &x, &routing, None)?;
        let (got, got_plan) = dispatch(c.as_ref(), kind, &x, &routing, Some(&laid))?;
        assert_eq!(got.to_vec::<f32>()?, want.to_vec::<f32>()?);
        assert_eq!(got_plan.sent_and_received(), want_plan.sent_and_received());
        assert_eq!(
            got_plan.rows_per_local_expert(),
            want_plan.rows_per_local_expert()
        );
        let short = laid.narrow(0, 0, routed - 1)?;
        let err = dispatch(c.as_ref(), kind, &x, &routing, Some(&short))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&format!("the routing sends {routed} rows of {HIDDEN}")),
            "{err}"
        );
        Ok(())
    });
    out.expect("both ranks");
}
