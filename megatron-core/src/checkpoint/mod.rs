//! Checkpoints on disk: parameters and optimizer state by logical name and logical shape, in
//! safetensors files, with the run's metadata and a checksum of every file.
//!
//! A save directory holds one directory per saved iteration, `iter_0000100/`, and
//! `latest_checkpointed_iteration.txt`, as Megatron-LM lays them out. An iteration directory is
//! written under a temporary name, every file synced, then renamed into place; the `latest` file
//! is replaced the same way. A failed save leaves the earlier checkpoints as they were, a save
//! killed midway leaves a working directory that the next save or training load removes, and a
//! checkpoint that does not match its checksums is refused on load. Values that are not finite
//! are never saved.
//!
//! Tensors are stored whole and unpadded (the vocabulary without Megatron's padding rows), so a
//! checkpoint does not depend on the tensor-, data- or pipeline-parallel layout that wrote it.
//! The distributed optimizer's state is the exception: every rank writes its own shard
//! ([`OptimizerShard`], `optimizer.rank00003.safetensors`), each piece with the logical
//! elements it holds, and a load puts the pieces back together whatever the layout.
//!
//! A run that saves holds the directory's lock ([`SaveLock`]): one writer per save directory.
//! A trainer's state goes in and out through `Trainer::save_checkpoint` and
//! `Trainer::load_checkpoint` (`trainer.rs`: parameters gathered to whole tensors on global rank
//! 0, the distributed optimizer's moments written by every rank as its shard).

mod lock;
mod trainer;

pub use lock::{LOCK_FILE, SaveLock};
pub use trainer::{SaveInfo, load_params, open_checkpoint};

use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File};
use std::io::Read;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use thiserror::Error;

/// Files saved beside a checkpoint's tensors, each a name and its contents (e.g.
/// [`TOKENIZER_FILE`]).
pub type Files = Vec<(String, Vec<u8>)>;

/// The format tag written into every checkpoint.
pub const FORMAT: &str = "megatron-rs/1";
/// File naming the newest iteration of a save directory.
pub const LATEST: &str = "latest_checkpointed_iteration.txt";
/// Parameters.
pub const MODEL_FILE: &str = "model.safetensors";
/// Optimizer state.
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
/// Metadata, with the files' checksums.
pub const META_FILE: &str = "meta.json";
/// The start of every optimizer shard file's name (the distributed optimizer).
pub const OPTIMIZER_SHARD_PREFIX: &str = "optimizer.rank";

/// The name of global rank `rank`'s optimizer shard file.
pub fn optimizer_shard_file(rank: usize) -> String {
    format!("{OPTIMIZER_SHARD_PREFIX}{rank:05}.safetensors")
}

/// Whether `name` is an optimizer shard file's.
fn is_optimizer_shard(name: &str) -> bool {
    name.starts_with(OPTIMIZER_SHARD_PREFIX) && name.ends_with(".safetensors")
}

/// One parameter's piece of a rank's optimizer shard: which logical elements of the whole,
/// unpadded tensor it holds, as runs `(first, length)` in row-major order, and the values of
/// each state tensor (`exp_avg`, `exp_avg_sq`) at them, run after run.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ShardPiece {
    /// Runs of consecutive logical elements.
    pub runs: Vec<(u64, u64)>,
    /// Each state tensor's values, by suffix.
    pub values: BTreeMap<String, Vec<f32>>,
}

/// A rank's shard of the distributed optimizer's state: its pieces, by parameter name.
pub type OptimizerShard = BTreeMap<String, ShardPiece>;
/// The tokenizer the run trained with, when it is a file (a Hugging Face `tokenizer.json`):
/// a checkpoint carries it, so it does not depend on where training ran.
pub const TOKENIZER_FILE: &str = "tokenizer.json";

/// Why a checkpoint could not be written or read.
#[derive(Debug, Clone, Error)]
pub enum CheckpointError {
    /// A file operation failed.
    #[error("{path}: {message}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// What the system said.
        message: String,
    },
    /// A file is not what a checkpoint holds.
    #[error("{path}: {message}")]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A file does not match the checksum recorded when it was saved.
    #[error(
        "{path}: checksum mismatch (saved {expected}, found {found}): the file changed or is truncated"
    )]
    Checksum {
        /// The file.
        path: PathBuf,
        /// SHA-256 recorded at save time.
        expected: String,
        /// SHA-256 of the file now.
        found: String,
    },
    /// A tensor to save holds NaN or an infinity: such a checkpoint is never written.
    #[error(
        "{path}: `{name}` holds {value} at element {index}; a checkpoint of non-finite values is not saved"
    )]
    NotFinite {
        /// The save directory.
        path: PathBuf,
        /// The tensor.
        name: String,
        /// Its first non-finite element.
        index: usize,
        /// That element's value.
        value: f32,
    },
    /// A tensor the model needs is not in the checkpoint, or has another shape.
    #[error("{path}: {message}")]
    Tensor {
        /// The file.
        path: PathBuf,
        /// Which tensor and what is wrong.
        message: String,
    },
}

