//! The Llama-family blocks in the DSL's GPT (issue 34): RMSNorm (`--normalization RMSNorm`),
//! the gated MLP (`--swiglu`, fc1 holding each tensor-parallel rank's gate and up rows), linear
//! layers without biases (`--disable-bias-linear`), rotary position embeddings
//! (`--position-embedding-type rope`) and an output layer of its own
//! (`--untie-embeddings-and-output-weights`, each end of a pipeline holding only its table)
//! train at every layout as one rank does, step by step with dropout on, on thread ranks and
//! from the command line (pipeline, distributed optimizer, a checkpoint saved at one layout and
//! resumed at another); the parameter count the config reports is the built model's.

mod support;

use megatron::models::PositionEmbeddingType;
use megatron::models::gpt::Gpt;
use megatron::module::{Builder, Module};
use megatron::tensor_parallel::Normalization;
use support::{TempDir, megatron};

#[test]
fn rms_norm_swiglu_without_biases_trains_at_every_layout_as_one_rank() {
    let config = support::llama_like(0.1);
    let reference = support::gpt_curve(&config, (1, 1), false, 16, 12);
    assert!(
        reference[11].0 < reference[0].0 - 0.3,
        "the loss falls: {reference:?}"
    );
    // tp 4 over 2 key/value groups: each group's key and value on two ranks (their gradients
    // summed over them), each rank its share of the group's queries.
    for (tp, dp, sp) in [
        (2, 1, false),
        (2, 1, true),
        (1, 2, false),
        (2, 2, true),
        (4, 1, false),
        (4, 2, true),
    ] {
        let curve = support::gpt_curve(&config, (tp, dp), sp, 16, 12);
        // Only the order of f32 sums differs (tensor parallelism's partial products, the
        // data-parallel reduction): losses to 1e-4, gradient norms to 1e-3.
        support::assert_curves_close(
            &curve,
            &reference,
            1e-4,
            1e-3,
            &format!("tp {tp} dp {dp} sequence parallel {sp}"),
        );
    }
}

#[test]
fn the_config_counts_the_parameters_the_model_builds() {
    for (norm, swiglu, bias, untied) in [
        (Normalization::LayerNorm, false, true, false),
        (Normalization::RmsNorm, false, true, true),
        (Normalization::RmsNorm, true, false, false),
        (Normalization::LayerNorm, true, true, true),
    ] {
        let mut c = support::tiny_gpt(0.0);
        (c.normalization, c.swiglu, c.add_bias_linear) = (norm, swiglu, bias);
        // Qwen2's bias on the QKV projection alone.
        c.add_qkv_bias = !bias && swiglu;
        c.untie_embeddings_and_output_weights = untied;
        if untied {
            c.position_embedding_type = PositionEmbeddingType::Rope;
            // Grouped-query attention with heads of 12 (not hidden / heads = 8), and the
            // query and key norms.
            (c.num_query_groups, c.kv_channels) = (Some(2), Some(12));
            c.qk_layernorm = true;
        }
        let model = Gpt::build(&c.spec(), &mut Builder::new(3)).unwrap();
        let mut built = 0;
        let mut names = Vec::new();
        model.visit_params(&mut |p| {
            built += p.spec().logical.numel();
            names.push(p.spec().name.clone());
        });
        assert_eq!(
            built,
            c.num_params(1),
            "{norm:?} swiglu {swiglu} bias {bias}"
        );
        let biases = names.iter().filter(|n| n.ends_with(".bias")).count();
        // Each layer's two norms and the final one, and with qk-layernorm two more a layer.
        let norms = 2 * c.num_layers + 1 + if c.qk_layernorm { 2 * c.num_layers } else { 0 };
        let norm_biases = match norm {
            Normalization::LayerNorm => norms,
            Normalization::RmsNorm => 0,
        };
        let linear_biases = match (bias, c.add_qkv_bias) {
            (true, _) => 4 * c.num_layers,
            (false, true) => c.num_layers,
            (false, false) => 0,
        };
        assert_eq!(biases, norm_biases + linear_biases, "{names:?}");
        assert_eq!(
            names.contains(&"wte.output_weight".to_string()),
            untied,
            "{names:?}"
        );
        assert_eq!(
            names.contains(&"wpe.weight".to_string()),
            !untied,
            "{names:?}"
        );
        let qk = "blocks.0.attn.qk_norm.k_norm.weight".to_string();
        assert_eq!(names.contains(&qk), untied, "{names:?}");
    }
}

