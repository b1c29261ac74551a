//! Bytes of host tensor storage alive now, and the most alive at once since the last reset:
//! process-wide (thread ranks share it), counted where storages are made and dropped (a
//! storage's whole allocation, recycled or not); and the same per thread that allocated them
//! ([`ThreadAccount`]: a thread rank's own, whichever thread drops them).

use std::sync::Arc;
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

/// The host storage one thread allocated: alive now, and the most alive at once since its last
/// reset.
#[derive(Debug, Default)]
pub struct ThreadAccount {
    live: AtomicUsize,
    peak: AtomicUsize,
}

impl ThreadAccount {
    /// Bytes alive now.
    pub fn live_bytes(&self) -> usize {
        self.live.load(Ordering::Relaxed)
    }

    /// The most bytes alive at once since the last [`ThreadAccount::reset_peak`].
    pub fn peak_bytes(&self) -> usize {
        self.peak.load(Ordering::Relaxed)
    }

    /// Starts a new high-water mark at what is alive now.
    pub fn reset_peak(&self) {
        self.peak.store(self.live_bytes(), Ordering::Relaxed);
    }
}

thread_local! {
    static THIS_THREAD: Arc<ThreadAccount> = Arc::default();
}

/// The calling thread's account (a thread rank's).
pub fn this_thread() -> Arc<ThreadAccount> {
    THIS_THREAD.with(Arc::clone)
}

/// Counts `bytes` allocated by the calling thread; returns its account, which the storage
/// frees them from.
pub(crate) fn allocated(bytes: usize) -> Arc<ThreadAccount> {
    let now = LIVE.fetch_add(bytes, Ordering::Relaxed) + bytes;
    PEAK.fetch_max(now, Ordering::Relaxed);
    let account = this_thread();
    let mine = account.live.fetch_add(bytes, Ordering::Relaxed) + bytes;
    account.peak.fetch_max(mine, Ordering::Relaxed);
    account
}

pub(crate) fn freed(bytes: usize, account: &ThreadAccount) {
    LIVE.fetch_sub(bytes, Ordering::Relaxed);
    account.live.fetch_sub(bytes, Ordering::Relaxed);
}
