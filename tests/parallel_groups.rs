//! Megatron's rank generator: seed 001's worked examples, hand-checked layouts, and properties
//! over many configurations against an independent brute-force grouping.

use std::collections::BTreeMap;

use megatron::parallel::{
    Axis, ConfigError, GroupKind, GroupToken, Layout, Order, ParallelConfig, ParallelLayout,
};

mod support;
use support::megatron;

fn layout(config: ParallelConfig) -> ParallelLayout {
    ParallelLayout::new(&config).expect("valid config")
}

fn groups(layout: &ParallelLayout, token: &str) -> Vec<Vec<usize>> {
    layout.token_groups(&GroupToken::parse(token).expect("token"))
}

fn v(groups: &[&[usize]]) -> Vec<Vec<usize>> {
    groups.iter().map(|g| g.to_vec()).collect()
}

#[test]
fn seed_dense_tp4_pp2_dp2() {
    let l = layout(ParallelConfig::new(16).with_tp(4).with_pp(2));
    assert_eq!(l.config().dp, 2);
    assert_eq!(
        groups(&l, "tp"),
        v(&[
            &[0, 1, 2, 3],
            &[4, 5, 6, 7],
            &[8, 9, 10, 11],
            &[12, 13, 14, 15]
        ])
    );
    assert_eq!(
        groups(&l, "dp"),
        v(&[
            &[0, 4],
            &[1, 5],
            &[2, 6],
            &[3, 7],
            &[8, 12],
            &[9, 13],
            &[10, 14],
            &[11, 15]
        ])
    );
    assert_eq!(
        groups(&l, "pp"),
        v(&[
            &[0, 8],
            &[1, 9],
            &[2, 10],
            &[3, 11],
            &[4, 12],
            &[5, 13],
            &[6, 14],
            &[7, 15]
        ])
    );
    // Seed formula (2): global = tp_rank + dp_rank·tp + pp_rank·tp·dp.
    let gen_ = l.generator(Layout::Dense);
    for rank in 0..16 {
        let (t, d, p) = (
            gen_.coordinate(rank, Axis::Tp),
            gen_.coordinate(rank, Axis::Dp),
            gen_.coordinate(rank, Axis::Pp),
        );
        assert_eq!(rank, t + d * 4 + p * 8);
    }
}

#[test]
fn seed_moe_etp1_pp2_ep4_edp2() {
    let l = layout(
        ParallelConfig::new(16)
            .with_tp(4)
            .with_pp(2)
            .with_etp(1)
            .with_ep(4),
    );
    assert_eq!(l.config().edp, 2);
    assert_eq!(
        groups(&l, "ep"),
        v(&[
            &[0, 1, 2, 3],
            &[4, 5, 6, 7],
            &[8, 9, 10, 11],
            &[12, 13, 14, 15]
        ])
    );
    assert_eq!(
        groups(&l, "edp"),
        v(&[
            &[0, 4],
            &[1, 5],
            &[2, 6],
            &[3, 7],
            &[8, 12],
            &[9, 13],
            &[10, 14],
            &[11, 15]
        ])
    );
    let pp = v(&[
        &[0, 8],
        &[1, 9],
        &[2, 10],
        &[3, 11],
        &[4, 12],
        &[5, 13],
        &[6, 14],
        &[7, 15],
    ]);
    assert_eq!(l.generator(Layout::Expert).groups(&[Axis::Pp]), pp);
    assert_eq!(
        groups(&l, "etp"),
        (0..16).map(|r| vec![r]).collect::<Vec<_>>()
    );
    // The dense half of the same world is the TP4-PP2-DP2 layout.
    assert_eq!(groups(&l, "dp"), groups(&l, "edp"));
    assert_eq!(groups(&l, "tp")[1], vec![4, 5, 6, 7]);
}

