//! Tensors streamed between safetensors files, a few megabytes at a time: a file is opened by
//! its header alone ([`SafetensorsFile`], checked against the file's length so a truncated
//! shard is named before anything is read), an output tensor is a list of byte ranges of input
//! tensors ([`OutTensor`]: a fused QKV is each query group's rows of `q_proj`, `k_proj` and
//! `v_proj` in turn, stacked experts are each expert's matrix in turn) read with positioned
//! reads and written as they arrive. Only a layout that is not a concatenation of row ranges (GPT-2's
//! transposed Conv1D weights) is computed, one tensor at a time. Peak memory is therefore a
//! fixed margin (the copy buffer) plus, for computed tensors, twice the largest of them: never
//! the model.
//!
//! Values keep their dtype unless the output asks for another: then each element is rounded
//! to nearest, ties to even (what `torch.Tensor.to` does, and so Megatron-Bridge's export),
//! through f32.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use safetensors::tensor::Dtype;
use serde_json::{Value, json};

/// Elements copied per read: 4 MiB of f32.
const CHUNK: usize = 1 << 20;
/// The largest header a safetensors file may have (the format's own limit).
const MAX_HEADER: u64 = 100_000_000;

/// Where one tensor lies in its file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<usize>,
    /// Offset of its first byte in the file.
    offset: u64,
}

impl TensorInfo {
    /// Elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Bytes of its data.
    pub fn bytes(&self) -> u64 {
        (self.numel() * self.dtype.bitsize() / 8) as u64
    }
}

/// A safetensors file opened for reading tensor by tensor: its header, checked against the
/// file's length.
#[derive(Debug)]
pub struct SafetensorsFile {
    path: PathBuf,
    file: File,
    tensors: BTreeMap<String, TensorInfo>,
}

/// Reads `buf.len()` bytes of `file` at `offset`.
fn read_at(file: &File, path: &Path, offset: u64, buf: &mut [u8]) -> Result<()> {
    #[cfg(unix)]
    let result = {
        use std::os::unix::fs::FileExt;
        file.read_exact_at(buf, offset)
    };
    #[cfg(windows)]
    let result = {
        use std::os::windows::fs::FileExt;
        let mut done = 0;
        let mut result = Ok(());
        while done < buf.len() {
            match file.seek_read(&mut buf[done..], offset + done as u64) {
                Ok(0) => {
                    result = Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof));
                    break;
                }
                Ok(n) => done += n,
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        result
    };
    result.with_context(|| {
        format!(
            "reading {} bytes at {offset} of {}",
            buf.len(),
            path.display()
        )
    })
}

impl SafetensorsFile {
    /// Opens `path` and reads its header. A file shorter than its header says (a truncated
    /// shard), a header that is not the format's, or a tensor whose bytes do not match its
    /// shape is refused naming the file.
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
        let len = file
            .metadata()
            .with_context(|| format!("reading {}", path.display()))?
            .len();
        let bad =
            |why: String| anyhow::anyhow!("{}: not a safetensors file: {why}", path.display());
        if len < 8 {
            return Err(bad(format!(
                "{len} bytes, shorter than the 8 that size its header"
            )));
        }
        let mut size = [0u8; 8];
        read_at(&file, path, 0, &mut size)?;
        let n = u64::from_le_bytes(size);
        if n > MAX_HEADER || 8 + n > len {
            return Err(bad(format!(
                "a header of {n} bytes in a file of {len}: truncated or corrupt"
            )));
        }
        let mut header = vec![0u8; n as usize];
        read_at(&file, path, 8, &mut header)?;
        let header: Value =
            serde_json::from_slice(&header).map_err(|e| bad(format!("its header: {e}")))?;
        let Value::Object(entries) = header else {
            return Err(bad("its header is not a JSON object".into()));
        };
        let data_start = 8 + n;
        let mut tensors = BTreeMap::new();
        let mut end = 0u64;
        for (name, entry) in entries {
            if name == "__metadata__" {
                continue;
            }
            let dtype: Dtype = serde_json::from_value(entry["dtype"].clone())
                .map_err(|_| bad(format!("`{name}` has dtype {}", entry["dtype"])))?;
            let shape: Vec<usize> = serde_json::from_value(entry["shape"].clone())
                .map_err(|_| bad(format!("`{name}` has shape {}", entry["shape"])))?;
            let offsets: [u64; 2] = serde_json::from_value(entry["data_offsets"].clone())
                .map_err(|_| bad(format!("`{name}` has offsets {}", entry["data_offsets"])))?;
            let numel = shape
                .iter()
                .try_fold(1u64, |n, &d| n.checked_mul(d as u64))
                .ok_or_else(|| bad(format!("`{name}`'s shape {shape:?} overflows")))?;
            let want = numel.saturating_mul(dtype.bitsize() as u64).div_ceil(8);
            if offsets[1] < offsets[0] || offsets[1] - offsets[0] != want {
                return Err(bad(format!(
                    "`{name}` of shape {shape:?} in {dtype:?} needs {want} bytes, its offsets \
                     {offsets:?} give {}",
                    offsets[1].saturating_sub(offsets[0])
                )));
            }
            end = end.max(offsets[1]);
            let offset = data_start + offsets[0];
            tensors.insert(
                name,
                TensorInfo {
                    dtype,
                    shape,
                    offset,
                },
            );
        }
        if data_start + end > len {
            bail!(
                "{}: truncated: its header places tensors up to byte {}, the file has {len} bytes",
                path.display(),
                data_start + end
            );
        }
        Ok(SafetensorsFile {
            path: path.to_path_buf(),
            file,
            tensors,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Its tensors, by name.
    pub fn tensors(&self) -> &BTreeMap<String, TensorInfo> {
        &self.tensors
    }

    /// Tensor `name`, if the file holds it.
    pub fn tensor(&self, name: &str) -> Option<TensorRef<'_>> {
        self.tensors
            .get_key_value(name)
            .map(|(name, info)| TensorRef {
                file: self,
                name,
                info,
            })
    }
}

/// One tensor of an opened file.
#[derive(Debug, Clone, Copy)]
pub struct TensorRef<'a> {
    file: &'a SafetensorsFile,
    name: &'a str,
    info: &'a TensorInfo,
}

