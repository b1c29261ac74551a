//! Every command validates its settings with the same shared code: numbers past their bounds,
//! values that cannot work in the precision they are used in, Megatron-LM's own rules, and
//! flags that would do nothing are refused before anything runs, naming the flag; the messages
//! name the cause the user can act on.

mod support;

use support::megatron;

/// Runs each command line and checks it fails with one `error:` line holding `expected`.
fn refused(cases: &[(&[&str], &str)]) {
    for (args, expected) in cases {
        let (ok, _, stderr) = megatron(args);
        assert!(!ok, "{args:?} was accepted");
        let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error:")).collect();
        assert_eq!(errors.len(), 1, "{args:?}: {stderr}");
        assert!(errors[0].contains(expected), "{args:?}: {stderr}");
    }
}

#[test]
fn numbers_past_their_bounds_are_refused_naming_the_flag() {
    refused(&[
        (
            &[
                "schedule",
                "--pp",
                "2",
                "--microbatches",
                "18446744073709551615",
            ],
            "'--microbatches <MICROBATCHES>': must be at most 262144",
        ),
        (
            &["groups", "--world-size", "18446744073709551615"],
            "'--world-size <WORLD_SIZE>': must be at most 1048576 (the ranks of a job)",
        ),
        (
            &["layout", "--model", "gpt-tiny", "--dp", "1000000007"],
            "'--dp <DP>': must be at most 1048576",
        ),
        (
            &["inspect", "--num-experts", "100000"],
            "'--num-experts <NUM_EXPERTS>': must be at most 65536",
        ),
        (
            &[
                "inspect",
                "--num-experts",
                "4",
                "--moe-layer-freq",
                "[1]*1000000000000",
            ],
            "--moe-layer-freq [1]*1000000000000: lists 1000000000000 layers or more",
        ),
        (
            &[
                "inspect",
                "--hidden-size",
                "16777216",
                "--num-attention-heads",
                "16",
            ],
            "parameters (--num-layers 4 × --hidden-size 16777216 ...), more than megatron-rs accepts",
        ),
        (
            &[
                "schedule",
                "--pp",
                "65536",
                "--vpp",
                "2",
                "--microbatches",
                "4",
            ],
            "a schedule of --pipeline-model-parallel-size 65536 × \
             --virtual-pipeline-model-parallel-size 2 × 4 microbatches = 524288",
        ),
        (
            &["inspect", "--pp", "0"],
            "'--pipeline-model-parallel-size <PP>': must be at least 1",
        ),
        (
            &["inspect", "--vpp", "0"],
            "'--virtual-pipeline-model-parallel-size <VPP>': must be at least 1",
        ),
        (
            &[
                "graphs",
                "--pp",
                "2",
                "--microbatches",
                "4",
                "--cuda-graph-scope",
                "attn",
                "--seq-length",
                "0",
            ],
            "'--seq-length <SEQ_LENGTH>': must be at least 1",
        ),
        (
            &[
                "tokenizer",
                "train",
                "--input",
                "x.jsonl",
                "--output",
                "t.json",
                "--vocab-size",
                "18446744073709551615",
            ],
            "'--vocab-size <VOCAB_SIZE>': must be at most 16777216",
        ),
        (
            &[
                "train",
                "--moe-shared-expert-intermediate-size",
                "0",
                "--num-experts",
                "4",
            ],
            "'--moe-shared-expert-intermediate-size <MOE_SHARED_EXPERT_INTERMEDIATE_SIZE>': must be at least 1",
        ),
        (
            &["train", "--dp", "2048"],
            "2048 is more than megatron-rs accepts (at most 1024: thread ranks of one process",
        ),
        (
            &["bench", "attention", "--seq-length", "1073741824"],
            "needs about 274877956096.0 GiB of memory, more than",
        ),
    ]);
    // A model of a trillion parameters is listed from its specs, without its memory.
    let (ok, stdout, stderr) = megatron(&[
        "inspect",
        "--model",
        "gpt-moe-tiny",
        "--hidden-size",
        "262144",
    ]);
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains("parameters: 1103958.11M in total"),
        "{stdout}"
    );
    // A schedule of many stages answers (its simulation is linear in the schedule's length).
    let (ok, stdout, stderr) = megatron(&["schedule", "--pp", "65536", "--microbatches", "4"]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("(not drawn: 65536 ranks × "), "{stdout}");
}

