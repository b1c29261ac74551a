//! Megatron-LM's blended dataset and dataset builder: several GPT datasets mixed by weights.

use std::fmt;
use std::sync::Arc;

use super::SampleSource;
use super::error::{DataError, Result, data_invalid};
use super::gpt::{GptDataset, GptDatasetConfig, Split};
use super::indexed::IndexedDataset;
use super::packed::{PackedDataset, is_packed};

/// The surplus of samples built for each dataset of a blend (Megatron-LM's
/// `mid_level_dataset_surplus`), so that the blend never runs one dry.
pub const MID_LEVEL_DATASET_SURPLUS: f64 = 0.005;

/// Several datasets mixed by weights: sample `i` is sample `dataset_sample_index[i]` of dataset
/// `dataset_index[i]`.
pub struct BlendedDataset {
    datasets: Vec<Arc<dyn SampleSource>>,
    weights: Vec<f64>,
    dataset_index: Vec<i16>,
    dataset_sample_index: Vec<i64>,
}

impl fmt::Debug for BlendedDataset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BlendedDataset")
            .field("datasets", &self.datasets.len())
            .field("weights", &self.weights)
            .field("samples", &self.dataset_index.len())
            .finish()
    }
}

/// Megatron-LM's `normalize`: weights divided by their sum.
pub fn normalize(weights: &[f64]) -> Vec<f64> {
    let sum: f64 = weights.iter().sum();
    weights.iter().map(|w| w / sum).collect()
}

impl BlendedDataset {
    /// `size` samples of `datasets` mixed by `weights` (normalized here), as Megatron-LM's
    /// `build_blending_indices`: sample `i` comes from the dataset furthest behind its share,
    /// the one with the largest `weight·max(i, 1) − taken` (the first on ties). With `size`
    /// `None`, the weights are sample counts and every dataset gives exactly that many
    /// (`build_exhaustive_blending_indices`).
    ///
    /// Errors when a dataset has fewer samples than the blend takes from it.
    pub fn new(
        datasets: Vec<Arc<dyn SampleSource>>,
        weights: &[f64],
        size: Option<u64>,
    ) -> Result<BlendedDataset> {
        if datasets.is_empty() || datasets.len() != weights.len() {
            return data_invalid!(
                "a blend needs one weight per dataset, got {} datasets and {} weights",
                datasets.len(),
                weights.len()
            );
        }
        if datasets.len() >= i16::MAX as usize {
            return data_invalid!("a blend holds fewer than 32,767 datasets");
        }
        if let Some(w) = weights.iter().find(|w| !(w.is_finite() && **w > 0.0)) {
            return data_invalid!("blend weights must be positive, got {w}");
        }
        let (weights, dataset_index, dataset_sample_index) = match size {
            Some(size) => {
                let weights = normalize(weights);
                let (a, b) = blending_indices(&weights, size);
                (weights, a, b)
            }
            None => {
                if let Some(w) = weights.iter().find(|w| w.fract() != 0.0) {
                    return data_invalid!(
                        "an exhaustive blend takes whole sample counts as weights, got {w}"
                    );
                }
                let sizes: Vec<u64> = weights.iter().map(|&w| w as u64).collect();
                let (a, b) = exhaustive_blending_indices(&sizes);
                (weights.to_vec(), a, b)
            }
        };
        let mut taken = vec![0u64; datasets.len()];
        for &d in &dataset_index {
            taken[d as usize] += 1;
        }
        for (i, (ds, &n)) in datasets.iter().zip(&taken).enumerate() {
            if (ds.len() as u64) < n {
                return data_invalid!(
                    "the blend oversamples dataset {i}: it takes {n} samples from a dataset of {}",
                    ds.len()
                );
            }
        }
        Ok(BlendedDataset {
            datasets,
            weights,
            dataset_index,
            dataset_sample_index,
        })
    }

    /// Number of samples.
    pub fn len(&self) -> usize {
        self.dataset_index.len()
    }

    /// Whether there are no samples.
    pub fn is_empty(&self) -> bool {
        self.dataset_index.is_empty()
    }

    /// The blended datasets.
    pub fn datasets(&self) -> &[Arc<dyn SampleSource>] {
        &self.datasets
    }

    /// The weights (normalized when the blend has a size).
    pub fn weights(&self) -> &[f64] {
        &self.weights
    }

    /// Which dataset each sample comes from.
    pub fn dataset_index(&self) -> &[i16] {
        &self.dataset_index
    }

    /// Which sample of its dataset each sample is.
    pub fn dataset_sample_index(&self) -> &[i64] {
        &self.dataset_sample_index
    }

    /// Sample `i`.
    pub fn sample(&self, i: u64) -> Result<Vec<u32>> {
        let (d, k) = self.locate(i)?;
        self.datasets[d].sample(k)
    }

    /// Which dataset sample `i` comes from, and which of its samples it is.
    fn locate(&self, i: u64) -> Result<(usize, u64)> {
        let Some(&d) = usize::try_from(i)
            .ok()
            .and_then(|i| self.dataset_index.get(i))
        else {
            return data_invalid!(
                "sample {i} out of range: the blend has {} samples",
                self.len()
            );
        };
        Ok((d as usize, self.dataset_sample_index[i as usize] as u64))
    }
}