#[test]
fn named_families_of_one_rank() {
    let l = layout(ParallelConfig::new(16).with_tp(2).with_cp(2).with_pp(2));
    let r = l.rank(5).unwrap();
    // rank 5 = tp 1 + cp 0·2 + dp 1·4 + pp 0·8
    assert_eq!(
        (r.tp_rank(), r.cp_rank(), r.dp_rank(), r.pp_rank()),
        (1, 0, 1, 0)
    );
    assert_eq!(r.group(GroupKind::Tp).ranks, vec![4, 5]);
    assert_eq!(r.group(GroupKind::Cp).ranks, vec![5, 7]);
    assert_eq!(r.group(GroupKind::Dp).ranks, vec![1, 5]);
    assert_eq!(r.group(GroupKind::DpCp).ranks, vec![1, 3, 5, 7]);
    assert_eq!(r.group(GroupKind::TpCp).ranks, vec![4, 5, 6, 7]);
    assert_eq!(r.group(GroupKind::TpPp).ranks, vec![4, 5, 12, 13]);
    assert_eq!(r.group(GroupKind::TpDpCp).ranks, (0..8).collect::<Vec<_>>());
    assert_eq!(r.group(GroupKind::Pp).ranks, vec![5, 13]);
    assert_eq!(r.group(GroupKind::Embedding).ranks, vec![5, 13]);
    assert_eq!(r.group(GroupKind::DpCp).index, 2);
    // The expert layout folds the same 16 ranks as etp 2 · ep 1 · edp 4 · pp 2.
    assert_eq!(r.group(GroupKind::Edp).ranks, vec![1, 3, 5, 7]);
    assert_eq!(r.group(GroupKind::World).ranks.len(), 16);
}

#[test]
fn embedding_group_is_first_and_last_stage() {
    let l = layout(ParallelConfig::new(8).with_pp(4));
    assert_eq!(l.groups(GroupKind::Embedding), v(&[&[0, 6], &[1, 7]]));
    assert!(l.rank(2).unwrap().get(GroupKind::Embedding).is_none());
    assert_eq!(l.rank(6).unwrap().group(GroupKind::Embedding).index, 1);
    let single_stage = layout(ParallelConfig::new(4).with_tp(2));
    assert_eq!(
        single_stage.groups(GroupKind::Embedding),
        v(&[&[0], &[1], &[2], &[3]])
    );
}

#[test]
fn order_with_dp_last() {
    let order = Order::parse("tp-cp-ep-pp-dp").unwrap();
    let l = layout(
        ParallelConfig::new(16)
            .with_tp(4)
            .with_pp(2)
            .with_order(order),
    );
    assert_eq!(
        groups(&l, "pp"),
        v(&[
            &[0, 4],
            &[1, 5],
            &[2, 6],
            &[3, 7],
            &[8, 12],
            &[9, 13],
            &[10, 14],
            &[11, 15]
        ])
    );
    assert_eq!(
        groups(&l, "dp"),
        v(&[
            &[0, 8],
            &[1, 9],
            &[2, 10],
            &[3, 11],
            &[4, 12],
            &[5, 13],
            &[6, 14],
            &[7, 15]
        ])
    );
    // Expert layout with etp·ep = tp·cp keeps the pipeline groups.
    let moe = ParallelConfig::new(16)
        .with_tp(4)
        .with_pp(2)
        .with_etp(1)
        .with_ep(4);
    let l = layout(moe.clone().with_order(order));
    assert_eq!(groups(&l, "ep")[1], vec![4, 5, 6, 7]);
    assert_eq!(groups(&l, "edp")[0], vec![0, 8]);
    // ... and a mismatch is refused, as Megatron asserts: first that dp and edp agree when pp is
    // not last (dp 2, edp 4 here), which is what keeps the pipeline groups equal.
    let bad = ParallelConfig::new(16)
        .with_tp(4)
        .with_pp(2)
        .with_etp(1)
        .with_ep(2);
    let err = ParallelLayout::new(&bad.with_order(order)).unwrap_err();
    assert!(
        err.to_string().contains("pp 2 gives dp 2 and edp 4"),
        "{err}"
    );
}

#[test]
fn bad_configs_name_the_numbers() {
    let msg = |c: ParallelConfig| ParallelLayout::new(&c).unwrap_err().to_string();
    assert_eq!(
        msg(ParallelConfig::new(12).with_tp(4).with_pp(2)),
        "world size 12 is not divisible by tp·cp·pp = 4·1·2 = 8 (the sizes of --tp, --cp and --pp)"
    );
    assert_eq!(
        msg(ParallelConfig::new(16).with_tp(2).with_etp(1).with_ep(3)),
        "world size 16 is not divisible by etp·ep·pp = 1·3·1 = 3 (the sizes of --etp, --ep and --pp)"
    );
    assert!(msg(ParallelConfig::new(16).with_tp(4).with_dp(2)).contains("dp 2 was given"));
    assert_eq!(
        msg(ParallelConfig::new(8).with_tp(0)),
        "tp must be at least 1, got 0"
    );
    assert!(msg(ParallelConfig::new(8).with_vpp(2)).contains("pp = 1"));
    // As Megatron's RankGenerator: an order may leave out axes of size 1 (appended at its end),
    // not larger ones.
    let short = Order::parse("tp-cp-dp-pp").unwrap();
    assert_eq!(short.to_string(), "tp-cp-dp-pp-ep");
    assert!(
        ParallelConfig::new(8)
            .with_tp(2)
            .with_order(short)
            .validate()
            .is_ok()
    );
    assert_eq!(
        msg(ParallelConfig::new(8).with_ep(2).with_order(short)),
        "the size of ep is 2, but the order `tp-cp-dp-pp` does not name it (Megatron-LM's \
         RankGenerator appends only the axes of size 1 an order leaves out)"
    );
    assert!(
        msg(ParallelConfig::new(8)
            .with_cp(2)
            .with_order(Order::parse("tp-dp").unwrap()))
        .starts_with("the size of cp is 2")
    );
    // Megatron's assertion for orders not ending in pp.
    assert!(
        msg(ParallelConfig::new(8)
            .with_ep(2)
            .with_pp(2)
            .with_order(Order::parse("tp-cp-ep-pp-dp").unwrap()))
        .starts_with("when not using pp-last rank ordering")
    );
    assert!(
        Order::parse("tp-tp-ep-dp-pp")
            .unwrap_err()
            .to_string()
            .contains("twice")
    );
    assert!(matches!(
        GroupToken::parse("tp-xp"),
        Err(ConfigError::BadToken { .. })
    ));
}

