//! Pipeline schedules against Megatron-LM: the seed's worked PP=4, VPP=2, M=8 orders, the
//! example in Megatron-LM's own docstring, Megatron's argument checks, and, over every small
//! configuration, a valid pipeline (each backward after its forward, messages awaited in the
//! order they are sent, no deadlock), activations held bounded by the warm-up, and the bubble
//! of Megatron-LM's theory. `megatron schedule` prints what the executor walks.

mod support;
use megatron::pipeline_parallel::{
    Costs, Pass, RankCounts, Schedule, ScheduleConfig, ScheduleError, Slot, TableEntry,
    order_from_table, schedule_table, simulate, traces,
};
use support::megatron;

/// The orders of the seed's PP = 4, VPP = 2, 8 microbatches (group size 4), each rank's by the
/// seed's step-by-step derivation: warm-up forwards, forward/backward pairs, cool-down.
const SEED_ORDERS: [[i32; 32]; 4] = [
    [
        1, 1, 1, 1, 2, 2, 2, 2, 1, 1, 1, -2, 1, -2, 2, -2, 2, -2, 2, -1, 2, -1, -1, -1, -2, -2, -2,
        -2, -1, -1, -1, -1,
    ],
    [
        1, 1, 1, 1, 2, 2, 2, 2, 1, -2, 1, -2, 1, -2, 1, -2, 2, -1, 2, -1, 2, -1, 2, -1, -2, -2, -2,
        -2, -1, -1, -1, -1,
    ],
    [
        1, 1, 1, 1, 2, 2, 2, -2, 2, -2, 1, -2, 1, -2, 1, -1, 1, -1, 2, -1, 2, -1, 2, -2, 2, -2, -2,
        -2, -1, -1, -1, -1,
    ],
    [
        1, 1, 1, 1, 2, -2, 2, -2, 2, -2, 2, -2, 1, -1, 1, -1, 1, -1, 1, -1, 2, -2, 2, -2, 2, -2, 2,
        -2, -1, -1, -1, -1,
    ],
];

#[test]
fn the_seeds_interleaved_orders_for_every_rank() {
    let schedule = Schedule::new(ScheduleConfig::new(4, 2, 8)).unwrap();
    // The seed's table: chunk 0 then chunk 1 for microbatches 0–3, then for 4–7.
    let chunks: Vec<usize> = schedule.table.iter().map(|s| s.chunk).collect();
    assert_eq!(chunks, [0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1]);
    for (rank, expected) in SEED_ORDERS.iter().enumerate() {
        let r = &schedule.ranks[rank];
        // (PP − rank − 1)·2 + (VPP − 1)·group size.
        assert_eq!(r.counts.warmup, (4 - rank - 1) * 2 + 4, "rank {rank}");
        assert_eq!(r.counts.total, 16);
        assert_eq!(r.megatron_order().unwrap(), expected, "rank {rank}");
    }
}

#[test]
fn megatrons_docstring_example() {
    // cuda_graphs.convert_schedule_table_to_order's docstring: PP 2, N 3, M 5, VP 2.
    let table = schedule_table(5, 2, 3);
    let (mbs, chunks): (Vec<usize>, Vec<usize>) =
        table.iter().map(|s| (s.microbatch, s.chunk)).unzip();
    assert_eq!(mbs, [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]);
    assert_eq!(chunks, [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]);
    assert_eq!(
        order_from_table(&table, 2, 5),
        [
            1, 1, 1, 2, 2, 2, -2, 1, -2, 1, -2, 2, -1, 2, -1, -1, -2, -2, -1, -1
        ]
    );
    // The same configuration through the schedule: rank 1 has (2 − 1 − 1)·2 + 3 warm-up.
    let mut config = ScheduleConfig::new(2, 2, 5);
    config.group_size = Some(3);
    let schedule = Schedule::new(config).unwrap();
    assert_eq!(schedule.ranks[1].counts.warmup, 3);
    assert_eq!(schedule.ranks[0].counts.warmup, 5);
    assert_eq!(
        schedule.ranks[0].megatron_order().unwrap(),
        order_from_table(&table, 2, 5)
    );
}