impl<'a> TensorRef<'a> {
    /// Its name in its file.
    pub fn name(&self) -> &'a str {
        self.name
    }

    /// Its element type.
    pub fn dtype(&self) -> Dtype {
        self.info.dtype
    }

    /// Its shape.
    pub fn shape(&self) -> &'a [usize] {
        &self.info.shape
    }

    /// Its file's path.
    pub fn path(&self) -> &'a Path {
        &self.file.path
    }

    /// Elements `elems` (in row-major order) as bytes of its dtype.
    pub fn read_bytes(&self, elems: Range<usize>) -> Result<Vec<u8>> {
        let size = self.info.dtype.bitsize() / 8;
        let mut buf = vec![0u8; elems.len() * size];
        read_at(
            &self.file.file,
            &self.file.path,
            self.info.offset + (elems.start * size) as u64,
            &mut buf,
        )?;
        Ok(buf)
    }

    /// Elements `elems` as f32 (from F32, F16 or BF16).
    pub fn read_f32(&self, elems: Range<usize>) -> Result<Vec<f32>> {
        let dtype = float_dtype(self.info.dtype)
            .with_context(|| format!("{}: `{}`", self.file.path.display(), self.name))?;
        decode(dtype, &self.read_bytes(elems)?)
    }

    /// Every element as f32.
    pub fn read_all(&self) -> Result<Vec<f32>> {
        self.read_f32(0..self.info.numel())
    }

    /// Rows `rows` of the tensor (`[rows.., ..]`): their elements.
    pub fn rows(&self, rows: Range<usize>) -> Slice<'a> {
        let cols: usize = self.info.shape.iter().skip(1).product();
        Slice {
            tensor: *self,
            elems: rows.start * cols..rows.end * cols,
        }
    }

    /// Elements `elems`, in row-major order.
    pub fn elems(&self, elems: Range<usize>) -> Slice<'a> {
        Slice {
            tensor: *self,
            elems,
        }
    }

    /// All of it.
    pub fn all(&self) -> Slice<'a> {
        Slice {
            tensor: *self,
            elems: 0..self.info.numel(),
        }
    }

    /// Whether it holds the same values as `other` (same shape, compared as f32), read a
    /// chunk at a time.
    pub fn same_values(&self, other: &TensorRef<'_>) -> Result<bool> {
        if self.shape() != other.shape() {
            return Ok(false);
        }
        let n = self.info.numel();
        for start in (0..n).step_by(CHUNK) {
            let r = start..(start + CHUNK).min(n);
            if self.read_f32(r.clone())? != other.read_f32(r)? {
                return Ok(false);
            }
        }
        Ok(true)
    }
}