/// Independent reference: group ranks by their coordinates on the other axes (computed from
/// mixed-radix digits), members ascending, groups by their smallest member.
fn brute_force(sizes: &[(Axis, usize)], masked: &[Axis]) -> Vec<Vec<usize>> {
    let world: usize = sizes.iter().map(|(_, s)| s).product();
    let mut by_key: BTreeMap<Vec<usize>, Vec<usize>> = BTreeMap::new();
    for rank in 0..world {
        let mut rest = rank;
        let mut key = Vec::new();
        for (axis, size) in sizes {
            let digit = rest % size;
            rest /= size;
            if !masked.contains(axis) {
                key.push(digit);
            }
        }
        by_key.entry(key).or_default().push(rank);
    }
    let mut groups: Vec<Vec<usize>> = by_key.into_values().collect();
    groups.sort();
    groups
}

/// Every subset of axes, as lists.
fn subsets(axes: &[Axis]) -> Vec<Vec<Axis>> {
    (1..1usize << axes.len())
        .map(|bits| {
            axes.iter()
                .enumerate()
                .filter(|(i, _)| bits >> i & 1 == 1)
                .map(|(_, a)| *a)
                .collect()
        })
        .collect()
}

#[test]
fn properties_over_many_configs() {
    let orders = [
        "tp-cp-ep-dp-pp",
        "tp-cp-ep-pp-dp",
        "tp-pp-dp-cp-ep",
        "pp-dp-tp-cp-ep",
    ];
    let mut checked = 0;
    for world in [1, 2, 4, 6, 8, 12, 16, 24, 32] {
        for tp in [1, 2, 3, 4] {
            for cp in [1, 2] {
                for pp in [1, 2, 4] {
                    for ep in [1, 2, 4] {
                        for etp in [1, 2] {
                            for order in orders {
                                let config = ParallelConfig::new(world)
                                    .with_tp(tp)
                                    .with_cp(cp)
                                    .with_pp(pp)
                                    .with_ep(ep)
                                    .with_etp(etp)
                                    .with_order(Order::parse(order).unwrap());
                                let Ok(l) = ParallelLayout::new(&config) else {
                                    continue;
                                };
                                check_layout(&l);
                                checked += 1;
                            }
                        }
                    }
                }
            }
        }
    }
    assert!(checked > 300, "only {checked} valid configs");
}

fn check_layout(l: &ParallelLayout) {
    let world = l.config().world_size;
    for layout in [Layout::Dense, Layout::Expert] {
        let g = l.generator(layout);
        let order = g.order();
        let sizes: Vec<(Axis, usize)> = order.axes().iter().map(|&a| (a, g.size(a))).collect();
        for axes in subsets(&Axis::ALL) {
            let got = g.groups(&axes);
            assert_eq!(
                got,
                brute_force(&sizes, &axes),
                "{layout:?} {axes:?} {sizes:?}"
            );
            // Each family partitions the world.
            let mut seen = vec![false; world];
            for group in &got {
                for &r in group {
                    assert!(!seen[r], "rank {r} twice in {axes:?}");
                    seen[r] = true;
                }
            }
            assert!(seen.iter().all(|&s| s));
            // group_of agrees with the full listing.
            for group in &got {
                for (i, &r) in group.iter().enumerate() {
                    assert_eq!(g.group_of(r, &axes), (group.clone(), i));
                }
            }
        }
        // Groups of orthogonal axes meet only in the rank itself.
        for rank in 0..world {
            for a in Axis::ALL {
                for b in Axis::ALL {
                    if a == b {
                        continue;
                    }
                    let (ga, _) = g.group_of(rank, &[a]);
                    let (gb, _) = g.group_of(rank, &[b]);
                    let common: Vec<_> = ga.iter().filter(|r| gb.contains(r)).collect();
                    assert_eq!(common, vec![&rank]);
                }
            }
        }
    }
    // Every rank's named groups are the ones listed for its family.
    for rank in 0..world {
        let rg = l.rank(rank).unwrap();
        for group in rg.iter() {
            let family = l.groups(group.kind);
            assert!(
                family.contains(&group.ranks),
                "{:?} of rank {rank}",
                group.kind
            );
            assert_eq!(group.ranks[group.index], rank);
        }
    }
}

