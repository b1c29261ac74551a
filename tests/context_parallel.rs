//! Context parallelism (issue 35, `--context-parallel-size`, every `--cp-comm-type`): each rank
//! of a context-parallel group holds chunks r and 2·cp − 1 − r of every sequence; attention
//! alone gives full causal attention's output and input gradient at those rows with the ring
//! (p2p), the all-gather, the head all-to-all (a2a) and the hierarchical a2a+p2p (every block
//! of the causal mask: a chunk's own diagonal, the chunks before it, none after; sliding
//! windows that cut blocks), and training at cp 2 and 4, with tensor parallelism, data
//! parallelism and the distributed optimizer, and a Llama's rotary embeddings and grouped
//! keys, follows cp 1 step by step with hidden and attention dropout on (each mask drawn at its
//! element's global place); a checkpoint saved at cp 2 resumes at cp 1 and cp 4; bad sizes
//! and what is not built yet are refused by name.

mod support;

use megatron::comm::ParallelState;
use megatron::comm::threads::launch;
use megatron::context_parallel::traffic::{self, LayerSizes, Traffic};
use megatron::context_parallel::{ContextParallel, CpChunks, CpCommType};
use megatron::module::{Cx, Site};
use megatron::parallel::{ParallelConfig, ParallelLayout};
use megatron::tensor::Tensor;
use megatron::tensor_parallel::CausalSelfAttention;
use support::{TempDir, megatron};

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// Output and input gradient of attention over `qkv` (`[s, b, width]`) with output gradient
/// `dy`, on each rank of a cp-way group holding its chunks with comm type `kind`: every
/// rank's, in rank order.
fn attention_at(
    (cp, kind): (usize, CpCommType),
    op: &CausalSelfAttention,
    qkv: &Tensor,
    dy: &Tensor,
) -> Vec<(Vec<f32>, Vec<f32>)> {
    let layout = ParallelLayout::new(&ParallelConfig::new(cp).with_cp(cp)).unwrap();
    launch(cp, |w| -> R<(Vec<f32>, Vec<f32>)> {
        let ps = ParallelState::new(&w, &layout)?.with_cp_comm_type(&w, kind)?;
        let cx = Cx::new(&ps, 3);
        let (x, d) = match cp {
            1 => (qkv.clone(), dy.clone()),
            _ => {
                let seq = qkv.dims()[0];
                let chunks = CpChunks::new(seq, cp, ps.groups().cp_rank())?;
                (chunks.take_local(qkv)?, chunks.take_local(dy)?)
            }
        };
        let (y, saved) = op.forward_chunks(&cx, Site::ROOT, &x)?;
        let dx = op.backward_chunks(&cx, Site::ROOT, saved, &d)?;
        Ok((y.to_vec::<f32>()?, dx.to_vec::<f32>()?))
    })
    .unwrap()
}

/// Every comm type at cp 2 and 4 (a2a+p2p at 4: all-to-all in pairs, a ring of two pairs),
/// those whose all-to-all cannot split `groups` left out.
fn forms(groups: usize) -> Vec<(usize, CpCommType)> {
    let mut all = Vec::new();
    for cp in [2, 4] {
        all.push((cp, CpCommType::P2p));
        all.push((cp, CpCommType::AllGather));
        if groups.is_multiple_of(cp) {
            all.push((cp, CpCommType::A2a));
        }
    }
    if groups.is_multiple_of(2) {
        all.push((4, CpCommType::A2aP2p { a2a: 2, p2p: 2 }));
    }
    all
}

