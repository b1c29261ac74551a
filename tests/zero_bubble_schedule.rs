//! The zero-bubble schedules (ZB-H1, ZB-H2, ZB-V, DualPipeV) against their definitions: ZB-H1
//! and ZB-H2 for pp 4, M 8 derived by hand from Qi et al.'s rules; ZB-V and DualPipeV against
//! the orders torch.distributed.pipelining builds (tests/data/torch_pipeline_orders.json, made by
//! tools/golden/torch_pipeline_orders.py); for every pp ≤ 8 and M ≤ 32 each schedule accepts, a
//! valid pipeline, the paper's bubble at equal pass times, the activations the paper claims,
//! and a plan that completes under either delivery; the walk refuses a weight-gradient pass out
//! of its place; the command line refuses what a schedule cannot run, naming the numbers.

mod support;
use megatron::pipeline_parallel::plan::{Delivery, check, plan};
use megatron::pipeline_parallel::{
    Costs, Pass, RecordingStage, Schedule, ScheduleConfig, ScheduleKind, Slot, WalkError, simulate,
    theory, traces, walk,
};
use serde_json::Value;
use support::megatron;

/// `megatron schedule --json`'s per-rank traces, as `"F0 B0 W0 …"` (pass, microbatch; with two
/// chunks, the chunk's letter first: `aF0`).
fn traces_of(args: &[&str]) -> Vec<String> {
    let mut all = vec!["schedule", "--json"];
    all.extend_from_slice(args);
    let (ok, stdout, stderr) = megatron(&all);
    assert!(ok, "{stderr}");
    let v: Value = serde_json::from_str(&stdout).unwrap();
    let two = v["vpp"] == 2;
    v["per_rank"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            let passes: Vec<String> = r["trace"]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| {
                    let chunk = match two {
                        true => ["a", "b"][p[1].as_u64().unwrap() as usize],
                        false => "",
                    };
                    format!("{chunk}{}{}", p[0].as_str().unwrap(), p[2])
                })
                .collect();
            passes.join(" ")
        })
        .collect()
}

#[test]
fn zb_h1_for_pp_4_and_8_microbatches_by_hand() {
    // Rank i: p − 1 − i forwards; i pairs F B; triples F B W (each W the oldest pending) while
    // forwards remain; pairs B W; the i W's left.
    let expected = [
        "F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7",
        "F0 F1 F2 B0 F3 B1 W0 F4 B2 W1 F5 B3 W2 F6 B4 W3 F7 B5 W4 B6 W5 B7 W6 W7",
        "F0 F1 B0 F2 B1 F3 B2 W0 F4 B3 W1 F5 B4 W2 F6 B5 W3 F7 B6 W4 B7 W5 W6 W7",
        "F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7",
    ];
    let args = ["--schedule", "zb-h1", "--pp", "4", "--microbatches", "8"];
    assert_eq!(traces_of(&args), expected);
}

#[test]
fn zb_h2_for_pp_4_and_8_microbatches_by_hand() {
    // Rank i: 2(p − 1 − i) forwards; 2i pairs F B; triples; pairs B W; the 2i W's left.
    let expected = [
        "F0 F1 F2 F3 F4 F5 F6 B0 W0 F7 B1 W1 B2 W2 B3 W3 B4 W4 B5 W5 B6 W6 B7 W7",
        "F0 F1 F2 F3 F4 B0 F5 B1 F6 B2 W0 F7 B3 W1 B4 W2 B5 W3 B6 W4 B7 W5 W6 W7",
        "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 W0 F7 B5 W1 B6 W2 B7 W3 W4 W5 W6 W7",
        "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 W0 F7 B7 W1 W2 W3 W4 W5 W6 W7",
    ];
    let args = ["--schedule", "zb-h2", "--pp", "4", "--microbatches", "8"];
    assert_eq!(traces_of(&args), expected);
}

#[test]
fn zbv_and_dualpipev_follow_torch_distributed_pipelining() {
    let golden: Value = serde_json::from_str(
        &std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/data/torch_pipeline_orders.json"
        ))
        .unwrap(),
    )
    .unwrap();
    let mut cases = 0;
    for name in ["zbv", "dualpipev"] {
        for case in golden[name].as_array().unwrap() {
            let (pp, m) = (case["pp"].to_string(), case["microbatches"].to_string());
            let args = ["--schedule", name, "--pp", &pp, "--microbatches", &m];
            let torch: Vec<String> = case["ranks"]
                .as_array()
                .unwrap()
                .iter()
                .map(|rank| {
                    let passes: Vec<String> = rank
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|p| {
                            let chunk = ["a", "b"][p[1].as_u64().unwrap() as usize];
                            format!("{chunk}{}{}", p[0].as_str().unwrap(), p[2])
                        })
                        .collect();
                    passes.join(" ")
                })
                .collect();
            assert_eq!(traces_of(&args), torch, "{name} pp {pp} M {m}");
            cases += 1;
        }
    }
    assert_eq!(cases, 13);
}