/// Why `dir` cannot become a directory when something stands in its place: a symbolic link
/// to nothing, or a file (`None`: it is a directory, or nothing is there).
pub fn blocked_dir(dir: &Path) -> Option<String> {
    let link = fs::symlink_metadata(dir).ok()?;
    match fs::metadata(dir) {
        Err(_) if link.file_type().is_symlink() => {
            let target = fs::read_link(dir)
                .map(|t| t.display().to_string())
                .unwrap_or_default();
            Some(format!(
                "a symbolic link to {target}, which does not exist: remove the link or create \
                 its target"
            ))
        }
        Ok(meta) if !meta.is_dir() => Some("a file, not a directory".to_string()),
        _ => None,
    }
}

/// Creates the directory `dir` and its parents; where a file or a symbolic link to nothing
/// stands in its place, the error says so (not the operating system's "File exists").
pub fn create_dir(dir: &Path) -> Result<(), CheckpointError> {
    if let Some(why) = blocked_dir(dir) {
        return Err(CheckpointError::Io {
            path: dir.to_path_buf(),
            message: why,
        });
    }
    fs::create_dir_all(dir).map_err(io(dir))
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |e| CheckpointError::Io {
        path: path.to_path_buf(),
        message: e.to_string(),
    }
}

/// A whole tensor: its logical shape and f32 values in row-major order.
#[derive(Debug, Clone, PartialEq)]
pub struct Whole {
    /// Logical shape.
    pub shape: Vec<usize>,
    /// Values.
    pub data: Vec<f32>,
}

/// A whole tensor from its shape and little-endian f32 bytes.
fn whole(shape: Vec<usize>, bytes: &[u8]) -> Whole {
    let data = bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    Whole { shape, data }
}

/// The values of little-endian `bytes` of `dtype` as f32: F32 as they are, F16 and BF16 (what
/// an imported model keeps) widened exactly; `None` for another dtype.
pub fn values_f32(dtype: Dtype, bytes: &[u8]) -> Option<Vec<f32>> {
    Some(match dtype {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        _ => return None,
    })
}

/// A whole tensor from its shape and the little-endian bytes of `dtype` (F32, F16 or BF16).
fn whole_of(dtype: Dtype, shape: Vec<usize>, bytes: &[u8]) -> Whole {
    let data = values_f32(dtype, bytes).unwrap_or_default();
    Whole { shape, data }
}

/// A tensor found in a mapped file: its dtype, shape and bytes.
type Found<'a> = (Dtype, Vec<usize>, &'a [u8]);

/// A tensor of a checkpoint's mapped file, read element range by element range as f32.
#[derive(Debug, Clone)]
pub struct Stored<'a> {
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: &'a [u8],
}

impl Stored<'_> {
    /// Its shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.bytes.len() * 8 / self.dtype.bitsize()
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// Appends elements `range` (clamped to its length) to `out` as f32.
    pub fn extend_from(&self, range: std::ops::Range<usize>, out: &mut Vec<f32>) {
        let size = self.dtype.bitsize() / 8;
        let end = range.end.min(self.len());
        let start = range.start.min(end);
        let bytes = &self.bytes[start * size..end * size];
        out.extend(values_f32(self.dtype, bytes).unwrap_or_default());
    }
}

/// Size and SHA-256 of one file of a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileDigest {
    /// Bytes.
    pub bytes: u64,
    /// Hex SHA-256.
    pub sha256: String,
}

/// Everything about a checkpoint besides its tensors.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointMeta {
    /// [`FORMAT`].
    pub format: String,
    /// Optimizer steps completed: training resumes at this step.
    pub iteration: u64,
    /// Steps the optimizer's moments have seen (its bias correction).
    pub adam_steps: u64,
    /// The run's seed (parameters, data order and dropout all derive from it).
    pub seed: u64,
    /// Samples consumed so far.
    pub consumed_samples: u64,
    /// Tensor-parallel size of the run that saved it (informational: loading reshards).
    pub saved_tp: usize,
    /// Data-parallel size of the run that saved it (informational).
    pub saved_dp: usize,
    /// Pipeline-parallel size of the run that saved it (informational: the tensors are whole).
    #[serde(default = "one")]
    pub saved_pp: usize,
    /// The model's architecture, as its config serialises.
    pub model: serde_json::Value,
    /// Free-form facts about the run (training arguments, tokenizer...).
    #[serde(default)]
    pub run: serde_json::Value,
    /// Size and checksum of every tensor file, filled in by [`save`].
    #[serde(default)]
    pub files: BTreeMap<String, FileDigest>,
    /// The loss scale and its trackers, for a run with loss scaling (`--fp16`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grad_scaler: Option<crate::optimizer::GradScaler>,
    /// The checkpoint that holds the parameters this one does not save (a LoRA fine-tune's
    /// frozen base): loads read them there. `None`: this checkpoint holds them all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base: Option<PathBuf>,
    /// SHA-256 of this metadata as written without this field, filled in by [`save`]: an
    /// edited `meta.json` (its iteration, its record of the run) is refused as a changed tensor
    /// file is. Checkpoints written before it existed have none and load unchecked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub meta_sha256: Option<String>,
}

