use super::*;

/// Deterministic values in [lo, hi).
fn values(n: usize, seed: u64, lo: f32, hi: f32) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            lo + (hi - lo) * ((s >> 40) as f32 / (1u64 << 24) as f32)
        })
        .collect()
}

fn close(a: f32, b: f32, tol: f32) -> bool {
    (a - b).abs() <= tol * (1.0 + b.abs())
}

#[test]
fn settings_that_cannot_route_are_errors_with_their_numbers() {
    let err = |c: RouterConfig| c.validate().unwrap_err().to_string();
    assert_eq!(
        err(RouterConfig::new(4, 5)),
        "--moe-router-topk 5 must be between 1 and --num-experts 4"
    );
    assert!(err(RouterConfig::new(0, 1)).contains("at least one expert"));
    for bad in [0.0, -1.0, f32::NAN] {
        let c = RouterConfig {
            capacity_factor: Some(bad),
            ..RouterConfig::new(4, 2)
        };
        assert!(err(c).contains("--moe-expert-capacity-factor"), "{bad}");
    }
    let c = RouterConfig {
        pad_to_capacity: true,
        ..RouterConfig::new(4, 2)
    };
    assert!(err(c).contains("needs --moe-expert-capacity-factor"));
    let c = RouterConfig {
        expert_bias: true,
        ..RouterConfig::new(4, 2)
    };
    assert!(err(c).contains("sigmoid"));
    let e = route(&[0.0; 7], 1, &RouterConfig::new(4, 2), None).unwrap_err();
    assert!(e.to_string().contains("7 values"), "{e}");
}

#[test]
fn top_k_then_softmax_and_softmax_then_top_k_by_hand() {
    let logits = [1.0, 3.0, 2.0, 0.0];
    let r = route(&logits, 1, &RouterConfig::new(4, 2), None).unwrap();
    let (a, b) = (1.0 / (1.0 + (-1.0f32).exp()), 1.0 / (1.0 + 1.0f32.exp()));
    assert!(
        close(r.probs[1], a, 1e-6) && close(r.probs[2], b, 1e-6),
        "{:?}",
        r.probs
    );
    assert_eq!((r.probs[0], r.probs[3]), (0.0, 0.0));
    assert_eq!(r.map, [false, true, true, false]);
    assert_eq!(r.tokens_per_expert, [0, 1, 1, 0]);
    let pre = RouterConfig {
        pre_softmax: true,
        topk_scaling_factor: Some(2.0),
        ..RouterConfig::new(4, 2)
    };
    let r = route(&logits, 1, &pre, None).unwrap();
    let z: f32 = logits.iter().map(|x| x.exp()).sum();
    assert!(
        close(r.probs[1], 2.0 * 3f32.exp() / z, 1e-6),
        "{:?}",
        r.probs
    );
    assert!(close(r.probs[2], 2.0 * 2f32.exp() / z, 1e-6));
    // Sigmoid scores: the bias moves the choice, not the weights.
    let sig = RouterConfig {
        score_function: ScoreFunction::Sigmoid,
        expert_bias: true,
        ..RouterConfig::new(4, 1)
    };
    let r = route(&logits, 1, &sig, Some(&[0.0, 0.0, 0.0, 0.9])).unwrap();
    assert_eq!(r.map, [false, false, false, true]);
    assert!(close(r.probs[3], 0.5, 1e-6));
}

