//! Imported Hugging Face checkpoints fine-tune at every layout (issue 34): the tiny Llama
//! (grouped-query attention, Llama 3.1's RoPE, untied) and Mixtral (SwiGLU experts) that
//! transformers made (`tests/data/hf/`), imported with `megatron convert --from hf`, then
//! trained with `megatron train --load` on an indexed dataset of their 64-token vocabulary at
//! tensor (with and without sequence parallelism), pipeline, data, and expert parallelism and
//! with the distributed optimizer, each step by step as the one-rank run; bf16 follows f32 to
//! 16 bits' precision.

mod support;

use support::{TempDir, assert_follows, curve, import_golden, token_dataset};

#[test]
fn imported_llama_mixtral_and_deepseek_v3_fine_tune_at_every_layout_as_one_rank() {
    let dir = TempDir::new("hf-finetune");
    let data = token_dataset(&dir, 64, 96);
    for (name, layouts) in [
        (
            "llama",
            &[
                &["--tp", "2"][..],
                &["--tp", "2", "--sequence-parallel"],
                &["--pp", "2"],
                &["--dp", "2", "--use-distributed-optimizer"],
            ][..],
        ),
        (
            "mixtral",
            &[
                &["--dp", "2", "--ep", "2"][..],
                &["--tp", "2", "--sequence-parallel", "--ep", "2"],
                &["--pp", "2", "--dp", "2", "--ep", "2"],
                &["--dp", "2", "--ep", "2", "--use-distributed-optimizer"],
            ],
        ),
        (
            "deepseek_v3",
            &[
                &["--dp", "2", "--ep", "2"][..],
                &["--tp", "2", "--sequence-parallel", "--ep", "2"],
                &["--pp", "2", "--dp", "2", "--ep", "2"],
                &["--cp", "2", "--ep", "2"],
            ],
        ),
    ] {
        let ckpt = import_golden(&dir, name, &format!("{name}-ckpt"));
        let common = [
            "train",
            "--quiet",
            "--load",
            &ckpt,
            "--data",
            &data,
            "--seq-length",
            "16",
            "--micro-batch-size",
            "1",
            "--global-batch-size",
            "4",
            "--lr",
            "1e-3",
            "--train-iters",
            "4",
            "--seed",
            "3",
        ];
        let reference = curve(&common, &dir, &format!("{name}-one"), &[]);
        assert!(
            reference[3].1 < reference[0].1,
            "{name}: fine-tuning lowers the loss: {reference:?}"
        );
        for (i, flags) in layouts.iter().enumerate() {
            let got = curve(&common, &dir, &format!("{name}-{i}"), flags);
            // f32 sums in other orders (partial products over tp, the data-parallel and
            // expert reductions).
            assert_follows(&got, &reference, (1e-5, 1e-4), &format!("{name} {flags:?}"));
        }
        // bf16 parameters (f32 main copies in the optimizer) with the distributed optimizer
        // over 2 ranks: the same training to bf16's precision.
        let bf16 = curve(
            &common,
            &dir,
            &format!("{name}-bf16"),
            &["--bf16", "--dp", "2", "--use-distributed-optimizer"],
        );
        assert_follows(&bf16, &reference, (2e-2, 1e-1), &format!("{name} bf16"));
    }
}