impl CheckpointMeta {
    /// The metadata as `meta.json` holds it, with [`CheckpointMeta::meta_sha256`] set to the
    /// digest of the rest.
    fn sealed_json(&mut self, path: &Path) -> Result<Vec<u8>, CheckpointError> {
        let json = |meta: &CheckpointMeta| {
            serde_json::to_vec_pretty(meta).map_err(|e| CheckpointError::Format {
                path: path.to_path_buf(),
                message: e.to_string(),
            })
        };
        self.meta_sha256 = None;
        self.meta_sha256 = Some(sha256_hex(&json(self)?));
        json(self)
    }

    /// Checks [`CheckpointMeta::meta_sha256`] against the rest of the metadata read from
    /// `path`.
    fn check_seal(&self, path: &Path) -> Result<(), CheckpointError> {
        let Some(expected) = &self.meta_sha256 else {
            return Ok(());
        };
        let mut unsealed = self.clone();
        unsealed.meta_sha256 = None;
        let body = serde_json::to_vec_pretty(&unsealed).map_err(|e| CheckpointError::Format {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        let found = sha256_hex(&body);
        if &found != expected {
            return Err(CheckpointError::Checksum {
                path: path.to_path_buf(),
                expected: expected.clone(),
                found,
            });
        }
        Ok(())
    }
}

/// The SHA-256 of `bytes` in hexadecimal.
fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn one() -> usize {
    1
}

/// Tensors as the bytes of a safetensors file (to send them to another rank).
pub fn tensors_to_bytes(tensors: &BTreeMap<String, Whole>) -> Result<Vec<u8>, CheckpointError> {
    let views = tensors
        .iter()
        .map(|(name, t)| {
            TensorView::new(Dtype::F32, t.shape.clone(), bytemuck::cast_slice(&t.data))
                .map(|v| (name.clone(), v))
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| CheckpointError::Format {
            path: PathBuf::from("(in memory)"),
            message: e.to_string(),
        })?;
    safetensors::serialize(views, None).map_err(|e| CheckpointError::Format {
        path: PathBuf::from("(in memory)"),
        message: e.to_string(),
    })
}

/// Tensors from the bytes [`tensors_to_bytes`] made.
pub fn tensors_from_bytes(bytes: &[u8]) -> Result<BTreeMap<String, Whole>, CheckpointError> {
    let bad = |message: String| CheckpointError::Format {
        path: PathBuf::from("(in memory)"),
        message,
    };
    let st = SafeTensors::deserialize(bytes).map_err(|e| bad(e.to_string()))?;
    let mut out = BTreeMap::new();
    for (name, view) in st.tensors() {
        if view.dtype() != Dtype::F32 {
            return Err(bad(format!("`{name}` is {:?}, expected F32", view.dtype())));
        }
        out.insert(name, whole(view.shape().to_vec(), view.data()));
    }
    Ok(out)
}

/// The directory of iteration `iteration` inside a save directory.
pub fn iteration_dir(save: &Path, iteration: u64) -> PathBuf {
    save.join(format!("iter_{iteration:07}"))
}

/// The iterations saved in `save` (its `iter_N` directories), in order; none when it cannot be
/// read.
pub fn saved_iterations(save: &Path) -> Vec<u64> {
    let mut found: Vec<u64> = fs::read_dir(save)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().is_dir())
        .filter_map(|e| e.file_name().to_str()?.strip_prefix("iter_")?.parse().ok())
        .collect();
    found.sort_unstable();
    found
}

fn sha256_file(path: &Path) -> Result<FileDigest, CheckpointError> {
    let mut file = File::open(path).map_err(io(path))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut bytes = 0u64;
    loop {
        let n = file.read(&mut buf).map_err(io(path))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        bytes += n as u64;
    }
    let sha256 = hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    Ok(FileDigest { bytes, sha256 })
}

fn write_tensors(path: &Path, tensors: &BTreeMap<String, Whole>) -> Result<(), CheckpointError> {
    let views = tensors
        .iter()
        .map(|(name, t)| {
            let view = TensorView::new(Dtype::F32, t.shape.clone(), bytemuck::cast_slice(&t.data))
                .map_err(|e| CheckpointError::Format {
                    path: path.to_path_buf(),
                    message: format!("{name}: {e}"),
                })?;
            Ok((name.clone(), view))
        })
        .collect::<Result<Vec<_>, CheckpointError>>()?;
    let metadata = HashMap::from([("format".to_string(), FORMAT.to_string())]);
    safetensors::serialize_to_file(views, Some(metadata), path).map_err(|e| {
        CheckpointError::Format {
            path: path.to_path_buf(),
            message: e.to_string(),
        }
    })?;
    File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(io(path))
}

/// Writes `content` to `path` through a temporary file, synced, then renamed into place
/// ([`crate::files::write_atomically`]: through a symbolic link, never over a directory or a
/// device).
pub fn write_atomically(path: &Path, content: &[u8]) -> Result<(), CheckpointError> {
    crate::files::write_atomically(path, content).map_err(|(path, e)| io(&path)(e))
}

fn sync_dir(dir: &Path) -> Result<(), CheckpointError> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(io(dir))
}

/// The first non-finite value of `tensors`, as an error naming it.
fn check_finite(save: &Path, tensors: &BTreeMap<String, Whole>) -> Result<(), CheckpointError> {
    for (name, t) in tensors {
        if let Some(index) = t.data.iter().position(|v| !v.is_finite()) {
            return Err(CheckpointError::NotFinite {
                path: save.to_path_buf(),
                name: name.clone(),
                index,
                value: t.data[index],
            });
        }
    }
    Ok(())
}

/// The process id in the name of a save's working directory (`.iter_0000100.tmp-4242`).
fn writer_pid(name: &str, marker: &str) -> Option<u32> {
    name.strip_prefix(".iter_")?
        .split_once(marker)?
        .1
        .parse()
        .ok()
}

/// Whether the process `pid` still runs (on Linux; elsewhere every other process counts as
/// gone). Another live process's save in progress is left alone.
fn is_running(pid: u32) -> bool {
    pid == std::process::id() || Path::new("/proc").join(pid.to_string()).is_dir()
}

/// Removes what saves interrupted by a kill left in the save directory `save`: the working
/// directories of unfinished iterations (`.iter_N.tmp-PID`), and the old copy of an iteration
/// being replaced (`.iter_N.old-PID`), which is moved back into place if the replacement never
/// arrived. Returns the directories removed or restored. Best effort: what cannot be removed
/// stays (a read-only checkpoint still loads).
pub fn remove_interrupted_saves(save: &Path) -> Vec<PathBuf> {
    let Ok(entries) = fs::read_dir(save) else {
        return Vec::new();
    };
    let mut cleaned = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let path = entry.path();
        if let Some(pid) = writer_pid(&name, ".tmp-") {
            if pid != std::process::id() && !is_running(pid) && fs::remove_dir_all(&path).is_ok() {
                cleaned.push(path);
            }
        } else if let Some(pid) = writer_pid(&name, ".old-")
            && pid != std::process::id()
            && !is_running(pid)
        {
            let iteration = name.trim_start_matches('.').split('.').next().unwrap_or("");
            let target = save.join(iteration);
            let done = if target.exists() {
                fs::remove_dir_all(&path).is_ok()
            } else {
                fs::rename(&path, &target).is_ok()
            };
            if done {
                cleaned.push(path);
            }
        }
    }
    cleaned
}