#[test]
fn context_parallel_attention_is_full_causal_attention_at_the_ranks_rows() {
    // 3 heads (none divides evenly into anything), 6 query heads in 2 groups, 4 heads at
    // every form; attention dropout drawn at each weight's global place; a sliding window of
    // 5 keys (chunks of 2 positions at cp 4: pairs wholly in, wholly out and cut by it).
    for (heads, groups, p, window) in [
        (3, 3, 0.0, None),
        (6, 2, 0.0, None),
        (3, 3, 0.3, None),
        (4, 4, 0.3, None),
        (4, 2, 0.0, Some(5)),
        (4, 4, 0.2, Some(3)),
    ] {
        let (s, b, d) = (16, 2, 4);
        let width = (heads + 2 * groups) * d;
        let qkv = Tensor::from_vec(support::values(s * b * width, 1, 3.0), [s, b, width]).unwrap();
        let dy = Tensor::from_vec(
            support::values(s * b * heads * d, 2, 1.0),
            [s, b, heads * d],
        )
        .unwrap();
        let op = CausalSelfAttention::new(heads, p)
            .with_query_groups(groups)
            .with_window(window);
        let full = attention_at((1, CpCommType::default()), &op, &qkv, &dy).remove(0);
        for (cp, kind) in forms(groups) {
            let ranks = attention_at((cp, kind), &op, &qkv, &dy);
            for (rank, (y, dx)) in ranks.iter().enumerate() {
                let chunks = CpChunks::new(s, cp, rank).unwrap();
                let rows = |v: &[f32], per: usize| -> Vec<f32> {
                    chunks
                        .ranges()
                        .into_iter()
                        .flat_map(|r| v[r.start * per..r.end * per].to_vec())
                        .collect()
                };
                let what = format!(
                    "heads {heads} groups {groups} p {p} window {window:?} cp {cp} {kind:?} \
                     rank {rank}"
                );
                support::assert_close_f32(y, &rows(&full.0, b * heads * d), &format!("{what} out"));
                support::assert_close_f32(dx, &rows(&full.1, b * width), &format!("{what} grad"));
            }
        }
    }
}

#[test]
fn attention_called_as_a_plain_op_at_cp_2_names_the_attribute() {
    let layout = ParallelLayout::new(&ParallelConfig::new(2).with_cp(2)).unwrap();
    let errors = launch(2, |w| -> R<String> {
        let ps = ParallelState::new(&w, &layout)?;
        let cx = Cx::new(&ps, 3);
        let x = Tensor::zeros([4, 1, 3 * 8], megatron::tensor::DType::F32);
        let op = CausalSelfAttention::new(2, 0.0);
        Ok(megatron::module::Op::forward(&op, &cx, Site::ROOT, &x)
            .expect_err("an #[op] attention at cp 2")
            .to_string())
    })
    .unwrap();
    assert!(
        errors[0].contains("declare its field #[context_parallel]"),
        "{}",
        errors[0]
    );
}

#[test]
fn each_form_sends_the_bytes_of_its_formula() {
    // 6 query heads in 2 groups of 8 elements, 2 sequences of 16 positions.
    let (heads, groups, d, s, b) = (6, 2, 8, 16, 2);
    let width = (heads + 2 * groups) * d;
    let qkv = Tensor::from_vec(support::values(s * b * width, 4, 1.0), [s, b, width]).unwrap();
    let dy = Tensor::from_vec(
        support::values(s * b * heads * d, 5, 1.0),
        [s, b, heads * d],
    )
    .unwrap();
    let op = CausalSelfAttention::new(heads, 0.0).with_query_groups(groups);
    let sizes = LayerSizes {
        seq: s,
        batch: b,
        groups,
        per_group: heads / groups,
        head_dim: d,
    };
    for (cp, kind) in forms(groups) {
        let layout = ParallelLayout::new(&ParallelConfig::new(cp).with_cp(cp)).unwrap();
        let measured = launch(cp, |w| -> R<Traffic> {
            let ps = ParallelState::new(&w, &layout)?.with_cp_comm_type(&w, kind)?;
            let groups = ps.context_parallel().expect("cp groups");
            let sent = || groups.sent();
            let cx = Cx::new(&ps, 3);
            let chunks = CpChunks::new(s, cp, ps.groups().cp_rank())?;
            let (x, g) = (chunks.take_local(&qkv)?, chunks.take_local(&dy)?);
            let before = sent();
            let (_, saved) = op.forward_chunks(&cx, Site::ROOT, &x)?;
            let forward = sent() - before;
            op.backward_chunks(&cx, Site::ROOT, saved, &g)?;
            Ok(Traffic {
                forward,
                backward: sent() - before - forward,
            })
        })
        .unwrap();
        let want = traffic::traffic(kind, cp, sizes);
        assert!(want.forward > 0 && want.backward > 0, "{kind:?}");
        for (rank, got) in measured.iter().enumerate() {
            assert_eq!(*got, want, "cp {cp} {kind:?} rank {rank}");
        }
    }
}

