//! Imported Hugging Face checkpoints fine-tune at every layout (issue 34): the tiny Llama
//! (grouped-query attention, Llama 3.1's RoPE, untied) and Mixtral (SwiGLU experts) that
//! transformers made (`tests/data/hf/`), imported with `megatron convert --from hf`, then
//! trained with `megatron train --load` on an indexed dataset of their 64-token vocabulary at
//! tensor (with and without sequence parallelism), pipeline, data, and expert parallelism and
//! with the distributed optimizer, each step by step as the one-rank run; bf16 follows f32 to
//! 16 bits' precision.

mod support;

use megatron::data::{DType, IndexedDatasetBuilder};
use support::{TempDir, curve, megatron};

/// Documents of tokens below 64 (the golden models' vocabulary): a few repeated phrases, so
/// that the loss has something to learn.
fn dataset(dir: &TempDir) -> String {
    let prefix = dir.join("tokens");
    let mut b = IndexedDatasetBuilder::create(&prefix, DType::U16).unwrap();
    for d in 0..64u32 {
        let tokens: Vec<u32> = (0..96u32).map(|j| (d * 7 + (j % 12) * 5) % 64).collect();
        b.add_document(&tokens, &[tokens.len()]).unwrap();
    }
    b.finish().unwrap();
    prefix
}

/// Imports golden model `name` into `dir`; returns the checkpoint's path.
fn import(dir: &TempDir, name: &str) -> String {
    let hf = format!("{}/tests/data/hf/{name}", env!("CARGO_MANIFEST_DIR"));
    let ckpt = dir.join(&format!("{name}-ckpt"));
    let (ok, _, stderr) = megatron(&["convert", "--from", "hf", &hf, "--to", &ckpt]);
    assert!(ok, "{name}: {stderr}");
    ckpt
}

/// The losses and gradient norms of `layouts` against `reference` (relative `loss_tol` and
/// `norm_tol`).
fn assert_follows(
    got: &[(u64, f64, f64)],
    want: &[(u64, f64, f64)],
    (loss_tol, norm_tol): (f64, f64),
    what: &str,
) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (g, w) in got.iter().zip(want) {
        assert!(
            (g.1 - w.1).abs() <= loss_tol * w.1,
            "{what}: loss {g:?} vs {w:?}"
        );
        assert!(
            (g.2 - w.2).abs() <= norm_tol * w.2,
            "{what}: grad norm {g:?} vs {w:?}"
        );
    }
}

#[test]
fn imported_llama_and_mixtral_fine_tune_at_every_layout_as_one_rank() {
    let dir = TempDir::new("hf-finetune");
    let data = dataset(&dir);
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
    ] {
        let ckpt = import(&dir, name);
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
