//! Whole documents packed into sequences: first-fit decreasing (Megatron-Bridge's default
//! packing), each bin holding at most `capacity` tokens (a training sample's `seq_length + 1`),
//! a document never split over two bins. A document longer than a bin is refused, dropped or
//! cut to the bin, as the user chooses, and counted.

use anyhow::{Result, bail};
use clap::ValueEnum;

/// What happens to a document longer than a bin.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Default)]
pub enum Overlong {
    /// Stop with an error naming the document.
    #[default]
    Error,
    /// Leave it out (counted).
    Drop,
    /// Keep its first tokens that fit (counted).
    Truncate,
}

/// What the packer did with the documents it was given.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Packing {
    /// For each bin, the indices of its documents, in placement order.
    pub bins: Vec<Vec<usize>>,
    /// Documents dropped for their length.
    pub dropped: Vec<usize>,
    /// Documents cut to the bin.
    pub truncated: Vec<usize>,
    /// Tokens placed.
    pub tokens: usize,
}

impl Packing {
    /// The share of the bins' capacity the documents fill.
    pub fn fill(&self, capacity: usize) -> f64 {
        self.tokens as f64 / (self.bins.len() * capacity).max(1) as f64
    }
}

/// Packs documents of `lengths` into bins of `capacity` tokens by first-fit decreasing: the
/// longest first (ties in input order), each into the first bin with room. `name(i)` names
/// document `i` in errors.
pub fn first_fit_decreasing(
    lengths: &[usize],
    capacity: usize,
    overlong: Overlong,
    name: impl Fn(usize) -> String,
) -> Result<Packing> {
    if capacity == 0 {
        bail!("bins of 0 tokens hold nothing");
    }
    let mut packing = Packing::default();
    let mut order: Vec<usize> = (0..lengths.len()).collect();
    order.sort_by(|&a, &b| lengths[b].cmp(&lengths[a]).then(a.cmp(&b)));
    // The bins' free room, and for the first-fit search a tree of the most room in each span.
    let mut room = FreeRoom::new();
    for i in order {
        let mut len = lengths[i];
        if len > capacity {
            match overlong {
                Overlong::Error => bail!(
                    "{} has {len} tokens, more than a sequence of {capacity} holds (--seq-length \
                     + 1): choose --overlong drop or truncate, or a longer --seq-length",
                    name(i)
                ),
                Overlong::Drop => {
                    packing.dropped.push(i);
                    continue;
                }
                Overlong::Truncate => {
                    packing.truncated.push(i);
                    len = capacity;
                }
            }
        }
        if len == 0 {
            continue;
        }
        let bin = match room.first_with(len) {
            Some(b) => b,
            None => {
                packing.bins.push(Vec::new());
                room.push(capacity)
            }
        };
        room.take(bin, len);
        packing.bins[bin].push(i);
        packing.tokens += len;
    }
    packing.truncated.sort_unstable();
    packing.dropped.sort_unstable();
    Ok(packing)
}

/// Each document in a bin of its own, in input order (the rest of each bin padding): what
/// packing is measured against. Overlong documents as [`first_fit_decreasing`] treats them.
pub fn one_per_bin(
    lengths: &[usize],
    capacity: usize,
    overlong: Overlong,
    name: impl Fn(usize) -> String,
) -> Result<Packing> {
    let mut packing = Packing::default();
    for (i, &len) in lengths.iter().enumerate() {
        let one = first_fit_decreasing(&[len], capacity, overlong, |_| name(i))?;
        if !one.dropped.is_empty() {
            packing.dropped.push(i);
            continue;
        }
        if !one.truncated.is_empty() {
            packing.truncated.push(i);
        }
        packing.tokens += one.tokens;
        packing.bins.push(vec![i]);
    }
    Ok(packing)
}

/// The free room of each bin, with a max-tree over it: the first bin with at least `n` free
/// tokens is found in `O(log bins)`.
struct FreeRoom {
    /// Leaves from `size` on; node `k` holds the most room of its two children.
    tree: Vec<usize>,
    size: usize,
    bins: usize,
}

impl FreeRoom {
    fn new() -> Self {
        FreeRoom {
            tree: vec![0; 2],
            size: 1,
            bins: 0,
        }
    }

