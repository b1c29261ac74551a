//! GPT samples and blends as Megatron-LM builds them.
//!
//! The expected indices below were produced by Megatron-LM's own code: `_build_document_index`
//! and `_build_shuffle_index` of `megatron/core/datasets/gpt_dataset.py` with NumPy, and
//! `build_sample_idx` / `build_blending_indices` of `helpers.cpp` compiled as Megatron-LM
//! compiles it, for the same sequence lengths, sequence length, sample count and seed.

use std::path::PathBuf;
use std::sync::Arc;

use megatron::data::{
    Blend, BlendedDataset, DType, GptDataset, GptDatasetConfig, IndexedDataset,
    IndexedDatasetBuilder, SampleSource, Split, SplitVector, build_gpt_dataset, parse_data_path,
};

struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let dir =
            std::env::temp_dir().join(format!("megatron-data-gpt-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Token `j` of sequence `s`: distinct across the dataset (for `s·100 + j < 65,536`).
fn token(s: usize, j: usize) -> u32 {
    ((s * 100 + j) % 65_000) as u32
}

/// A dataset of one sequence per document with the given lengths.
fn dataset(dir: &TempDir, name: &str, lengths: &[usize]) -> Arc<IndexedDataset> {
    dataset_from(dir, name, lengths, 0)
}

/// The same with every token shifted by `base`.
fn dataset_from(dir: &TempDir, name: &str, lengths: &[usize], base: u32) -> Arc<IndexedDataset> {
    let prefix = dir.0.join(name);
    let mut b = IndexedDatasetBuilder::create(&prefix, DType::U16).unwrap();
    for (s, &n) in lengths.iter().enumerate() {
        let tokens: Vec<u32> = (0..n).map(|j| base + token(s, j)).collect();
        b.add_document(&tokens, &[n]).unwrap();
    }
    b.finish().unwrap();
    Arc::new(IndexedDataset::open(&prefix).unwrap())
}

fn gpt(
    ds: &Arc<IndexedDataset>,
    seqs: std::ops::Range<usize>,
    seq_length: usize,
    num_samples: Option<u64>,
    seed: u32,
) -> GptDataset {
    GptDataset::with_sequences(
        ds.clone(),
        seqs,
        Split::Train,
        seq_length,
        num_samples,
        seed,
    )
    .unwrap()
}

/// A position-weighted checksum (also computed on Megatron-LM's arrays).
fn checksum(values: impl Iterator<Item = u64>) -> u64 {
    let mut h: u128 = 0;
    for (i, x) in values.enumerate() {
        h = (h * 1_000_003 + u128::from(x) + i as u128) % (1u128 << 61);
    }
    h as u64
}

fn checksums(g: &GptDataset) -> (usize, usize, u64, u64, u64) {
    (
        g.document_index().len(),
        g.sample_index().len(),
        checksum(g.document_index().iter().map(|&d| d as u64)),
        checksum(
            g.sample_index()
                .iter()
                .map(|&[d, o]| u64::from(d) * 65_537 + u64::from(o)),
        ),
        checksum(g.shuffle_index().iter().map(|&s| u64::from(s))),
    )
}

const SMALL: [usize; 10] = [5, 9, 3, 12, 7, 4, 10, 6, 8, 11];

#[test]
fn indices_are_megatrons_with_a_separate_final_epoch() {
    let dir = TempDir::new("small-separate");
    let ds = dataset(&dir, "d", &SMALL);
    let g = gpt(&ds, 0..10, 8, Some(20), 1234);
    assert_eq!(g.num_epochs(), 3);
    assert_eq!(
        g.document_index(),
        [
            3, 3, 2, 6, 4, 5, 4, 0, 8, 8, 7, 1, 0, 9, 7, 1, 9, 2, 6, 5, 8, 1, 7, 6, 9, 5, 4, 3, 0,
            2
        ]
    );
    assert_eq!(
        g.sample_index(),
        [
            [0, 0],
            [0, 8],
            [1, 4],
            [2, 0],
            [3, 5],
            [4, 3],
            [6, 0],
            [7, 1],
            [8, 4],
            [9, 4],
            [10, 4],
            [11, 6],
            [13, 0],
            [13, 8],
            [14, 5],
            [15, 7],
            [16, 6],
            [18, 0],
            [18, 8],
            [20, 2],
            [21, 2],
            [22, 1],
            [23, 3],
            [24, 1],
            [24, 9],
            [26, 2],
            [27, 3],
            [27, 11],
            [29, 2]
        ]
    );
    assert_eq!(
        g.shuffle_index(),
        [
            12, 5, 4, 8, 10, 6, 17, 14, 1, 13, 2, 3, 15, 16, 9, 0, 11, 7, 21, 20, 26, 24, 18, 22,
            23, 27, 19, 25
        ]
    );
}

#[test]
fn indices_are_megatrons_in_one_shuffle() {
    let dir = TempDir::new("small-joint");
    let ds = dataset(&dir, "d", &SMALL);
    let g = gpt(&ds, 0..10, 8, Some(25), 1234);
    assert_eq!(g.num_epochs(), 3);
    assert_eq!(
        g.document_index(),
        [
            7, 0, 4, 1, 8, 8, 3, 3, 4, 3, 2, 4, 0, 2, 7, 6, 8, 5, 6, 5, 1, 9, 7, 9, 0, 2, 1, 6, 9,
            5
        ]
    );
    assert_eq!(
        g.shuffle_index(),
        [
            27, 3, 20, 6, 16, 8, 9, 15, 13, 5, 0, 4, 18, 24, 25, 22, 21, 10, 7, 14, 17, 23, 26, 11,
            1, 12, 19, 2
        ]
    );

    // A sub-range of the sequences, one epoch, another seed.
    let g = gpt(&ds, 2..9, 4, None, 7);
    assert_eq!(g.document_index(), [4, 7, 2, 8, 5, 3, 6]);
    assert_eq!(
        g.sample_index(),
        [
            [0, 0],
            [0, 4],
            [1, 1],
            [1, 5],
            [3, 0],
            [3, 4],
            [4, 0],
            [5, 0],
            [5, 4],
            [5, 8],
            [6, 0],
            [6, 4],
            [6, 8]
        ]
    );
    assert_eq!(g.shuffle_index(), [1, 2, 5, 3, 0, 4, 6, 11, 10, 9, 8, 7]);
}

#[test]
fn larger_indices_match_megatrons_checksums() {
    let dir = TempDir::new("large");
    let lengths: Vec<usize> = (0..300).map(|i| (i * 7919) % 50 + 1).collect();
    let ds = dataset(&dir, "d", &lengths);
    let g = gpt(&ds, 0..291, 64, Some(1000), 1234);
    assert_eq!(g.num_epochs(), 9);
    assert_eq!(
        checksums(&g),
        (
            2619,
            1041,
            948_439_303_847_129_630,
            602_946_999_844_734_052,
            282_137_615_456_093_752
        )
    );
    let g = gpt(&ds, 0..291, 64, Some(450), 1234);
    assert_eq!(g.num_epochs(), 4);
    assert_eq!(
        checksums(&g),
        (
            1164,
            463,
            1_418_318_669_410_525_378,
            245_083_482_416_312_241,
            1_652_889_350_607_210_842
        )
    );
    let g = gpt(&ds, 291..300, 16, None, 99);
    assert_eq!(
        checksums(&g),
        (
            9,
            16,
            1_856_656_879_244_715_233,
            624_138_175_301_437_679,
            688_371_108_172_948_866
        )
    );

    let lengths: Vec<usize> = (0..5000).map(|i| (i * 31) % 97 + 1).collect();
    let ds = dataset(&dir, "e", &lengths);
    let g = gpt(&ds, 0..5000, 128, Some(3000), u32::MAX);
    assert_eq!(
        checksums(&g),
        (
            10_000,
            3829,
            2_017_443_465_958_085_734,
            761_733_861_923_167_649,
            1_613_002_280_411_654_766
        )
    );
    let g = gpt(&ds, 100..4900, 128, None, 0);
    assert_eq!(
        checksums(&g),
        (
            4800,
            1838,
            2_214_950_541_819_704_404,
            34_416_837_038_636_133,
            1_887_155_821_167_805_000
        )
    );
}

#[test]
fn samples_cover_the_shuffled_token_stream() {
    let dir = TempDir::new("cover");
    let lengths: Vec<usize> = (0..40).map(|i| (i * 13) % 29 + 1).collect();
    let ds = dataset(&dir, "d", &lengths);
    for (seq_length, num_samples) in [(8, Some(200)), (16, None), (33, Some(50)), (2, Some(7))] {
        let g = gpt(&ds, 0..40, seq_length, num_samples, 5);
        assert!(g.len() as u64 >= num_samples.unwrap_or(1));
        // The naive reconstruction: every document of the document index, one after the
        // other; unshuffled sample k is tokens k·seq ..= (k+1)·seq of that stream.
        let stream: Vec<u32> = g
            .document_index()
            .iter()
            .flat_map(|&s| (0..lengths[s as usize]).map(move |j| token(s as usize, j)))
            .collect();
        for i in 0..g.len() {
            let k = g.shuffle_index()[i] as usize;
            let sample = g.sample(i as u64).unwrap();
            assert_eq!(sample.len(), seq_length + 1);
            assert_eq!(
                sample,
                stream[k * seq_length..=(k + 1) * seq_length],
                "sample {i}"
            );
        }
        assert!(g.sample(g.len() as u64).is_err());
        // Every shuffled sample once.
        let mut seen = g.shuffle_index().to_vec();
        seen.sort_unstable();
        assert!(seen.iter().enumerate().all(|(i, &s)| s as usize == i));
    }
}

#[test]
fn every_rank_builds_the_same_dataset() {
    let dir = TempDir::new("ranks");
    let lengths: Vec<usize> = (0..64).map(|i| (i * 17) % 41 + 2).collect();
    let ds = dataset(&dir, "d", &lengths);
    let config = GptDatasetConfig::new(24, 1234).with_split("90,5,5".parse().unwrap());
    // Four "ranks", each opening the files and building on its own.
    let ranks: Vec<GptDataset> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|_| {
                s.spawn(|| {
                    let ds = Arc::new(IndexedDataset::open(ds.prefix()).unwrap());
                    GptDataset::new(ds, &config, Split::Train, Some(300)).unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for g in &ranks[1..] {
        assert_eq!(g.document_index(), ranks[0].document_index());
        assert_eq!(g.sample_index(), ranks[0].sample_index());
        assert_eq!(g.shuffle_index(), ranks[0].shuffle_index());
        for i in [0u64, 1, 17, 299] {
            assert_eq!(g.sample(i).unwrap(), ranks[0].sample(i).unwrap());
        }
    }
    // Another seed gives another order.
    let other = GptDataset::new(
        ds.clone(),
        &GptDatasetConfig {
            seed: 4321,
            ..config
        },
        Split::Train,
        Some(300),
    )
    .unwrap();
    assert_ne!(other.shuffle_index(), ranks[0].shuffle_index());
}

#[test]
fn splits_are_by_documents_as_megatron_rounds_them() {
    let split: SplitVector = "969,30,1".parse().unwrap();
    assert_eq!(split.sequence_range(Split::Train, 1000), Some(0..969));
    assert_eq!(split.sequence_range(Split::Valid, 1000), Some(969..999));
    assert_eq!(split.sequence_range(Split::Test, 1000), Some(999..1000));
    let split: SplitVector = "99,1,0".parse().unwrap();
    assert_eq!(split.sequence_range(Split::Test, 1000), None);
    assert_eq!(split.sequence_range(Split::Valid, 1000), Some(990..1000));
    // Python's round: halves to even.
    let split: SplitVector = "1,1".parse().unwrap();
    assert_eq!(split.sequence_range(Split::Train, 5), Some(0..2));
    assert_eq!(split.sequence_range(Split::Train, 3), Some(0..2));
    assert_eq!(split.sequence_range(Split::Valid, 3), Some(2..3));
    assert!("1,2,3,4".parse::<SplitVector>().is_err());
    assert!("0,0,0".parse::<SplitVector>().is_err());
    assert!("a,b".parse::<SplitVector>().is_err());

    let dir = TempDir::new("split");
    let lengths: Vec<usize> = (0..100).map(|i| i % 9 + 3).collect();
    let ds = dataset(&dir, "d", &lengths);
    let config = GptDatasetConfig::new(8, 1).with_split("80,20".parse().unwrap());
    let train = GptDataset::new(ds.clone(), &config, Split::Train, Some(10)).unwrap();
    let valid = GptDataset::new(ds.clone(), &config, Split::Valid, Some(10)).unwrap();
    assert_eq!(train.sequences(), 0..80);
    assert_eq!(valid.sequences(), 80..100);
    assert!(train.document_index().iter().all(|&d| d < 80));
    assert!(valid.document_index().iter().all(|&d| d >= 80));
    let err = GptDataset::new(ds.clone(), &config, Split::Test, Some(10)).unwrap_err();
    assert!(err.to_string().contains("test split"), "{err}");
    let blend = Blend::single(ds);
    assert!(
        build_gpt_dataset(&blend, &config, Split::Test, Some(10))
            .unwrap()
            .is_none()
    );
}

/// A source of `n` samples whose tokens name the source and the sample.
struct Fake(u32, usize);

impl SampleSource for Fake {
    fn len(&self) -> usize {
        self.1
    }

    fn sample(&self, i: u64) -> megatron::data::Result<Vec<u32>> {
        Ok(vec![self.0, i as u32])
    }
}

fn fakes(sizes: &[usize]) -> Vec<Arc<dyn SampleSource>> {
    sizes
        .iter()
        .enumerate()
        .map(|(d, &n)| Arc::new(Fake(d as u32, n)) as Arc<dyn SampleSource>)
        .collect()
}

#[test]
fn blending_follows_the_weights_at_every_prefix() {
    let weights = [0.3, 0.5, 0.2];
    let b = BlendedDataset::new(fakes(&[400, 600, 300]), &weights, Some(1000)).unwrap();
    assert_eq!(
        &b.dataset_index()[..40],
        [
            1, 0, 2, 1, 0, 1, 2, 1, 0, 1, 0, 1, 2, 1, 0, 1, 2, 1, 0, 1, 0, 1, 2, 1, 0, 1, 2, 1, 0,
            1, 0, 1, 2, 1, 0, 1, 2, 1, 0, 1
        ]
    );
    assert_eq!(
        checksum(b.dataset_index().iter().map(|&d| d as u64)),
        1_826_028_372_038_969_882
    );
    assert_eq!(
        checksum(b.dataset_sample_index().iter().map(|&d| d as u64)),
        1_031_533_704_474_358_892
    );

    // Unnormalized weights, 10,000 samples: within 1% of the shares after every prefix of 100.
    let weights = [2.0, 7.0, 1.0, 10.0];
    let n = 10_000;
    let b = BlendedDataset::new(fakes(&[6000; 4]), &weights, Some(n)).unwrap();
    assert_eq!(b.len(), n as usize);
    let mut counts = [0usize; 4];
    for (i, &d) in b.dataset_index().iter().enumerate() {
        // Each dataset's samples are taken in order.
        assert_eq!(b.dataset_sample_index()[i], counts[d as usize] as i64);
        counts[d as usize] += 1;
        let k = i + 1;
        if k >= 100 {
            for (c, w) in counts.iter().zip(weights) {
                let share = w / 20.0;
                assert!(
                    (*c as f64 / k as f64 - share).abs() < 0.01,
                    "after {k}: {counts:?}"
                );
            }
        }
    }
    assert_eq!(counts, [1000, 3500, 500, 5000]);
    let s = b.sample(3).unwrap();
    assert_eq!(
        s,
        [
            b.dataset_index()[3] as u32,
            b.dataset_sample_index()[3] as u32
        ]
    );

    // A dataset too small for its share is an error.
    let err = BlendedDataset::new(fakes(&[3000, 10]), &[1.0, 1.0], Some(100)).unwrap_err();
    assert!(err.to_string().contains("oversamples dataset 1"), "{err}");
    // Exhaustive: exactly the given counts.
    let b = BlendedDataset::new(fakes(&[3, 5, 2]), &[3.0, 5.0, 2.0], None).unwrap();
    assert_eq!(b.dataset_index(), [1, 0, 2, 1, 0, 1, 2, 1, 0, 1]);
    assert_eq!(b.dataset_sample_index(), [0, 0, 0, 1, 1, 2, 1, 3, 2, 4]);
}

#[test]
fn the_builder_blends_gpt_datasets_as_megatron() {
    let dir = TempDir::new("builder");
    let a = dataset(&dir, "a", &(0..50).map(|i| i % 7 + 5).collect::<Vec<_>>());
    // Dataset b's tokens are 30,000 and up, a's below 5,000.
    let b = dataset_from(
        &dir,
        "b",
        &(0..80).map(|i| i % 11 + 2).collect::<Vec<_>>(),
        30_000,
    );
    let config = GptDatasetConfig::new(16, 1234).with_split("98,2,0".parse().unwrap());
    let blend = Blend::weighted(vec![(a.clone(), 30.0), (b.clone(), 70.0)]);
    let n = 1000;
    let train = build_gpt_dataset(&blend, &config, Split::Train, Some(n))
        .unwrap()
        .unwrap();
    // Σ ⌈n·wᵢ⌉ samples.
    assert_eq!(train.len(), 1000);
    // The parts are the GPT datasets built with their share plus the 0.5% surplus.
    let part_a = GptDataset::new(a.clone(), &config, Split::Train, Some(302)).unwrap();
    let part_b = GptDataset::new(b.clone(), &config, Split::Train, Some(704)).unwrap();
    let mut taken = [0u64; 2];
    for i in 0..n {
        let s = train.sample(i).unwrap();
        assert_eq!(s.len(), 17);
        if s[0] < 30_000 {
            assert_eq!(s, part_a.sample(taken[0]).unwrap(), "sample {i}");
            taken[0] += 1;
        } else {
            assert_eq!(s, part_b.sample(taken[1]).unwrap(), "sample {i}");
            taken[1] += 1;
        }
    }
    assert_eq!(taken, [300, 700]);

    let (prefixes, weights) = parse_data_path(&[
        "30".to_string(),
        a.prefix().display().to_string(),
        "70".to_string(),
        b.prefix().display().to_string(),
    ])
    .unwrap();
    assert_eq!(weights, Some(vec![30.0, 70.0]));
    assert_eq!(prefixes[1], b.prefix().display().to_string());
    let (_, weights) = parse_data_path(&[a.prefix().display().to_string()]).unwrap();
    assert_eq!(weights, None);

    // One unweighted dataset: the GPT dataset itself.
    let single = build_gpt_dataset(&Blend::single(a.clone()), &config, Split::Train, Some(40))
        .unwrap()
        .unwrap();
    let direct = GptDataset::new(a.clone(), &config, Split::Train, Some(40)).unwrap();
    assert_eq!(single.len(), direct.len());
    assert_eq!(single.sample(5).unwrap(), direct.sample(5).unwrap());

    // Several unweighted datasets: one epoch of each, blended by size.
    let both = Blend {
        datasets: vec![a, b],
        weights: None,
    };
    let config = GptDatasetConfig::new(16, 1234);
    let all = build_gpt_dataset(&both, &config, Split::Train, None)
        .unwrap()
        .unwrap();
    let one_epoch_a =
        GptDataset::new(both.datasets[0].clone(), &config, Split::Train, None).unwrap();
    let one_epoch_b =
        GptDataset::new(both.datasets[1].clone(), &config, Split::Train, None).unwrap();
    assert_eq!(all.len(), one_epoch_a.len() + one_epoch_b.len());
    let some = build_gpt_dataset(&both, &config, Split::Train, Some(10))
        .unwrap()
        .unwrap();
    assert_eq!(some.len(), 10);
}