/// The save directory a checkpoint path belongs to: itself when it holds [`LATEST`], the parent
/// of an iteration directory otherwise.
pub fn save_dir_of(path: &Path) -> Option<PathBuf> {
    if path.join(LATEST).is_file() {
        return Some(path.to_path_buf());
    }
    let parent = path.parent()?;
    parent.join(LATEST).is_file().then(|| parent.to_path_buf())
}

/// Saves iteration `meta.iteration` into `save` (created if needed): the model's tensors, the
/// optimizer's if given, `files` (name and contents, e.g. [`TOKENIZER_FILE`]) and the metadata
/// with every file's checksum. Returns the iteration's directory. An existing directory of the
/// same iteration is replaced only once the new one is complete; what interrupted saves left
/// behind is removed first ([`remove_interrupted_saves`]). Tensors holding NaN or infinities
/// are refused before anything is written.
pub fn save(
    save: &Path,
    model: &BTreeMap<String, Whole>,
    optimizer: Option<&BTreeMap<String, Whole>>,
    files: &[(&str, &[u8])],
    meta: CheckpointMeta,
) -> Result<PathBuf, CheckpointError> {
    check_finite(save, model)?;
    if let Some(opt) = optimizer {
        check_finite(save, opt)?;
    }
    let tmp = begin_save(save, meta.iteration)?;
    finish_save(save, &tmp, model, optimizer, files, meta)
}

/// The working directory a save of `iteration` by process `pid` writes into before it is
/// renamed into place.
pub fn working_dir(save: &Path, iteration: u64, pid: u32) -> PathBuf {
    save.join(format!(".iter_{iteration:07}.tmp-{pid}"))
}

/// Starts a save of `iteration` into `save` (created if needed): removes what interrupted saves
/// left and creates this process's empty working directory, which other ranks may write their
/// [`OptimizerShard`]s into ([`write_optimizer_shard`]) before [`finish_save`].
pub fn begin_save(save: &Path, iteration: u64) -> Result<PathBuf, CheckpointError> {
    create_dir(save)?;
    remove_interrupted_saves(save);
    let tmp = working_dir(save, iteration, std::process::id());
    let _ = fs::remove_dir_all(&tmp);
    fs::create_dir(&tmp).map_err(io(&tmp))?;
    Ok(tmp)
}

/// Gives up a save begun by [`begin_save`]: its working directory is removed.
pub fn abandon_save(tmp: &Path) {
    let _ = fs::remove_dir_all(tmp);
}

