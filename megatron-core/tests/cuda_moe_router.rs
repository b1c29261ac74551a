//! The MoE router and the all-to-all dispatcher's preprocessing on the GPU (`cuda::DeviceRouting`,
//! `cu/moe.cu`) against the host router (`moe::route`) for every router setting: scores
//! (softmax after or before the top-k, sigmoid with and without the expert bias), the top-k
//! scaling, capacity (by probability, by position, padded), the load-balancing losses (micro-batch
//! and per sequence) and the z loss, forward and backward; and the tokens laid out expert-major
//! against the host's order. On the emulated GPU (the kernels' own source on the CPU, the same libm) the routings
//! are equal bit for bit; on a GPU the choices and counts are equal and the weights and losses
//! agree to float rounding (CUDA's `expf` is within 2 ulp).
//!
//! Needs a GPU: `cargo test -p megatron-core --features cuda --test cuda_moe_router --
//! --ignored` (or `MEGATRON_EMULATED_GPU=1` and `--include-ignored`).
#![cfg(feature = "cuda")]

mod support;

use megatron_core::cuda::DeviceRouting;
use megatron_core::moe::{
    DropPolicy, GroupLimited, LoadBalancing, RouterConfig, RouterError, Routing, ScoreFunction,
    route, route_backward,
};
use megatron_core::tensor::Tensor;
use support::{det, gpu};

const SEQ: usize = 8;
const BATCH: usize = 3;
const TOKENS: usize = SEQ * BATCH;
const EXPERTS: usize = 6;
const HIDDEN: usize = 5;

/// The router settings compared, by name.
fn configs() -> Vec<(&'static str, RouterConfig)> {
    let base = RouterConfig::new(EXPERTS, 2);
    let with = |f: &dyn Fn(&mut RouterConfig)| {
        let mut c = base;
        f(&mut c);
        c
    };
    vec![
        (
            "softmax after the top-k, aux and z losses",
            with(&|c| {
                c.aux_loss_coeff = 1e-2;
                c.z_loss_coeff = Some(1e-3);
            }),
        ),
        (
            "softmax before the top-k, per-sequence aux loss",
            with(&|c| {
                c.pre_softmax = true;
                c.load_balancing = LoadBalancing::SeqAuxLoss;
                c.aux_loss_coeff = 1e-2;
            }),
        ),
        (
            "sigmoid with the expert bias, scaled",
            with(&|c| {
                c.score_function = ScoreFunction::Sigmoid;
                c.expert_bias = true;
                c.topk_scaling_factor = Some(2.5);
                c.aux_loss_coeff = 1e-2;
            }),
        ),
        (
            "sigmoid top-1",
            with(&|c| {
                c.score_function = ScoreFunction::Sigmoid;
                c.topk = 1;
            }),
        ),
        (
            "capacity 0.5 by probability",
            with(&|c| c.capacity_factor = Some(0.5)),
        ),
        (
            "capacity 0.5 by position",
            with(&|c| {
                c.capacity_factor = Some(0.5);
                c.drop_policy = DropPolicy::Position;
            }),
        ),
        (
            "capacity 0.5 padded",
            with(&|c| {
                c.capacity_factor = Some(0.5);
                c.pad_to_capacity = true;
            }),
        ),
        (
            "capacity 4 padded (above the tokens)",
            with(&|c| {
                c.capacity_factor = Some(4.0);
                c.pad_to_capacity = true;
            }),
        ),
        (
            "capacity 2, nothing dropped",
            with(&|c| c.capacity_factor = Some(2.0)),
        ),
        (
            "group-limited: 3 groups, each token keeping 1",
            with(&|c| c.group_limited = Some(GroupLimited { groups: 3, topk: 1 })),
        ),
        (
            "group-limited softmax before the top-k: 3 groups, keeping 2",
            with(&|c| {
                c.pre_softmax = true;
                c.group_limited = Some(GroupLimited { groups: 3, topk: 2 });
            }),
        ),
        (
            "group-limited sigmoid with the expert bias, scaled",
            with(&|c| {
                c.score_function = ScoreFunction::Sigmoid;
                c.expert_bias = true;
                c.topk_scaling_factor = Some(2.5);
                c.group_limited = Some(GroupLimited { groups: 3, topk: 1 });
            }),
        ),
    ]
}

fn emulated() -> bool {
    std::env::var_os("MEGATRON_EMULATED_GPU").is_some_and(|v| v == "1")
}