#[test]
fn inspect_shows_the_bytes_each_form_sends_and_a_ranks_activations() {
    for kind in ["p2p", "all_gather", "a2a"] {
        let (ok, stdout, stderr) = megatron(&[
            "inspect",
            "--model",
            "llama-tiny",
            "--cp",
            "2",
            "--cp-comm-type",
            kind,
            "--seq-length",
            "512",
            "--json",
        ]);
        assert!(ok, "{stderr}");
        let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
        let cp = &v["context_parallel"];
        assert_eq!(cp["positions_per_rank"], 256, "{cp}");
        let sent = &cp["attention_bytes_sent_per_rank_and_microbatch"];
        assert_eq!(sent["formula"], sent["measured"], "{kind}: {sent}");
        // llama-tiny: 2 groups of 2 queries of 32: keys and values 2·256·2·32 f32 a rank.
        let kv = 2 * 256 * 2 * 32 * 4;
        let forward = sent["formula"]["forward"].as_u64().unwrap();
        match kind {
            "a2a" => assert_eq!(forward, kv * 6 / 2 / 2, "{sent}"),
            _ => assert_eq!(forward, kv, "{sent}"),
        }
        let memory = &cp["layer_activation_bytes_per_rank"];
        assert!(memory["cp"].as_u64() < memory["cp1"].as_u64(), "{memory}");
    }
}

/// gpt-tiny cut to 2 layers, sequences of 32, hidden and attention dropout on.
const COMMON: [&str; 16] = [
    "train",
    "--quiet",
    "--num-layers",
    "2",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--seed=5",
    "--attention-dropout",
    "0.1",
    "--hidden-dropout",
    "0.1",
    "--train-iters=4",
];

fn assert_follows(got: &[(u64, f64, f64)], want: &[(u64, f64, f64)], what: &str) {
    // Only the order of f32 sums differs (attention's over gathered keys, the loss and the
    // gradients over the data×context-parallel group).
    assert_within(got, want, (1e-5, 1e-4), what);
}

/// Each step's loss and gradient norm within `(loss, norm)` of `want`'s, relative.
fn assert_within(
    got: &[(u64, f64, f64)],
    want: &[(u64, f64, f64)],
    (loss, norm): (f64, f64),
    what: &str,
) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (x, y) in got.iter().zip(want) {
        assert!(
            (x.1 - y.1).abs() <= loss * y.1,
            "{what}: loss {x:?} vs {y:?}"
        );
        assert!(
            (x.2 - y.2).abs() <= norm * y.2,
            "{what}: grad norm {x:?} vs {y:?}"
        );
    }
}

