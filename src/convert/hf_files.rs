//! A Hugging Face model directory's files: its weights (`model.safetensors`, or the shards
//! `model.safetensors.index.json` names) opened for streaming, the files an import carries
//! into the checkpoint's `hf/` folder and an export writes back unchanged (the original
//! `config.json`, `generation_config.json`, the tokenizer's files), and an export's directory,
//! written aside and renamed into place once whole.

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use megatron_core::checkpoint::{self, Files};
use serde_json::Value;

use super::stream::{SafetensorsFile, TensorRef};

/// The checkpoint's folder of files carried from the Hugging Face directory.
pub const CARRIED_DIR: &str = "hf";

/// The files an import carries (besides `tokenizer.json`, which the checkpoint holds for
/// training): the config as it was, the generation settings, and the tokenizer's other files
/// (its config with the chat template, special tokens, SentencePiece or BPE vocabularies).
pub const CARRIED: [&str; 12] = [
    "config.json",
    "generation_config.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
];

/// The files of [`CARRIED`] that `hf_dir` has, named for the checkpoint (`hf/config.json`).
pub fn carried_from(hf_dir: &Path) -> Result<Files> {
    let mut files = Vec::new();
    for name in CARRIED {
        let path = hf_dir.join(name);
        if path.is_file() {
            let bytes = fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
            files.push((format!("{CARRIED_DIR}/{name}"), bytes));
        }
    }
    Ok(files)
}

/// The carried files of the checkpoint `ckpt` (by their names in it, `hf/config.json`): what
/// a save of a run loaded from it carries on.
pub fn carried_in(ckpt: &Path) -> Result<Files> {
    let dir = checkpoint::resolve(ckpt)?;
    let meta = checkpoint::read_meta(&dir)?;
    let prefix = format!("{CARRIED_DIR}/");
    meta.files
        .keys()
        .filter(|name| name.starts_with(&prefix))
        .map(|name| {
            let path = dir.join(name);
            let bytes = fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
            Ok((name.clone(), bytes))
        })
        .collect()
}

/// The original `config.json` a checkpoint carries, if it carries one.
pub fn carried_config(files: &Files) -> Result<Option<Value>> {
    let name = format!("{CARRIED_DIR}/config.json");
    files
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, bytes)| {
            serde_json::from_slice(bytes).context("the carried Hugging Face config.json")
        })
        .transpose()
}

/// A Hugging Face directory's weights, opened for streaming: every tensor by the name the
/// model knows it by, each read from the shard the index gives it.
#[derive(Debug)]
pub struct HfWeights {
    dir: PathBuf,
    files: Vec<SafetensorsFile>,
    /// Tensor name → (file, name in that file).
    by_name: BTreeMap<String, (usize, String)>,
    taken: RefCell<BTreeSet<String>>,
}

impl HfWeights {
    /// Opens `dir`'s `model.safetensors`, or the shards its index names. `rename` gives each
    /// stored name the name the model reads it by, or `None` for a tensor that is no weight
    /// (a buffer older files saved); two stored tensors of one name are refused.
    pub fn open(dir: &Path, rename: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let index = dir.join("model.safetensors.index.json");
        let mut files = Vec::new();
        let mut by_name = BTreeMap::new();
        let add = |by_name: &mut BTreeMap<String, (usize, String)>,
                   file: usize,
                   stored: &str,
                   path: &Path|
         -> Result<()> {
            let Some(name) = rename(stored) else {
                return Ok(());
            };
            if let Some((_, other)) = by_name.insert(name.clone(), (file, stored.to_string())) {
                bail!(
                    "{}: `{stored}` and `{other}` are both `{name}`: which one is the model's is \
                     not known",
                    path.display()
                );
            }
            Ok(())
        };
        if !index.is_file() {
            let path = dir.join("model.safetensors");
            if !path.exists() && dir.join("pytorch_model.bin").exists() {
                bail!(
                    "{}: only safetensors weights are read; save the model with \
                     safe_serialization=True",
                    dir.display()
                );
            }
            let file = SafetensorsFile::open(&path)?;
            let names: Vec<String> = file.tensors().keys().cloned().collect();
            files.push(file);
            for stored in &names {
                add(&mut by_name, 0, stored, &path)?;
            }
            return Ok(HfWeights {
                dir: dir.to_path_buf(),
                files,
                by_name,
                taken: RefCell::default(),
            });
        }
        let text =
            fs::read_to_string(&index).with_context(|| format!("reading {}", index.display()))?;
        let map: Value = serde_json::from_str(&text)
            .with_context(|| format!("{}: not JSON", index.display()))?;
        let Some(weight_map) = map["weight_map"].as_object() else {
            bail!("{}: no `weight_map`", index.display());
        };
        let mut shards: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for (name, shard) in weight_map {
            let Some(shard) = shard.as_str() else {
                bail!(
                    "{}: `{name}`'s shard is {shard}, not a file name",
                    index.display()
                );
            };
            if shard.contains('/') || shard.contains('\\') || shard.contains("..") {
                bail!(
                    "{}: shard `{shard}` is not a file of the directory",
                    index.display()
                );
            }
            shards.entry(shard).or_default().push(name);
        }
        for (shard, names) in shards {
            let path = dir.join(shard);
            if !path.exists() {
                bail!(
                    "{}: shard `{shard}` (holding `{}` and {} more) is missing from {}",
                    index.display(),
                    names[0],
                    names.len() - 1,
                    dir.display()
                );
            }
            let file = SafetensorsFile::open(&path)?;
            for name in names {
                if file.tensor(name).is_none() {
                    bail!(
                        "{}: `{name}` is not in {shard}, where the index puts it",
                        index.display()
                    );
                }
                add(&mut by_name, files.len(), name, &path)?;
            }
            files.push(file);
        }
        Ok(HfWeights {
            dir: dir.to_path_buf(),
            files,
            by_name,
            taken: RefCell::default(),
        })
    }

