//! Megatron-LM's indexed dataset (`PREFIX.idx` + `PREFIX.bin`), read through memory maps.
//!
//! The `.idx` file, all little-endian (Megatron-LM `indexed_dataset._IndexWriter`):
//!
//! | bytes | what |
//! | --- | --- |
//! | 9 | the magic `MMIDIDX\x00\x00` |
//! | 8 | the version, `u64` = 1 |
//! | 1 | the token type's code ([`DType::code`]) |
//! | 8 | the sequence count `S`, `u64` |
//! | 8 | the document-index length `D`, `u64` (the number of documents + 1) |
//! | 4·S | every sequence's length in tokens, `i32` |
//! | 8·S | every sequence's byte offset in `.bin`, `i64` |
//! | 8·D | the document index, `i64`: document `d` is sequences `idx[d]..idx[d+1]`; `idx[0]` = 0 |
//! | S | optional (multimodal datasets only): every sequence's mode, `i8` |
//!
//! The `.bin` file is the token ids of every sequence, one after the other, in the header's type.
//! Nothing is read into memory up front: arrays are decoded from the maps on access.

use std::fmt;
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::dtype::DType;
use super::error::{DataError, Result, data_invalid};

/// The magic bytes that open every `.idx` file.
pub const INDEX_MAGIC: &[u8; 9] = b"MMIDIDX\x00\x00";
/// The only index version Megatron-LM writes.
pub const INDEX_VERSION: u64 = 1;
/// Bytes before the sequence lengths: magic, version, dtype code and the two counts.
pub const INDEX_HEADER_LEN: usize = 9 + 8 + 1 + 8 + 8;

/// `PREFIX.idx`.
pub fn idx_path(prefix: impl AsRef<Path>) -> PathBuf {
    with_suffix(prefix.as_ref(), ".idx")
}

/// `PREFIX.bin`.
pub fn bin_path(prefix: impl AsRef<Path>) -> PathBuf {
    with_suffix(prefix.as_ref(), ".bin")
}

pub(crate) fn with_suffix(prefix: &Path, suffix: &str) -> PathBuf {
    let mut s = prefix.as_os_str().to_owned();
    s.push(suffix);
    PathBuf::from(s)
}

/// A read-only file: a memory map, or nothing for an empty file (which cannot be mapped).
struct MappedFile {
    map: Option<Mmap>,
}

impl MappedFile {
    fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(|e| DataError::io(path, "open", e))?;
        let len = file
            .metadata()
            .map_err(|e| DataError::io(path, "stat", e))?
            .len();
        if len == 0 {
            return Ok(MappedFile { map: None });
        }
        // SAFETY: the map is read-only and private to this process. Like every reader of
        // memory-mapped data (NumPy's memmap in Megatron-LM included), we rely on the files not
        // being truncated or rewritten while they are open; megatron-rs itself only ever replaces
        // dataset files by renaming new ones into place, which leaves open maps intact.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| DataError::io(path, "map", e))?;
        Ok(MappedFile { map: Some(map) })
    }

    fn bytes(&self) -> &[u8] {
        self.map.as_deref().unwrap_or(&[])
    }
}

/// An indexed dataset on disk, mapped into memory: sequences of token ids grouped into documents.
pub struct IndexedDataset {
    prefix: PathBuf,
    idx_path: PathBuf,
    bin_path: PathBuf,
    idx: MappedFile,
    bin: MappedFile,
    dtype: DType,
    sequence_count: usize,
    /// Entries of the document index (documents + 1).
    document_entries: usize,
    lengths_at: usize,
    pointers_at: usize,
    documents_at: usize,
}

impl fmt::Debug for IndexedDataset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IndexedDataset")
            .field("prefix", &self.prefix)
            .field("dtype", &self.dtype)
            .field("sequences", &self.sequence_count)
            .field("documents", &self.documents())
            .finish()
    }
}

fn u64_at(bytes: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"))
}

fn escape(bytes: &[u8]) -> String {
    bytes
        .iter()
        .flat_map(|&b| std::ascii::escape_default(b))
        .map(char::from)
        .collect()
}

