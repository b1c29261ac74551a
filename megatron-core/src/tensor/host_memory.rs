//! Bytes of host tensor storage alive now, and the most alive at once since the last reset:
//! process-wide (thread ranks share it), counted where storages are made and dropped (a
//! storage's whole allocation, recycled or not).

use std::sync::atomic::{AtomicUsize, Ordering};

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

/// Bytes of host storage alive now.
pub fn live_bytes() -> usize {
    LIVE.load(Ordering::Relaxed)
}

/// The most bytes of host storage alive at once since the last [`reset_peak`].
pub fn peak_bytes() -> usize {
    PEAK.load(Ordering::Relaxed)
}

/// Starts a new high-water mark at what is alive now.
pub fn reset_peak() {
    PEAK.store(LIVE.load(Ordering::Relaxed), Ordering::Relaxed);
}

pub(crate) fn allocated(bytes: usize) {
    let now = LIVE.fetch_add(bytes, Ordering::Relaxed) + bytes;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

pub(crate) fn freed(bytes: usize) {
    LIVE.fetch_sub(bytes, Ordering::Relaxed);
}