#[test]
fn capacity_keeps_each_experts_best_or_first_tokens() {
    // Four tokens, all preferring expert 0 (top-1 of 2); capacity ⌈4·1/2·1⌉ = 2.
    let logits = [0.5, 0.0, 2.0, 0.0, 1.0, 0.0, 3.0, 0.0];
    let config = RouterConfig {
        capacity_factor: Some(1.0),
        ..RouterConfig::new(2, 1)
    };
    assert_eq!(config.capacity(4), Some(2));
    let r = route(&logits, 4, &config, None).unwrap();
    // Top-1 softmax gives each token weight 1: ties, kept by position.
    assert_eq!(r.tokens_per_expert, [2, 0]);
    assert_eq!(r.dropped, 2);
    let pre = RouterConfig {
        pre_softmax: true,
        ..config
    };
    let r = route(&logits, 4, &pre, None).unwrap();
    // By probability: tokens 3 and 1 (logit gaps 3 and 2).
    let kept: Vec<usize> = (0..4).filter(|&t| r.map[t * 2]).collect();
    assert_eq!(kept, [1, 3]);
    let first = RouterConfig {
        drop_policy: DropPolicy::Position,
        ..pre
    };
    let r = route(&logits, 4, &first, None).unwrap();
    let kept: Vec<usize> = (0..4).filter(|&t| r.map[t * 2]).collect();
    assert_eq!(kept, [0, 1]);
    // Padded to capacity: every expert gets exactly 2 tokens, the extra ones with weight 0.
    let padded = RouterConfig {
        pad_to_capacity: true,
        ..pre
    };
    let r = route(&logits, 4, &padded, None).unwrap();
    assert_eq!(r.tokens_per_expert, [2, 2]);
    assert!((0..4).all(|t| r.probs[t * 2 + 1] == 0.0));
}

#[test]
fn the_load_balancing_losses_are_the_switch_formula() {
    let (tokens, e, k, seq) = (12, 4, 2, 4);
    let logits = values(tokens * e, 3, -2.0, 2.0);
    let config = RouterConfig {
        aux_loss_coeff: 0.01,
        ..RouterConfig::new(e, k)
    };
    let r = route(&logits, seq, &config, None).unwrap();
    // By hand: f_i = count_i / (T·k), P_i = mean score; loss = coeff · E · Σ f_i P_i.
    let mut count = vec![0.0f32; e];
    let mut mean = vec![0.0f32; e];
    for t in 0..tokens {
        let mut s = vec![0.0; e];
        softmax(&logits[t * e..(t + 1) * e], &mut s);
        for j in top_k(&s, k) {
            count[j] += 1.0;
        }
        for j in 0..e {
            mean[j] += s[j] / tokens as f32;
        }
    }
    let want: f32 = 0.01
        * e as f32
        * (0..e)
            .map(|j| count[j] / (tokens * k) as f32 * mean[j])
            .sum::<f32>();
    assert!(close(r.aux_loss, want, 1e-5), "{} vs {want}", r.aux_loss);
    // Per sequence: the micro-batch loss of each sequence alone, averaged. Sequence b holds
    // the tokens t with t % batch == b ([seq, batch] order).
    let batch = tokens / seq;
    let seq_config = RouterConfig {
        load_balancing: LoadBalancing::SeqAuxLoss,
        ..config
    };
    let r = route(&logits, seq, &seq_config, None).unwrap();
    let per_sequence: f32 = (0..batch)
        .map(|b| {
            let own: Vec<f32> = (0..seq)
                .flat_map(|s| logits[(s * batch + b) * e..(s * batch + b + 1) * e].to_vec())
                .collect();
            route(&own, seq, &config, None).unwrap().aux_loss
        })
        .sum::<f32>()
        / batch as f32;
    assert!(
        close(r.aux_loss, per_sequence, 1e-5),
        "{} vs {per_sequence}",
        r.aux_loss
    );
    // The z loss: coeff · mean (log Σ exp)².
    let z = RouterConfig {
        z_loss_coeff: Some(1e-3),
        ..RouterConfig::new(e, k)
    };
    let r = route(&logits, seq, &z, None).unwrap();
    let want: f32 = (0..tokens)
        .map(|t| log_sum_exp(&logits[t * e..(t + 1) * e]).powi(2))
        .sum::<f32>()
        / tokens as f32
        * 1e-3;
    assert!(close(r.z_loss, want, 1e-6));
}

/// Σ dprobs·probs + scale·(aux + z) at `logits`, in f64.
fn objective(logits: &[f32], dprobs: &[f32], scale: f32, seq: usize, c: &RouterConfig) -> f64 {
    let r = route(logits, seq, c, None).unwrap();
    let main: f64 = r
        .probs
        .iter()
        .zip(dprobs)
        .map(|(&p, &d)| f64::from(p) * f64::from(d))
        .sum();
    main + f64::from(scale) * f64::from(r.aux_loss + r.z_loss)
}

