//! Checkpoints: a resumed run continues bit for bit, loading reshards across tensor-parallel
//! sizes, and corrupt or failed saves leave earlier checkpoints as they were.

mod support;

use std::path::{Path, PathBuf};

use megatron::checkpoint::SaveInfo;
use megatron::comm::ParallelState;
use megatron::comm::threads::launch;
use megatron::models::GptConfig;
use megatron::models::gpt::Gpt;
use megatron::module::{Builder, Module};
use megatron::parallel::{ParallelConfig, ParallelLayout};
use megatron::training::{BatchPlan, DecayStyle, LrSchedule, Sampler, TokenStream, Trainer};

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

fn config() -> GptConfig {
    let mut c = GptConfig::new(2, 32, 4, 256, 32);
    c.hidden_dropout = 0.1;
    c.attention_dropout = 0.1;
    c
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("megatron-ckpt-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// Runs steps `from..to` on tp × dp ranks, loading `load` first and saving into `save` at the
/// end; returns the losses and the final parameters (whole, in visit order) of global rank 0.
fn run(
    tp: usize,
    dp: usize,
    from: u64,
    to: u64,
    seed: u64,
    load: Option<&Path>,
    save: Option<&Path>,
) -> (Vec<f64>, Vec<f32>) {
    let layout = ParallelLayout::new(&ParallelConfig::new(tp * dp).with_tp(tp)).unwrap();
    let text = "Checkpoints must resume bit for bit. ".repeat(40);
    let c = config();
    let result = launch(tp * dp, |w| -> R<(Vec<f64>, Vec<f32>)> {
        let ps = ParallelState::new(&w, &layout)?;
        let model = Gpt::build(&c.spec(), &mut Builder::for_rank(seed, ps.groups()))?;
        let plan = BatchPlan {
            seq_length: 16,
            micro_batch: 2,
            global_batch: 4,
            dp,
        };
        let sampler = Sampler::windows(TokenStream::from_bytes(text.as_bytes()), plan, 7)?;
        let schedule = LrSchedule {
            max_lr: 3e-3,
            min_lr: 3e-4,
            warmup_steps: 2,
            decay_steps: 8,
            style: DecayStyle::Cosine,
        };
        let train = support::train_config(schedule, 5, 4096);
        let mut trainer = Trainer::new(model, &ps, sampler, train)?;
        if let Some(path) = load {
            let meta = trainer.load_checkpoint(&ps, path)?;
            assert_eq!(meta.iteration, from);
        }
        let mut losses = Vec::new();
        for step in from..to {
            losses.push(trainer.step(&ps, step)?.loss);
        }
        if let Some(path) = save {
            let info = SaveInfo {
                model: serde_json::json!({"test": true}),
                run: serde_json::Value::Null,
                files: Vec::new(),
                base: None,
            };
            trainer.save_checkpoint(&ps, path, to, &info)?;
        }
        // Whole parameters through a save of their own, read back.
        let mut params = Vec::new();
        trainer
            .model()
            .visit_params(&mut |p| params.extend(p.value().to_vec::<f32>().unwrap()));
        Ok((losses, if tp == 1 { params } else { Vec::new() }))
    });
    match result {
        Ok(mut out) => out.remove(0),
        Err(e) => panic!("{e}"),
    }
}

#[test]
fn a_resumed_run_continues_bit_for_bit() {
    let dir = scratch("resume");
    let (all, params) = run(1, 2, 0, 6, 1, None, None);
    let (first, _) = run(1, 2, 0, 3, 1, None, Some(&dir));
    // A different parameter seed proves the load replaces every value.
    let (second, resumed) = run(1, 2, 3, 6, 999, Some(&dir), None);
    let joined: Vec<u64> = first.iter().chain(&second).map(|l| l.to_bits()).collect();
    assert_eq!(joined, all.iter().map(|l| l.to_bits()).collect::<Vec<_>>());
    assert_eq!(
        resumed.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        params.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn loading_with_another_tensor_parallel_size_reshards() {
    let dir = scratch("reshard");
    let (reference, _) = run(2, 1, 0, 4, 1, None, None);
    run(2, 1, 0, 3, 1, None, Some(&dir));
    for tp in [1, 4] {
        let (next, _) = run(tp, 1, 3, 4, 42, Some(&dir), None);
        assert!(
            (next[0] - reference[3]).abs() <= 1e-5 * reference[3],
            "tp {tp}: {} vs {}",
            next[0],
            reference[3]
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn corrupt_checkpoints_are_refused_and_failed_saves_leave_the_old_ones() {
    let dir = scratch("corrupt");
    run(1, 1, 0, 2, 1, None, Some(&dir));
    let iter = dir.join("iter_0000002");
    let model_file = iter.join("model.safetensors");
    let original = std::fs::read(&model_file).unwrap();
    // A truncated file fails its checksum.
    std::fs::write(&model_file, &original[..original.len() - 10]).unwrap();
    let err = megatron::checkpoint::open(&dir).unwrap_err().to_string();
    assert!(
        err.contains("model.safetensors: checksum mismatch"),
        "{err}"
    );
    // A bad header (length prefix) is a clear error too, even unverified.
    let mut bad = original.clone();
    bad[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    std::fs::write(&model_file, &bad).unwrap();
    assert!(megatron::checkpoint::open_unverified(&dir).is_err());
    std::fs::write(&model_file, &original).unwrap();
    assert!(megatron::checkpoint::open(&dir).is_ok());
    // A save that cannot complete (its staging directory cannot be created) changes nothing.
    let blocker = dir.join(format!(".iter_0000004.tmp-{}", std::process::id()));
    std::fs::write(&blocker, b"in the way").unwrap();
    let failed = std::panic::catch_unwind(|| run(1, 1, 2, 4, 1, Some(&dir), Some(&dir)));
    assert!(failed.is_err(), "the save must fail");
    std::fs::remove_file(&blocker).unwrap();
    assert_eq!(
        std::fs::read_to_string(dir.join("latest_checkpointed_iteration.txt")).unwrap(),
        "2"
    );
    assert_eq!(std::fs::read(&model_file).unwrap(), original);
    assert!(!dir.join("iter_0000004").exists());
    let names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        names.len(),
        2,
        "only iter_0000002 and the latest file: {names:?}"
    );
    // A directory that is no checkpoint says so.
    let err = megatron::checkpoint::open(&scratch("empty"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("not a checkpoint"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn files_beside_the_tensors_are_checksummed_and_non_finite_values_are_never_saved() {
    use megatron::checkpoint::{self, CheckpointMeta, Whole};
    use std::collections::BTreeMap;

    let dir = scratch("files");
    let _ = std::fs::remove_dir_all(&dir);
    let meta = |iteration| CheckpointMeta {
        base: None,
        format: String::new(),
        iteration,
        adam_steps: 0,
        seed: 0,
        consumed_samples: 0,
        saved_tp: 1,
        saved_dp: 1,
        saved_pp: 1,
        model: serde_json::json!({}),
        run: serde_json::json!({}),
        files: BTreeMap::new(),
        grad_scaler: None,
        meta_sha256: None,
    };
    let tensor = |v: f32| {
        BTreeMap::from([(
            "w".to_string(),
            Whole {
                shape: vec![3],
                data: vec![1.0, v, 2.0],
            },
        )])
    };
    let files = [(checkpoint::TOKENIZER_FILE, b"{\"a\": 1}".as_slice())];
    checkpoint::save(&dir, &tensor(0.5), None, &files, meta(1)).unwrap();
    let loaded = checkpoint::open(&dir).unwrap();
    let path = loaded.file(checkpoint::TOKENIZER_FILE).unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), b"{\"a\": 1}");
    assert!(loaded.file("other.json").is_none());
    // A changed file fails its checksum like a tensor file.
    std::fs::write(&path, b"{\"a\": 2}").unwrap();
    let err = checkpoint::open(&dir).unwrap_err().to_string();
    assert!(err.contains("tokenizer.json: checksum mismatch"), "{err}");
    // NaN or infinities: refused, nothing written.
    for bad in [f32::NAN, f32::INFINITY] {
        let err = checkpoint::save(&dir, &tensor(bad), None, &[], meta(2))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("`w` holds") && err.contains("at element 1"),
            "{err}"
        );
    }
    assert!(!dir.join("iter_0000002").exists());
    assert_eq!(
        std::fs::read_to_string(dir.join("latest_checkpointed_iteration.txt")).unwrap(),
        "1"
    );
    std::fs::remove_dir_all(&dir).ok();
}