/// The flags of the command-line runs: gpt-tiny cut to 4 layers with the Llama blocks on, and a
/// sliding window of 5 keys in layers 1 and 3 (every second layer attends to all).
const COMMON: [&str; 26] = [
    "train",
    "--quiet",
    "--num-layers",
    "4",
    "--seq-length",
    "16",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "8",
    "--seed=5",
    "--normalization",
    "RMSNorm",
    "--swiglu",
    "--disable-bias-linear",
    "--train-iters=4",
    "--position-embedding-type",
    "rope",
    "--untie-embeddings-and-output-weights",
    "--group-query-attention",
    "--num-query-groups=2",
    "--qk-layernorm",
    "--window-size",
    "5,0",
    "--window-attn-skip-freq",
    "2",
];

#[test]
fn pipelines_and_the_distributed_optimizer_of_the_command_line_train_as_one_rank() {
    let dir = TempDir::new("decoder-blocks");
    let reference = support::curve(&COMMON, &dir, "one", &[]);
    for (name, flags) in [
        ("pp2", &["--pp", "2"][..]),
        ("pp2v2", &["--pp", "2", "--vpp", "2"]),
        ("tp2pp2dp2", &["--tp", "2", "--pp", "2", "--dp", "2"]),
        ("dp2do", &["--dp", "2", "--use-distributed-optimizer"][..]),
    ] {
        let curve = support::curve(&COMMON, &dir, name, flags);
        assert_eq!(curve.len(), reference.len(), "{name}");
        for (x, y) in curve.iter().zip(&reference) {
            assert!(
                (x.1 - y.1).abs() <= 1e-5 * y.1,
                "{name}: loss {x:?} vs {y:?}"
            );
            assert!(
                (x.2 - y.2).abs() <= 1e-4 * y.2,
                "{name}: grad norm {x:?} vs {y:?}"
            );
        }
    }
}

/// A checkpoint of the untied model saved at pp 2 (each end saving its own table) resumes at
/// pp 1 and at tp 2 as the pp 2 run went on (to f32's last places: the gradient norm, and at
/// tp 2 the products, are summed in another order).
#[test]
fn a_pipeline_checkpoint_of_the_untied_model_resumes_at_other_layouts() {
    let dir = TempDir::new("decoder-blocks-resume");
    let save = dir.join("ckpt");
    let whole = support::curve(
        &COMMON,
        &dir,
        "whole",
        &[
            "--pp",
            "2",
            "--train-iters=6",
            "--save",
            &save,
            "--save-interval",
            "3",
        ],
    );
    let from = format!("{save}/iter_0000003");
    // tp 4 over the 2 key/value groups: each group's key and value loaded on two ranks.
    for (name, flags) in [
        ("pp1", &[][..]),
        ("tp2", &["--tp", "2"][..]),
        ("tp4", &["--tp", "4"][..]),
    ] {
        let mut args = vec!["--train-iters=6", "--load", &from];
        args.extend(flags);
        let resumed = support::curve(&COMMON, &dir, name, &args);
        assert_eq!(resumed.len(), 3, "{name}");
        // The loaded tensors are the saved ones bit for bit: at pp 1 the first loss is too;
        // tp 2 sums its products in another order.
        if name == "pp1" {
            assert_eq!(resumed[0].1.to_bits(), whole[3].1.to_bits(), "{name}");
        }
        for (x, y) in resumed.iter().zip(&whole[3..]) {
            assert_eq!(x.0, y.0, "{name}");
            assert!(
                (x.1 - y.1).abs() <= 1e-5 * y.1,
                "{name}: loss {x:?} vs {y:?}"
            );
        }
    }
    // Saved at tp 4 with the distributed optimizer (each key/value head's copies, parameters
    // and moments, written once), resumed at tp 1 as the tp 4 run went on.
    let save4 = dir.join("ckpt4");
    let sharded = [
        "--dp",
        "2",
        "--use-distributed-optimizer",
        "--train-iters=6",
    ];
    let mut first = sharded.to_vec();
    first.extend(["--tp", "4", "--save", &save4, "--save-interval", "3"]);
    let tp4 = support::curve(&COMMON, &dir, "tp4-whole", &first);
    let from4 = format!("{save4}/iter_0000003");
    let mut then = sharded.to_vec();
    then.extend(["--load", &from4]);
    let resumed = support::curve(&COMMON, &dir, "tp4-to-tp1", &then);
    assert_eq!(resumed.len(), 3);
    for (x, y) in resumed.iter().zip(&tp4[3..]) {
        assert_eq!(x.0, y.0);
        assert!(
            (x.1 - y.1).abs() <= 1e-5 * y.1,
            "tp4 → tp1: loss {x:?} vs {y:?}"
        );
        assert!(
            (x.2 - y.2).abs() <= 1e-4 * y.2,
            "tp4 → tp1: grad norm {x:?} vs {y:?}"
        );
    }
}