/// The training schedules of `kind` for every pp ≤ 8 and M ≤ 32 it accepts (interleaved with
/// two chunks).
fn accepted(kind: ScheduleKind) -> Vec<ScheduleConfig> {
    let vpp = (kind == ScheduleKind::Interleaved).then_some(2);
    (1..=8)
        .flat_map(|pp| (1..=32).map(move |m| (pp, m)))
        .filter_map(|(pp, m)| ScheduleConfig::named(kind, pp, vpp, m).ok())
        .filter(|c| c.validate().is_ok())
        .collect()
}

#[test]
fn every_schedule_is_a_pipeline_with_its_papers_bubble_and_memory() {
    for kind in ScheduleKind::ALL {
        let configs = accepted(kind);
        assert!(configs.len() >= 50, "{kind}: {} accepted", configs.len());
        for config in configs {
            let what = format!("{kind} pp {} M {}", config.pp, config.microbatches);
            let schedule = Schedule::new(config).unwrap();
            let timeline =
                simulate(&schedule, Costs::EQUAL).unwrap_or_else(|e| panic!("{what}: {e}"));
            let (p, m, v) = (config.pp, config.microbatches, config.vpp);
            for (_, stats) in traces(&schedule).unwrap() {
                assert_eq!((stats.forwards, stats.backwards), (m * v, m * v), "{what}");
                let weights = if kind.splits_backward() { m * v } else { 0 };
                assert_eq!(stats.weights, weights, "{what}");
            }
            let theory = theory(&config, Costs::EQUAL.times());
            if m >= theory.min_microbatches {
                assert!(
                    (timeline.bubble() - theory.bubble).abs() < 1e-12,
                    "{what}: bubble {} vs {} ({})",
                    timeline.bubble(),
                    theory.bubble,
                    theory.formula
                );
                if let Some(within) = theory.within_ranks {
                    assert!(
                        (timeline.bubble_within_ranks() - within).abs() < 1e-12,
                        "{what}: inside the ranks {} vs {within}",
                        timeline.bubble_within_ranks()
                    );
                }
            }
            // The most microbatches' activations a rank holds (a chunk's count per chunk; a V's
            // chunk is half a stage): ZB-H1 and ZB-V hold 1F1B's, ZB-H2 up to 2p − 1.
            let peak = timeline.walks.iter().map(|w| w.max_live).max().unwrap();
            let one_f_one_b = p.min(m);
            match kind {
                ScheduleKind::OneFOneB | ScheduleKind::ZbH1 => {
                    assert_eq!(peak, one_f_one_b, "{what}")
                }
                ScheduleKind::ZbH2 => assert_eq!(peak, (2 * p - 1).min(m), "{what}"),
                ScheduleKind::Zbv => assert_eq!(peak, 2 * one_f_one_b, "{what}"),
                ScheduleKind::Interleaved | ScheduleKind::DualPipeV => {}
            }
        }
    }
}

#[test]
fn every_schedules_plan_completes_under_either_delivery() {
    let mut checked = 0;
    for kind in ScheduleKind::ALL {
        for config in accepted(kind) {
            for forward_only in [false, true] {
                let config = ScheduleConfig {
                    forward_only,
                    ..config
                };
                let schedule = Schedule::new(config).unwrap();
                for delivery in [Delivery::Buffered, Delivery::Rendezvous] {
                    let what = format!("{config:?} {delivery:?}");
                    let plans = plan(&schedule, delivery).unwrap_or_else(|e| panic!("{what}: {e}"));
                    check(&plans, &config.stage_map(), delivery)
                        .unwrap_or_else(|e| panic!("{what}: {e}"));
                    checked += 1;
                }
            }
        }
    }
    assert!(checked > 4000, "{checked}");
}