/// The floating-point dtypes parameters are held in: F32, F16 and BF16.
pub fn float_dtype(dtype: Dtype) -> Result<Dtype> {
    match dtype {
        Dtype::F32 | Dtype::F16 | Dtype::BF16 => Ok(dtype),
        other => bail!("{other:?} values: parameters are F32, F16 or BF16"),
    }
}

/// Values of `dtype` (F32, F16 or BF16) from their little-endian bytes.
fn decode(dtype: Dtype, bytes: &[u8]) -> Result<Vec<f32>> {
    match megatron_core::checkpoint::values_f32(dtype, bytes) {
        Some(values) => Ok(values),
        None => bail!("{dtype:?} values: parameters are F32, F16 or BF16"),
    }
}

/// Appends `values` as little-endian bytes of `dtype`, each rounded to nearest, ties to even.
fn encode(dtype: Dtype, values: &[f32], out: &mut Vec<u8>) {
    match dtype {
        Dtype::F16 => out.extend(
            values
                .iter()
                .flat_map(|&v| half::f16::from_f32(v).to_le_bytes()),
        ),
        Dtype::BF16 => out.extend(
            values
                .iter()
                .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes()),
        ),
        _ => out.extend(values.iter().flat_map(|v| v.to_le_bytes())),
    }
}

/// Elements of one input tensor, in row-major order.
#[derive(Debug, Clone)]
pub struct Slice<'a> {
    tensor: TensorRef<'a>,
    elems: Range<usize>,
}

/// Computes a tensor's values (f32) when it is written.
pub type Compute<'a> = Box<dyn Fn() -> Result<Vec<f32>> + 'a>;

/// Where an output tensor's values come from.
pub enum Source<'a> {
    /// Elements of input tensors, one after another.
    Slices(Vec<Slice<'a>>),
    /// Values computed when the tensor is written.
    Computed(Compute<'a>),
}

/// A tensor to write: its name, dtype and shape, and where its values come from.
pub struct OutTensor<'a> {
    /// Name in the output file.
    pub name: String,
    /// Element type written.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<usize>,
    /// Its values.
    pub source: Source<'a>,
}

impl<'a> OutTensor<'a> {
    /// `slices` one after another as a tensor of `shape`, in their dtype (F32 when they
    /// differ).
    pub fn concat(name: impl Into<String>, shape: Vec<usize>, slices: Vec<Slice<'a>>) -> Self {
        let first = slices.first().map_or(Dtype::F32, |s| s.tensor.dtype());
        let dtype = match slices.iter().all(|s| s.tensor.dtype() == first) {
            true => first,
            false => Dtype::F32,
        };
        OutTensor {
            name: name.into(),
            dtype,
            shape,
            source: Source::Slices(slices),
        }
    }

    /// Input tensor `t` as it is, named `name`.
    pub fn copy(name: impl Into<String>, t: TensorRef<'a>) -> Self {
        Self::concat(name, t.shape().to_vec(), vec![t.all()])
    }

    /// Values computed when written, of `dtype` and `shape`.
    pub fn computed(
        name: impl Into<String>,
        dtype: Dtype,
        shape: Vec<usize>,
        compute: impl Fn() -> Result<Vec<f32>> + 'a,
    ) -> Self {
        OutTensor {
            name: name.into(),
            dtype,
            shape,
            source: Source::Computed(Box::new(compute)),
        }
    }

    /// Elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Bytes written.
    pub fn bytes(&self) -> u64 {
        (self.numel() * self.dtype.bitsize() / 8) as u64
    }
}

/// What [`write_file`] checks of the values it writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Check {
    /// Nothing: the values are written as they are.
    Nothing,
    /// Every value is finite (a checkpoint holds no NaN or infinity).
    Finite,
}

/// Writes `values` (bytes of `from`) to `out` as `to`, checking them as `check` asks.
fn put(
    out: &mut impl Write,
    from: Dtype,
    to: Dtype,
    bytes: &[u8],
    check: Check,
    what: &dyn Fn(usize) -> String,
    scratch: &mut Vec<u8>,
) -> Result<()> {
    if from == to && check == Check::Nothing {
        return out.write_all(bytes).map_err(Into::into);
    }
    let values = decode(from, bytes)?;
    if check == Check::Finite
        && let Some(i) = values.iter().position(|v| !v.is_finite())
    {
        bail!(
            "{} is {}: a checkpoint of values that are not finite is not written",
            what(i),
            values[i]
        );
    }
    if from == to {
        return out.write_all(bytes).map_err(Into::into);
    }
    scratch.clear();
    encode(to, &values, scratch);
    out.write_all(scratch).map_err(Into::into)
}