impl IndexedDataset {
    /// Opens `PREFIX.idx` and `PREFIX.bin` and checks what can be checked without reading every
    /// entry: the header, that the index arrays fit in the `.idx` file, that the document index
    /// starts at 0 and ends at the sequence count, and that the last sequence ends within `.bin`.
    /// [`IndexedDataset::validate`] checks every entry.
    pub fn open(prefix: impl AsRef<Path>) -> Result<IndexedDataset> {
        let prefix = prefix.as_ref().to_path_buf();
        let idx_path = idx_path(&prefix);
        let bin_path = bin_path(&prefix);
        let idx = MappedFile::open(&idx_path)?;
        let bin = MappedFile::open(&bin_path)?;
        let idx_for_errors = idx_path.clone();
        let bad = move |message: String| Err(DataError::format(&idx_for_errors, message));
        let b = idx.bytes();

        if b.len() < INDEX_MAGIC.len() || &b[..INDEX_MAGIC.len()] != INDEX_MAGIC {
            let found = &b[..b.len().min(INDEX_MAGIC.len())];
            return bad(format!(
                "not a Megatron indexed-dataset index: wrong magic \"{}\" (expected \"{}\")",
                escape(found),
                escape(INDEX_MAGIC)
            ));
        }
        if b.len() < INDEX_HEADER_LEN {
            return bad(format!(
                "truncated header: {} bytes, the header alone is {INDEX_HEADER_LEN}",
                b.len()
            ));
        }
        let version = u64_at(b, 9);
        if version != INDEX_VERSION {
            return bad(format!(
                "unsupported index version {version} (megatron-rs reads version {INDEX_VERSION})"
            ));
        }
        let code = b[17];
        let Some(dtype) = DType::from_code(code) else {
            return bad(format!(
                "bad dtype code {code} (Megatron's codes are 1 uint8, 2 int8, 3 int16, 4 int32, \
                 5 int64, 6 float64, 7 float32, 8 uint16)"
            ));
        };
        if !dtype.is_integer() {
            return bad(format!(
                "dtype code {code} ({dtype}) cannot hold token ids; megatron-rs reads integer \
                 token types"
            ));
        }
        let sequence_count = u64_at(b, 18);
        let document_entries = u64_at(b, 26);
        let needed = sequence_count
            .checked_mul(4 + 8)
            .and_then(|n| {
                document_entries
                    .checked_mul(8)
                    .and_then(|d| n.checked_add(d))
            })
            .and_then(|n| n.checked_add(INDEX_HEADER_LEN as u64));
        let Some(needed) = needed.filter(|&n| n <= b.len() as u64) else {
            return bad(format!(
                "index arrays run past the end of the file: {sequence_count} sequences and \
                 {document_entries} document-index entries need {} bytes, the file has {}",
                needed.map_or("more than 2^64".to_string(), |n| n.to_string()),
                b.len()
            ));
        };
        // Both counts fit in usize: their arrays are inside a mapped file.
        let sequence_count = sequence_count as usize;
        let document_entries = document_entries as usize;
        let lengths_at = INDEX_HEADER_LEN;
        let pointers_at = lengths_at + 4 * sequence_count;
        let documents_at = pointers_at + 8 * sequence_count;
        let trailing = b.len() - needed as usize;
        if trailing != 0 {
            if trailing == sequence_count {
                let modes = &b[needed as usize..];
                if let Some(i) = modes.iter().position(|&m| m != 0) {
                    return bad(format!(
                        "holds per-sequence modes (a multimodal dataset): sequence {i} has mode \
                         {}; megatron-rs reads text datasets only (every mode 0)",
                        modes[i] as i8
                    ));
                }
            } else {
                return bad(format!(
                    "{trailing} unexpected bytes after the document index (the arrays of \
                     {sequence_count} sequences and {document_entries} document-index entries \
                     end at byte {needed})"
                ));
            }
        }
        let ds = IndexedDataset {
            prefix,
            idx_path,
            bin_path,
            idx,
            bin,
            dtype,
            sequence_count,
            document_entries,
            lengths_at,
            pointers_at,
            documents_at,
        };
        if document_entries == 0 {
            return bad("empty document index (it holds at least the leading 0)".into());
        }
        let first = ds.raw_document_entry(0);
        let last = ds.raw_document_entry(document_entries - 1);
        if first != 0 || last != sequence_count as i64 {
            return bad(format!(
                "document index runs from {first} to {last}; it must run from 0 to the sequence \
                 count {sequence_count}"
            ));
        }
        if sequence_count > 0 {
            ds.sequence_bytes(sequence_count - 1)?;
        }
        Ok(ds)
    }

