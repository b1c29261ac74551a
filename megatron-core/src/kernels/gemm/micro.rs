//! The register tiles of the packed product: `MR × NR` sums of one chunk of k, held in vector
//! registers, written to C with the chunk's epilogue.
//!
//! Each tile reads an A panel (`kc × MR`, one column of the tile's rows per k) and a B panel
//! (`kc × NR`, one row of its columns per k), both packed by `packed.rs`, and keeps one
//! accumulator register per `MR` row and vector of `NR` columns: with vectors along C's rows,
//! each k costs `NR / lanes` loads of B, `MR` broadcasts of A (folded into the multiply-adds)
//! and `MR · NR / lanes` fused multiply-adds, which the tile's size keeps the FMA ports' work.
//!
//! | instruction set | tile | accumulators | chosen for |
//! | --- | --- | --- | --- |
//! | AVX-512 F | 14 × 32 | 28 of 32 zmm | Intel Xeon (two 512-bit FMA ports), AMD Zen 4/5 |
//! | AVX2 + FMA | 6 × 16 | 12 of 16 ymm | Haswell and later, Zen 1–3 |
//! | AVX512_BF16 | 14 × 32 | 28 of 32 zmm | bf16 products: Cooper Lake, Zen 4/5 |
//! | AMX-BF16 | 32 × 32 | 4 of 8 tiles | bf16 products: Sapphire Rapids and later (`amx.rs`) |
//!
//! The bf16 tile reads panels of bf16 pairs, two steps of k in each 32-bit element, the earlier
//! in the high half: `vdpbf16ps` adds the high halves' product first, and a product of two bf16
//! is exact in f32, so each step is the fused multiply-add the f32 tiles perform on the bf16
//! values, in the same order. Its sums are the f32 tiles' sums of the operands rounded to bf16,
//! bit for bit, save that `vdpbf16ps` flushes denormals to zero.
//!
//! # The arithmetic, exactly
//!
//! Every accumulator starts at +0 and takes the chunk's products in ascending k, one fused
//! multiply-add each. The epilogue then writes `α·acc` where β = 0 (C unread, it may be NaN), and
//! `fma(α, acc, β·C)` otherwise (later chunks of k pass β = 1). Edge tiles, whose rows or columns
//! stop short of the tile, compute the whole tile from zero-padded panels and write their part
//! with the same two roundings in scalar code: so an element's bits depend on neither its tile,
//! nor the blocking, nor the instruction set, nor the threads.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Steps of k before a tile's end at which it fetches its part of C.
#[cfg(target_arch = "x86_64")]
const PREFETCH_STEPS: usize = 64;

/// Where a tile writes: C's block and the chunk's epilogue.
#[derive(Debug, Clone, Copy)]
pub(super) struct Out {
    /// C's element (0, 0) of the tile.
    pub c: *mut f32,
    /// C's row stride.
    pub rsc: isize,
    /// C's column stride.
    pub csc: isize,
    /// Rows of the tile inside C (≤ MR).
    pub rows: usize,
    /// Columns of the tile inside C (≤ NR).
    pub cols: usize,
    /// α.
    pub alpha: f32,
    /// β of this chunk of k: the caller's for the first, 1 for later ones.
    pub beta: f32,
}

/// A register tile: its shape, and the function computing one chunk of k into C.
#[derive(Debug, Clone, Copy)]
pub(super) struct Tile {
    /// Rows of C per tile (the A panel's width).
    pub mr: usize,
    /// Columns of C per tile (the B panel's width).
    pub nr: usize,
    /// `"avx512 14×32"`, for the benches.
    pub name: &'static str,
    /// Whether the panels hold bf16 pairs (two steps of k in each 32-bit element) rather than
    /// f32 (one step each).
    pub pairs: bool,
    /// Whether A's panel is laid out by rows (row i's steps contiguous, as AMX's tiles load
    /// them) rather than by steps (each step's `mr` rows side by side).
    pub a_rows: bool,
    /// The panels' steps are padded with zeros to a multiple of this.
    pub k_multiple: usize,
    /// Run before a thread's blocks of a product (AMX's `ldtilecfg`): what `run` needs set up.
    pub enter: Option<unsafe fn()>,
    /// Run once a thread's blocks of a product are done (AMX's `tilerelease`).
    pub release: Option<unsafe fn()>,
    /// Computes `kc` products of the packed panels into the tile of C that `out` names.
    ///
    /// # Safety
    /// `a` holds `kc · mr` and `b` `kc · nr` elements; `out` names elements of C in bounds that
    /// only this call accesses; the CPU supports the tile's instruction set.
    pub run: unsafe fn(kc: usize, a: *const f32, b: *const f32, out: &Out),
}