#[test]
fn a_weight_gradient_pass_out_of_place_is_refused() {
    let (f, b, w) = (Slot::forward(0), Slot::backward(0), Slot::weight(0));
    let walked = |order: &[Slot]| walk(order, 1, 2, false, &mut RecordingStage::default());
    assert!(walked(&[f, b, w, f, b, w]).is_ok());
    // A W before its backward.
    let err = walked(&[f, w, b, f, b, w]).unwrap_err();
    assert!(
        matches!(
            err,
            WalkError::OutOfOrder {
                pass: Pass::Weight,
                microbatch: 0,
                ..
            }
        ),
        "{err}"
    );
    // A W moved past the end of the step, after the optimizer's: its gradients would be missing.
    let err = walked(&[f, b, w, f, b]).unwrap_err();
    assert!(err.to_string().contains("the optimizer steps"), "{err}");
}

#[test]
fn the_command_line_refuses_what_a_schedule_cannot_run() {
    for (args, want) in [
        (
            &[
                "--schedule",
                "zbv",
                "--pp",
                "4",
                "--vpp",
                "3",
                "--microbatches",
                "8",
            ][..],
            "--pipeline-schedule zbv runs 2 model chunks (its V: down the ranks and back up) per \
             rank, got --virtual-pipeline-model-parallel-size 3",
        ),
        (
            &[
                "--schedule",
                "dualpipev",
                "--pp",
                "4",
                "--microbatches",
                "6",
            ],
            "dualpipev needs at least 2·pp = 8 microbatches per step",
        ),
        (
            &[
                "--schedule",
                "zb-h1",
                "--pp",
                "4",
                "--vpp",
                "2",
                "--microbatches",
                "8",
            ],
            "zb-h1 runs 1 model chunk per rank, got --virtual-pipeline-model-parallel-size 2",
        ),
        (
            &[
                "--schedule",
                "interleaved",
                "--pp",
                "4",
                "--microbatches",
                "8",
            ],
            "interleaved runs at least 2 model chunks per rank, and \
             --virtual-pipeline-model-parallel-size was not given",
        ),
        (
            &[
                "--schedule",
                "zbv",
                "--pp",
                "4",
                "--microbatches",
                "8",
                "--group-size",
                "4",
            ],
            "--microbatch-group-size-per-virtual-pipeline-stage 4 does nothing with \
             --pipeline-schedule zbv (it groups the interleaved schedule's microbatches): drop it",
        ),
        (
            &["--schedule", "zbv", "--pp", "1", "--microbatches", "8"],
            "zbv needs a pipeline of at least 2 stages, got --pipeline-model-parallel-size 1",
        ),
        (
            &["--schedule", "zb-h3", "--pp", "4", "--microbatches", "8"],
            "unknown pipeline schedule; one of 1f1b, interleaved, zb-h1, zb-h2, zbv, dualpipev",
        ),
    ] {
        let mut all = vec!["schedule"];
        all.extend_from_slice(args);
        let (ok, _, stderr) = megatron(&all);
        assert!(!ok, "{args:?}");
        assert!(stderr.contains(want), "{args:?}: {stderr}");
    }
    // The text output names the schedule's formula.
    let (ok, stdout, stderr) = megatron(&[
        "schedule",
        "--pipeline-schedule",
        "zb-h1",
        "--pp",
        "4",
        "--microbatches",
        "8",
    ]);
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains("bubble 0.125 of the compute time (theory: (p − 1)(F + B − W)"),
        "{stdout}"
    );
}

#[test]
fn uneven_stages_simulated_idle_the_lighter_ranks() {
    use megatron::pipeline_parallel::simulate_ranks;
    let schedule = Schedule::new(ScheduleConfig::new(2, 1, 16)).unwrap();
    // Equal costs per rank: the same timeline as one cost for all.
    let equal = simulate_ranks(&schedule, &[Costs::EQUAL, Costs::EQUAL]).unwrap();
    assert_eq!(equal, simulate(&schedule, Costs::EQUAL).unwrap());
    assert!((equal.mean_rank_bubble() - 1.0 / 16.0).abs() < 1e-12);
    // The last stage twice as slow: it sets the pace, its bubble stays (p − 1)/M of its own
    // time, and the first rank idles half of the step.
    let slow = Costs {
        forward: 2,
        backward: 2,
        weight: 2,
    };
    let uneven = simulate_ranks(&schedule, &[Costs::EQUAL, slow]).unwrap();
    let (busy0, busy1) = (uneven.busy_per_rank[0], uneven.busy_per_rank[1]);
    assert_eq!(busy1, 2 * busy0);
    assert_eq!(uneven.makespan, busy1 + 3);
    assert!(
        uneven.mean_rank_bubble() > 0.5,
        "{}",
        uneven.mean_rank_bubble()
    );
}