#[test]
fn counts_for_training_forward_only_and_moe_overlap() {
    // 1F1B: pp − rank − 1 warm-up forwards, capped by the microbatches.
    let c = ScheduleConfig::new(4, 1, 2);
    let counts: Vec<(usize, usize, bool)> = (0..4)
        .map(|r| {
            let k = RankCounts::of(&c, r);
            (k.warmup, k.remaining, k.all_in_warmup)
        })
        .collect();
    assert_eq!(
        counts,
        [(2, 0, true), (2, 0, true), (1, 1, false), (0, 2, false)]
    );
    // Forward-only: everything is warm-up.
    let mut f = ScheduleConfig::new(4, 2, 8);
    f.forward_only = true;
    let k = RankCounts::of(&f, 3);
    assert_eq!(
        (k.total, k.warmup, k.remaining, k.all_in_warmup),
        (16, 16, 0, true)
    );
    let schedule = Schedule::new(f).unwrap();
    assert!(
        schedule
            .ranks
            .iter()
            .all(|r| r.order.iter().all(|s| s.pass == Pass::Forward))
    );
    assert_eq!(schedule.ranks[0].order.len(), 16);
    // MoE overlap: one more warm-up forward in the interleaved schedule only.
    let mut m = ScheduleConfig::new(4, 2, 8);
    m.overlap_moe_comm = true;
    assert_eq!(RankCounts::of(&m, 0).warmup, 11);
    assert_eq!(RankCounts::of(&m, 3).warmup, 5);
    let mut one = ScheduleConfig::new(4, 1, 8);
    one.overlap_moe_comm = true;
    assert_eq!(RankCounts::of(&one, 0).warmup, 3);
    // No pipeline: no warm-up.
    assert_eq!(RankCounts::of(&ScheduleConfig::new(1, 1, 4), 0).warmup, 0);
}

#[test]
fn megatrons_checks_name_the_numbers() {
    let err = |c: ScheduleConfig| Schedule::new(c).unwrap_err();
    let with_group = |pp, vpp, m, g| {
        let mut c = ScheduleConfig::new(pp, vpp, m);
        c.group_size = Some(g);
        c
    };
    assert_eq!(
        err(with_group(4, 2, 8, 3)),
        ScheduleError::GroupSize {
            group: 3,
            pp: 4,
            microbatches: 8
        }
    );
    assert!(matches!(
        err(with_group(4, 2, 8, 9)),
        ScheduleError::GroupSize { group: 9, .. }
    ));
    // 10 = 4 + 4 + 2: a last group of 2 < pp.
    let e = err(ScheduleConfig::new(4, 2, 10));
    assert_eq!(
        e,
        ScheduleError::ShortLastGroup {
            microbatches: 10,
            group: 4,
            remainder: 2,
            pp: 4
        }
    );
    assert!(
        e.to_string()
            .contains("is 2: it must be 0 or at least the pipeline-parallel size 4")
    );
    assert_eq!(
        err(ScheduleConfig::new(1, 2, 8)),
        ScheduleError::VirtualWithoutPipeline { vpp: 2, pp: 1 }
    );
    assert!(matches!(
        err(ScheduleConfig::new(4, 1, 0)),
        ScheduleError::Zero { .. }
    ));
    // The non-interleaved schedule takes any group size and any M.
    assert!(Schedule::new(with_group(4, 1, 3, 7)).is_ok());
}

/// Every configuration Megatron-LM accepts with pp ≤ 8, V ≤ 4, M ≤ 16 (and every group size).
fn configurations() -> Vec<ScheduleConfig> {
    let mut out = Vec::new();
    for pp in 1..=8 {
        for vpp in 1..=4 {
            for m in 1..=16 {
                let groups: Vec<Option<usize>> = if vpp == 1 {
                    vec![None]
                } else {
                    (1..=m).map(Some).collect()
                };
                for group_size in groups {
                    let c = ScheduleConfig {
                        group_size,
                        ..ScheduleConfig::new(pp, vpp, m)
                    };
                    if c.validate().is_ok() {
                        out.push(c);
                    }
                }
            }
        }
    }
    out
}