/// Writes global rank `rank`'s shard of the optimizer state into a save's working directory
/// (synced; [`finish_save`] records its checksum). Values that are not finite are refused.
pub fn write_optimizer_shard(
    tmp: &Path,
    rank: usize,
    shard: &OptimizerShard,
) -> Result<(), CheckpointError> {
    let path = tmp.join(optimizer_shard_file(rank));
    let mut index: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    for (name, piece) in shard {
        let n: u64 = piece.runs.iter().map(|r| r.1).sum();
        for (suffix, values) in &piece.values {
            if values.len() as u64 != n {
                return Err(CheckpointError::Format {
                    path: path.clone(),
                    message: format!(
                        "`{name}.{suffix}` has {} values for runs of {n} elements",
                        values.len()
                    ),
                });
            }
            if let Some(i) = values.iter().position(|v| !v.is_finite()) {
                return Err(CheckpointError::NotFinite {
                    path: tmp.to_path_buf(),
                    name: format!("{name}.{suffix}"),
                    index: i,
                    value: values[i],
                });
            }
        }
        let words: Vec<i64> = piece
            .runs
            .iter()
            .flat_map(|&(start, len)| [start as i64, len as i64])
            .collect();
        index.insert(name.clone(), bytemuck::cast_slice(&words).to_vec());
    }
    let mut views = Vec::new();
    for (name, piece) in shard {
        let runs = piece.runs.len();
        views.push((
            format!("{name}.index"),
            TensorView::new(Dtype::I64, vec![runs, 2], &index[name]),
        ));
        for (suffix, values) in &piece.values {
            views.push((
                format!("{name}.{suffix}"),
                TensorView::new(Dtype::F32, vec![values.len()], bytemuck::cast_slice(values)),
            ));
        }
    }
    let views = views
        .into_iter()
        .map(|(name, view)| {
            view.map(|v| (name.clone(), v))
                .map_err(|e| CheckpointError::Format {
                    path: path.clone(),
                    message: format!("{name}: {e}"),
                })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let metadata = HashMap::from([("format".to_string(), FORMAT.to_string())]);
    safetensors::serialize_to_file(views, Some(metadata), &path).map_err(|e| {
        CheckpointError::Format {
            path: path.clone(),
            message: e.to_string(),
        }
    })?;
    File::open(&path)
        .and_then(|f| f.sync_all())
        .map_err(io(&path))
}

/// Completes a save begun by [`begin_save`] in `tmp`: writes the model's tensors, the whole
/// optimizer's if given, `files` and the metadata with the checksum of every file (the
/// optimizer shards other ranks wrote included), then renames the working directory into
/// place. On failure the working directory is removed.
pub fn finish_save(
    save: &Path,
    tmp: &Path,
    model: &BTreeMap<String, Whole>,
    optimizer: Option<&BTreeMap<String, Whole>>,
    files: &[(&str, &[u8])],
    meta: CheckpointMeta,
) -> Result<PathBuf, CheckpointError> {
    let mut write_model = |path: &Path| {
        check_finite(save, model)?;
        write_tensors(path, model)
    };
    finish_with(save, tmp, &mut write_model, optimizer, files, meta)
}

/// Saves iteration `meta.iteration` into `save` as [`save`] does, its parameters written by
/// `write_model` into the path it is given ([`MODEL_FILE`] of the working directory: a
/// safetensors file of whole, unpadded tensors in F32, BF16 or F16, e.g. streamed from another
/// format without holding the model), with `files` beside them and no optimizer state.
pub fn save_with_model(
    save: &Path,
    write_model: &mut dyn FnMut(&Path) -> Result<(), CheckpointError>,
    files: &[(&str, &[u8])],
    meta: CheckpointMeta,
) -> Result<PathBuf, CheckpointError> {
    let tmp = begin_save(save, meta.iteration)?;
    finish_with(save, &tmp, write_model, None, files, meta)
}

fn finish_with(
    save: &Path,
    tmp: &Path,
    write_model: &mut dyn FnMut(&Path) -> Result<(), CheckpointError>,
    optimizer: Option<&BTreeMap<String, Whole>>,
    files: &[(&str, &[u8])],
    mut meta: CheckpointMeta,
) -> Result<PathBuf, CheckpointError> {
    let target = iteration_dir(save, meta.iteration);
    let result = (|| {
        meta.format = FORMAT.to_string();
        meta.files.clear();
        for entry in fs::read_dir(tmp).map_err(io(tmp))? {
            let name = entry.map_err(io(tmp))?.file_name();
            let name = name.to_string_lossy();
            if is_optimizer_shard(&name) {
                meta.files
                    .insert(name.to_string(), sha256_file(&tmp.join(&*name))?);
            }
        }
        let path = tmp.join(MODEL_FILE);
        write_model(&path)?;
        meta.files
            .insert(MODEL_FILE.to_string(), sha256_file(&path)?);
        if let Some(opt) = optimizer {
            let path = tmp.join(OPTIMIZER_FILE);
            write_tensors(&path, opt)?;
            meta.files
                .insert(OPTIMIZER_FILE.to_string(), sha256_file(&path)?);
        }
        for (name, bytes) in files {
            let path = tmp.join(name);
            // A file may sit in a folder of the checkpoint (`hf/config.json`), never outside it.
            let inside = Path::new(name)
                .components()
                .all(|c| matches!(c, std::path::Component::Normal(_)));
            if !inside {
                return Err(CheckpointError::Format {
                    path,
                    message: "a checkpoint's file must lie inside its directory".into(),
                });
            }
            if let Some(parent) = path.parent() {
                fs::create_dir_all(parent).map_err(io(parent))?;
            }
            write_atomically(&path, bytes)?;
            meta.files.insert(name.to_string(), sha256_file(&path)?);
        }
        let json = meta.sealed_json(&tmp.join(META_FILE))?;
        write_atomically(&tmp.join(META_FILE), &json)?;
        sync_dir(tmp)?;
        if target.exists() {
            let old = save.join(format!(
                ".iter_{:07}.old-{}",
                meta.iteration,
                std::process::id()
            ));
            fs::rename(&target, &old).map_err(io(&target))?;
            fs::rename(tmp, &target).map_err(io(&target))?;
            let _ = fs::remove_dir_all(&old);
        } else {
            fs::rename(tmp, &target).map_err(io(&target))?;
        }
        write_atomically(&save.join(LATEST), meta.iteration.to_string().as_bytes())?;
        sync_dir(save)
    })();
    if result.is_err() {
        abandon_save(tmp);
    }
    result.map(|()| target)
}

/// The iteration directory `path` names: itself if it holds [`META_FILE`], else the one its
/// [`LATEST`] file names.
pub fn resolve(path: &Path) -> Result<PathBuf, CheckpointError> {
    if path.join(META_FILE).is_file() {
        return Ok(path.to_path_buf());
    }
    let latest = path.join(LATEST);
    let text = fs::read_to_string(&latest).map_err(|e| CheckpointError::Io {
        path: path.to_path_buf(),
        message: format!("not a checkpoint: no {META_FILE} and no readable {LATEST} ({e})"),
    })?;
    let iteration: u64 = text.trim().parse().map_err(|_| CheckpointError::Format {
        path: latest.clone(),
        message: format!("`{}` is not an iteration number", text.trim()),
    })?;
    Ok(iteration_dir(path, iteration))
}

/// A checkpoint opened for reading: its metadata and its tensor files, memory-mapped and
/// verified against their checksums.
pub struct Loaded {
    dir: PathBuf,
    meta: CheckpointMeta,
    model: memmap2::Mmap,
    optimizer: Option<memmap2::Mmap>,
    /// The distributed optimizer's shard files, by name.
    shards: Vec<(String, memmap2::Mmap)>,
    /// The checkpoint [`CheckpointMeta::base`] names, opened with this one.
    base: Option<Box<Loaded>>,
}

impl std::fmt::Debug for Loaded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loaded")
            .field("dir", &self.dir)
            .field("iteration", &self.meta.iteration)
            .finish()
    }
}

