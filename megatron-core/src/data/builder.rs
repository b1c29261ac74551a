//! Writes an indexed dataset byte for byte as Megatron-LM's `IndexedDatasetBuilder` does, to
//! temporary files renamed into place by [`IndexedDatasetBuilder::finish`].

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use super::dtype::DType;
use super::error::{DataError, Result, data_invalid};
use super::indexed::{INDEX_MAGIC, INDEX_VERSION, bin_path, idx_path, with_suffix};

/// Writes `PREFIX.bin` and `PREFIX.idx`.
///
/// Tokens go to `PREFIX.bin.<pid>.tmp` as they come; the index is kept in memory (12 bytes a
/// sequence, 8 a document) and written by [`finish`](Self::finish), which then renames both files
/// into place. Dropping an unfinished builder (an error on the way) removes the temporary files,
/// so a failed run leaves neither partial files nor a damaged previous dataset.
pub struct IndexedDatasetBuilder {
    prefix: PathBuf,
    dtype: DType,
    bin_tmp: PathBuf,
    idx_tmp: PathBuf,
    bin: Option<BufWriter<File>>,
    sequence_lengths: Vec<i32>,
    document_indices: Vec<i64>,
    bin_bytes: u64,
    scratch: Vec<u8>,
}

impl IndexedDatasetBuilder {
    /// Starts a dataset of `dtype` tokens at `prefix`.
    pub fn create(prefix: impl AsRef<Path>, dtype: DType) -> Result<Self> {
        let prefix = prefix.as_ref().to_path_buf();
        if !dtype.is_integer() {
            return data_invalid!("cannot write token ids as {dtype}");
        }
        for path in [bin_path(&prefix), idx_path(&prefix)] {
            crate::files::output_path(&path).map_err(|e| DataError::io(&path, "write", e))?;
        }
        let pid = std::process::id();
        let bin_tmp = with_suffix(&prefix, &format!(".bin.{pid}.tmp"));
        let idx_tmp = with_suffix(&prefix, &format!(".idx.{pid}.tmp"));
        let file = File::create(&bin_tmp).map_err(|e| DataError::io(&bin_tmp, "create", e))?;
        Ok(IndexedDatasetBuilder {
            prefix,
            dtype,
            bin_tmp,
            idx_tmp,
            bin: Some(BufWriter::with_capacity(1 << 20, file)),
            sequence_lengths: Vec::new(),
            document_indices: vec![0],
            bin_bytes: 0,
            scratch: Vec::new(),
        })
    }

    /// The token type being written.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Sequences written so far.
    pub fn sequences(&self) -> usize {
        self.sequence_lengths.len()
    }

    /// Documents ended so far.
    pub fn documents(&self) -> usize {
        self.document_indices.len() - 1
    }

    /// Tokens written so far.
    pub fn tokens(&self) -> u64 {
        self.bin_bytes / self.dtype.size() as u64
    }

    /// Appends one sequence (Megatron-LM's `add_item`); [`end_document`](Self::end_document)
    /// closes the document.
    pub fn add_sequence(&mut self, tokens: &[u32]) -> Result<()> {
        let len = i32::try_from(tokens.len()).map_err(|_| {
            DataError::Invalid(format!(
                "a sequence of {} tokens does not fit the format's int32 lengths",
                tokens.len()
            ))
        })?;
        let (_, max) = self.dtype.range();
        self.scratch.clear();
        self.scratch.reserve(tokens.len() * self.dtype.size());
        for &t in tokens {
            if i64::from(t) > max {
                return data_invalid!(
                    "token id {t} does not fit the dataset's {} tokens (max {max})",
                    self.dtype
                );
            }
            self.dtype.encode(i64::from(t), &mut self.scratch);
        }
        let bin = self
            .bin
            .as_mut()
            .expect("the .bin writer is open until finish");
        bin.write_all(&self.scratch)
            .map_err(|e| DataError::io(&self.bin_tmp, "write", e))?;
        self.bin_bytes += self.scratch.len() as u64;
        self.sequence_lengths.push(len);
        Ok(())
    }

