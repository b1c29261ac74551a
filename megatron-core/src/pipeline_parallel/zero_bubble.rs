//! The zero-bubble schedules' orders: each backward split into `B` (the input gradient, which
//! the previous stage waits for) and `W` (the weight gradients, which nobody waits for), and the
//! `W`s moved into the slots where 1F1B's ranks idle.
//!
//! With `F`, `B` and `W` taking `T_F`, `T_B` and `T_W` and `p` ranks, 1F1B idles
//! `(p − 1)(T_F + T_B + T_W)` per rank and step (its backward is `B` and `W` together); Qi et
//! al.'s handcrafted schedules (Zero Bubble Pipeline Parallelism, ICLR 2024):
//!
//! - **ZB-H1** holds 1F1B's activations (at most `p` microbatches) and idles
//!   `(p − 1)(T_F + T_B − T_W)`: a third of 1F1B's at equal times. Rank `i`: `p − 1 − i`
//!   forwards, `i` pairs `F B`, triples `F B W` while forwards remain, pairs `B W`, then the `i`
//!   `W`s left (each `W` the oldest pending).
//! - **ZB-H2** warms up with `2(p − 1 − i)` forwards and `2i` pairs (up to `2p − 1`
//!   microbatches held) and idles `(p − 1)(T_F + T_B − 2T_W)`: nothing at equal times.
//! - **ZB-V** (their section 6) gives each rank two chunks in a V (stages `r` and `2p − 1 − r`,
//!   [`Placement::Vee`](super::Placement::Vee)), each half a 1F1B stage's work, holds 1F1B's
//!   activations and idles nothing at equal times. The order is the one
//!   torch.distributed.pipelining's `ScheduleZBVZeroBubble` builds.
//! - **DualPipeV** (DeepSeek-V3's DualPipe folded into a V) pairs, in its steady phase, a
//!   forward of one chunk with a full backward of the other, which DeepSeek overlaps with each
//!   other's all-to-alls; here the pair runs as the forward, then the backward and its `W` at
//!   once. The order is the one torch.distributed.pipelining's `ScheduleDualPipeV` builds (at
//!   least `2p` microbatches).
//!
//! Every order is checked as a pipeline (each pass after its input, messages awaited in the
//! order they are sent, no deadlock) by [`simulate`](super::simulate()), and its bubble against
//! the formulas above by the tests.

use super::executor::{Pass, Slot};

/// ZB-H1 (`depth` 1) or ZB-H2 (`depth` 2) for pipeline rank `rank` of `pp` and `m` microbatches.
pub(super) fn zb_h(pp: usize, rank: usize, m: usize, depth: usize) -> Vec<Slot> {
    let warmup = (depth * (pp - 1 - rank)).min(m);
    let pairs = (depth * rank).min(m - warmup);
    let triples = m - warmup - pairs;
    let (f, b, w) = (Slot::forward(0), Slot::backward(0), Slot::weight(0));
    let mut order = vec![f; warmup];
    for _ in 0..pairs {
        order.extend([f, b]);
    }
    for _ in 0..triples {
        order.extend([f, b, w]);
    }
    // The backwards left (as many as the warm-up's forwards), each with the oldest W.
    for _ in 0..warmup {
        order.extend([b, w]);
    }
    order.extend(std::iter::repeat_n(w, pairs));
    order
}

/// A pass with its microbatch, as the generators below count them.
type Numbered = (Pass, usize, usize);

/// Counts each (pass, chunk)'s microbatches as passes are added, and keeps the chunks whose
/// split backwards left weight-gradient passes pending, oldest first (a chunk's W passes take
/// its microbatches in order, so the chunk names the pending pass).
#[derive(Default)]
struct Builder {
    passes: Vec<Numbered>,
    next: std::collections::HashMap<(Pass, usize), usize>,
    pending: std::collections::VecDeque<usize>,
}

impl Builder {
    /// Adds the next microbatch's `pass` through `chunk`.
    fn add(&mut self, pass: Pass, chunk: usize) {
        let next = self.next.entry((pass, chunk)).or_default();
        self.passes.push((pass, chunk, *next));
        *next += 1;
    }

    /// The passes of `pass` through `chunk` added so far.
    fn count(&self, pass: Pass, chunk: usize) -> usize {
        self.next.get(&(pass, chunk)).copied().unwrap_or(0)
    }

    /// A backward whose weight gradients wait in the queue.
    fn split_backward(&mut self, chunk: usize) {
        self.pending.push_back(chunk);
        self.add(Pass::Backward, chunk);
    }

    /// A backward with its weight gradients at once.
    fn full_backward(&mut self, chunk: usize) {
        self.add(Pass::Backward, chunk);
        self.add(Pass::Weight, chunk);
    }