#[test]
fn the_routers_gradient_matches_finite_differences() {
    let (tokens, e, seq) = (8, 4, 4);
    let base = RouterConfig {
        aux_loss_coeff: 0.1,
        z_loss_coeff: Some(0.05),
        ..RouterConfig::new(e, 2)
    };
    let cases = [
        ("softmax after top-k", base),
        (
            "softmax before top-k, scaled",
            RouterConfig {
                pre_softmax: true,
                topk_scaling_factor: Some(1.5),
                ..base
            },
        ),
        (
            "sigmoid top-2",
            RouterConfig {
                score_function: ScoreFunction::Sigmoid,
                ..base
            },
        ),
        (
            "sigmoid top-1, sequence aux loss",
            RouterConfig {
                score_function: ScoreFunction::Sigmoid,
                topk: 1,
                load_balancing: LoadBalancing::SeqAuxLoss,
                ..base
            },
        ),
        (
            "capacity drops tokens",
            RouterConfig {
                capacity_factor: Some(0.5),
                pre_softmax: true,
                ..base
            },
        ),
    ];
    for (seed, (what, config)) in cases.iter().enumerate() {
        // Logits a row's entries well apart (no top-k flips within the step).
        let mut logits = values(tokens * e, 10 + seed as u64, -1.5, 1.5);
        for t in 0..tokens {
            for j in 0..e {
                logits[t * e + j] += 0.7 * ((t * 3 + j * 5) % e) as f32;
            }
        }
        let dprobs = values(tokens * e, 20 + seed as u64, -1.0, 1.0);
        let scale = 0.7;
        let r = route(&logits, seq, config, None).unwrap();
        if config.capacity_factor.is_some() {
            assert!(r.dropped > 0, "{what}: nothing dropped");
        }
        let grad = route_backward(&r, &logits, &dprobs, scale, config).unwrap();
        let h = 1e-3f32;
        for i in 0..logits.len() {
            let mut plus = logits.clone();
            plus[i] += h;
            let mut minus = logits.clone();
            minus[i] -= h;
            let fd = (objective(&plus, &dprobs, scale, seq, config)
                - objective(&minus, &dprobs, scale, seq, config))
                / (2.0 * f64::from(h));
            assert!(
                (fd as f32 - grad[i]).abs() <= 2e-3 * (1.0 + fd.abs() as f32),
                "{what}: d/dlogit[{i}] = {} by the backward, {fd} by finite differences",
                grad[i]
            );
        }
    }
}

#[test]
fn the_expert_bias_moves_towards_the_mean_load() {
    let mut bias = vec![0.0f32; 4];
    update_expert_bias(&mut bias, &[10.0, 2.0, 6.0, 6.0], 0.001);
    assert_eq!(bias, [-0.001, 0.001, 0.0, 0.0]);
}

/// Megatron-LM's `group_limited_topk` written out plainly: each group's score the sum of its
/// values sorted from the largest, the first `topk / group_topk` of them; the groups sorted by
/// score (ties to the lower group), the first `group_topk` kept; every other expert's value
/// masked to -inf, then the top-k of all of them (ties to the lower index).
fn group_limited_reference(
    values: &[f32],
    k: usize,
    groups: usize,
    group_topk: usize,
) -> Vec<usize> {
    let per = values.len() / groups;
    let mut scores = Vec::new();
    for g in 0..groups {
        let mut v = values[g * per..(g + 1) * per].to_vec();
        v.sort_by(|a, b| b.total_cmp(a));
        scores.push(v[..k / group_topk].iter().fold(0.0f32, |s, x| s + x));
    }
    let mut order: Vec<usize> = (0..groups).collect();
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    let masked: Vec<f32> = values
        .iter()
        .enumerate()
        .map(|(j, &v)| match order[..group_topk].contains(&(j / per)) {
            true => v,
            false => f32::NEG_INFINITY,
        })
        .collect();
    let mut experts: Vec<usize> = (0..values.len()).collect();
    experts.sort_by(|&a, &b| masked[b].total_cmp(&masked[a]).then(a.cmp(&b)));
    experts.truncate(k);
    experts
}