#[test]
fn every_order_is_a_valid_pipeline_holding_at_most_warmup_plus_one_activations() {
    let configs = configurations();
    assert!(configs.len() > 500, "{} configurations", configs.len());
    for config in configs {
        let schedule = Schedule::new(config).unwrap();
        // No deadlock, and every channel awaits its messages in the order they are sent.
        let timeline =
            simulate(&schedule, Costs::EQUAL).unwrap_or_else(|e| panic!("{config:?}: {e}"));
        let walked = traces(&schedule).unwrap();
        let m = config.microbatches;
        for (rank, (ops, stats)) in walked.iter().enumerate() {
            let counts = &schedule.ranks[rank].counts;
            assert_eq!(counts.warmup + counts.remaining, counts.total);
            assert_eq!(stats.forwards, m * config.vpp, "{config:?}");
            assert_eq!(stats.backwards, m * config.vpp, "{config:?}");
            assert!(
                stats.max_live <= counts.warmup + 1,
                "{config:?} rank {rank}: {} live > warm-up {} + 1",
                stats.max_live,
                counts.warmup
            );
            // Each microbatch goes through each chunk once each way, forward first; the n-th
            // forward is the table's n-th slot, the n-th backward that slot's mirrored chunk.
            let forwards: Vec<TableEntry> = ops
                .iter()
                .filter(|o| o.pass == Pass::Forward)
                .map(|o| TableEntry {
                    microbatch: o.microbatch,
                    chunk: o.chunk,
                })
                .collect();
            assert_eq!(forwards, schedule.table, "{config:?}");
            let backwards: Vec<TableEntry> = ops
                .iter()
                .filter(|o| o.pass == Pass::Backward)
                .map(|o| TableEntry {
                    microbatch: o.microbatch,
                    chunk: config.vpp - 1 - o.chunk,
                })
                .collect();
            assert_eq!(backwards, schedule.table, "{config:?}");
        }
        // The bubble of the theory when the microbatches fill whole groups of pp.
        if m % config.pp == 0 && config.group() == config.pp {
            let theory = (config.pp - 1) as f64 / (config.vpp * m) as f64;
            assert!(
                (timeline.bubble() - theory).abs() < 1e-12,
                "{config:?}: bubble {} vs {theory}",
                timeline.bubble()
            );
        }
    }
}