    /// The oldest pending weight-gradient pass, if any.
    fn pending_weight(&mut self) {
        if let Some(chunk) = self.pending.pop_front() {
            self.add(Pass::Weight, chunk);
        }
    }

    /// The passes of the first `m` microbatches, as slots (each pass's microbatch is then its
    /// chunk's next one, which [`super::walk`] checks).
    fn into_slots(self, m: usize) -> Vec<Slot> {
        self.passes
            .into_iter()
            .filter(|&(_, _, microbatch)| microbatch < m)
            .map(|(pass, chunk, _)| Slot { pass, chunk })
            .collect()
    }
}

/// ZB-V for rank `rank` of `pp` and `m` microbatches: chunk 0 is stage `rank`, chunk 1 stage
/// `2pp − 1 − rank`. Built for `max(2pp − 1, m)` microbatches (enough to fill the V) and cut to
/// the first `m`, as torch's `ScheduleZBVZeroBubble` does.
pub(super) fn zbv(pp: usize, rank: usize, m: usize) -> Vec<Slot> {
    let n = m.max(2 * pp - 1);
    let mut o = Builder::default();
    // Warm-up: chunk 0 fills the way down, chunk 1 starts on the way back up.
    for _ in 0..2 * (pp - rank) - 1 {
        o.add(Pass::Forward, 0);
    }
    for _ in 0..rank {
        o.add(Pass::Forward, 1);
        o.add(Pass::Forward, 0);
    }
    for _ in 0..pp - rank {
        o.add(Pass::Forward, 1);
        o.full_backward(1);
    }
    // Steady: chunk 0's forward (while any remain) and backward, then chunk 1's.
    while o.count(Pass::Forward, 1) < o.count(Pass::Forward, 0) || o.count(Pass::Forward, 0) < n {
        if o.count(Pass::Forward, 0) < n {
            o.add(Pass::Forward, 0);
        }
        o.full_backward(0);
        o.add(Pass::Forward, 1);
        o.full_backward(1);
    }
    // Cool-down: input gradients first, weight gradients where the pipeline drains.
    for _ in 0..rank {
        o.split_backward(0);
        o.split_backward(1);
    }
    for _ in 0..pp - rank {
        o.add(Pass::Backward, 0);
        o.add(Pass::Weight, 0);
    }
    for chunk in [1, 0] {
        while o.count(Pass::Weight, chunk) < o.count(Pass::Backward, chunk) {
            o.add(Pass::Weight, chunk);
        }
    }
    o.into_slots(m)
}

/// DualPipeV for rank `rank` of `pp` and `m ≥ 2pp` microbatches (chunks as [`zbv`]), as
/// torch's `ScheduleDualPipeV` builds it; each of its overlapped forward-and-backward pairs
/// runs as the forward, then the full backward.
pub(super) fn dualpipev(pp: usize, rank: usize, m: usize) -> Vec<Slot> {
    let mut o = Builder::default();
    let overlapped = |o: &mut Builder, forward: usize, backward: usize| {
        o.add(Pass::Forward, forward);
        o.full_backward(backward);
    };
    // Chunk 0 down the V; both chunks; then chunk 1's zero-bubble backwards.
    for _ in 0..2 * (pp - rank - 1) {
        o.add(Pass::Forward, 0);
    }
    for _ in 0..rank + 1 {
        o.add(Pass::Forward, 0);
        o.add(Pass::Forward, 1);
    }
    for _ in 0..pp - rank - 1 {
        o.split_backward(1);
        o.pending_weight();
        o.add(Pass::Forward, 1);
    }
    // The main phase: each chunk's forward beside the other's backward.
    for i in 0..(m + rank + 1).saturating_sub(2 * pp) {
        if i == 0 && rank == pp - 1 {
            o.add(Pass::Forward, 0);
            o.full_backward(1);
        } else {
            overlapped(&mut o, 0, 1);
        }
        overlapped(&mut o, 1, 0);
    }
    for _ in 0..pp - rank - 1 {
        o.full_backward(1);
        overlapped(&mut o, 1, 0);
    }
    // The drain: full backwards, then (from the middle on) split ones whose W fill the end.
    let mut split = false;
    let drain = rank + 1;
    for i in 0..drain {
        let half = drain / 2;
        for (chunk, parity) in [(1, 1), (0, 0)] {
            if i == half && rank % 2 == parity {
                split = true;
            }
            match split {
                true => o.split_backward(chunk),
                false => o.full_backward(chunk),
            }
        }
    }
    for _ in 0..pp - rank - 1 {
        o.pending_weight();
        match split {
            true => o.split_backward(0),
            false => o.full_backward(0),
        }
    }
    for _ in 0..rank + 1 {
        o.pending_weight();
    }
    o.into_slots(m)
}