    /// Opens a bin with `room` free tokens; returns its index.
    fn push(&mut self, room: usize) -> usize {
        if self.bins == self.size {
            // Double the leaves, keeping the bins' room.
            let leaves: Vec<usize> = self.tree[self.size..].to_vec();
            self.size *= 2;
            self.tree = vec![0; 2 * self.size];
            self.tree[self.size..self.size + leaves.len()].copy_from_slice(&leaves);
            for k in (1..self.size).rev() {
                self.tree[k] = self.tree[2 * k].max(self.tree[2 * k + 1]);
            }
        }
        let b = self.bins;
        self.bins += 1;
        self.set(b, room);
        b
    }

    fn set(&mut self, b: usize, room: usize) {
        let mut k = self.size + b;
        self.tree[k] = room;
        while k > 1 {
            k /= 2;
            self.tree[k] = self.tree[2 * k].max(self.tree[2 * k + 1]);
        }
    }

    fn take(&mut self, b: usize, n: usize) {
        let room = self.tree[self.size + b] - n;
        self.set(b, room);
    }

    fn first_with(&self, n: usize) -> Option<usize> {
        if self.bins == 0 || self.tree[1] < n {
            return None;
        }
        let mut k = 1;
        while k < self.size {
            k = if self.tree[2 * k] >= n {
                2 * k
            } else {
                2 * k + 1
            };
        }
        Some(k - self.size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// First-fit decreasing by a plain scan, as the definition reads.
    fn by_scan(lengths: &[usize], capacity: usize) -> Vec<Vec<usize>> {
        let mut order: Vec<usize> = (0..lengths.len()).collect();
        order.sort_by(|&a, &b| lengths[b].cmp(&lengths[a]).then(a.cmp(&b)));
        let mut bins: Vec<(usize, Vec<usize>)> = Vec::new();
        for i in order {
            match bins.iter_mut().find(|(room, _)| *room >= lengths[i]) {
                Some((room, docs)) => {
                    *room -= lengths[i];
                    docs.push(i);
                }
                None => bins.push((capacity - lengths[i], vec![i])),
            }
        }
        bins.into_iter().map(|(_, d)| d).collect()
    }

    #[test]
    fn packs_as_first_fit_decreasing_defines_it() {
        let lengths = [3, 9, 4, 4, 2, 7, 1, 5, 5, 6, 8, 2, 3];
        let p = first_fit_decreasing(&lengths, 10, Overlong::Error, |i| i.to_string()).unwrap();
        assert_eq!(p.bins, by_scan(&lengths, 10));
        assert_eq!(p.bins[0], vec![1, 6]);
        assert_eq!(p.tokens, lengths.iter().sum::<usize>());
        let mut seen: Vec<usize> = p.bins.concat();
        seen.sort_unstable();
        assert_eq!(seen, (0..lengths.len()).collect::<Vec<_>>());
        // Many documents: the tree agrees with the scan.
        let many: Vec<usize> = (0..500).map(|i| 1 + (i * 37 + i * i) % 60).collect();
        let p = first_fit_decreasing(&many, 64, Overlong::Error, |i| i.to_string()).unwrap();
        assert_eq!(p.bins, by_scan(&many, 64));
        assert!(p.fill(64) > 0.9, "{}", p.fill(64));
    }

    #[test]
    fn overlong_documents_are_refused_dropped_or_cut() {
        let lengths = [3, 12, 5];
        let err = first_fit_decreasing(&lengths, 10, Overlong::Error, |i| format!("line {i}"))
            .unwrap_err();
        assert!(err.to_string().starts_with("line 1 has 12 tokens"), "{err}");
        let p = first_fit_decreasing(&lengths, 10, Overlong::Drop, |i| i.to_string()).unwrap();
        assert_eq!(
            (p.bins.clone(), p.dropped.clone()),
            (vec![vec![2, 0]], vec![1])
        );
        let p = first_fit_decreasing(&lengths, 10, Overlong::Truncate, |i| i.to_string()).unwrap();
        assert_eq!(
            (p.bins.clone(), p.truncated.clone()),
            (vec![vec![1], vec![2, 0]], vec![1])
        );
    }
}
