//! NumPy's legacy `numpy.random.RandomState(seed)` as far as Megatron-LM's dataset indices use
//! it: the Mersenne Twister MT19937 seeded from a 32-bit integer, and `shuffle` of a 1-D array.
//!
//! Megatron-LM shuffles its document and sample indices with `RandomState(config.random_seed)`;
//! reproducing the generator bit for bit makes our indices the same as Megatron's for the same
//! seed, so a run can move between the two on the same data in the same order.

const N: usize = 624;
const M: usize = 397;
const MATRIX_A: u32 = 0x9908_b0df;
const UPPER_MASK: u32 = 0x8000_0000;
const LOWER_MASK: u32 = 0x7fff_ffff;

/// `RandomState(seed)`: MT19937 with NumPy's integer seeding (Matsumoto and Nishimura's
/// `init_genrand`).
#[derive(Clone)]
pub struct RandomState {
    state: Box<[u32; N]>,
    pos: usize,
}

impl std::fmt::Debug for RandomState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RandomState")
            .field("pos", &self.pos)
            .finish()
    }
}

impl RandomState {
    /// The generator NumPy builds for an integer seed in `0..2^32`.
    pub fn new(seed: u32) -> Self {
        let mut state = Box::new([0u32; N]);
        state[0] = seed;
        for i in 1..N {
            let prev = state[i - 1];
            state[i] = 1_812_433_253u32
                .wrapping_mul(prev ^ (prev >> 30))
                .wrapping_add(i as u32);
        }
        RandomState { state, pos: N }
    }

    fn regenerate(&mut self) {
        let s = &mut self.state;
        for i in 0..N {
            let y = (s[i] & UPPER_MASK) | (s[(i + 1) % N] & LOWER_MASK);
            let mut next = s[(i + M) % N] ^ (y >> 1);
            if y & 1 != 0 {
                next ^= MATRIX_A;
            }
            s[i] = next;
        }
        self.pos = 0;
    }

    /// The next 32-bit output (tempered).
    pub fn next_u32(&mut self) -> u32 {
        if self.pos >= N {
            self.regenerate();
        }
        let mut y = self.state[self.pos];
        self.pos += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^ (y >> 18)
    }

    /// The next 64-bit output: two 32-bit outputs, the first one high.
    pub fn next_u64(&mut self) -> u64 {
        let hi = u64::from(self.next_u32());
        (hi << 32) | u64::from(self.next_u32())
    }

    /// A uniform integer in `0..=max` by masked rejection, as NumPy's `random_interval`.
    pub fn interval(&mut self, max: u64) -> u64 {
        if max == 0 {
            return 0;
        }
        let mask = u64::MAX >> max.leading_zeros();
        if max <= u64::from(u32::MAX) {
            loop {
                let v = u64::from(self.next_u32()) & mask;
                if v <= max {
                    return v;
                }
            }
        } else {
            loop {
                let v = self.next_u64() & mask;
                if v <= max {
                    return v;
                }
            }
        }
    }

    /// Shuffles `x` in place as `RandomState.shuffle` does a 1-D array (Fisher–Yates from the
    /// end).
    pub fn shuffle<T>(&mut self, x: &mut [T]) {
        for i in (1..x.len()).rev() {
            let j = self.interval(i as u64) as usize;
            x.swap(i, j);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mt19937_reference_outputs() {
        // The reference generator's published check: init_genrand(5489), 10,000th output.
        let mut r = RandomState::new(5489);
        let mut last = 0;
        for _ in 0..10_000 {
            last = r.next_u32();
        }
        assert_eq!(last, 4_123_659_995);
        // First outputs for seed 1234 (as `RandomState(1234).randint(0, 2**32, dtype=uint32)`
        // draws them one by one).
        let mut r = RandomState::new(1234);
        let first: Vec<u32> = (0..3).map(|_| r.next_u32()).collect();
        assert_eq!(first, [822_569_775, 2_137_449_171, 2_671_936_806]);
    }

    #[test]
    fn shuffles_like_numpy() {
        // numpy.random.RandomState(1234).shuffle(a := numpy.arange(10)); a
        let mut a: Vec<i32> = (0..10).collect();
        RandomState::new(1234).shuffle(&mut a);
        assert_eq!(a, [7, 2, 9, 1, 0, 8, 4, 5, 6, 3]);
    }
}