fn map_file(
    dir: &Path,
    name: &str,
    meta: &CheckpointMeta,
    verify: bool,
) -> Result<memmap2::Mmap, CheckpointError> {
    let path = dir.join(name);
    let Some(expected) = meta.files.get(name) else {
        return Err(CheckpointError::Format {
            path,
            message: format!("{META_FILE} records no checksum for it"),
        });
    };
    if verify {
        verify_file(dir, name, expected)?;
    }
    let file = File::open(&path).map_err(io(&path))?;
    // SAFETY: the file is only read; a concurrent writer would be a user error that the
    // checksum above makes very unlikely to go unnoticed.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io(&path))?;
    SafeTensors::deserialize(&map).map_err(|e| CheckpointError::Format {
        path: path.clone(),
        message: format!("not a valid safetensors file ({e}): truncated or corrupt"),
    })?;
    Ok(map)
}

/// The metadata of the checkpoint `path` names (no tensor file is read).
pub fn read_meta(path: &Path) -> Result<CheckpointMeta, CheckpointError> {
    let dir = resolve(path)?;
    let meta_path = dir.join(META_FILE);
    let text = fs::read(&meta_path).map_err(io(&meta_path))?;
    let meta: CheckpointMeta =
        serde_json::from_slice(&text).map_err(|e| CheckpointError::Format {
            path: meta_path.clone(),
            message: e.to_string(),
        })?;
    if meta.format != FORMAT {
        return Err(CheckpointError::Format {
            path: meta_path,
            message: format!("format `{}`, this build reads `{FORMAT}`", meta.format),
        });
    }
    meta.check_seal(&meta_path)?;
    Ok(meta)
}

/// Opens the checkpoint `path` names (see [`resolve`]), verifying every file's checksum.
pub fn open(path: &Path) -> Result<Loaded, CheckpointError> {
    open_with(path, true)
}

/// Opens a checkpoint without hashing its files (when another rank verifies them).
pub fn open_unverified(path: &Path) -> Result<Loaded, CheckpointError> {
    open_with(path, false)
}