#[test]
fn training_at_cp_2_and_4_follows_cp_1() {
    let dir = TempDir::new("context-parallel");
    let reference = support::curve(&COMMON, &dir, "cp1", &[]);
    assert!(reference[3].1 < reference[0].1, "{reference:?}");
    for (name, flags) in [
        ("cp2", &["--cp", "2"][..]),
        ("cp4", &["--cp", "4"]),
        ("cp2-p2p", &["--cp", "2", "--cp-comm-type", "p2p"]),
        ("cp4-p2p", &["--cp", "4", "--cp-comm-type", "p2p"]),
        ("cp2-a2a", &["--cp", "2", "--cp-comm-type", "a2a"]),
        ("cp4-a2a", &["--cp", "4", "--cp-comm-type", "a2a"]),
        (
            "cp4-a2a+p2p",
            &[
                "--cp",
                "4",
                "--cp-comm-type",
                "a2a+p2p",
                "--hierarchical-context-parallel-sizes",
                "2",
                "2",
            ],
        ),
        ("cp2-tp2", &["--cp", "2", "--tp", "2"]),
        (
            "cp2-tp2-sp",
            &["--cp", "2", "--tp", "2", "--sequence-parallel"],
        ),
        (
            "cp2-tp2-sp-p2p",
            &[
                "--cp",
                "2",
                "--tp",
                "2",
                "--sequence-parallel",
                "--cp-comm-type",
                "p2p",
            ],
        ),
        ("cp2-pp2", &["--cp", "2", "--pp", "2"]),
        (
            "cp2-pp2-a2a",
            &["--cp", "2", "--pp", "2", "--cp-comm-type", "a2a"],
        ),
        (
            "cp2-recompute",
            &[
                "--cp",
                "2",
                "--recompute-granularity",
                "full",
                "--recompute-method",
                "uniform",
                "--recompute-num-layers",
                "1",
                "--cp-comm-type",
                "p2p",
            ],
        ),
        (
            "cp2-tp2-p2p",
            &["--cp", "2", "--tp", "2", "--cp-comm-type", "p2p"],
        ),
    ] {
        assert_follows(
            &support::curve(&COMMON, &dir, name, flags),
            &reference,
            name,
        );
    }
    let dp2 = support::curve(
        &COMMON,
        &dir,
        "dp2",
        &["--dp", "2", "--use-distributed-optimizer"],
    );
    let cp2dp2 = support::curve(
        &COMMON,
        &dir,
        "cp2-dp2",
        &["--cp", "2", "--dp", "2", "--use-distributed-optimizer"],
    );
    assert_follows(&cp2dp2, &dp2, "cp 2 × dp 2, distributed optimizer");
    // Mixed precision: bf16 products and activations, f32 main parameters.
    let bf16 = support::curve(&COMMON, &dir, "bf16", &["--bf16"]);
    for kind in ["p2p", "a2a"] {
        let cp2 = support::curve(
            &COMMON,
            &dir,
            &format!("bf16-cp2-{kind}"),
            &["--bf16", "--cp", "2", "--cp-comm-type", kind],
        );
        // bf16 products round their operands, so the f32 sums' other order now and then moves
        // an activation across a rounding boundary (2⁻⁹ of it), which the products and Adam's
        // first, sign-like steps carry: 16-bit precision's bound.
        assert_within(&cp2, &bf16, (2e-3, 2e-3), &format!("bf16 cp 2 {kind}"));
    }
    // A Llama: rotary embeddings at each chunk's global positions, grouped-query attention.
    let llama = ["--model", "llama-tiny", "--qk-layernorm"];
    let one = support::curve(&COMMON, &dir, "llama-cp1", &llama);
    for kind in ["all_gather", "p2p", "a2a"] {
        let two = support::curve(
            &COMMON,
            &dir,
            &format!("llama-cp2-{kind}"),
            &[&llama[..], &["--cp", "2", "--cp-comm-type", kind]].concat(),
        );
        assert_follows(&two, &one, &format!("llama-tiny cp 2 {kind}"));
    }
    // A sliding window of 6 keys over chunks of 4 positions at cp 4.
    let window = [&llama[..], &["--window-size", "6,0"]].concat();
    let one = support::curve(&COMMON, &dir, "window-cp1", &window);
    let four = support::curve(
        &COMMON,
        &dir,
        "window-cp4",
        &[&window[..], &["--cp", "4", "--cp-comm-type", "p2p"]].concat(),
    );
    assert_follows(&four, &one, "llama-tiny, window 6, cp 4 p2p");
}

#[test]
fn a_checkpoint_saved_at_cp_2_resumes_bit_for_bit_and_at_cp_1_and_4() {
    let dir = TempDir::new("context-parallel-resume");
    let save = dir.join("ckpt");
    let whole = support::curve(
        &COMMON,
        &dir,
        "whole",
        &[
            "--cp",
            "2",
            "--train-iters=6",
            "--save",
            &save,
            "--save-interval",
            "3",
        ],
    );
    let from = format!("{save}/iter_0000003");
    // At the layout it was saved at, the run goes on bit for bit.
    let again = support::curve(
        &COMMON,
        &dir,
        "cp2",
        &["--cp", "2", "--train-iters=6", "--load", &from],
    );
    assert_eq!(again, whole[3..], "resumed at cp 2");
    for (name, cp) in [("cp1", "1"), ("cp4", "4")] {
        let resumed = support::curve(
            &COMMON,
            &dir,
            name,
            &["--cp", cp, "--train-iters=6", "--load", &from],
        );
        assert_eq!(resumed.len(), 3, "{name}");
        assert_follows(&resumed, &whole[3..], name);
    }
}

