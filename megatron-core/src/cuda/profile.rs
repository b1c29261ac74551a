//! Where the GPU's time goes, kernel by kernel, without an external profiler: while on, every
//! kernel launch and every cuBLAS product is bracketed by two timing events on its stream, and
//! [`stop`] sums the times between them by name (products by shape, with their FLOP rate).
//!
//! The events add a little time of their own between kernels, so a profiled step is slightly
//! slower than a plain one; the shares are what it is for. Times of ranks sharing one GPU on
//! several streams overlap, so profile one rank per GPU. Not for use while a stream is being
//! captured into a CUDA graph (captured events have no times).

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};

use cudarc::driver::CudaEvent;
use parking_lot::Mutex;
use serde::Serialize;

use super::error::{CudaError, Result};

static ON: AtomicBool = AtomicBool::new(false);

/// One timed launch: its name, the FLOPs it does (products only), its two events.
struct Launch {
    name: String,
    flops: f64,
    events: (CudaEvent, CudaEvent),
}

static LAUNCHES: Mutex<Vec<Launch>> = Mutex::new(Vec::new());

/// Starts timing every launch in the process (earlier records are dropped).
pub fn start() {
    LAUNCHES.lock().clear();
    ON.store(true, Ordering::SeqCst);
}

/// Whether launches are being timed.
pub fn enabled() -> bool {
    ON.load(Ordering::Relaxed)
}

/// Records one launch bracketed by `events` (start, end), doing `flops` floating-point operations.
pub(crate) fn record(name: impl Into<String>, flops: f64, events: (CudaEvent, CudaEvent)) {
    LAUNCHES.lock().push(Launch {
        name: name.into(),
        flops,
        events,
    });
}

/// Stops timing and sums the recorded launches by name (waits for them to finish).
pub fn stop() -> Result<Profile> {
    ON.store(false, Ordering::SeqCst);
    let launches = std::mem::take(&mut *LAUNCHES.lock());
    let mut rows: HashMap<String, ProfileRow> = HashMap::new();
    for l in launches {
        let ms = l
            .events
            .0
            .elapsed_ms(&l.events.1)
            .map_err(|e| CudaError::driver(format!("timing {}", l.name), e))?;
        let row = rows.entry(l.name.clone()).or_insert_with(|| ProfileRow {
            name: l.name,
            calls: 0,
            ms: 0.0,
            flops: 0.0,
        });
        row.calls += 1;
        row.ms += f64::from(ms);
        row.flops += l.flops;
    }
    let mut rows: Vec<ProfileRow> = rows.into_values().collect();
    rows.sort_by(|a, b| b.ms.total_cmp(&a.ms).then_with(|| a.name.cmp(&b.name)));
    Ok(Profile { rows })
}

/// The time of every launch name, largest first.
#[derive(Debug, Clone, Serialize)]
pub struct Profile {
    /// One row per kernel name or product shape.
    pub rows: Vec<ProfileRow>,
}

/// The launches of one name.
#[derive(Debug, Clone, Serialize)]
pub struct ProfileRow {
    /// Kernel name, or `gemm m×n×k×batch dtype` for a cuBLAS product.
    pub name: String,
    /// Launches.
    pub calls: u64,
    /// GPU milliseconds between each launch's events, summed.
    pub ms: f64,
    /// Floating-point operations of the products (0 for other kernels).
    pub flops: f64,
}

impl ProfileRow {
    /// TFLOP/s of a product row (none for other kernels).
    pub fn tflops(&self) -> Option<f64> {
        (self.flops > 0.0 && self.ms > 0.0).then(|| self.flops / (self.ms * 1e9))
    }
}

impl Profile {
    /// Milliseconds of every launch together.
    pub fn total_ms(&self) -> f64 {
        self.rows.iter().map(|r| r.ms).sum()
    }

    /// The row of launches named `name`.
    pub fn row(&self, name: &str) -> Option<&ProfileRow> {
        self.rows.iter().find(|r| r.name == name)
    }

    /// The `n` largest rows, the rest summed into one row named `other`.
    pub fn top(&self, n: usize) -> Profile {
        let mut rows: Vec<ProfileRow> = self.rows.iter().take(n).cloned().collect();
        let rest = &self.rows[n.min(self.rows.len())..];
        if !rest.is_empty() {
            rows.push(ProfileRow {
                name: format!("other ({} names)", rest.len()),
                calls: rest.iter().map(|r| r.calls).sum(),
                ms: rest.iter().map(|r| r.ms).sum(),
                flops: rest.iter().map(|r| r.flops).sum(),
            });
        }
        Profile { rows }
    }
}

impl fmt::Display for Profile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let total = self.total_ms().max(f64::MIN_POSITIVE);
        writeln!(
            f,
            "{:>9} {:>6} {:>7} {:>8}  name",
            "ms", "share", "calls", "TFLOP/s"
        )?;
        for r in &self.rows {
            let rate = r.tflops().map_or(String::new(), |t| format!("{t:.1}"));
            writeln!(
                f,
                "{:>9.2} {:>5.1}% {:>7} {:>8}  {}",
                r.ms,
                100.0 * r.ms / total,
                r.calls,
                rate,
                r.name
            )?;
        }
        write!(f, "{total:>9.2} total")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(name: &str, calls: u64, ms: f64, flops: f64) -> ProfileRow {
        ProfileRow {
            name: name.to_string(),
            calls,
            ms,
            flops,
        }
    }

    #[test]
    fn the_table_sums_the_rest_and_gives_product_rates() {
        let p = Profile {
            rows: vec![
                row(
                    "gemm 4096×4096×4096×1 bf16",
                    2,
                    1.0,
                    2.0 * 2.0 * 4096f64.powi(3),
                ),
                row("softmax_forward", 40, 0.5, 0.0),
                row("layer_norm_forward", 80, 0.25, 0.0),
                row("bias_add", 80, 0.25, 0.0),
            ],
        };
        let top = p.top(2);
        assert_eq!(top.rows.len(), 3);
        assert_eq!(top.rows[2].name, "other (2 names)");
        assert_eq!(top.rows[2].calls, 160);
        assert_eq!(top.total_ms(), 2.0);
        // 2·2·4096³ FLOPs in 1 ms: 274.9 TFLOP/s.
        let rate = top.rows[0].tflops().unwrap();
        assert!((rate - 274.877_906_944).abs() < 1e-6, "{rate}");
        assert_eq!(top.rows[1].tflops(), None);
        let table = top.to_string();
        assert!(table.contains(" 50.0%"), "{table}");
        assert!(table.ends_with("2.00 total"), "{table}");
    }
}