#[test]
fn values_that_cannot_work_are_refused_as_the_command_line_is_read() {
    refused(&[
        (
            &["train", "--fp16", "--initial-loss-scale", "1e300"],
            "'--initial-loss-scale <INITIAL_LOSS_SCALE>': 1e300 is infinite in f32",
        ),
        (
            &["train", "--fp16", "--loss-scale", "1e39"],
            "'--loss-scale <LOSS_SCALE>': 1e39 is infinite in f32",
        ),
        (
            &["train", "--lr", "NaN"],
            "'--lr <LR>': must be a finite number",
        ),
        (
            &["train", "--moe-aux-loss-coeff=-1", "--num-experts", "4"],
            "'--moe-aux-loss-coeff <MOE_AUX_LOSS_COEFF>': must be at least 0",
        ),
        (
            &["train", "--moe-z-loss-coeff", "inf", "--num-experts", "4"],
            "'--moe-z-loss-coeff <MOE_Z_LOSS_COEFF>': must be a finite number",
        ),
        (
            &[
                "train",
                "--moe-router-topk-scaling-factor",
                "0",
                "--num-experts",
                "4",
            ],
            "'--moe-router-topk-scaling-factor <MOE_ROUTER_TOPK_SCALING_FACTOR>': must be more than 0",
        ),
        (
            &["train", "--ep", "0"],
            "'--expert-model-parallel-size <EP>': must be at least 1",
        ),
        (
            &["train", "--etp", "0"],
            "'--expert-tensor-parallel-size <ETP>': must be at least 1",
        ),
    ]);
}