#[test]
fn cli_reproduces_both_seed_examples_as_json() {
    let (ok, stdout, stderr) = megatron(&[
        "groups",
        "--world-size",
        "16",
        "--tp",
        "4",
        "--pp",
        "2",
        "--etp",
        "1",
        "--ep",
        "4",
        "--group",
        "tp-dp-cp",
        "--group",
        "ep-edp",
        "--json",
    ]);
    assert!(ok, "{stderr}");
    let json: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let get = |layout: &str, token: &str| -> Vec<Vec<usize>> {
        serde_json::from_value(json[layout][token].clone()).unwrap()
    };
    assert_eq!(get("dense", "tp")[3], vec![12, 13, 14, 15]);
    assert_eq!(get("dense", "dp")[4], vec![8, 12]);
    assert_eq!(get("dense", "pp")[7], vec![7, 15]);
    assert_eq!(get("dense", "cp").len(), 16);
    assert_eq!(
        get("dense", "tp-dp-cp"),
        vec![(0..8).collect::<Vec<_>>(), (8..16).collect()]
    );
    assert_eq!(get("expert", "ep")[2], vec![8, 9, 10, 11]);
    assert_eq!(get("expert", "edp")[7], vec![11, 15]);
    assert_eq!(get("expert", "etp").len(), 16);
    assert_eq!(get("expert", "pp")[0], vec![0, 8]);
    assert_eq!(
        get("expert", "ep-edp"),
        vec![(0..8).collect::<Vec<_>>(), (8..16).collect()]
    );
}

#[test]
fn cli_table_and_errors() {
    let (ok, stdout, _) = megatron(&["groups", "--world-size", "16", "--tp", "4", "--pp", "2"]);
    assert!(ok);
    assert!(
        stdout.contains("dp   8 × 2: [0, 4] [1, 5] [2, 6] [3, 7] [8, 12]"),
        "{stdout}"
    );
    let (ok, _, stderr) = megatron(&["groups", "--world-size", "12", "--tp", "4", "--pp", "2"]);
    assert!(!ok);
    assert!(
        stderr.contains("world size 12 is not divisible by tp·cp·pp = 4·1·2 = 8 (the sizes of --tp, --cp and --pp)"),
        "{stderr}"
    );
    let (ok, _, stderr) = megatron(&["groups", "--world-size", "8", "--group", "tp-zz"]);
    assert!(!ok);
    assert!(stderr.contains("`zz` is not an axis"), "{stderr}");
}

#[test]
fn groups_takes_an_order_as_megatron_does_and_refuses_with_megatrons_reason() {
    // Axes of size 1 may be left out; the printed order has them appended.
    let (ok, stdout, stderr) = megatron(&[
        "groups",
        "--world-size",
        "8",
        "--tp",
        "2",
        "--order",
        "tp-dp-pp",
    ]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("order tp-dp-pp-ep-cp"), "{stdout}");
    let cases: [(&[&str], &str); 3] = [
        (
            &["--cp", "2", "--order", "tp-dp-pp"],
            "the size of cp is 2, but the order `tp-dp-pp` does not name it",
        ),
        (
            &["--ep", "2", "--order", "tp-cp-dp-pp"],
            "the size of ep is 2, but the order `tp-cp-dp-pp` does not name it",
        ),
        (
            &["--ep", "2", "--pp", "2", "--order", "tp-cp-ep-pp-dp"],
            "when not using pp-last rank ordering, the data parallel size of the attention and \
             moe layers must be the same",
        ),
    ];
    for (flags, expected) in cases {
        let mut args = vec!["groups", "--world-size", "8", "--tp", "2"];
        args.extend(flags);
        let (ok, _, stderr) = megatron(&args);
        assert!(!ok && stderr.contains(expected), "{flags:?}: {stderr}");
        assert!(!stderr.contains("permutation"), "{stderr}");
    }
}
