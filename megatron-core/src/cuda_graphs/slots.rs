//! In-flight microbatch slots: which static buffers (and graphs) a pass uses, reused as the
//! pipeline order frees them.
//!
//! A forward of chunk `c` takes the lowest slot of `c` that no microbatch holds; the backward of
//! that microbatch frees it (its forward's outputs and saved activations are dead after it). So
//! a chunk needs as many slots as it ever has microbatches in flight: the schedule's bound (the
//! warm-up plus one), never the number of microbatches.

use crate::pipeline_parallel::{Slot, Stage, WalkError, walk};

/// Every (chunk, microbatch)'s slot for one rank's order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotPlan {
    /// `slot[chunk][microbatch]`.
    slot: Vec<Vec<usize>>,
    /// Slots each chunk needs.
    per_chunk: Vec<usize>,
    /// The most microbatches in flight at once over all chunks.
    max_live: usize,
}

/// Hands out slots as passes run: a forward takes its chunk's lowest free slot, the backward
/// of the same microbatch frees it. [`SlotPlan`] walks an order with it; a pipeline's executor
/// uses it live, so both give the same slots.
#[derive(Debug, Clone, Default)]
pub struct SlotAllocator {
    /// `slot[chunk][microbatch]`, for the microbatches seen.
    slot: Vec<Vec<usize>>,
    /// Per chunk, which slots are held.
    held: Vec<Vec<bool>>,
    live: usize,
    max_live: usize,
}

impl SlotAllocator {
    /// An allocator with no slot held.
    pub fn new() -> SlotAllocator {
        SlotAllocator::default()
    }

    /// The slot of `microbatch`'s forward through `chunk`: its chunk's lowest free one.
    pub fn take(&mut self, chunk: usize, microbatch: usize) -> usize {
        if self.held.len() <= chunk {
            self.held.resize(chunk + 1, Vec::new());
            self.slot.resize(chunk + 1, Vec::new());
        }
        let held = &mut self.held[chunk];
        let free = match held.iter().position(|h| !h) {
            Some(free) => free,
            None => {
                held.push(false);
                held.len() - 1
            }
        };
        held[free] = true;
        let slots = &mut self.slot[chunk];
        if slots.len() <= microbatch {
            slots.resize(microbatch + 1, 0);
        }
        slots[microbatch] = free;
        self.live += 1;
        self.max_live = self.max_live.max(self.live);
        free
    }

    /// The slot `microbatch` holds in `chunk` (taken by its forward).
    pub fn slot(&self, chunk: usize, microbatch: usize) -> usize {
        self.slot
            .get(chunk)
            .and_then(|s| s.get(microbatch))
            .copied()
            .unwrap_or(0)
    }

    /// Frees `microbatch`'s slot in `chunk` (its backward ran) and returns it.
    pub fn free(&mut self, chunk: usize, microbatch: usize) -> usize {
        let slot = self.slot(chunk, microbatch);
        if let Some(h) = self.held.get_mut(chunk).and_then(|h| h.get_mut(slot))
            && *h
        {
            *h = false;
            self.live -= 1;
        }
        slot
    }
}

impl Stage for SlotAllocator {
    type Error = WalkError;

    fn forward(&mut self, chunk: usize, microbatch: usize) -> Result<(), WalkError> {
        self.take(chunk, microbatch);
        Ok(())
    }

    fn backward(&mut self, chunk: usize, microbatch: usize) -> Result<(), WalkError> {
        self.free(chunk, microbatch);
        Ok(())
    }

    /// Graph scopes run in forwards and backwards only (a schedule with weight-gradient passes
    /// runs without them).
    fn weight(&mut self, _chunk: usize, _microbatch: usize) -> Result<(), WalkError> {
        Ok(())
    }
}

impl SlotPlan {
    /// The slots of a rank running `order` over `chunks` chunks and `microbatches`
    /// microbatches.
    pub fn new(order: &[Slot], chunks: usize, microbatches: usize) -> Result<SlotPlan, WalkError> {
        let mut assign = SlotAllocator::new();
        assign.held.resize(chunks, Vec::new());
        assign.slot.resize(chunks, vec![0; microbatches]);
        walk(order, chunks, microbatches, false, &mut assign)?;
        Ok(SlotPlan {
            per_chunk: assign.held.iter().map(Vec::len).collect(),
            slot: assign.slot,
            max_live: assign.max_live,
        })
    }

    /// One slot per chunk: microbatches that run forward and backward one after the other.
    pub fn sequential(chunks: usize, microbatches: usize) -> SlotPlan {
        SlotPlan {
            slot: vec![vec![0; microbatches]; chunks],
            per_chunk: vec![1; chunks],
            max_live: 1,
        }
    }

    /// The slot of `microbatch` in `chunk`.
    pub fn slot(&self, chunk: usize, microbatch: usize) -> usize {
        self.slot[chunk][microbatch]
    }

    /// The slots `chunk` needs.
    pub fn slots(&self, chunk: usize) -> usize {
        self.per_chunk[chunk]
    }

    /// The slots of every chunk.
    pub fn per_chunk(&self) -> &[usize] {
        &self.per_chunk
    }

    /// The most microbatches in flight at once over all chunks.
    pub fn max_live(&self) -> usize {
        self.max_live
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline_parallel::{Schedule, ScheduleConfig};

    #[test]
    fn one_f_one_b_reuses_a_slot_once_its_backward_ran() {
        // PP 4, rank 0: 3 warm-up forwards, then F/B pairs.
        let schedule = Schedule::new(ScheduleConfig::new(4, 1, 8)).unwrap();
        let plan = SlotPlan::new(&schedule.ranks[0].order, 1, 8).unwrap();
        assert_eq!(plan.slots(0), 4);
        // Microbatch 4 runs after microbatch 0's backward: it takes slot 0 again.
        let slots: Vec<usize> = (0..8).map(|m| plan.slot(0, m)).collect();
        assert_eq!(slots, [0, 1, 2, 3, 0, 1, 2, 3]);
        let last = SlotPlan::new(&schedule.ranks[3].order, 1, 8).unwrap();
        assert_eq!(last.slots(0), 1);
    }

    #[test]
    fn the_peak_is_the_seeds_bound_whatever_the_microbatches() {
        // The seed: activations in flight peak at (PP − rank − 1)·2 + (VPP − 1)·PP + 1.
        for m in [8, 16, 32, 64] {
            let schedule = Schedule::new(ScheduleConfig::new(4, 2, m)).unwrap();
            for rank in 0..4 {
                let plan = SlotPlan::new(&schedule.ranks[rank].order, 2, m).unwrap();
                assert_eq!(
                    plan.max_live(),
                    (4 - rank - 1) * 2 + 4 + 1,
                    "rank {rank}, M {m}"
                );
                assert!(plan.per_chunk().iter().all(|&s| s <= plan.max_live()));
            }
        }
    }
}
