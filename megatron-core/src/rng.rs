//! Counter-based random numbers: Philox4x32-10 and the stream ids that key dropout masks.
//!
//! A counter-based generator is a pure function of `(counter, key)`, so any element of a random
//! tensor can be produced on its own, on any rank and on any device. That is what makes dropout
//! masks independent of the parallel layout: a mask element depends only on the seed, the stream
//! id and the element's *logical* index, never on how the tensor is sharded.

/// Philox4x32 round multipliers (Salmon et al., SC'11; Random123).
pub const PHILOX_M4X32: [u32; 2] = [0xD251_1F53, 0xCD9E_8D57];
/// Philox4x32 key-schedule increments (golden ratio and √3 − 1, as 32-bit fractions).
pub const PHILOX_W32: [u32; 2] = [0x9E37_79B9, 0xBB67_AE85];

/// Number of Philox rounds of [`philox4x32_10`].
const ROUNDS: usize = 10;

/// High and low 32-bit halves of the 64-bit product `a·b`.
#[inline(always)]
fn mul_hi_lo(a: u32, b: u32) -> (u32, u32) {
    let p = u64::from(a) * u64::from(b);
    ((p >> 32) as u32, p as u32)
}

/// One Philox4x32 S-box/P-box round.
#[inline(always)]
fn round(c: [u32; 4], k: [u32; 2]) -> [u32; 4] {
    let (hi0, lo0) = mul_hi_lo(PHILOX_M4X32[0], c[0]);
    let (hi1, lo1) = mul_hi_lo(PHILOX_M4X32[1], c[2]);
    [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0]
}

/// Philox4x32-10: four random 32-bit words for a 128-bit `counter` under a 64-bit `key`.
///
/// Bit-identical to Random123's `philox4x32(ctr, key)` with 10 rounds (and to cuRAND's Philox
/// block function): ten rounds, the key bumped by [`PHILOX_W32`] between consecutive rounds.
#[inline]
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let mut c = counter;
    let mut k = key;
    c = round(c, k);
    for _ in 1..ROUNDS {
        k = [
            k[0].wrapping_add(PHILOX_W32[0]),
            k[1].wrapping_add(PHILOX_W32[1]),
        ];
        c = round(c, k);
    }
    c
}

/// Number of Philox blocks [`philox4x32_10_batch`] computes at once.
pub const PHILOX_BATCH: usize = 16;

/// [`philox4x32_10`] of [`PHILOX_BATCH`] counters at once, in structure-of-arrays form:
/// `counters[w][j]` is word `w` of counter `j`, and the result is laid out the same way.
///
/// Bit-identical to calling [`philox4x32_10`] on each counter; written so that the compiler
/// vectorises it. Each 32-bit word is kept zero-extended in a 64-bit lane, so that a round is
/// one 32×32 → 64-bit vector multiply per multiplied word (`pmuludq`), shifts, masks and XORs,
/// with no packing of the products' halves back into 32-bit lanes (which costs more than the
/// multiplies on AVX-512).
#[inline(always)]
pub fn philox4x32_10_batch(
    counters: [[u32; PHILOX_BATCH]; 4],
    key: [u32; 2],
) -> [[u32; PHILOX_BATCH]; 4] {
    const LO: u64 = 0xffff_ffff;
    let mut c = [[0u64; PHILOX_BATCH]; 4];
    for (wide, narrow) in c.iter_mut().zip(&counters) {
        for (d, &v) in wide.iter_mut().zip(narrow) {
            *d = u64::from(v);
        }
    }
    let [mut c0, mut c1, mut c2, mut c3] = c;
    let (m0, m1) = (u64::from(PHILOX_M4X32[0]), u64::from(PHILOX_M4X32[1]));
    let (mut k0, mut k1) = (u64::from(key[0]), u64::from(key[1]));
    for round in 0..ROUNDS {
        if round > 0 {
            k0 = (k0 + u64::from(PHILOX_W32[0])) & LO;
            k1 = (k1 + u64::from(PHILOX_W32[1])) & LO;
        }
        for j in 0..PHILOX_BATCH {
            // Every lane holds a value below 2³²; the masks tell the compiler so.
            let p0 = m0 * (c0[j] & LO);
            let p1 = m1 * (c2[j] & LO);
            c0[j] = (p1 >> 32) ^ c1[j] ^ k0;
            c1[j] = p1 & LO;
            c2[j] = (p0 >> 32) ^ c3[j] ^ k1;
            c3[j] = p0 & LO;
        }
    }
    let mut out = [[0u32; PHILOX_BATCH]; 4];
    for (narrow, wide) in out.iter_mut().zip([c0, c1, c2, c3]) {
        for (d, v) in narrow.iter_mut().zip(wide) {
            *d = v as u32;
        }
    }
    out
}