/// Writes `acc` (row-major `mr × nr`) into the tile's part of C, element by element.
///
/// # Safety
/// As [`Tile::run`]; compiled into each tile's function, so `mul_add` is the FMA instruction.
#[inline(always)]
pub(super) unsafe fn write_scalar(acc: &[f32], nr: usize, out: &Out) {
    for i in 0..out.rows {
        for j in 0..out.cols {
            // SAFETY: (i, j) lies inside the tile of C the caller gave.
            unsafe {
                let e = out.c.offset(i as isize * out.rsc + j as isize * out.csc);
                let sum = acc[i * nr + j];
                *e = if out.beta == 0.0 {
                    out.alpha * sum
                } else {
                    out.alpha.mul_add(sum, out.beta * *e)
                };
            }
        }
    }
}

/// Defines one tile function: `$mr` rows by `$nv` vectors of `$lanes` columns.
#[cfg(target_arch = "x86_64")]
macro_rules! tile {
    (
        $(#[$doc:meta])*
        $name:ident, $features:literal, $mr:literal, $nv:literal, $lanes:literal, $vec:ty,
        $zero:ident, $load:ident, $store:ident, $set1:ident, $fmadd:ident, $mul:ident,
        $step:ident
    ) => {
        $(#[$doc])*
        #[target_feature(enable = $features)]
        pub(super) unsafe fn $name(kc: usize, a: *const f32, b: *const f32, out: &Out) {
            const NR: usize = $nv * $lanes;
            let mut acc: [[$vec; $nv]; $mr] = [[$zero(); $nv]; $mr];
            // SAFETY: the panels hold `kc` steps of `$mr` and `NR` elements (the caller's
            // contract); C's tile is in bounds and this call's alone.
            unsafe {
                let step = |acc: &mut [[$vec; $nv]; $mr], p: usize| {
                    let bp = b.add(p * NR);
                    let mut bv = [$zero(); $nv];
                    for v in 0..$nv {
                        bv[v] = $load(bp.add(v * $lanes));
                    }
                    let ap = a.add(p * $mr);
                    for i in 0..$mr {
                        let ai = $set1(*ap.add(i));
                        for v in 0..$nv {
                            acc[i][v] = $step(ai, bv[v], acc[i][v]);
                        }
                    }
                };
                // C's tile is read (or written) once the sums are done: its lines are fetched
                // into L1 while the last PREFETCH_STEPS steps run, early enough to arrive and
                // late enough not to be evicted by the panels streaming through L1.
                let ahead = kc.saturating_sub(PREFETCH_STEPS);
                for p in 0..ahead {
                    step(&mut acc, p);
                }
                if out.csc == 1 {
                    for i in 0..out.rows {
                        let row = out.c.offset(i as isize * out.rsc).cast::<i8>();
                        for line in (0..NR * 4).step_by(64) {
                            _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(line));
                        }
                    }
                }
                for p in ahead..kc {
                    step(&mut acc, p);
                }
                if out.rows == $mr && out.cols == NR && out.csc == 1 {
                    let alpha = $set1(out.alpha);
                    for i in 0..$mr {
                        let row = out.c.offset(i as isize * out.rsc);
                        for v in 0..$nv {
                            let e = row.add(v * $lanes);
                            // β = 1 (every chunk of k after the first) needs no β·C: 1·C is C.
                            let sum = if out.beta == 0.0 {
                                $mul(alpha, acc[i][v])
                            } else if out.beta == 1.0 {
                                $fmadd(alpha, acc[i][v], $load(e))
                            } else {
                                $fmadd(alpha, acc[i][v], $mul($load(e), $set1(out.beta)))
                            };
                            $store(e, sum);
                        }
                    }
                } else {
                    let mut spill = [0.0f32; $mr * NR];
                    for i in 0..$mr {
                        for v in 0..$nv {
                            $store(spill.as_mut_ptr().add(i * NR + v * $lanes), acc[i][v]);
                        }
                    }
                    write_scalar(&spill, NR, out);
                }
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
tile!(
    /// AVX-512: 14 rows × 32 columns, 28 zmm accumulators.
    avx512_14x32, "avx512f,fma", 14, 2, 16, __m512,
    _mm512_setzero_ps, _mm512_loadu_ps, _mm512_storeu_ps, _mm512_set1_ps, _mm512_fmadd_ps,
    _mm512_mul_ps, _mm512_fmadd_ps
);

/// `acc + a₀·b₀ + a₁·b₁` in each lane, for the bf16 pairs `(a₀, a₁)` and `(b₀, b₁)` held in the
/// lane's high and low halves (the layout `packed.rs` gives): `vdpbf16ps` adds the high halves'
/// product first, each addition one f32 fused multiply-add (products of bf16 are exact in f32),
/// denormal inputs read as zero and denormal sums flushed to zero.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn dot_pairs(a: __m512, b: __m512, acc: __m512) -> __m512 {
    // SAFETY: only compiled into `avx512bf16_14x32`, whose CPU has AVX512_BF16; the casts
    // reinterpret 512 bits. The broadcast `a` goes last, where the instruction can read it from
    // memory itself (`{1to16}`): the same sums, as each product is exact and the halves keep
    // their order.
    unsafe {
        _mm512_dpbf16_ps(
            acc,
            std::mem::transmute::<__m512, __m512bh>(b),
            std::mem::transmute::<__m512, __m512bh>(a),
        )
    }
}

#[cfg(target_arch = "x86_64")]
tile!(
    /// AVX512_BF16: 14 rows × 32 columns of f32 sums of bf16 pairs, 28 zmm accumulators; each
    /// step is two steps of k.
    avx512bf16_14x32, "avx512f,avx512bf16,fma", 14, 2, 16, __m512,
    _mm512_setzero_ps, _mm512_loadu_ps, _mm512_storeu_ps, _mm512_set1_ps, _mm512_fmadd_ps,
    _mm512_mul_ps, dot_pairs
);

#[cfg(target_arch = "x86_64")]
tile!(
    /// AVX2 + FMA: 6 rows × 16 columns, 12 ymm accumulators.
    avx2_6x16, "avx2,fma", 6, 2, 8, __m256,
    _mm256_setzero_ps, _mm256_loadu_ps, _mm256_storeu_ps, _mm256_set1_ps, _mm256_fmadd_ps,
    _mm256_mul_ps, _mm256_fmadd_ps
);

/// The AVX-512 tile.
#[cfg(target_arch = "x86_64")]
pub(super) const AVX512: Tile = Tile {
    mr: 14,
    nr: 32,
    name: "avx512 14×32",
    pairs: false,
    a_rows: false,
    k_multiple: 1,
    enter: None,
    release: None,
    run: avx512_14x32,
};

/// The AVX512_BF16 tile of bf16 products.
#[cfg(target_arch = "x86_64")]
pub(super) const AVX512_BF16: Tile = Tile {
    mr: 14,
    nr: 32,
    name: "avx512bf16 14×32",
    pairs: true,
    a_rows: false,
    k_multiple: 1,
    enter: None,
    release: None,
    run: avx512bf16_14x32,
};

/// The AVX2 + FMA tile.
#[cfg(target_arch = "x86_64")]
pub(super) const AVX2: Tile = Tile {
    mr: 6,
    nr: 16,
    name: "avx2+fma 6×16",
    pairs: false,
    a_rows: false,
    k_multiple: 1,
    enter: None,
    release: None,
    run: avx2_6x16,
};