/// Grouped-query attention is multi-head attention over each query's group's key and value:
/// with 4 heads in 2 groups, the output equals multi-head attention's on the projection with
/// each group's key and value repeated beside its queries (bit for bit), and the gradient is
/// the multi-head one with each group's key and value gradients summed over its queries.
#[test]
fn grouped_query_attention_is_multi_head_attention_over_repeated_keys_and_values() {
    use megatron::comm::ParallelState;
    use megatron::comm::threads::launch;
    use megatron::module::{Cx, Op, Site};
    use megatron::parallel::{ParallelConfig, ParallelLayout};
    use megatron::tensor::Tensor;
    use megatron::tensor_parallel::CausalSelfAttention;
    let (s, b, d, groups, per_group) = (5, 2, 4, 2, 2);
    let heads = groups * per_group;
    let width = groups * (per_group + 2) * d;
    let grouped = support::values(s * b * width, 3, 2.0);
    // Per token: group g's queries j, then its key (slot 2) and value (slot 3).
    let at = |t: usize, g: usize, slot: usize| t * width + (g * (per_group + 2) + slot) * d;
    let mut repeated = Vec::new();
    for t in 0..s * b {
        for g in 0..groups {
            for j in 0..per_group {
                for slot in [j, per_group, per_group + 1] {
                    repeated.extend_from_slice(&grouped[at(t, g, slot)..at(t, g, slot) + d]);
                }
            }
        }
    }
    let dy = support::values(s * b * heads * d, 4, 2.0);
    let layout = ParallelLayout::new(&ParallelConfig::new(1)).unwrap();
    launch(
        1,
        |w| -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
            let ps = ParallelState::new(&w, &layout)?;
            let cx = Cx::new(&ps, 1);
            let run = |op: CausalSelfAttention, qkv: &[f32], w: usize| {
                let qkv = Tensor::from_vec(qkv.to_vec(), [s, b, w])?;
                let (y, saved) = op.forward(&cx, Site::ROOT, &qkv)?;
                let dy = Tensor::from_vec(dy.clone(), [s, b, heads * d])?;
                let dx = op.backward(&cx, Site::ROOT, saved, &dy)?;
                Ok::<_, megatron::Error>((y.to_vec::<f32>()?, dx.to_vec::<f32>()?))
            };
            let mha = CausalSelfAttention::new(heads, 0.0);
            let (y_gqa, dx_gqa) = run(mha.clone().with_query_groups(groups), &grouped, width)?;
            let (y_mha, dx_mha) = run(mha, &repeated, heads * 3 * d)?;
            assert_eq!(y_gqa, y_mha);
            for t in 0..s * b {
                for g in 0..groups {
                    for (slot, part) in [(per_group, 1), (per_group + 1, 2)] {
                        for k in 0..d {
                            let sum: f32 = (0..per_group)
                                .map(|j| {
                                    dx_mha[t * heads * 3 * d
                                        + ((g * per_group + j) * 3 + part) * d
                                        + k]
                                })
                                .sum();
                            assert_eq!(dx_gqa[at(t, g, slot) + k], sum);
                        }
                    }
                    for j in 0..per_group {
                        let from = t * heads * 3 * d + (g * per_group + j) * 3 * d;
                        assert_eq!(
                            &dx_gqa[at(t, g, j)..at(t, g, j) + d],
                            &dx_mha[from..from + d]
                        );
                    }
                }
            }
            Ok(())
        },
    )
    .unwrap();
}