#[test]
fn megatrons_rules_and_flags_that_would_do_nothing_are_refused() {
    refused(&[
        (
            &["train", "--num-experts", "4", "--moe-router-topk", "1"],
            "--moe-router-topk 1 with softmax scores needs --moe-router-pre-softmax",
        ),
        (
            &["train", "--bf16", "--initial-loss-scale", "8"],
            "--initial-loss-scale does nothing with --bf16",
        ),
        (
            &["train", "--fp16", "--loss-scale", "8", "--hysteresis", "3"],
            "--hysteresis does nothing with a static --loss-scale",
        ),
        (
            &[
                "train",
                "--num-experts",
                "4",
                "--moe-token-drop-policy",
                "position",
            ],
            "--moe-token-drop-policy position does nothing without --moe-expert-capacity-factor",
        ),
        (
            &[
                "train",
                "--num-experts",
                "4",
                "--moe-router-bias-update-rate",
                "0.01",
            ],
            "--moe-router-bias-update-rate 0.01 does nothing without --moe-router-enable-expert-bias",
        ),
        (
            &[
                "train",
                "--num-experts",
                "4",
                "--moe-router-load-balancing-type",
                "none",
                "--moe-aux-loss-coeff",
                "0.1",
            ],
            "--moe-aux-loss-coeff 0.1 does nothing with --moe-router-load-balancing-type none",
        ),
        (
            &[
                "train",
                "--pp",
                "2",
                "--num-layers",
                "2",
                "--microbatch-group-size-per-virtual-pipeline-stage",
                "2",
            ],
            "--microbatch-group-size-per-virtual-pipeline-stage 2 does nothing with \
             --pipeline-schedule 1f1b (it groups the interleaved schedule's microbatches): add \
             --virtual-pipeline-model-parallel-size",
        ),
        // The zero-bubble schedules: what each runs, named.
        (
            &["train", "--pipeline-schedule", "zb-h1"],
            "--pipeline-schedule zb-h1 needs a pipeline (a single stage runs each microbatch's \
             forward, then its backward): add --pp, or drop it",
        ),
        (
            &[
                "train",
                "--pp",
                "2",
                "--pipeline-schedule",
                "zbv",
                "--vpp",
                "4",
            ],
            "--pipeline-schedule zbv runs 2 model chunks (its V: down the ranks and back up) per \
             rank, got --virtual-pipeline-model-parallel-size 4",
        ),
        (
            &[
                "train",
                "--pp",
                "2",
                "--pipeline-schedule",
                "dualpipev",
                "--global-batch-size",
                "12",
                "--micro-batch-size",
                "4",
            ],
            "dualpipev needs at least 2·pp = 4 microbatches per step (its steady phase pairs a \
             forward of one chunk with a backward of the other), got 3",
        ),
        (
            &[
                "train",
                "--pp",
                "2",
                "--pipeline-schedule",
                "zbv",
                "--num-layers",
                "6",
                "--decoder-first-pipeline-num-layers",
                "2",
            ],
            "in a V (--pipeline-schedule zbv or dualpipev) the first rank holds both ends of the \
             model: give an even layout",
        ),
        (
            &[
                "train",
                "--pp",
                "2",
                "--pipeline-schedule",
                "zb-h2",
                "--cuda-graph-scope",
                "attn",
            ],
            "--cuda-graph-scope cannot run with --pipeline-schedule zb-h2",
        ),
        (
            &[
                "train",
                "--pp",
                "2",
                "--account-for-loss-in-pipeline-split",
                "--decoder-last-pipeline-num-layers",
                "1",
            ],
            "count the ends as layers of an even split: they do not go with \
             --decoder-first-pipeline-num-layers or --decoder-last-pipeline-num-layers",
        ),
        (
            &["train", "--account-for-embedding-in-pipeline-split"],
            "count the ends in a pipeline's split: add --pp, or drop them",
        ),
        (
            &["train", "--pp", "2", "--pipeline-schedule", "zb-h4"],
            "unknown pipeline schedule; one of 1f1b, interleaved, zb-h1, zb-h2, zbv, dualpipev",
        ),
        // Too few microbatches for the interleaved schedule: the batch, not a flag never given.
        (
            &[
                "train",
                "--pp",
                "4",
                "--vpp",
                "2",
                "--num-layers",
                "8",
                "--global-batch-size",
                "12",
                "--micro-batch-size",
                "4",
            ],
            "the interleaved schedule needs at least pp = 4 microbatches per step, got 3 (raise \
             --global-batch-size",
        ),
        (
            &["train", "--vocab-size", "100"],
            "--vocab-size 100 is smaller than the 256 byte values",
        ),
        (
            &["train", "--save-interval", "5"],
            "--save-interval does nothing without --save",
        ),
        (
            &["train", "--eval-iters", "5"],
            "--eval-iters does nothing without --eval-interval",
        ),
        (
            &["train", "--comm-report"],
            "--comm-report does nothing without --log-json",
        ),
        (
            &["train", "--fp32-products"],
            "--fp32-products chooses a GPU's products",
        ),
        (
            &["train", "--lr-decay-style", "constant", "--min-lr", "0"],
            "--min-lr does nothing with --lr-decay-style constant",
        ),
        (
            &["train", "--moe-token-dispatcher-type", "allgather"],
            "--moe-token-dispatcher-type allgather does nothing without MoE layers",
        ),
        (
            &[
                "train",
                "--num-experts",
                "4",
                "--moe-router-score-function",
                "sigmoid",
                "--moe-router-pre-softmax",
            ],
            "--moe-router-pre-softmax does nothing with --moe-router-score-function sigmoid",
        ),
        (
            &["train", "--accumulate-allreduce-grads-in-fp32"],
            "--accumulate-allreduce-grads-in-fp32 does nothing in an f32 run",
        ),
        (
            &["train", "--lr-warmup-iters", "100", "--train-iters", "10"],
            "--lr-warmup-iters 100 must be less than --lr-decay-iters 10",
        ),
        (
            &["train", "--split", "NaN,1,1"],
            "'--split <SPLIT>': bad split \"NaN,1,1\"",
        ),
        (
            &[
                "generate", "--load", "ckpt", "--prompt", "a", "--top-k", "5",
            ],
            "--top-k 5 does nothing with greedy decoding",
        ),
        (
            &["plot", "/dev/null"],
            "/dev/null holds no training step: nothing to draw",
        ),
        // Issue 45: flags accepted without a word though they changed nothing.
        (
            &["train", "--rotary-base", "500000"],
            "--rotary-base does nothing without rotary positions (the model has learned \
             absolute positions): add --position-embedding-type rope",
        ),
        (
            &["inspect", "--model", "gpt-tiny", "--use-rope-scaling"],
            "--use-rope-scaling does nothing without rotary positions",
        ),
        (
            &["train", "--add-qkv-bias"],
            "--add-qkv-bias does nothing: the model's linear layers all have biases",
        ),
        (
            &[
                "train",
                "--window-size",
                "4,0",
                "--window-attn-skip-freq",
                "1",
            ],
            "--window-attn-skip-freq 1 gives every layer full attention",
        ),
        (
            &[
                "train",
                "--window-size",
                "4,0",
                "--window-attn-skip-freq",
                "9",
            ],
            "--window-attn-skip-freq 9 skips no layer of the model's 4",
        ),
        (
            &[
                "schedule",
                "--pp",
                "4",
                "--microbatches",
                "8",
                "--overlap-moe-expert-parallel-comm",
            ],
            "--overlap-moe-expert-parallel-comm adds a warm-up forward to the interleaved \
             schedule's training steps only: with --pipeline-schedule 1f1b it does nothing",
        ),
        (
            &[
                "graphs",
                "--pp",
                "2",
                "--microbatches",
                "4",
                "--pipeline-schedule",
                "zb-h1",
                "--cuda-graph-scope",
                "attn",
            ],
            "--cuda-graph-scope cannot run with --pipeline-schedule zb-h1",
        ),
        // Messages that named the wrong thing.
        (
            &["train", "--window-size", "5,0,0"],
            "`5,0,0` has 3 parts, not two: write LEFT,RIGHT",
        ),
        (
            &["train", "--pipeline-schedule", "interleaved", "--pp", "2"],
            "interleaved runs at least 2 model chunks per rank, and \
             --virtual-pipeline-model-parallel-size was not given",
        ),
    ]);
    // Megatron-LM's spelling of the group size, and the short one kept as an alias.
    for flag in [
        "--microbatch-group-size-per-virtual-pipeline-stage",
        "--microbatch-group-size-per-vp-stage",
    ] {
        let (ok, _, stderr) = megatron(&[
            "schedule",
            "--pp",
            "2",
            "--vpp",
            "2",
            "--microbatches",
            "4",
            flag,
            "2",
        ]);
        assert!(ok, "{flag}: {stderr}");
    }
}