#[test]
fn a_broken_order_is_found() {
    // A backward before its forward is refused by the walk.
    let mut schedule = Schedule::new(ScheduleConfig::new(4, 1, 8)).unwrap();
    schedule.ranks[3].order.swap(0, 1);
    assert!(traces(&schedule).is_err());
    // Rank 0 running rank 1's order and the other way round: rank 0 waits for the gradient of
    // microbatch 0, which rank 1 computes only after microbatch 1, which rank 0 sends only after
    // that gradient.
    let mut schedule = Schedule::new(ScheduleConfig::new(2, 1, 2)).unwrap();
    assert_eq!(schedule.ranks[0].megatron_order().unwrap(), [1, 1, -1, -1]);
    assert_eq!(schedule.ranks[1].megatron_order().unwrap(), [1, -1, 1, -1]);
    assert_eq!(schedule.ranks[1].order[1], Slot::backward(0));
    let (a, b) = (
        schedule.ranks[0].order.clone(),
        schedule.ranks[1].order.clone(),
    );
    schedule.ranks[0].order = b;
    schedule.ranks[1].order = a;
    let err = simulate(&schedule, Costs::EQUAL).unwrap_err().to_string();
    assert!(err.contains("deadlock"), "{err}");
    assert!(
        err.contains("rank 0 at Backward of chunk 0 microbatch 0 waits for the Backward of virtual stage 1 microbatch 0"),
        "{err}"
    );
    // Rank 1 of the seed's schedule running a chunk-1 forward before the last chunk-0 one of
    // the first group: it would take the wrong activation off rank 0's channel.
    let mut schedule = Schedule::new(ScheduleConfig::new(4, 2, 8)).unwrap();
    schedule.ranks[1].order.swap(3, 4);
    let err = simulate(&schedule, Costs::EQUAL).unwrap_err();
    assert!(
        matches!(
            err,
            megatron::pipeline_parallel::PipelineError::ChannelOrder {
                pass: Pass::Forward,
                from: 0,
                to: 1,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn the_schedule_command_prints_what_the_executor_walks() {
    let (ok, stdout, stderr) = megatron(&[
        "schedule",
        "--pp",
        "4",
        "--vpp",
        "2",
        "--microbatches",
        "8",
        "--json",
    ]);
    assert!(ok, "{stderr}");
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(v["pp"], 4);
    assert_eq!(v["vpp"], 2);
    assert_eq!(v["num_microbatches"], 8);
    assert_eq!(v["group_size"], 4);
    assert_eq!(v["schedule_table"][4], serde_json::json!([0, 1]));
    for (rank, expected) in SEED_ORDERS.iter().enumerate() {
        let r = &v["per_rank"][rank];
        assert_eq!(r["pp_rank"], rank);
        assert_eq!(r["total_num_microbatches"], 16);
        assert_eq!(r["num_warmup_microbatches"], (4 - rank - 1) * 2 + 4);
        assert_eq!(
            r["num_microbatches_remaining"],
            16 - ((4 - rank - 1) * 2 + 4)
        );
        assert_eq!(r["are_all_microbatches_in_warmup"], false);
        let order: Vec<i64> = serde_json::from_value(r["order"].clone()).unwrap();
        let expected: Vec<i64> = expected.iter().map(|&e| i64::from(e)).collect();
        assert_eq!(order, expected);
        // The trace follows the order: its k-th pass is the order's k-th entry's chunk.
        let trace = r["trace"].as_array().unwrap();
        assert_eq!(trace.len(), 32);
        for (entry, pass) in expected.iter().zip(trace) {
            let kind = if *entry > 0 { "F" } else { "B" };
            assert_eq!(pass[0], kind);
            assert_eq!(pass[1], entry.unsigned_abs() - 1);
        }
        assert!(r["max_live_activations"].as_u64().unwrap() <= (4 - rank as u64 - 1) * 2 + 5);
    }
    // The text timeline: a row per rank.
    let (ok, stdout, _) = megatron(&["schedule", "--pp", "2", "--microbatches", "4"]);
    assert!(ok);
    assert!(
        stdout.contains("rank 0 |") && stdout.contains("rank 1 |"),
        "{stdout}"
    );
    assert!(stdout.contains("bubble 0.250"), "{stdout}");
    // A configuration Megatron-LM refuses.
    let (ok, _, stderr) = megatron(&[
        "schedule",
        "--pp",
        "4",
        "--vpp",
        "2",
        "--microbatches",
        "10",
    ]);
    assert!(!ok);
    assert!(stderr.contains("the remainder of M=10"), "{stderr}");
}

#[test]
fn every_plan_runs_its_order_and_completes_under_either_delivery() {
    use megatron::pipeline_parallel::plan::{Action, Delivery, check, plan};
    use megatron::pipeline_parallel::traces;
    let mut checked = 0;
    for config in configurations() {
        for (forward_only, delivery) in [
            (false, Delivery::Buffered),
            (false, Delivery::Rendezvous),
            (true, Delivery::Rendezvous),
        ] {
            let config = ScheduleConfig {
                forward_only,
                ..config
            };
            let schedule = Schedule::new(config).unwrap();
            let what = format!("{config:?} {delivery:?}");
            let plans = plan(&schedule, delivery).unwrap_or_else(|e| panic!("{what}: {e}"));
            check(&plans, &config.stage_map(), delivery).unwrap_or_else(|e| panic!("{what}: {e}"));
            for (rank_plan, (ops, _)) in plans.iter().zip(traces(&schedule).unwrap()) {
                // The passes are the rank's order, unchanged.
                let runs: Vec<_> = rank_plan
                    .actions
                    .iter()
                    .filter_map(|a| match a {
                        Action::Run(op) => Some(*op),
                        _ => None,
                    })
                    .collect();
                assert_eq!(runs, ops, "{what} rank {}", rank_plan.rank);
                // Where sends wait for their receives, a batch holds at most one message to and
                // one from each peer.
                for a in rank_plan
                    .actions
                    .iter()
                    .filter(|_| delivery == Delivery::Rendezvous)
                {
                    if let Action::Exchange { sends, recvs, .. } = a {
                        for list in [sends, recvs] {
                            let mut peers: Vec<_> = list.iter().map(|t| t.peer).collect();
                            peers.sort();
                            peers.dedup();
                            assert_eq!(peers.len(), list.len(), "{what}: {a:?}");
                        }
                    }
                }
            }
            checked += 1;
        }
    }
    assert!(checked > 1000, "{checked}");
}

#[test]
fn sends_that_wait_deadlock_the_buffered_plan_and_not_the_batched_one() {
    use megatron::pipeline_parallel::plan::{Action, Delivery, PlanError, check, plan};
    // In the interleaved schedule two ranks send at once, each waiting for the other's
    // receive, where the sends go as soon as they are produced.
    for config in [ScheduleConfig::new(2, 2, 4), ScheduleConfig::new(4, 2, 8)] {
        let schedule = Schedule::new(config).unwrap();
        let buffered = plan(&schedule, Delivery::Buffered).unwrap();
        let map = config.stage_map();
        check(&buffered, &map, Delivery::Buffered).unwrap();
        assert!(
            matches!(
                check(&buffered, &map, Delivery::Rendezvous),
                Err(PlanError::Deadlock(_))
            ),
            "{config:?}"
        );
        let batched = plan(&schedule, Delivery::Rendezvous).unwrap();
        check(&batched, &map, Delivery::Rendezvous).unwrap();
    }
    // A pass moved before the exchange that brings its input is caught.
    let schedule = Schedule::new(ScheduleConfig::new(2, 1, 2)).unwrap();
    let mut plans = plan(&schedule, Delivery::Rendezvous).unwrap();
    let actions = &mut plans[1].actions;
    let first_run = actions
        .iter()
        .position(|a| matches!(a, Action::Run(_)))
        .unwrap();
    let run = actions.remove(first_run);
    actions.insert(0, run);
    assert!(matches!(
        check(&plans, &schedule.config.stage_map(), Delivery::Rendezvous),
        Err(PlanError::Early { rank: 1, .. })
    ));
}

#[test]
fn the_ends_counted_as_layers_take_a_layer_off_the_first_and_last_virtual_stage() {
    use megatron::pipeline_parallel::{PipelineLayout, Placement};
    let runs = |l: &PipelineLayout, pp: usize, vpp: usize| -> Vec<(usize, usize)> {
        let mut parts: Vec<(usize, std::ops::Range<usize>)> = (0..pp)
            .flat_map(|r| (0..vpp).map(move |c| (r, c)))
            .map(|(r, c)| (l.virtual_stage(r, c), l.part(r, c).layers))
            .collect();
        parts.sort_by_key(|p| p.0);
        parts.into_iter().map(|(_, r)| (r.start, r.end)).collect()
    };
    // 6 layers + embedding + loss = 8 over 2 × 2 virtual stages of 2: 1, 2, 2, 1.
    let l = PipelineLayout::with_ends_counted(6, 2, 2, true, true).unwrap();
    assert_eq!(runs(&l, 2, 2), [(0, 1), (1, 3), (3, 5), (5, 6)]);
    // In a V the same stages, the last on the first rank.
    let v = l.placed(Placement::Vee).unwrap();
    assert_eq!(v.part(0, 1).layers, 5..6);
    assert!(v.part(0, 1).last && v.part(0, 0).first);
    // 7 layers + the loss over 2 stages: 4 + 3.
    let l = PipelineLayout::with_ends_counted(7, 2, 1, false, true).unwrap();
    assert_eq!(runs(&l, 2, 1), [(0, 4), (4, 7)]);
    // Megatron-LM's rule: the layers and the ends counted divide over the stages.
    let err = PipelineLayout::with_ends_counted(8, 2, 1, false, true).unwrap_err();
    assert!(
        err.to_string()
            .starts_with("9 layers with the loss counted do not divide"),
        "{err}"
    );
    // 2 layers and both ends over 4 stages: the ends' stages hold only them.
    let l = PipelineLayout::with_ends_counted(2, 4, 1, true, true).unwrap();
    assert_eq!(runs(&l, 4, 1), [(0, 0), (0, 1), (1, 2), (2, 2)]);
}