    /// Checks every entry: lengths non-negative, every sequence inside `.bin`, the document
    /// index non-decreasing. Returns the number of tokens.
    pub fn validate(&self) -> Result<u64> {
        let mut tokens = 0u64;
        for i in 0..self.sequence_count {
            tokens += self.sequence_bytes(i)?.len() as u64 / self.dtype.size() as u64;
        }
        let mut prev = 0i64;
        for d in 0..self.document_entries {
            let e = self.raw_document_entry(d);
            if e < prev || e > self.sequence_count as i64 {
                return Err(DataError::format(
                    &self.idx_path,
                    format!(
                        "document index entry {d} is {e}, after {prev}; entries must be \
                         non-decreasing sequence indices up to {}",
                        self.sequence_count
                    ),
                ));
            }
            prev = e;
        }
        Ok(tokens)
    }

    /// The path prefix the dataset was opened with.
    pub fn prefix(&self) -> &Path {
        &self.prefix
    }

    /// `PREFIX.idx`.
    pub fn idx_path(&self) -> &Path {
        &self.idx_path
    }

    /// `PREFIX.bin`.
    pub fn bin_path(&self) -> &Path {
        &self.bin_path
    }

    /// The type of the token ids in `.bin`.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The number of sequences (Megatron-LM's `len(IndexedDataset)`). For GPT data prepared
    /// without sentence splitting, every document is one sequence.
    pub fn len(&self) -> usize {
        self.sequence_count
    }

    /// Whether there are no sequences.
    pub fn is_empty(&self) -> bool {
        self.sequence_count == 0
    }

    /// The number of documents (the document index's length minus its leading 0).
    pub fn documents(&self) -> usize {
        self.document_entries - 1
    }

    /// Size of `.bin` in bytes.
    pub fn bin_len(&self) -> u64 {
        self.bin.bytes().len() as u64
    }

    /// The sum of every sequence's length (reads the whole length array).
    pub fn num_tokens(&self) -> u64 {
        (0..self.sequence_count)
            .map(|i| self.raw_length(i).max(0) as u64)
            .sum()
    }

    fn raw_length(&self, i: usize) -> i32 {
        let at = self.lengths_at + 4 * i;
        i32::from_le_bytes(self.idx.bytes()[at..at + 4].try_into().expect("4 bytes"))
    }

    fn raw_pointer(&self, i: usize) -> i64 {
        let at = self.pointers_at + 8 * i;
        u64_at(self.idx.bytes(), at) as i64
    }

    fn raw_document_entry(&self, d: usize) -> i64 {
        u64_at(self.idx.bytes(), self.documents_at + 8 * d) as i64
    }

    fn check_sequence(&self, i: usize) -> Result<()> {
        if i >= self.sequence_count {
            return data_invalid!(
                "sequence {i} out of range: {} has {} sequences",
                self.prefix.display(),
                self.sequence_count
            );
        }
        Ok(())
    }

    /// The length in tokens of sequence `i`.
    pub fn sequence_length(&self, i: usize) -> Result<usize> {
        self.check_sequence(i)?;
        let len = self.raw_length(i);
        usize::try_from(len).map_err(|_| {
            DataError::format(
                &self.idx_path,
                format!("sequence {i} has a negative length {len}"),
            )
        })
    }

    /// The byte offset of sequence `i` in `.bin`.
    pub fn sequence_pointer(&self, i: usize) -> Result<u64> {
        self.check_sequence(i)?;
        let p = self.raw_pointer(i);
        u64::try_from(p).map_err(|_| {
            DataError::format(
                &self.idx_path,
                format!("sequence {i} has a negative byte offset {p}"),
            )
        })
    }

    /// The sequences of document `d`.
    pub fn document_sequences(&self, d: usize) -> Result<Range<usize>> {
        if d >= self.documents() {
            return data_invalid!(
                "document {d} out of range: {} has {} documents",
                self.prefix.display(),
                self.documents()
            );
        }
        let (a, b) = (self.raw_document_entry(d), self.raw_document_entry(d + 1));
        if a < 0 || b < a || b > self.sequence_count as i64 {
            return Err(DataError::format(
                &self.idx_path,
                format!(
                    "document {d} spans sequences {a}..{b}, outside 0..{}",
                    self.sequence_count
                ),
            ));
        }
        Ok(a as usize..b as usize)
    }