/// Checks a file of the checkpoint against the size and checksum recorded for it.
fn verify_file(dir: &Path, name: &str, expected: &FileDigest) -> Result<(), CheckpointError> {
    let path = dir.join(name);
    let found = sha256_file(&path)?;
    if found != *expected {
        return Err(CheckpointError::Checksum {
            path,
            expected: expected.sha256.clone(),
            found: found.sha256,
        });
    }
    Ok(())
}

fn open_with(path: &Path, verify: bool) -> Result<Loaded, CheckpointError> {
    let dir = resolve(path)?;
    let meta = read_meta(&dir)?;
    if verify {
        for (name, digest) in &meta.files {
            if name != MODEL_FILE && name != OPTIMIZER_FILE && !is_optimizer_shard(name) {
                verify_file(&dir, name, digest)?;
            }
        }
    }
    let model = map_file(&dir, MODEL_FILE, &meta, verify)?;
    let optimizer = if meta.files.contains_key(OPTIMIZER_FILE) {
        Some(map_file(&dir, OPTIMIZER_FILE, &meta, verify)?)
    } else {
        None
    };
    let shards = meta
        .files
        .keys()
        .filter(|name| is_optimizer_shard(name))
        .map(|name| Ok((name.clone(), map_file(&dir, name, &meta, verify)?)))
        .collect::<Result<Vec<_>, CheckpointError>>()?;
    // The checkpoint holding what this one does not save (a LoRA fine-tune's frozen base),
    // opened as this one is.
    let base = match &meta.base {
        Some(base) => Some(Box::new(open_with(base, verify).map_err(|e| {
            CheckpointError::Format {
                path: dir.clone(),
                message: format!("its base {}: {e}", base.display()),
            }
        })?)),
        None => None,
    };
    Ok(Loaded {
        dir,
        meta,
        model,
        optimizer,
        shards,
        base,
    })
}

impl Loaded {
    /// The iteration directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The metadata.
    pub fn meta(&self) -> &CheckpointMeta {
        &self.meta
    }

    /// The path of a file saved beside the tensors (e.g. [`TOKENIZER_FILE`]), if the checkpoint
    /// holds one of that name.
    pub fn file(&self, name: &str) -> Option<PathBuf> {
        self.meta
            .files
            .contains_key(name)
            .then(|| self.dir.join(name))
    }

    /// Whether optimizer state was saved.
    pub fn has_optimizer(&self) -> bool {
        self.optimizer.is_some() || !self.shards.is_empty()
    }

    /// The whole values of a parameter's optimizer state `suffix` (e.g. `exp_avg`), of the
    /// parameter's whole, unpadded `shape`: from the optimizer file, or put together from every
    /// rank's shard, which must cover each element exactly once.
    pub fn optimizer_state(
        &self,
        name: &str,
        suffix: &str,
        shape: &[usize],
    ) -> Result<Whole, CheckpointError> {
        if self.shards.is_empty() {
            let whole = self.optimizer_tensor(&format!("{name}.{suffix}"))?;
            if whole.shape != shape {
                return Err(CheckpointError::Tensor {
                    path: self.dir.join(OPTIMIZER_FILE),
                    message: format!(
                        "`{name}.{suffix}` has shape {:?}, the model needs {shape:?}",
                        whole.shape
                    ),
                });
            }
            return Ok(whole);
        }
        let n: usize = shape.iter().product();
        let mut data = vec![0.0f32; n];
        let mut seen = vec![false; n];
        let mut covered = 0usize;
        for (file, map) in &self.shards {
            let path = self.dir.join(file);
            let st = SafeTensors::deserialize(map).map_err(|e| CheckpointError::Format {
                path: path.clone(),
                message: e.to_string(),
            })?;
            let Ok(index) = st.tensor(&format!("{name}.index")) else {
                continue;
            };
            let bad = |message: String| CheckpointError::Tensor {
                path: path.clone(),
                message,
            };
            let values = st
                .tensor(&format!("{name}.{suffix}"))
                .map_err(|_| bad(format!("`{name}` has no `{suffix}`")))?;
            if index.dtype() != Dtype::I64 || values.dtype() != Dtype::F32 {
                return Err(bad(format!(
                    "`{name}`'s index or `{suffix}` has the wrong dtype"
                )));
            }
            let words: Vec<i64> = index
                .data()
                .chunks_exact(8)
                .map(|w| i64::from_le_bytes(w.try_into().expect("8 bytes")))
                .collect();
            let values = whole(vec![], values.data()).data;
            let mut at = 0usize;
            for run in words.chunks_exact(2) {
                let (start, len) = (run[0] as usize, run[1] as usize);
                let (end, next) = (start.saturating_add(len), at.saturating_add(len));
                if run[0] < 0 || run[1] < 0 || end > n || next > values.len() {
                    return Err(bad(format!(
                        "`{name}`: a run of {len} elements at {start} lies outside its {n} \
                         elements or its {} values",
                        values.len()
                    )));
                }
                for (i, &v) in (start..end).zip(&values[at..next]) {
                    if seen[i] {
                        return Err(bad(format!(
                            "`{name}`: element {i} of its {suffix} is in two shards"
                        )));
                    }
                    seen[i] = true;
                    data[i] = v;
                }
                covered += len;
                at = next;
            }
        }
        if covered != n {
            return Err(CheckpointError::Tensor {
                path: self.dir.clone(),
                message: format!(
                    "the optimizer shards cover {covered} of the {n} elements of `{name}.{suffix}` \
                     ({} shard files): the shards do not cover the buffer, a shard file is \
                     missing",
                    self.shards.len()
                ),
            });
        }
        Ok(Whole {
            shape: shape.to_vec(),
            data,
        })
    }