#[test]
#[ignore = "needs a GPU"]
fn the_device_router_routes_as_the_host_router() {
    let gpu = gpu();
    let logits: Vec<f32> = det(TOKENS * EXPERTS, 3).iter().map(|x| 3.0 * x).collect();
    let bias: Vec<f32> = det(EXPERTS, 5).iter().map(|x| 0.2 * x).collect();
    let tokens = det(TOKENS * HIDDEN, 7);
    let on_gpu =
        |v: &[f32], shape: &[usize]| Tensor::from_slice(v, shape).unwrap().to_gpu(&gpu).unwrap();
    let (logits_d, bias_d, tokens_d) = (
        on_gpu(&logits, &[TOKENS, EXPERTS]),
        on_gpu(&bias, &[EXPERTS]),
        on_gpu(&tokens, &[TOKENS, HIDDEN]),
    );
    let (mut dropped, mut losses) = (0, 0);
    for (name, config) in configs() {
        let host: Routing = route(&logits, SEQ, &config, Some(&bias)).unwrap();
        dropped += host.dropped;
        losses += usize::from(host.aux_loss != 0.0) + usize::from(host.z_loss != 0.0);
        let device = DeviceRouting::new(&logits_d, SEQ, &config, Some(&bias_d), None)
            .and_then(|r| r.with_permuted(&tokens_d))
            .unwrap();
        let got = device.read_back().unwrap();
        assert_eq!(got.map, host.map, "{name}: which tokens go where");
        assert_eq!(
            got.tokens_per_expert, host.tokens_per_expert,
            "{name}: counts"
        );
        assert_eq!(got.dropped, host.dropped, "{name}: dropped");
        support::assert_close_rel(&got.probs, &host.probs, 1e-6, &format!("{name}: weights"));
        support::assert_close_rel(
            &[got.aux_loss, got.z_loss],
            &[host.aux_loss, host.z_loss],
            1e-6,
            name,
        );
        if emulated() {
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&got.probs),
                bits(&host.probs),
                "{name}: weights, bit for bit"
            );
            let losses = |r: &Routing| [r.aux_loss.to_bits(), r.z_loss.to_bits()];
            assert_eq!(losses(&got), losses(&host), "{name}: losses, bit for bit");
        }
        // What the backward reads stayed on the device.
        let err = route_backward(&got, &logits, &host.probs, 1.0, &config).unwrap_err();
        assert_eq!(err, RouterError::NothingSaved, "{name}");
        // The backward: the logits' gradient from the weights' and the losses' (scaled).
        let dprobs = det(TOKENS * EXPERTS, 11);
        let want = route_backward(&host, &logits, &dprobs, 0.5, &config).unwrap();
        let got = device
            .backward(
                &logits_d,
                &on_gpu(&dprobs, &[TOKENS, EXPERTS]),
                &on_gpu(&[0.5], &[1]),
            )
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        support::assert_close_rel(&got, &want, 1e-6, &format!("{name}: the logits' gradient"));
        if emulated() {
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&got),
                bits(&want),
                "{name}: the logits' gradient, bit for bit"
            );
        }
        // The tokens expert-major, each expert's in token order, zeros after.
        let permuted = device.permuted().unwrap().to_vec::<f32>().unwrap();
        let mut expected = Vec::new();
        for e in 0..EXPERTS {
            for t in 0..TOKENS {
                if host.map[t * EXPERTS + e] {
                    expected.extend_from_slice(&tokens[t * HIDDEN..(t + 1) * HIDDEN]);
                }
            }
        }
        assert!(
            permuted.len() >= expected.len(),
            "{name}: buffer of {} values",
            permuted.len()
        );
        assert_eq!(
            &permuted[..expected.len()],
            &expected[..],
            "{name}: permuted rows"
        );
        assert!(
            permuted[expected.len()..].iter().all(|&v| v == 0.0),
            "{name}: the tail"
        );
    }
    // The settings exercise what they name: capacity drops pairs, the losses are not 0.
    assert!(
        dropped > 0 && losses == 4,
        "dropped {dropped}, losses {losses}"
    );
}

#[test]
#[ignore = "needs a GPU"]
fn the_device_router_refuses_what_the_host_router_refuses() {
    let gpu = gpu();
    let logits = Tensor::from_vec(det(TOKENS * EXPERTS, 3), [TOKENS, EXPERTS])
        .unwrap()
        .to_gpu(&gpu)
        .unwrap();
    let err = DeviceRouting::new(&logits, 5, &RouterConfig::new(EXPERTS, 2), None, None)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("24 tokens do not cut into sequences of 5"),
        "{err}"
    );
    let err = DeviceRouting::new(&logits, SEQ, &RouterConfig::new(EXPERTS, 7), None, None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("--moe-router-topk 7"), "{err}");
}