#[test]
fn group_limited_routing_is_megatrons_on_random_scores_with_ties() {
    // 16 experts in 4 groups, values on a coarse grid so that values and group sums tie.
    let (e, k) = (16, 4);
    for (groups, group_topk) in [(4, 2), (4, 1), (8, 4), (2, 2), (16, 4)] {
        for seed in 0..200 {
            let grid: Vec<f32> = values(e, seed, -2.0, 2.0)
                .iter()
                .map(|v| (v * 2.0).round() / 2.0)
                .collect();
            let limited = Some(GroupLimited {
                groups,
                topk: group_topk,
            });
            let got = choose(&grid, k, limited);
            let want = group_limited_reference(&grid, k, groups, group_topk);
            assert_eq!(
                got, want,
                "{groups} groups, keep {group_topk}, seed {seed}: {grid:?}"
            );
            let kept: std::collections::BTreeSet<usize> =
                got.iter().map(|j| j / (e / groups)).collect();
            assert!(kept.len() <= group_topk, "{kept:?}");
        }
    }
    // One group keeps every expert: the plain top-k.
    let v = values(e, 7, -1.0, 1.0);
    let one = Some(GroupLimited { groups: 1, topk: 1 });
    assert_eq!(choose(&v, k, one), top_k(&v, k));
}

#[test]
fn group_limited_routing_routes_within_the_kept_groups_in_every_score_mode() {
    let (e, k, tokens) = (8, 2, 6);
    let logits = values(tokens * e, 3, -3.0, 3.0);
    let bias = values(e, 4, -0.5, 0.5);
    let limited = Some(GroupLimited { groups: 4, topk: 1 });
    for (pre, sigmoid) in [(false, false), (true, false), (false, true)] {
        let config = RouterConfig {
            pre_softmax: pre,
            score_function: if sigmoid {
                ScoreFunction::Sigmoid
            } else {
                ScoreFunction::Softmax
            },
            expert_bias: sigmoid,
            topk_scaling_factor: Some(2.5),
            group_limited: limited,
            ..RouterConfig::new(e, k)
        };
        let r = route(&logits, tokens, &config, sigmoid.then_some(&bias[..])).unwrap();
        for t in 0..tokens {
            let row = &logits[t * e..(t + 1) * e];
            // What the top-k ranks in this mode: the logits (softmax after the top-k), their
            // softmax (before), their sigmoids plus the bias.
            let ranked: Vec<f32> = match (pre, sigmoid) {
                (false, false) => row.to_vec(),
                (true, false) => {
                    let mut s = vec![0.0; e];
                    softmax(row, &mut s);
                    s
                }
                _ => row
                    .iter()
                    .zip(&bias)
                    .map(|(&x, b)| sigmoid_of(x) + b)
                    .collect(),
            };
            let want = group_limited_reference(&ranked, k, 4, 1);
            let got: Vec<usize> = (0..e).filter(|&j| r.map[t * e + j]).collect();
            let mut want_sorted = want.clone();
            want_sorted.sort();
            assert_eq!(got, want_sorted, "pre {pre} sigmoid {sigmoid} token {t}");
            // Both experts of one group of 2: the kept group.
            assert_eq!(want[0] / 2, want[1] / 2);
            if !pre {
                let total: f32 = r.probs[t * e..(t + 1) * e].iter().sum();
                assert!(
                    close(total, 2.5, 1e-5),
                    "weights sum to the scaling factor: {total}"
                );
            }
        }
    }
}

fn sigmoid_of(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

#[test]
fn group_limited_settings_that_cannot_route_name_their_numbers() {
    let err = |groups, topk, k| {
        RouterConfig {
            group_limited: Some(GroupLimited { groups, topk }),
            ..RouterConfig::new(16, k)
        }
        .validate()
        .unwrap_err()
        .to_string()
    };
    assert_eq!(
        err(3, 1, 2),
        "--moe-router-num-groups 3 does not divide --num-experts 16 into equal groups"
    );
    assert!(err(0, 1, 2).contains("--moe-router-num-groups 0"));
    for (groups, topk, k) in [(4, 5, 5), (4, 0, 2), (4, 3, 4), (8, 1, 4)] {
        let e = err(groups, topk, k);
        assert!(
            e.contains(&format!(
                "--moe-router-group-topk {topk} must be between 1 and"
            )),
            "{groups} {topk} {k}: {e}"
        );
    }
}