    /// Tensor `name` of the mapped `file` (its dtype one of `dtypes`), `None` when the file
    /// has none of that name.
    fn find_in<'a>(
        &'a self,
        map: &'a memmap2::Mmap,
        file: &str,
        name: &str,
        dtypes: &[Dtype],
    ) -> Result<Option<Found<'a>>, CheckpointError> {
        let path = self.dir.join(file);
        let st = SafeTensors::deserialize(map).map_err(|e| CheckpointError::Format {
            path: path.clone(),
            message: e.to_string(),
        })?;
        let Ok(view) = st.tensor(name) else {
            return Ok(None);
        };
        if !dtypes.contains(&view.dtype()) {
            return Err(CheckpointError::Tensor {
                path,
                message: format!("`{name}` is {:?}, expected one of {dtypes:?}", view.dtype()),
            });
        }
        Ok(Some((view.dtype(), view.shape().to_vec(), view.data())))
    }

    /// [`Loaded::find_in`], a missing tensor an error naming it.
    fn tensor_in<'a>(
        &'a self,
        map: &'a memmap2::Mmap,
        file: &str,
        name: &str,
        dtypes: &[Dtype],
    ) -> Result<Found<'a>, CheckpointError> {
        self.find_in(map, file, name, dtypes)?
            .ok_or_else(|| CheckpointError::Tensor {
                path: self.dir.join(file),
                message: format!("no tensor `{name}`"),
            })
    }

    /// A parameter's stored values, not yet read: a rank copies out only its part of them
    /// ([`Stored::extend_from`]), so the pages of the mapped file it touches are its own.
    pub fn model_stored(&self, name: &str) -> Result<Stored<'_>, CheckpointError> {
        let dtypes = [Dtype::F32, Dtype::BF16, Dtype::F16];
        let (dtype, shape, bytes) = self.tensor_in(&self.model, MODEL_FILE, name, &dtypes)?;
        Ok(Stored {
            dtype,
            shape,
            bytes,
        })
    }

    /// A parameter's whole values, as f32 (an imported model's F16 or BF16 widened exactly).
    pub fn model_tensor(&self, name: &str) -> Result<Whole, CheckpointError> {
        let dtypes = [Dtype::F32, Dtype::BF16, Dtype::F16];
        let (dtype, shape, bytes) = self.tensor_in(&self.model, MODEL_FILE, name, &dtypes)?;
        Ok(whole_of(dtype, shape, bytes))
    }

    /// An optimizer tensor's whole values (e.g. `blocks.0.mlp.fc1.weight.exp_avg`).
    pub fn optimizer_tensor(&self, name: &str) -> Result<Whole, CheckpointError> {
        let Some(map) = &self.optimizer else {
            return Err(CheckpointError::Tensor {
                path: self.dir.clone(),
                message: "no optimizer state was saved".into(),
            });
        };
        let (_, shape, bytes) = self.tensor_in(map, OPTIMIZER_FILE, name, &[Dtype::F32])?;
        Ok(whole(shape, bytes))
    }

    /// Whether the checkpoint holds parameter `name`.
    pub fn has_model_tensor(&self, name: &str) -> bool {
        SafeTensors::deserialize(&self.model).is_ok_and(|st| st.tensor(name).is_ok())
    }

    /// The checkpoint holding what this one does not save ([`CheckpointMeta::base`]), opened
    /// and verified with it.
    pub fn base(&self) -> Option<&Loaded> {
        self.base.as_deref()
    }

    /// Parameter `name`'s stored values: this checkpoint's, else its base's; `None` when
    /// neither holds it.
    pub fn find_stored(&self, name: &str) -> Result<Option<Stored<'_>>, CheckpointError> {
        let dtypes = [Dtype::F32, Dtype::BF16, Dtype::F16];
        if let Some((dtype, shape, bytes)) = self.find_in(&self.model, MODEL_FILE, name, &dtypes)? {
            return Ok(Some(Stored {
                dtype,
                shape,
                bytes,
            }));
        }
        match &self.base {
            Some(base) => base.find_stored(name),
            None => Ok(None),
        }
    }

    /// Names of every parameter in the checkpoint.
    pub fn model_names(&self) -> Result<Vec<String>, CheckpointError> {
        let st = SafeTensors::deserialize(&self.model).map_err(|e| CheckpointError::Format {
            path: self.dir.join(MODEL_FILE),
            message: e.to_string(),
        })?;
        let mut names: Vec<String> = st.names().into_iter().map(str::to_string).collect();
        names.sort();
        Ok(names)
    }
}