impl SampleSource for BlendedDataset {
    fn len(&self) -> usize {
        BlendedDataset::len(self)
    }

    fn sample(&self, i: u64) -> Result<Vec<u32>> {
        BlendedDataset::sample(self, i)
    }

    fn loss_mask(&self, i: u64) -> Result<Option<Vec<u8>>> {
        let (d, k) = self.locate(i)?;
        self.datasets[d].loss_mask(k)
    }

    fn has_loss_mask(&self) -> bool {
        self.datasets.iter().any(|d| d.has_loss_mask())
    }

    fn documents(&self, i: u64) -> Result<Option<Vec<usize>>> {
        let (d, k) = self.locate(i)?;
        self.datasets[d].documents(k)
    }

    fn has_documents(&self) -> bool {
        self.datasets.iter().any(|d| d.has_documents())
    }
}

/// `helpers.cpp`'s `build_blending_indices`.
fn blending_indices(weights: &[f64], size: u64) -> (Vec<i16>, Vec<i64>) {
    let mut taken = vec![0i64; weights.len()];
    let mut dataset_index = Vec::with_capacity(size as usize);
    let mut sample_index = Vec::with_capacity(size as usize);
    for i in 0..size {
        let at = (i as f64).max(1.0);
        let mut best = 0;
        let mut best_error = weights[0] * at - taken[0] as f64;
        for (d, &w) in weights.iter().enumerate().skip(1) {
            let error = w * at - taken[d] as f64;
            if error > best_error {
                best_error = error;
                best = d;
            }
        }
        dataset_index.push(best as i16);
        sample_index.push(taken[best]);
        taken[best] += 1;
    }
    (dataset_index, sample_index)
}

/// `helpers.cpp`'s `build_exhaustive_blending_indices`: exactly `sizes[d]` samples of each
/// dataset `d`, interleaved in proportion.
fn exhaustive_blending_indices(sizes: &[u64]) -> (Vec<i16>, Vec<i64>) {
    let total: u64 = sizes.iter().sum();
    let weights: Vec<f64> = sizes.iter().map(|&s| s as f64 / total as f64).collect();
    let mut taken = vec![0u64; sizes.len()];
    let mut unspent: Vec<usize> = (0..sizes.len()).filter(|&d| sizes[d] > 0).collect();
    let mut dataset_index = Vec::with_capacity(total as usize);
    let mut sample_index = Vec::with_capacity(total as usize);
    let mut i = 0u64;
    while !unspent.is_empty() {
        let at = (i as f64).max(1.0);
        let mut best = usize::MAX;
        let mut best_error = f64::MIN;
        for &d in &unspent {
            let error = weights[d] * at - taken[d] as f64;
            if error > best_error {
                best_error = error;
                best = d;
            }
        }
        dataset_index.push(best as i16);
        sample_index.push(taken[best] as i64);
        taken[best] += 1;
        if taken[best] == sizes[best] {
            unspent.retain(|&d| d != best);
        }
        i += 1;
    }
    (dataset_index, sample_index)
}

/// Where a run's samples come from: Megatron-LM's `--data-path`, one prefix or several with
/// optional weights.
#[derive(Debug, Clone)]
pub struct Blend {
    /// The indexed datasets.
    pub datasets: Vec<Arc<IndexedDataset>>,
    /// Their weights; `None` blends several datasets by their sizes (one epoch each).
    pub weights: Option<Vec<f64>>,
}

impl Blend {
    /// One dataset, unweighted (Megatron-LM's `--data-path PREFIX`).
    pub fn single(dataset: Arc<IndexedDataset>) -> Blend {
        Blend {
            datasets: vec![dataset],
            weights: None,
        }
    }

    /// Datasets with weights (Megatron-LM's `--data-path W1 PREFIX1 W2 PREFIX2 ...`).
    pub fn weighted(datasets: Vec<(Arc<IndexedDataset>, f64)>) -> Blend {
        let (datasets, weights) = datasets.into_iter().unzip();
        Blend {
            datasets,
            weights: Some(weights),
        }
    }

    /// Opens the datasets of a `--data-path` list (see [`parse_data_path`]).
    pub fn open(data_path: &[String]) -> Result<Blend> {
        let (prefixes, weights) = parse_data_path(data_path)?;
        let datasets = prefixes
            .iter()
            .map(|p| IndexedDataset::open(p).map(Arc::new))
            .collect::<Result<Vec<_>>>()?;
        Ok(Blend { datasets, weights })
    }

    /// Checks every entry of every dataset's index ([`IndexedDataset::validate`]), so that a
    /// damaged index is refused before training starts rather than when a step reaches it.
    pub fn validate(&self) -> Result<()> {
        for dataset in &self.datasets {
            dataset.validate()?;
        }
        Ok(())
    }
}