/// SplitMix64's golden-ratio increment, `⌊2⁶⁴/φ⌋` rounded to odd.
pub const SPLITMIX64_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64's output function (Stafford's Mix13), a bijection of `u64`.
#[inline]
pub fn splitmix64_mix(z: u64) -> u64 {
    let z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    let z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Hashes a list of components (e.g. step, micro-batch, layer, site) into a 64-bit stream id.
///
/// SplitMix64 chaining, starting from `h = 0`: for each component `c` in order,
/// `h ← splitmix64_mix((h ^ c) + SPLITMIX64_GAMMA)` (wrapping add), i.e. the component is XORed
/// into the state, which then takes one SplitMix64 step. Each step is a bijection of `c` for a
/// fixed prefix, so lists that differ only in their last component never collide, and `[a]` and
/// `[a, 0]` differ. The empty list gives 0.
pub fn stream_id(components: &[u64]) -> u64 {
    components.iter().fold(0u64, |h, &c| {
        splitmix64_mix((h ^ c).wrapping_add(SPLITMIX64_GAMMA))
    })
}

/// One independent Philox stream: the key is the run's seed, the stream id names the use site.
///
/// Block `b` of the stream is `philox4x32_10([lo32(b), hi32(b), lo32(stream), hi32(stream)], key)`
/// and the random word of logical element `i` is word `i % 4` of block `i / 4`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DropoutStream {
    /// Philox key: `[lo32(seed), hi32(seed)]`.
    pub key: [u32; 2],
    /// Stream id, the upper 64 bits of every Philox counter.
    pub stream: u64,
}

impl DropoutStream {
    /// The stream for `seed` at the site named by `components` (hashed with [`stream_id`]).
    pub fn new(seed: u64, components: &[u64]) -> Self {
        DropoutStream {
            key: [seed as u32, (seed >> 32) as u32],
            stream: stream_id(components),
        }
    }

    /// A stream of its own for part `part` of what this stream draws for (one document of a
    /// packed sample, say), under the same key.
    pub fn part(&self, part: &[u64]) -> Self {
        let mut components = vec![self.stream];
        components.extend_from_slice(part);
        DropoutStream {
            key: self.key,
            stream: stream_id(&components),
        }
    }

    /// The four random words of block `block` (logical elements `4·block .. 4·block + 4`).
    #[inline]
    pub fn block(&self, block: u64) -> [u32; 4] {
        let s = self.stream;
        philox4x32_10(
            [
                block as u32,
                (block >> 32) as u32,
                s as u32,
                (s >> 32) as u32,
            ],
            self.key,
        )
    }

    /// The words of blocks `first .. first + PHILOX_BATCH` in structure-of-arrays form:
    /// `[w][j]` is word `w` of block `first + j` (block numbers wrap around `u64`).
    #[inline(always)]
    pub fn blocks(&self, first: u64) -> [[u32; PHILOX_BATCH]; 4] {
        let s = self.stream;
        let (mut lo, mut hi) = ([0u32; PHILOX_BATCH], [0u32; PHILOX_BATCH]);
        for (j, (l, h)) in lo.iter_mut().zip(&mut hi).enumerate() {
            let block = first.wrapping_add(j as u64);
            (*l, *h) = (block as u32, (block >> 32) as u32);
        }
        let counters = [
            lo,
            hi,
            [s as u32; PHILOX_BATCH],
            [(s >> 32) as u32; PHILOX_BATCH],
        ];
        philox4x32_10_batch(counters, self.key)
    }

    /// The random words of logical elements `4·first .. 4·(first + PHILOX_BATCH)`, in order
    /// (the words of [`DropoutStream::blocks`], interleaved).
    #[inline(always)]
    pub fn words(&self, first: u64) -> [u32; 4 * PHILOX_BATCH] {
        let b = self.blocks(first);
        let mut out = [0u32; 4 * PHILOX_BATCH];
        for (j, w) in out.chunks_exact_mut(4).enumerate() {
            w.copy_from_slice(&[b[0][j], b[1][j], b[2][j], b[3][j]]);
        }
        out
    }

