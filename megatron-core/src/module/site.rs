//! `Site`: the identity of a call site in a model, stable across layouts.

/// A point in the model's call tree (`blocks.3.attn.dropout`), hashed to 64 bits.
///
/// Dropout streams are keyed by the site, the step and the microbatch, never by a rank, so the
/// same element of the same activation draws the same decision whatever tp, pp or dp is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Site(pub u64);

impl Site {
    /// The root of a model.
    pub const ROOT: Site = Site(0xcbf2_9ce4_8422_2325);

    /// The site of a named child (a field or an operation).
    pub fn child(self, name: &str) -> Site {
        // FNV-1a over the name, started from the parent's hash, then mixed.
        let mut h = self.0 ^ 0x2f;
        for b in name.bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        Site(crate::rng::splitmix64_mix(h))
    }

    /// The site of the `i`-th element of a list (a layer of a stack).
    pub fn index(self, i: usize) -> Site {
        Site(crate::rng::splitmix64_mix(
            self.0 ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x5a,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sites_are_distinct_and_stable() {
        let a = Site::ROOT.child("blocks").index(3).child("attn");
        assert_eq!(a, Site::ROOT.child("blocks").index(3).child("attn"));
        assert_ne!(a, Site::ROOT.child("blocks").index(2).child("attn"));
        assert_ne!(Site::ROOT.child("ab"), Site::ROOT.child("a").child("b"));
        assert_ne!(Site::ROOT.index(0), Site::ROOT);
    }
}