/// Writes `tensors` as the safetensors file `path` (created, or replaced), with `metadata` in
/// its header, streaming each tensor's values; synced before it returns. Each output dtype
/// must be F32, F16 or BF16.
pub fn write_file(
    path: &Path,
    tensors: &[OutTensor<'_>],
    metadata: &BTreeMap<String, String>,
    check: Check,
) -> Result<()> {
    let mut header = serde_json::Map::new();
    if !metadata.is_empty() {
        header.insert("__metadata__".into(), json!(metadata));
    }
    let mut at = 0u64;
    for t in tensors {
        float_dtype(t.dtype).with_context(|| format!("writing `{}`", t.name))?;
        if let Source::Slices(slices) = &t.source {
            let n: usize = slices.iter().map(|s| s.elems.len()).sum();
            if n != t.numel() {
                bail!(
                    "`{}`: {n} elements for shape {:?} (the conversion's layouts disagree)",
                    t.name,
                    t.shape
                );
            }
        }
        let end = at + t.bytes();
        header.insert(
            t.name.clone(),
            json!({ "dtype": t.dtype, "shape": t.shape, "data_offsets": [at, end] }),
        );
        at = end;
    }
    let mut header = serde_json::to_vec(&Value::Object(header))?;
    // The data starts 8-aligned, as the format's writers align it: padded with spaces.
    header.resize(header.len().next_multiple_of(8), b' ');
    let file = File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut out = BufWriter::with_capacity(1 << 22, file);
    let io = |e: std::io::Error| anyhow::anyhow!("writing {}: {e}", path.display());
    out.write_all(&(header.len() as u64).to_le_bytes())
        .map_err(io)?;
    out.write_all(&header).map_err(io)?;
    let mut scratch = Vec::new();
    for t in tensors {
        match &t.source {
            Source::Slices(slices) => {
                let mut written = 0usize;
                for s in slices {
                    let from = float_dtype(s.tensor.dtype()).with_context(|| {
                        format!("{}: `{}`", s.tensor.path().display(), s.tensor.name())
                    })?;
                    for start in s.elems.clone().step_by(CHUNK) {
                        let r = start..(start + CHUNK).min(s.elems.end);
                        let bytes = s.tensor.read_bytes(r.clone())?;
                        let base = written + (r.start - s.elems.start);
                        let what = |i: usize| format!("element {} of `{}`", base + i, t.name);
                        put(&mut out, from, t.dtype, &bytes, check, &what, &mut scratch)?;
                    }
                    written += s.elems.len();
                }
            }
            Source::Computed(compute) => {
                let values = compute().with_context(|| format!("computing `{}`", t.name))?;
                if values.len() != t.numel() {
                    bail!(
                        "`{}`: {} values computed for shape {:?}",
                        t.name,
                        values.len(),
                        t.shape
                    );
                }
                let bytes: &[u8] = bytemuck::cast_slice(&values);
                let what = |i: usize| format!("element {i} of `{}`", t.name);
                put(
                    &mut out,
                    Dtype::F32,
                    t.dtype,
                    bytes,
                    check,
                    &what,
                    &mut scratch,
                )?;
            }
        }
    }
    let file = out.into_inner().map_err(|e| io(e.into_error()))?;
    file.sync_all().map_err(io)
}

/// Bytes in a size such as transformers' `max_shard_size`: a whole number of bytes, or one
/// with a unit (`KB`, `MB`, `GB`, `TB`, powers of 1000; `KiB`, `MiB`, `GiB`, powers of 1024).
pub fn parse_size(text: &str) -> Result<u64> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let value: f64 = number
        .parse()
        .map_err(|_| anyhow::anyhow!("size `{text}` does not start with a number"))?;
    let multiplier: u64 = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 1,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "TB" => 1_000_000_000_000,
        "KIB" => 1 << 10,
        "MIB" => 1 << 20,
        "GIB" => 1 << 30,
        _ => bail!("size `{text}`: the unit is not one of B, KB, MB, GB, TB, KiB, MiB, GiB"),
    };
    let bytes = value * multiplier as f64;
    if !(bytes >= 1.0 && bytes < u64::MAX as f64) {
        bail!("size `{text}` must be at least one byte");
    }
    Ok(bytes as u64)
}