    /// The random word of logical element `index`.
    #[inline]
    pub fn word(&self, index: u64) -> u32 {
        self.block(index / 4)[(index % 4) as usize]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random123's known-answer vectors for philox4x32 with 10 rounds (`kat_vectors`):
    /// counter, key, expected output.
    const KAT: [([u32; 4], [u32; 2], [u32; 4]); 3] = [
        (
            [0; 4],
            [0; 2],
            [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8],
        ),
        (
            [u32::MAX; 4],
            [u32::MAX; 2],
            [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd],
        ),
        (
            [0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344],
            [0xa409_3822, 0x299f_31d0],
            [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1],
        ),
    ];

    #[test]
    fn philox_known_answers() {
        for (ctr, key, want) in KAT {
            assert_eq!(
                philox4x32_10(ctr, key),
                want,
                "ctr {ctr:08x?} key {key:08x?}"
            );
        }
    }

    #[test]
    #[allow(clippy::needless_range_loop)] // counter j of a structure of arrays
    fn batches_equal_the_scalar_blocks() {
        let keys = [[0, 0], [u32::MAX; 2], [0xa409_3822, 0x299f_31d0]];
        // Starts that make the low counter word wrap into the high one inside a batch, and the
        // whole counter wrap around u64.
        let starts = [
            0u64,
            1,
            17,
            u64::from(u32::MAX) - 5,
            (7u64 << 32) - 16,
            (0xdead_beefu64 << 32) | 0xffff_fff9,
            u64::MAX - 3,
        ];
        for key in keys {
            for (si, &first) in starts.iter().enumerate() {
                let stream = [0x1234_5678u32, 0x9abc_def0u32.wrapping_mul(si as u32)];
                let mut counters = [[0u32; PHILOX_BATCH]; 4];
                for j in 0..PHILOX_BATCH {
                    let b = first.wrapping_add(j as u64);
                    counters[0][j] = b as u32;
                    counters[1][j] = (b >> 32) as u32;
                    counters[2][j] = stream[0] ^ j as u32;
                    counters[3][j] = stream[1];
                }
                let got = philox4x32_10_batch(counters, key);
                for j in 0..PHILOX_BATCH {
                    let ctr = [0, 1, 2, 3].map(|w| counters[w][j]);
                    let want = philox4x32_10(ctr, key);
                    assert_eq!([0, 1, 2, 3].map(|w| got[w][j]), want, "{ctr:08x?}");
                }
            }
        }
        // The known answers, as lanes of a batch.
        for (ctr, key, want) in KAT {
            let got = philox4x32_10_batch([0, 1, 2, 3].map(|w| [ctr[w]; PHILOX_BATCH]), key);
            for j in 0..PHILOX_BATCH {
                assert_eq!([0, 1, 2, 3].map(|w| got[w][j]), want);
            }
        }
    }

    #[test]
    fn stream_batches_follow_the_counter_layout() {
        let s = DropoutStream::new(0x0123_4567_89ab_cdef, &[5, 6]);
        for first in [
            0u64,
            3,
            u64::from(u32::MAX) - 7,
            (1u64 << 62) - 9,
            u64::MAX - 2,
        ] {
            let blocks = s.blocks(first);
            let words = s.words(first);
            for j in 0..PHILOX_BATCH {
                let b = s.block(first.wrapping_add(j as u64));
                assert_eq!([0, 1, 2, 3].map(|w| blocks[w][j]), b, "block {first} + {j}");
                assert_eq!(&words[4 * j..4 * j + 4], &b);
            }
        }
    }

    #[test]
    fn splitmix_matches_reference_sequence() {
        // SplitMix64 seeded with 0: state += γ, output mix(state). First outputs of the reference
        // generator (Vigna's splitmix64.c).
        assert_eq!(splitmix64_mix(SPLITMIX64_GAMMA), 0xe220_a839_7b1d_cdaf);
        assert_eq!(
            splitmix64_mix(SPLITMIX64_GAMMA.wrapping_mul(2)),
            0x6e78_9e6a_a1b9_65f4
        );
    }

    #[test]
    fn stream_ids_are_chained_and_distinct() {
        assert_eq!(stream_id(&[]), 0);
        assert_eq!(stream_id(&[0]), splitmix64_mix(SPLITMIX64_GAMMA));
        let a = stream_id(&[7]);
        assert_eq!(
            stream_id(&[7, 3]),
            splitmix64_mix((a ^ 3).wrapping_add(SPLITMIX64_GAMMA))
        );
        let lists: [&[u64]; 8] = [
            &[],
            &[0],
            &[0, 0],
            &[1],
            &[1, 0],
            &[0, 1],
            &[1, 2, 3, 4],
            &[1, 2, 4, 3],
        ];
        for (i, x) in lists.iter().enumerate() {
            for y in &lists[i + 1..] {
                assert_ne!(stream_id(x), stream_id(y), "{x:?} vs {y:?}");
            }
        }
    }

    #[test]
    fn stream_words_follow_the_counter_layout() {
        let s = DropoutStream::new(0x0123_4567_89ab_cdef, &[5, 6]);
        assert_eq!(s.key, [0x89ab_cdef, 0x0123_4567]);
        let sid = stream_id(&[5, 6]);
        for i in [0u64, 1, 2, 3, 4, 1023, (7u64 << 32) + 9] {
            let b = i / 4;
            let ctr = [b as u32, (b >> 32) as u32, sid as u32, (sid >> 32) as u32];
            assert_eq!(s.word(i), philox4x32_10(ctr, s.key)[(i % 4) as usize]);
        }
        assert_ne!(
            s.block(0),
            DropoutStream::new(0x0123_4567_89ab_cdef, &[5, 7]).block(0)
        );
        assert_ne!(s.block(0), DropoutStream::new(1, &[5, 6]).block(0));
    }
}