    /// Tensor `name`, if there is one (not marked taken).
    pub fn get(&self, name: &str) -> Option<TensorRef<'_>> {
        let (file, stored) = self.by_name.get(name)?;
        self.files[*file].tensor(stored)
    }

    /// Tensor `name` of shape `shape`, marked taken; a missing tensor or another shape is
    /// refused naming it and the config's shape.
    pub fn take(&self, name: &str, shape: &[usize]) -> Result<TensorRef<'_>> {
        let Some(t) = self.get(name) else {
            bail!("{}: no tensor `{name}`", self.dir.display());
        };
        if t.shape() != shape {
            bail!(
                "{}: `{name}` has shape {:?}, the config implies {shape:?}",
                t.path().display(),
                t.shape()
            );
        }
        super::stream::float_dtype(t.dtype())
            .with_context(|| format!("{}: `{name}`", t.path().display()))?;
        self.taken.borrow_mut().insert(name.to_string());
        Ok(t)
    }

    /// Refuses a tensor nobody took: one the model does not have.
    pub fn refuse_untaken(&self) -> Result<()> {
        let taken = self.taken.borrow();
        match self.by_name.keys().find(|n| !taken.contains(*n)) {
            Some(extra) => bail!("{}: unexpected tensor `{extra}`", self.dir.display()),
            None => Ok(()),
        }
    }
}

/// An export's directory, written under a temporary name beside its target and renamed into
/// place by [`Staging::commit`]; dropped uncommitted, it is removed: a failed export leaves
/// nothing behind.
#[derive(Debug)]
pub struct Staging {
    tmp: PathBuf,
    target: PathBuf,
    committed: bool,
}

impl Staging {
    /// Starts writing `target`, which must be new or an empty directory.
    pub fn new(target: &Path) -> Result<Self> {
        super::hf_gpt2::refuse_existing(target)?;
        let name = target
            .file_name()
            .with_context(|| format!("{}: not a directory name", target.display()))?;
        let parent = match target.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        fs::create_dir_all(&parent).with_context(|| format!("creating {}", parent.display()))?;
        let mut tmp_name = std::ffi::OsString::from(".");
        tmp_name.push(name);
        tmp_name.push(format!(".tmp-{}", std::process::id()));
        let tmp = parent.join(tmp_name);
        let _ = fs::remove_dir_all(&tmp);
        fs::create_dir(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
        Ok(Staging {
            tmp,
            target: target.to_path_buf(),
            committed: false,
        })
    }

    /// The directory to write into.
    pub fn dir(&self) -> &Path {
        &self.tmp
    }

    /// Writes `name` in it.
    pub fn write(&self, name: &str, bytes: &[u8]) -> Result<()> {
        let path = self.tmp.join(name);
        fs::write(&path, bytes).with_context(|| format!("writing {}", path.display()))
    }

    /// Moves the finished directory into place.
    pub fn commit(mut self) -> Result<()> {
        if self.target.is_dir() {
            fs::remove_dir(&self.target)
                .with_context(|| format!("replacing the empty {}", self.target.display()))?;
        }
        fs::rename(&self.tmp, &self.target)
            .with_context(|| format!("moving the export into {}", self.target.display()))?;
        self.committed = true;
        if let Some(parent) = self.target.parent()
            && let Ok(d) = fs::File::open(if parent.as_os_str().is_empty() {
                Path::new(".")
            } else {
                parent
            })
        {
            let _ = d.sync_all();
        }
        Ok(())
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if !self.committed {
            let _ = fs::remove_dir_all(&self.tmp);
        }
    }
}
