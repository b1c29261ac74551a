//! TensorBoard event files: scalars that `tensorboard --logdir DIR` plots, as Megatron-LM writes
//! them.
//!
//! An event file is a sequence of TFRecords, each `len: u64 LE`, `masked_crc32c(len)`, `data`,
//! `masked_crc32c(data)`, whose data is an `Event` protocol buffer: `wall_time` (field 1,
//! double), `step` (2, int64), `file_version` (3, string) in the first record, and `summary`
//! (5, message) with `value` (1, repeated message) holding `tag` (1, string) and `simple_value`
//! (2, float).

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};

/// Writes scalar events into one event file of a log directory.
pub struct EventWriter {
    path: PathBuf,
    out: BufWriter<File>,
}

/// TFRecord's CRC: CRC-32C, rotated right by 15 bits, plus a constant.
pub fn masked_crc32c(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

fn varint(mut v: u64, out: &mut Vec<u8>) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// Field key: field number and wire type.
fn key(field: u64, wire: u64, out: &mut Vec<u8>) {
    varint(field << 3 | wire, out);
}

fn bytes_field(field: u64, data: &[u8], out: &mut Vec<u8>) {
    key(field, 2, out);
    varint(data.len() as u64, out);
    out.extend_from_slice(data);
}

/// An `Event` with wall time and step, and either a file version or one scalar.
fn event(
    wall_time: f64,
    step: i64,
    file_version: Option<&str>,
    scalar: Option<(&str, f32)>,
) -> Vec<u8> {
    let mut e = Vec::new();
    key(1, 1, &mut e);
    e.extend_from_slice(&wall_time.to_le_bytes());
    key(2, 0, &mut e);
    varint(step as u64, &mut e);
    if let Some(v) = file_version {
        bytes_field(3, v.as_bytes(), &mut e);
    }
    if let Some((tag, value)) = scalar {
        let mut val = Vec::new();
        bytes_field(1, tag.as_bytes(), &mut val);
        key(2, 5, &mut val);
        val.extend_from_slice(&value.to_le_bytes());
        let mut summary = Vec::new();
        bytes_field(1, &val, &mut summary);
        bytes_field(5, &summary, &mut e);
    }
    e
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

impl EventWriter {
    /// Creates `DIR/events.out.tfevents.<seconds>.megatron-rs.<pid>.<n>` (and `DIR`) and writes
    /// the file-version record.
    pub fn create(dir: &Path) -> Result<EventWriter> {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("creating the TensorBoard directory {}", dir.display()))?;
        let wall = now();
        // Never overwrite an earlier run's file: the name takes the first free counter.
        let mut n = 0u32;
        let (path, file) = loop {
            let path = dir.join(format!(
                "events.out.tfevents.{}.megatron-rs.{}.{n}",
                wall as u64,
                std::process::id()
            ));
            match File::options().write(true).create_new(true).open(&path) {
                Ok(file) => break (path, file),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && n < 1000 => n += 1,
                Err(e) => return Err(e).with_context(|| format!("creating {}", path.display())),
            }
        };
        let mut writer = EventWriter {
            path,
            out: BufWriter::new(file),
        };
        writer.record(&event(wall, 0, Some("brain.Event:2"), None))?;
        writer.flush()?;
        Ok(writer)
    }

    /// The event file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn record(&mut self, data: &[u8]) -> Result<()> {
        let len = (data.len() as u64).to_le_bytes();
        let out = &mut self.out;
        out.write_all(&len)?;
        out.write_all(&masked_crc32c(&len).to_le_bytes())?;
        out.write_all(data)?;
        out.write_all(&masked_crc32c(data).to_le_bytes())?;
        Ok(())
    }

    /// Writes one scalar, e.g. `lm loss` at `step`.
    pub fn scalar(&mut self, tag: &str, step: u64, value: f64) -> Result<()> {
        let e = event(now(), step as i64, None, Some((tag, value as f32)));
        self.record(&e)
            .with_context(|| format!("writing {}", self.path.display()))
    }

    /// Flushes buffered records to the file.
    pub fn flush(&mut self) -> Result<()> {
        self.out
            .flush()
            .with_context(|| format!("writing {}", self.path.display()))
    }
}