    fn sequence_bytes(&self, i: usize) -> Result<&[u8]> {
        let len = self.sequence_length(i)?;
        let ptr = self.sequence_pointer(i)?;
        let bin = self.bin.bytes();
        let size = self.dtype.size() as u64;
        let end = (len as u64)
            .checked_mul(size)
            .and_then(|n| n.checked_add(ptr));
        match end {
            Some(end) if end <= bin.len() as u64 => Ok(&bin[ptr as usize..end as usize]),
            _ => Err(DataError::format(
                &self.bin_path,
                format!(
                    "truncated or mismatched with its index: sequence {i} ({len} {} tokens at \
                     byte {ptr}) ends at byte {}, past the end of the file ({} bytes)",
                    self.dtype,
                    end.map_or("beyond 2^64".to_string(), |e| e.to_string()),
                    bin.len()
                ),
            )),
        }
    }

    /// The tokens of sequence `i`, a view into the map.
    pub fn sequence(&self, i: usize) -> Result<Tokens<'_>> {
        Ok(Tokens {
            bytes: self.sequence_bytes(i)?,
            dtype: self.dtype,
        })
    }

    /// `length` tokens of sequence `i` from token `offset` on (Megatron-LM's
    /// `IndexedDataset.get`); `None` reads to the end of the sequence.
    pub fn get(&self, i: usize, offset: usize, length: Option<usize>) -> Result<Tokens<'_>> {
        let all = self.sequence(i)?;
        let n = all.len();
        let length = length.unwrap_or(n.saturating_sub(offset));
        if offset.checked_add(length).is_none_or(|end| end > n) {
            return data_invalid!(
                "tokens {offset}..{} of sequence {i} out of range: it has {n} tokens",
                offset.saturating_add(length)
            );
        }
        let s = self.dtype.size();
        Ok(Tokens {
            bytes: &all.bytes[offset * s..(offset + length) * s],
            dtype: self.dtype,
        })
    }

    /// The tokens of document `d` (all its sequences, concatenated) as 64-bit integers.
    pub fn document(&self, d: usize) -> Result<Vec<i64>> {
        let mut out = Vec::new();
        for i in self.document_sequences(d)? {
            out.extend(self.sequence(i)?.iter());
        }
        Ok(out)
    }
}

/// A sequence's token ids as stored, borrowed from the map; decoded on access.
#[derive(Clone, Copy)]
pub struct Tokens<'a> {
    bytes: &'a [u8],
    dtype: DType,
}

impl fmt::Debug for Tokens<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl<'a> Tokens<'a> {
    /// The number of tokens.
    pub fn len(&self) -> usize {
        self.bytes.len() / self.dtype.size()
    }

    /// Whether there are no tokens.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// The stored type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The raw little-endian bytes.
    pub fn as_bytes(&self) -> &'a [u8] {
        self.bytes
    }

    /// Token `j`.
    pub fn get(&self, j: usize) -> Option<i64> {
        (j < self.len()).then(|| self.dtype.decode(self.bytes, j))
    }

    /// Every token as a 64-bit integer.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = i64> + 'a {
        let (bytes, dtype) = (self.bytes, self.dtype);
        (0..self.len()).map(move |j| dtype.decode(bytes, j))
    }

    /// Every token as a 64-bit integer.
    pub fn to_i64_vec(&self) -> Vec<i64> {
        self.iter().collect()
    }

    /// Appends the tokens to `out` as `u32`; a negative id or one past `u32::MAX` is an error.
    pub fn extend_u32(&self, out: &mut Vec<u32>) -> Result<()> {
        out.reserve(self.len());
        match self.dtype {
            DType::U8 => out.extend(self.bytes.iter().map(|&b| u32::from(b))),
            DType::U16 => out.extend(
                self.bytes
                    .chunks_exact(2)
                    .map(|c| u32::from(u16::from_le_bytes([c[0], c[1]]))),
            ),
            DType::I32 => {
                for c in self.bytes.chunks_exact(4) {
                    let v = i32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                    out.push(u32::try_from(v).map_err(|_| bad_token(i64::from(v)))?);
                }
            }
            _ => {
                for v in self.iter() {
                    out.push(u32::try_from(v).map_err(|_| bad_token(v))?);
                }
            }
        }
        Ok(())
    }

    /// The tokens as `u32`; a negative id or one past `u32::MAX` is an error.
    pub fn to_u32_vec(&self) -> Result<Vec<u32>> {
        let mut out = Vec::with_capacity(self.len());
        self.extend_u32(&mut out)?;
        Ok(out)
    }
}

fn bad_token(v: i64) -> DataError {
    DataError::Invalid(format!(
        "token id {v} does not fit a u32 token id (ids are 0..2^32)"
    ))
}