/// Megatron-LM's `get_blend_from_list`: `PREFIX...` (no weights) or `W1 PREFIX1 W2 PREFIX2 ...`.
pub fn parse_data_path(args: &[String]) -> Result<(Vec<String>, Option<Vec<f64>>)> {
    if args.is_empty() {
        return data_invalid!("no data path given");
    }
    if args.len() % 2 == 1 {
        // Megatron reads an odd list as prefixes only; a number among them that names no
        // dataset is a weight whose prefix is missing.
        if let Some(weight) = args.iter().map(|s| s.trim()).find(|s| {
            s.parse::<f64>().is_ok() && !std::path::Path::new(&format!("{s}.idx")).exists()
        }) {
            return data_invalid!(
                "the data path {args:?} has {} items, and `{weight}` looks like a weight: give \
                 prefixes only, or a weight before every prefix (W1 PREFIX1 W2 PREFIX2 ...)",
                args.len()
            );
        }
        return Ok((args.iter().map(|s| s.trim().to_string()).collect(), None));
    }
    let parsed: Vec<Option<f64>> = args
        .chunks(2)
        .map(|c| c[0].trim().parse::<f64>().ok())
        .collect();
    if parsed.iter().all(Option::is_none) {
        return Ok((args.iter().map(|s| s.trim().to_string()).collect(), None));
    }
    if parsed.iter().any(Option::is_none) {
        return data_invalid!("bad data path {args:?}: give prefixes only, or weight-prefix pairs");
    }
    let prefixes = args.chunks(2).map(|c| c[1].trim().to_string()).collect();
    let weights: Vec<f64> = parsed.into_iter().flatten().collect();
    if let Some(bad) = weights.iter().find(|w| !w.is_finite() || **w < 0.0) {
        return data_invalid!(
            "the data path {args:?} has weight {bad}: weights must be finite and not negative"
        );
    }
    if weights.iter().sum::<f64>() <= 0.0 {
        return data_invalid!(
            "the data path {args:?} gives every dataset weight 0: at least one weight must be positive"
        );
    }
    Ok((prefixes, Some(weights)))
}

/// Megatron-LM's `BlendedMegatronDatasetBuilder` for one split of GPT data: the dataset the
/// trainer reads `num_samples` samples from, or `None` when `config.split` gives the split
/// nothing.
///
/// * one dataset, no weights: the [`GptDataset`] of the split itself;
/// * weights: every dataset's [`GptDataset`] built with its share of the samples plus
///   [`MID_LEVEL_DATASET_SURPLUS`], blended into `Σ ⌈num_samples·wᵢ⌉` samples;
/// * several datasets, no weights: one epoch of each, blended by their sizes.
pub fn build_gpt_dataset(
    blend: &Blend,
    config: &GptDatasetConfig,
    split: Split,
    num_samples: Option<u64>,
) -> Result<Option<Arc<dyn SampleSource>>> {
    if blend.datasets.is_empty() {
        return data_invalid!("an empty blend");
    }
    if config.split.bookends(split).is_none() {
        return Ok(None);
    }
    // Packed fine-tuning data keeps its sequences whole; token data is cut as GPTDataset cuts it.
    let build = |ds: &Arc<IndexedDataset>, n: Option<u64>| -> Result<Arc<dyn SampleSource>> {
        Ok(match is_packed(ds.prefix()) {
            true => Arc::new(PackedDataset::new(ds.clone(), config, split, n)?),
            false => Arc::new(GptDataset::new(ds.clone(), config, split, n)?),
        })
    };
    match &blend.weights {
        None if blend.datasets.len() == 1 => Ok(Some(build(&blend.datasets[0], num_samples)?)),
        Some(weights) => {
            if weights.len() != blend.datasets.len() {
                return data_invalid!(
                    "{} weights for {} datasets",
                    weights.len(),
                    blend.datasets.len()
                );
            }
            let Some(n) = num_samples else {
                return Err(DataError::Invalid(
                    "a weighted blend needs a number of samples".into(),
                ));
            };
            let weights = normalize(weights);
            let mut datasets = Vec::with_capacity(weights.len());
            let mut size = 0u64;
            for (ds, &w) in blend.datasets.iter().zip(&weights) {
                let target = (n as f64 * w).ceil();
                size += target as u64;
                let buffer = (target * (1.0 + MID_LEVEL_DATASET_SURPLUS)).ceil() as u64;
                datasets.push(build(ds, Some(buffer))?);
            }
            Ok(Some(Arc::new(BlendedDataset::new(
                datasets,
                &weights,
                Some(size),
            )?)))
        }
        None => {
            let datasets = blend
                .datasets
                .iter()
                .map(|ds| build(ds, None))
                .collect::<Result<Vec<_>>>()?;
            let sizes: Vec<f64> = datasets.iter().map(|d| d.len() as f64).collect();
            let total: u64 = datasets.iter().map(|d| d.len() as u64).sum();
            let size = num_samples.map(|n| n.min(total));
            Ok(Some(Arc::new(BlendedDataset::new(datasets, &sizes, size)?)))
        }
    }
}