#[test]
fn what_context_parallelism_cannot_do_yet_is_refused_by_name() {
    for (flags, says) in [
        (
            &["--cp", "2", "--seq-length", "30"][..],
            "--seq-length 30 is not divisible by it",
        ),
        (
            &["--cp", "4", "--cp-comm-type", "a2a", "--tp", "2"],
            "4 attention heads and 4 query groups over tensor-parallel size 2 (2, 2 per rank) must \
             each be divisible by 4",
        ),
        (
            &[
                "--cp",
                "4",
                "--cp-comm-type",
                "a2a+p2p",
                "--hierarchical-context-parallel-sizes",
                "2",
                "3",
            ],
            "--hierarchical-context-parallel-sizes 2 3: their product 6 is not --context-parallel-size 4",
        ),
        (
            &["--cp", "4", "--cp-comm-type", "a2a+p2p"],
            "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes",
        ),
        (
            &[
                "--cp",
                "4",
                "--cp-comm-type",
                "p2p",
                "--hierarchical-context-parallel-sizes",
                "2",
                "2",
            ],
            "is for --cp-comm-type a2a+p2p, not p2p",
        ),
        (
            &["--cp", "2", "--cp-comm-type", "ring"],
            "unknown --cp-comm-type `ring`",
        ),
        (
            &[
                "--cp",
                "2",
                "--tp",
                "4",
                "--sequence-parallel",
                "--seq-length",
                "20",
            ],
            "so tp must be even and divide s / cp = 10",
        ),
    ] {
        let mut args = vec!["train", "--train-iters", "1"];
        args.extend(flags);
        let (ok, _, stderr) = megatron(&args);
        assert!(!ok, "{flags:?}");
        assert!(stderr.contains(says), "{flags:?}: {stderr}");
    }
    // A world that cp (with tp and pp) does not divide.
    let (ok, _, stderr) = megatron(&["groups", "--world-size", "6", "--cp", "4"]);
    assert!(!ok);
    assert!(
        stderr.contains("world size 6 is not divisible by tp·cp·pp = 1·4·1 = 4"),
        "{stderr}"
    );
}

/// The causal work of each cp rank: per query it holds, the keys it sees (earlier positions
/// of its own document).
fn work_per_rank(seq: usize, cp: usize, docs: &megatron::documents::Documents) -> Vec<usize> {
    let spans = docs.spans();
    (0..cp)
        .map(|rank| {
            let chunks = CpChunks::of_microbatch(seq, cp, rank, Some(docs)).unwrap();
            chunks
                .ranges()
                .into_iter()
                .flatten()
                .map(|q| q - spans[q].0 + 1)
                .sum()
        })
        .collect()
}

#[test]
fn packed_documents_are_cut_one_by_one_and_balance_the_ranks_causal_work() {
    use megatron::documents::Documents;
    // A long document then a short one, 64 positions at cp 2: the whole sequence's two chunks
    // leave rank 1 nearly four times rank 0's work; the documents cut one by one (each a
    // multiple of 2·cp) give both the same.
    let docs = Documents::from_starts(64, vec![vec![48]], true, true).unwrap();
    let chunks = CpChunks::of_microbatch(64, 2, 0, Some(&docs)).unwrap();
    assert!(chunks.cuts_documents());
    assert_eq!(chunks.ranges(), [0..12, 36..48, 48..52, 60..64]);
    assert_eq!(chunks.local(), 32);
    assert_eq!(work_per_rank(64, 2, &docs), [656, 656]);
    // Attention not kept apart: the sequence's chunks.
    let whole = Documents::from_starts(64, vec![vec![48]], true, false).unwrap();
    let split = CpChunks::of_microbatch(64, 2, 0, Some(&whole)).unwrap();
    assert!(!split.cuts_documents());
    assert_eq!(split.ranges(), [0..16, 48..64]);
    assert_eq!(work_per_rank(64, 2, &whole), [272, 1040]);
    // A document that 2·cp does not divide, or two sequences a microbatch: the sequence's
    // chunks, as without documents.
    for docs in [
        Documents::from_starts(64, vec![vec![6]], true, true).unwrap(),
        Documents::from_starts(64, vec![vec![8], vec![8]], true, true).unwrap(),
    ] {
        let chunks = CpChunks::of_microbatch(64, 2, 0, Some(&docs)).unwrap();
        assert!(!chunks.cuts_documents());
    }
}