    /// Closes the current document (Megatron-LM's `end_document`): the sequences added since the
    /// last one form it. A document may hold no sequence.
    pub fn end_document(&mut self) {
        self.document_indices
            .push(self.sequence_lengths.len() as i64);
    }

    /// Appends a document of `tokens` split into sequences of `lengths` (Megatron-LM's
    /// `add_document`, as `preprocess_data.py` calls it: one sequence per sentence, or one for the
    /// whole document; no sequences for an empty one).
    pub fn add_document(&mut self, tokens: &[u32], lengths: &[usize]) -> Result<()> {
        let total: usize = lengths.iter().sum();
        if total != tokens.len() {
            return data_invalid!(
                "document of {} tokens given sequence lengths adding up to {total}",
                tokens.len()
            );
        }
        let mut at = 0;
        for &n in lengths {
            self.add_sequence(&tokens[at..at + n])?;
            at += n;
        }
        self.end_document();
        Ok(())
    }

    /// Writes the index and renames `PREFIX.bin` and `PREFIX.idx` into place. Returns the paths.
    pub fn finish(mut self) -> Result<(PathBuf, PathBuf)> {
        let bin = self
            .bin
            .take()
            .expect("the .bin writer is open until finish");
        let file = bin
            .into_inner()
            .map_err(|e| DataError::io(&self.bin_tmp, "write", e.into_error()))?;
        file.sync_all()
            .map_err(|e| DataError::io(&self.bin_tmp, "sync", e))?;
        drop(file);

        let idx = encode_index(self.dtype, &self.sequence_lengths, &self.document_indices);
        let mut file =
            File::create(&self.idx_tmp).map_err(|e| DataError::io(&self.idx_tmp, "create", e))?;
        file.write_all(&idx)
            .and_then(|()| file.sync_all())
            .map_err(|e| DataError::io(&self.idx_tmp, "write", e))?;
        drop(file);

        let mut targets = [bin_path(&self.prefix), idx_path(&self.prefix)];
        for path in &mut targets {
            let target = crate::files::output_path(path)
                .map_err(|e| DataError::io(path, "rename into place", e))?;
            *path = target;
        }
        let [bin_path, idx_path] = targets;
        std::fs::rename(&self.bin_tmp, &bin_path)
            .map_err(|e| DataError::io(&bin_path, "rename into place", e))?;
        if let Err(e) = std::fs::rename(&self.idx_tmp, &idx_path) {
            // Never leave a new .bin beside an index that does not describe it.
            let _ = std::fs::remove_file(&bin_path);
            return Err(DataError::io(&idx_path, "rename into place", e));
        }
        // Both renamed: nothing for Drop to clean up.
        self.bin_tmp = PathBuf::new();
        self.idx_tmp = PathBuf::new();
        Ok((bin_path, idx_path))
    }
}

impl Drop for IndexedDatasetBuilder {
    fn drop(&mut self) {
        self.bin.take();
        for p in [&self.bin_tmp, &self.idx_tmp] {
            if !p.as_os_str().is_empty() {
                let _ = std::fs::remove_file(p);
            }
        }
    }
}

/// The bytes of an `.idx` file: header, lengths, byte offsets (contiguous, in order) and
/// document index.
pub fn encode_index(dtype: DType, sequence_lengths: &[i32], document_indices: &[i64]) -> Vec<u8> {
    let s = sequence_lengths.len();
    let mut out = Vec::with_capacity(34 + 12 * s + 8 * document_indices.len());
    out.extend_from_slice(INDEX_MAGIC);
    out.extend_from_slice(&INDEX_VERSION.to_le_bytes());
    out.push(dtype.code());
    out.extend_from_slice(&(s as u64).to_le_bytes());
    out.extend_from_slice(&(document_indices.len() as u64).to_le_bytes());
    for &l in sequence_lengths {
        out.extend_from_slice(&l.to_le_bytes());
    }
    let size = dtype.size() as i64;
    let mut pointer = 0i64;
    for &l in sequence_lengths {
        out.extend_from_slice(&pointer.to_le_bytes());
        pointer += i64::from(l) * size;
    }
    for &d in document_indices {
        out.extend_from_slice(&d.to_le_bytes());
    }
    out
}
