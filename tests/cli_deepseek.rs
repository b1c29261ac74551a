//! `megatron train` of DeepSeek-V3's architecture: multi-latent attention (with and without a
//! query latent), YaRN, group-limited sigmoid routing with the expert bias and routed scaling,
//! shared experts and dense first layers. deepseek-v3-tiny trains at every layout as one rank
//! does; MLA trains as one rank at tensor, sequence, context and pipeline parallelism, with
//! recompute; and what the model cannot do is refused by name.

mod support;
use support::moe_runs::{assert_same_training, run_model};
use support::{TempDir, assert_curves_close, curve, megatron};

/// deepseek-v3-tiny, 4 micro-batches of 2 sequences of 32 a step, 4 steps.
const TINY: [&str; 14] = [
    "train",
    "--quiet",
    "--model",
    "deepseek-v3-tiny",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--seed=5",
    "--train-iters=4",
    "--moe-router-bias-update-rate",
    "0.01",
];

#[test]
fn deepseek_v3_tiny_trains_at_every_layout_as_one_rank() {
    let dir = TempDir::new("cli-deepseek-layouts");
    let run = |name: &str, extra: &[&str]| run_model(&TINY, &dir, "deepseek-v3-tiny", name, extra);
    // Multi-token prediction's depth on the last stage, its loss reported and compared.
    let mtp = |extra: &[&'static str]| [&["--mtp-num-layers", "1"][..], extra].concat();
    let reference = run("one", &mtp(&["--dp", "4", "--moe-router-dtype", "fp32"]));
    assert_eq!(reference[0].aux_losses.len(), 1, "mtp_1 reported");
    for (name, extra) in [
        (
            "tp2-sp-ep2",
            &["--dp", "2", "--tp", "2", "--sequence-parallel", "--ep", "2"][..],
        ),
        (
            "pp2-vpp2",
            &[
                "--dp",
                "2",
                "--pp",
                "2",
                "--num-layers-per-virtual-pipeline-stage",
                "1",
            ],
        ),
        (
            "dp4-distributed-optimizer",
            &["--dp", "4", "--use-distributed-optimizer"],
        ),
        ("ep2", &["--dp", "4", "--ep", "2"]),
        // The first stage holds the dense layer alone, no experts: the gradient norm's
        // collectives must still be the other stages' (this hung once).
        ("pp4", &["--pp", "4"]),
        ("ep2-etp2", &["--dp", "4", "--ep", "2", "--etp", "2"]),
        // The depth's shift crosses from chunk to chunk: the chunks' first positions gathered.
        ("cp2", &["--dp", "2", "--cp", "2", "--ep", "2"]),
        (
            "recompute",
            &[
                "--dp",
                "4",
                "--recompute-granularity",
                "full",
                "--recompute-method",
                "uniform",
                "--recompute-num-layers",
                "2",
            ],
        ),
    ] {
        assert_same_training(&run(name, &mtp(extra)), &reference, name);
    }
}

/// LoRA on deepseek-v3-tiny (adapters beside every projection of multi-latent attention, by
/// Megatron-LM's names: the replicated down projections, the column-parallel up projections,
/// the output projection; and every MLP: the dense one, the routed and the shared experts):
/// the base frozen but the routers' expert biases, which keep moving with the token counts as
/// Megatron-LM's buffer does; at ep 2 × tp 2 with sp as on one rank.
#[test]
fn lora_fine_tuning_keeps_the_expert_bias_moving() {
    let dir = TempDir::new("cli-deepseek-lora");
    let run = |name: &str, extra: &[&str]| {
        let mut flags = vec![
            "--lora-rank",
            "4",
            "--lora-target-modules",
            "linear_q_down_proj",
            "linear_q_up_proj",
            "linear_kv_down_proj",
            "linear_kv_up_proj",
            "linear_proj",
            "linear_fc1",
            "linear_fc2",
        ];
        flags.extend(extra);
        run_model(&TINY, &dir, "deepseek-v3-tiny", name, &flags)
    };
    let one = run("one", &["--dp", "4"]);
    assert!(
        one.windows(2)
            .any(|w| w[0].tokens_per_expert != w[1].tokens_per_expert),
        "the routing changes as the bias and the adapters train"
    );
    assert_same_training(
        &run(
            "tp2-sp-ep2",
            &["--dp", "2", "--tp", "2", "--sequence-parallel", "--ep", "2"],
        ),
        &one,
        "LoRA at tp 2 × ep 2",
    );
}

/// llama-tiny's layers with multi-latent attention in place of grouped-query attention.
const MLA: [&str; 27] = [
    "train",
    "--quiet",
    "--model",
    "llama-tiny",
    "--num-layers",
    "2",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--seed=5",
    "--train-iters=4",
    "--multi-latent-attention",
    "--qk-layernorm",
    "--kv-lora-rank",
    "24",
    "--qk-head-dim",
    "16",
    "--qk-pos-emb-head-dim",
    "8",
    "--v-head-dim",
    "20",
    "--rope-type",
    "yarn",
    "--rotary-scaling-factor=4",
];

#[test]
fn latent_attention_trains_as_one_rank_at_every_layout() {
    let dir = TempDir::new("cli-deepseek-mla");
    for (what, extra) in [
        ("queries projected directly", &[][..]),
        (
            "a query latent, scores scaled by mscale",
            &[
                "--q-lora-rank",
                "40",
                "--mscale-all-dim",
                "1",
                "--original-max-position-embeddings",
                "16",
            ],
        ),
    ] {
        let run = |name: &str, layout: &[&str]| {
            let mut flags = extra.to_vec();
            flags.extend(layout);
            let c = curve(&MLA, &dir, name, &flags);
            c.iter().map(|&(_, l, g)| (l, g)).collect::<Vec<_>>()
        };
        let one = run("one", &["--dp", "2"]);
        assert!(one[3].0 < one[0].0, "{what}: {one:?}");
        for (name, layout) in [
            ("tp2", &["--dp", "2", "--tp", "2"][..]),
            ("tp2-sp", &["--dp", "2", "--tp", "2", "--sequence-parallel"]),
            ("cp2", &["--dp", "2", "--cp", "2"]),
            (
                "cp2-a2a",
                &["--dp", "2", "--cp", "2", "--cp-comm-type", "a2a"],
            ),
            ("pp2", &["--dp", "2", "--pp", "2"]),
            (
                "selective",
                &["--dp", "2", "--recompute-granularity", "selective"],
            ),
        ] {
            assert_curves_close(
                &run(name, layout),
                &one,
                1e-5,
                1e-3,
                &format!("{what}, {name}"),
            );
        }
    }
}

#[test]
fn bf16_latent_attention_at_tp_2_follows_one_rank() {
    let dir = TempDir::new("cli-deepseek-bf16");
    let run = |name: &str, extra: &[&str]| {
        let mut flags = vec!["--bf16", "--q-lora-rank", "40"];
        flags.extend(extra);
        curve(&MLA, &dir, name, &flags)
            .iter()
            .map(|&(_, l, g)| (l, g))
            .collect::<Vec<_>>()
    };
    let one = run("one", &[]);
    let tp2 = run("tp2-sp", &["--tp", "2", "--sequence-parallel"]);
    // bf16 products summed over other shards: a percent of the norm.
    assert_curves_close(&tp2, &one, 2e-2, 1e-2, "bf16 tp 2");
}

#[test]
fn what_the_model_cannot_do_is_refused_by_name() {
    let tiny = |extra: &[&str]| {
        let mut args = TINY.to_vec();
        args.extend(extra);
        let (ok, _, stderr) = megatron(&args);
        assert!(!ok, "{extra:?} ran");
        stderr
    };
    for (extra, message) in [
        (
            &["--tp", "3"][..],
            "--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 3",
        ),
        (
            &[
                "--moe-router-num-groups",
                "3",
                "--moe-router-group-topk",
                "2",
            ],
            "--moe-router-num-groups 3 does not divide --num-experts 8",
        ),
        (
            &[
                "--moe-router-num-groups",
                "4",
                "--moe-router-group-topk",
                "5",
            ],
            "--moe-router-group-topk 5 must be between 1 and --moe-router-num-groups 4",
        ),
        (&["--attention-dropout", "0.1"], "set --attention-dropout 0"),
        (&["--group-query-attention"], "drop --group-query-attention"),
        (
            &["--qk-pos-emb-head-dim", "3"],
            "--qk-pos-emb-head-dim 3: rotary embeddings turn pairs",
        ),
        (&["--rope-type", "yarn", "--use-rope-scaling"], "choose one"),
        (
            &["--lora-rank", "4", "--lora-target-modules", "linear_qkv"],
            "--lora-target-modules: the model has no `linear_qkv` (its linear layers are \
             self_attention.linear_q_down_proj, self_attention.linear_q_up_proj, \
             self_attention.linear_kv_down_proj, self_attention.linear_kv_up_proj, \
             self_attention.linear_proj",
        ),
        (
            &["--lora-rank", "4", "--lora-target-modules", "linear_q_proj"],
            "the model has no `linear_q_proj`",
        ),
        (
            &["--mtp-num-layers", "1", "--mtp-loss-scaling-factor=-1"],
            "--mtp-loss-scaling-factor must be finite and at least 0, got -1",
        ),
    ] {
        let stderr = tiny(extra);
        assert!(stderr.contains(message), "{extra:?}: {stderr}");
    }
    let llama = |extra: &[&str]| {
        let mut args = vec!["train", "--model", "llama-tiny", "--train-iters", "1"];
        args.extend(extra);
        megatron(&args).2
    };
    for (extra, message) in [
        (
            &["--kv-lora-rank", "16"][..],
            "--kv-lora-rank sizes multi-latent attention, which the model does not have",
        ),
        (
            &["--multi-latent-attention"],
            "--multi-latent-attention builds the latents' norms",
        ),
        (
            &["--mscale", "0.5"],
            "--mscale sets YaRN, which the model does not use: add --rope-type yarn",
        ),
        (
            &["--mtp-loss-scaling-factor", "0.2"],
            "--mtp-loss-scaling-factor 0.2 weighs multi-token prediction's losses, which the \
             model does not have: add --mtp-num-layers",
        ),
    ] {
        let stderr = llama(extra);
        assert!(stderr.contains(message), "{extra:?}: {stderr}");
    }
    let gpt = megatron(&[
        "train",
        "--model",
        "gpt-tiny",
        "--multi-latent-attention",
        "--qk-layernorm",
        "--attention-dropout",
        "0",
    ])
    .2;
    assert!(gpt.contains("add --position-embedding-type rope"), "{gpt}");
    let gpt = megatron(&["train", "--model", "gpt-tiny", "--mtp-num-layers", "2"]).2;
    assert!(
        gpt.contains("--mtp-num-layers 2 with learned absolute positions"),
        "{gpt}"
    );
}