/// The qk-layernorm's backward against finite differences: the gradient of Σ w·y with
/// respect to the projection (queries and keys through RMSNorm, values passed through) and the
/// two norms' weights' gradients, on a grouped projection of 2 groups of 2 queries.
#[test]
fn the_qk_norm_backward_matches_finite_differences() {
    use megatron::comm::ParallelState;
    use megatron::comm::threads::launch;
    use megatron::module::{Cx, Layer, Site};
    use megatron::parallel::{ParallelConfig, ParallelLayout};
    use megatron::tensor::Tensor;
    use megatron::tensor_parallel::{LayerNormSpec, QkNorm, QkNormSpec};
    let (s, b, d) = (3, 2, 6);
    let width = 2 * (2 + 2) * d;
    let x = support::values(s * b * width, 5, 4.0);
    let w = support::values(s * b * width, 6, 2.0);
    let spec = QkNormSpec::On {
        norm: LayerNormSpec::new(d).with_kind(Normalization::RmsNorm),
        per_group: 2,
        groups: 2,
    };
    let layout = ParallelLayout::new(&ParallelConfig::new(1)).unwrap();
    launch(
        1,
        |world| -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
            let ps = ParallelState::new(&world, &layout)?;
            let cx = Cx::new(&ps, 1);
            let norm = QkNorm::build(&spec, &mut Builder::new(7))?;
            let loss = |x: &[f32]| -> f64 {
                let t = Tensor::from_vec(x.to_vec(), [s, b, width]).unwrap();
                let (y, _) = norm.forward(&cx, Site::ROOT, &t).unwrap();
                let y = y.to_vec::<f32>().unwrap();
                y.iter().zip(&w).map(|(a, b)| *a as f64 * *b as f64).sum()
            };
            let t = Tensor::from_vec(x.clone(), [s, b, width])?;
            let (_, saved) = norm.forward(&cx, Site::ROOT, &t)?;
            let dy = Tensor::from_vec(w.clone(), [s, b, width])?;
            let dx = norm
                .backward(&cx, Site::ROOT, saved, &dy)?
                .to_vec::<f32>()?;
            let dir = support::values(x.len(), 8, 2.0);
            let eps = 1e-3f32;
            let shifted = |sign: f32| -> Vec<f32> {
                x.iter()
                    .zip(&dir)
                    .map(|(a, v)| a + sign * eps * v)
                    .collect()
            };
            let numeric = (loss(&shifted(1.0)) - loss(&shifted(-1.0))) / (2.0 * eps as f64);
            let analytic: f64 = dx
                .iter()
                .zip(&dir)
                .map(|(a, v)| *a as f64 * *v as f64)
                .sum();
            assert!(
                (numeric - analytic).abs() <= 2e-3 * analytic.abs().max(1.0),
                "dx: {numeric} vs {analytic}"
            );
            // The values (slot 3 of each group) pass through: their gradient is w's.
            for t in 0..s * b {
                for g in 0..2 {
                    let at = t * width + (g * 4 + 3) * d;
                    assert_eq!(&dx[at..at + d], &w[at..at + d]);
                }
            }
            let mut grads = Vec::new();
            norm.visit_params(&mut |p| {
                grads.push((p.spec().name.clone(), p.grad().to_vec::<f32>().unwrap()))
            });
            let names: Vec<&str> = grads.iter().map(|(n, _)| n.as_str()).collect();
            assert_eq!(names, ["q_norm.weight", "k_norm.weight"]);
            assert!(
                grads.iter().all(|(_, g)| g.iter().any(|v| *v != 0.0)),
                "{grads:?}"
            );
            Ok(())
        },
    )
    .unwrap();
}

#[test]
fn the_blocks_flags_are_checked() {
    let (ok, _, stderr) = megatron(&[
        "train",
        "--hidden-size",
        "96",
        "--num-attention-heads",
        "12",
        "--group-query-attention",
        "--num-query-groups",
        "3",
        "--tp",
        "2",
    ]);
    assert!(!ok);
    assert!(
        stderr.contains(
            "--num-query-groups 3 and --tensor-model-parallel-size 2: one must divide the other"
        ),
        "{stderr}"
    );
    let (ok, _, stderr) = megatron(&["train", "--position-embedding-type", "yarn"]);
    assert!(!ok);
    assert!(
        stderr.contains("yarn positions are not built in megatron-rs yet"),
        "{stderr}"
    );
    let (ok, _, stderr) = megatron(&[
        "train",
        "--position-embedding-type",
        "rope",
        "--rotary-percent",
        "0.3",
    ]);
    assert!(!ok);
    assert!(
        stderr.contains("9 of a head of 32 (--rotary-percent 0.3)"),
        "{stderr}"
    );
    let (ok, _, stderr) = megatron(&["train", "--normalization", "rmsnorm", "--train-iters", "1"]);
    assert!(!ok);
    assert!(
        stderr.contains("possible values: LayerNorm, RMSNorm"),
        "{stderr}"
    );
    for (window, says) in [
        ("-1,0", "the left part of `-1,0` must be 0 or more"),
        ("4,1", "the right part of `4,1` must be 0"),
        ("4", "`4` has 1 part, not two: write LEFT,RIGHT"),
        ("5,0,0", "`5,0,0` has 3 parts, not two"),
    ] {
        let (ok, _, stderr) = megatron(&["train", "--window-size", window]);
        assert!(!ok);
        assert!(stderr.contains(says), "{window}: {stderr}");
    }
}