/// The shards of tensors of `sizes` bytes, in order, as huggingface_hub splits a state dict:
/// a tensor joins the current shard unless that would pass `max` bytes; a tensor larger than
/// `max` has a shard of its own.
pub fn plan_shards(sizes: &[u64], max: u64) -> Vec<Range<usize>> {
    let mut shards = Vec::new();
    let (mut start, mut bytes) = (0usize, 0u64);
    for (i, &size) in sizes.iter().enumerate() {
        if size > max {
            if i > start {
                shards.push(start..i);
            }
            shards.push(i..i + 1);
            (start, bytes) = (i + 1, 0);
            continue;
        }
        if bytes + size > max && i > start {
            shards.push(start..i);
            (start, bytes) = (i, 0);
        }
        bytes += size;
    }
    if start < sizes.len() {
        shards.push(start..sizes.len());
    }
    shards
}

/// Writes `tensors` into the directory `dir` as transformers saves a model: `model.safetensors`
/// when they fit in one shard of `max_shard` bytes, else `model-0000N-of-0000M.safetensors`
/// with `model.safetensors.index.json` (`metadata.total_size`, `metadata.total_parameters`,
/// `weight_map`). Returns the files written.
pub fn write_sharded(dir: &Path, tensors: &[OutTensor<'_>], max_shard: u64) -> Result<Vec<String>> {
    let sizes: Vec<u64> = tensors.iter().map(OutTensor::bytes).collect();
    let shards = plan_shards(&sizes, max_shard);
    let metadata = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    if shards.len() <= 1 {
        write_file(
            &dir.join("model.safetensors"),
            tensors,
            &metadata,
            Check::Nothing,
        )?;
        return Ok(vec!["model.safetensors".into()]);
    }
    let n = shards.len();
    let mut files = Vec::new();
    let mut weight_map = BTreeMap::new();
    for (i, range) in shards.into_iter().enumerate() {
        let name = format!("model-{:05}-of-{n:05}.safetensors", i + 1);
        write_file(
            &dir.join(&name),
            &tensors[range.clone()],
            &metadata,
            Check::Nothing,
        )?;
        for t in &tensors[range] {
            weight_map.insert(t.name.clone(), name.clone());
        }
        files.push(name);
    }
    let index = json!({
        "metadata": {
            "total_parameters": tensors.iter().map(OutTensor::numel).sum::<usize>(),
            "total_size": sizes.iter().sum::<u64>(),
        },
        "weight_map": weight_map,
    });
    let mut text = serde_json::to_string_pretty(&index)?;
    text.push('\n');
    let index_name = "model.safetensors.index.json";
    std::fs::write(dir.join(index_name), text)
        .with_context(|| format!("writing {}", dir.join(index_name).display()))?;
    files.push(index_name.into());
    Ok(files)
}

/// The process's peak resident memory so far in bytes (Linux's `VmHWM`), `None` where the
/// system does not say.
pub fn peak_resident_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_split_as_huggingface_hub_splits() {
        // huggingface_hub's docstring: [6, 6, 2, 6, 2, 2] GB under 10 GB.
        assert_eq!(plan_shards(&[6, 6, 2, 6, 2, 2], 10), vec![0..1, 1..3, 3..6]);
        assert_eq!(plan_shards(&[3, 12, 3], 10), vec![0..1, 1..2, 2..3]);
        assert_eq!(plan_shards(&[], 10), Vec::<Range<usize>>::new());
    }

    #[test]
    fn sizes_read_with_transformers_units() {
        assert_eq!(parse_size("50GB").unwrap(), 50_000_000_000);
        assert_eq!(parse_size("24KB").unwrap(), 24_000);
        assert_eq!(parse_size("2MiB").unwrap(), 2 << 20);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert!(parse_size("5 parsecs").is_err());
        assert!(parse_size("0GB").is_err());
    }

    #[test]
    fn bf16_rounds_to_nearest_even() {
        // 1 + 2^-8 lies halfway between bf16's 1 and 1 + 2^-7: ties go to the even 1.
        let mut out = Vec::new();
        encode(
            Dtype::BF16,
            &[1.0 + 1.0 / 256.0, 1.0 + 3.0 / 256.0],
            &mut out,
        );
        let back = decode(Dtype::BF16, &out).unwrap();
        assert_eq!(back, vec![1.0, 1.0 + 4.0 / 256.0]);
    }
}