#[test]
fn messages_name_what_the_user_can_act_on() {
    let dir = support::TempDir::new("cli-validation-messages");
    // A dangling link where a directory is to be written: named, not "File exists".
    let link = dir.path().join("dangling");
    std::os::unix::fs::symlink(dir.path().join("nowhere"), &link).unwrap();
    let link = link.to_string_lossy().into_owned();
    let ckpt = dir.join("ckpt");
    support::small_checkpoint(&ckpt, 1, &[]);
    refused(&[
        (
            &["convert", "--from", &ckpt, "--to", "hf", &link],
            "dangling is a symbolic link to",
        ),
        (
            &["train", "--train-iters", "1", "--save", &link],
            "which does not exist: remove the link or create its target",
        ),
    ]);
    // Byte data ending its documents with the byte tokenizer's end-of-document token (256) on
    // gpt-tiny's 256-token vocabulary: the way out named.
    let corpus = dir.join("corpus.jsonl");
    std::fs::write(
        &corpus,
        "{\"text\": \"hello world\"}\n{\"text\": \"more\"}\n",
    )
    .unwrap();
    let prefix = dir.join("bytes");
    let (ok, _, stderr) = megatron(&[
        "preprocess",
        "--input",
        &corpus,
        "--tokenizer",
        "byte",
        "--output-prefix",
        &prefix,
        "--append-eod",
        "--quiet",
    ]);
    assert!(ok, "{stderr}");
    let data = format!("{prefix}_text_document");
    refused(&[(
        &[
            "train",
            "--data",
            &data,
            "--seq-length",
            "8",
            "--train-iters",
            "1",
        ],
        "document 0 ends with token 256, outside the model's vocabulary of 256: it is the byte \
         tokenizer's end-of-document token (the data was preprocessed with --append-eod); give \
         --tokenizer byte",
    )]);
    // The help says what each command does today.
    let (_, help, _) = megatron(&["--help"]);
    assert!(help.contains("Mixtral, Qwen3-MoE"), "{help}");
    assert!(help.contains("ZB-H1, ZB-H2, ZB-V or DualPipeV"), "{help}");
    let (_, help, _) = megatron(&["convert", "--help"]);
    for arch in [
        "MixtralForCausalLM",
        "Qwen3MoeForCausalLM",
        "MistralForCausalLM",
    ] {
        assert!(help.contains(arch), "{arch}: {help}");
    }
    let (_, help, _) = megatron(&["train", "--help"]);
    assert!(
        help.contains("the world is tp × cp × pp × dp ranks"),
        "{help}"
    );
}

#[test]
fn a_config_files_list_is_replaced_by_the_command_lines() {
    let dir = support::TempDir::new("cli-validation-config");
    let config = dir.join("run.toml");
    std::fs::write(&config, "cuda-graph-scope = [\"attn\", \"mlp\"]\n").unwrap();
    let graphs = |extra: &[&str]| {
        let mut args = vec![
            "graphs",
            "--config",
            &config,
            "--pp",
            "2",
            "--microbatches",
            "4",
        ];
        args.extend(extra);
        args.push("--json");
        let (ok, stdout, stderr) = megatron(&args);
        assert!(ok, "{stderr}");
        let report: serde_json::Value = serde_json::from_str(&stdout).unwrap();
        report["cuda_graph_scope"].clone()
    };
    assert_eq!(graphs(&[]), serde_json::json!(["attn", "mlp"]));
    assert_eq!(
        graphs(&["--cuda-graph-scope", "attn"]),
        serde_json::json!(["attn"])
    );
    std::fs::write(&config, "learning_rate = 0.1\n").unwrap();
    refused(&[(
        &["train", "--config", &config],
        "`learning-rate` is not a flag of `megatron train`",
    )]);
}
