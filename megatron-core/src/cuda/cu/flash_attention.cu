// Causal self-attention in tiles (the FlashAttention-2 algorithm): the scores, probabilities
// and their gradients live in registers, a tile at a time, and never reach global memory. The
// products run on the tensor cores (mma.sync m16n8k16, bf16 operands, f32 accumulation); the
// softmax is online (running row maximum and sum, rescaling the partial output), and the
// backward recomputes the probabilities from the saved log-sum-exp of every row. The backward
// has FlashAttention-2's five products without its atomics: one kernel per block of keys
// recomputes the scores and the probability gradients and gives dk and dv, storing the score
// gradients (bf16) of a chunk of queries; a second kernel per block of queries multiplies them
// by the keys (dq). Each gradient element is summed in one fixed order: the same bits every run.
// With dropout the forward also stores which elements it kept, a bit each (see keep_word_at),
// and the backward reads them instead of drawing the mask a second time.
//
// Layout: the fused projection `qkv` (bf16) holds, per position, batch entry and head, the
// head's query, key and value (d elements each, in that order); row i of head h of batch entry
// b starts `i·seq_stride + b·batch_stride + h·head_stride` elements in (Megatron-LM's
// [s, b, heads·3·d]: seq_stride = b·heads·3d, batch_stride = heads·3d, head_stride = 3d). Its
// gradient `dqkv` (bf16, what the projection's backward multiplies by) has the same layout; the
// output o (bf16, the output projection's operand), its gradient and its bf16 copy have theirs
// (o_*). Outputs are rounded once from the f32 accumulators. The log-sum-exp and the
// backward's row sums are [b, heads, s] (f32).
//
// Semantics are the CPU's attention with queries and keys of one sequence (sq = sk = s): query
// i sees keys j ≤ i (with a sliding window, also j ≥ i − window: `window` is s without one),
// probabilities softmax(scale·q·kᵀ) over them, attention dropout with the
// CPU's Philox mask over the [b, heads, s, s] probabilities (the mask's local element
// ((b·heads + h)·s + i)·s + j), and the output the dropped probabilities times v. The
// probabilities are rounded to bf16 for their product with v, as the unfused kernels store
// them with bf16 products. Rows are assumed finite (no ±∞/NaN scores).
//
// Packed documents (FlashAttention's variable-length sequences, in one launch): with a table
// `docs` of each position's document, query i also sees only keys of its own document. Row i
// of batch entry b has docs[b·s + i] = first | end << 32, its document's first position and the
// position after its last (null: one document). A query's first visible key is then the larger
// of its document's first and i − window: the forward and the query-gradient kernels start
// their key loop at the tile holding their block's first visible key (the tiles wholly before
// every row's document are skipped, not masked), and the key-gradient kernel ends its query
// loop after the last query that sees one of its block's keys. Inside the tiles walked, each
// row masks the keys before its own first visible one. The emulation counts the tiles walked.
//
// Tiles move through shared memory FlashAttention-2's way: global → shared by asynchronous
// 16-byte copies (cp.async) into two stages, the next tile's copies in flight while the
// current one is multiplied; shared → registers by ldmatrix, transposing (.trans) where a
// product needs a tile's columns (values, keys, queries and output gradients are read as they
// lie, never stored transposed). Only tiles that cross the causal diagonal or the sequence's
// end evaluate the mask per element.
//
// Warps own 16 rows of a tile each; FA_THREADS threads per block. Head dimensions 32, 64, 96
// and 128 are instantiated; the kernels take the head dimension at run time. Positions are
// 32-bit (the launchers refuse sequences of 2^31 and more).

#define FA_WARPS 4
#define FA_THREADS (FA_WARPS * WARP)
// Rows of a block: queries of the forward and the query gradient, keys of the key gradient.
#define FA_ROWS (16 * FA_WARPS)
// Keys per tile of the forward; queries per tile of the key gradient.
#define FA_FWD_KEYS 64
#define FA_BWD_COLS 32
// Keys per tile of the query gradient.
#define FA_DQ_KEYS 64
// Padding (in bf16 elements) of every shared row, so that the 8 rows an ldmatrix reads fall
// on different banks: rows of 2·D + 16 bytes (D a multiple of 32) put 8 consecutive rows'
// 16-byte pieces on 8 different groups of 4 banks.
#define FA_PAD 8

typedef unsigned short bf16_t;

// The block's dynamic shared memory (16-byte aligned), as `unsigned char* name`.
#ifdef EMULATED_CUDA
#define DYNAMIC_SHARED(name) unsigned char* name = emu_dynamic_shared
#else
#define DYNAMIC_SHARED(name) extern __shared__ __align__(16) unsigned char name[]
#endif

// ---------------------------------------------------------------------------------------------
// Shared memory: asynchronous copies in, matrix loads out.

// An address in shared memory: on a GPU the shared state space's 32-bit byte address (so that
// the constant parts of tile offsets fold into the instructions), in the emulation a pointer.
// Both take byte offsets with `+`.
#ifdef EMULATED_CUDA
typedef unsigned char* smem_t;
__device__ __forceinline__ smem_t smem(void* p) { return static_cast<unsigned char*>(p); }
#else
typedef u32 smem_t;
__device__ __forceinline__ smem_t smem(void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
#endif

// Starts copying `BYTES` (4 or 16, both addresses aligned to it) from global to shared memory;
// the copy lands once a later `copies_wait` covers the group it was committed in.
template <int BYTES>
__device__ __forceinline__ void copy_async(smem_t dst, const void* src) {
#ifdef EMULATED_CUDA
    emu_cp_async(dst, src, BYTES);
#else
    if (BYTES == 16) {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
    } else {
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(dst), "l"(src), "n"(BYTES)
                     : "memory");
    }
#endif
}

// Closes the group of this thread's copies started since the last commit.
__device__ __forceinline__ void copies_commit() {
#ifdef EMULATED_CUDA
    emu_cp_async_commit();
#else
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Waits until at most the newest `PENDING` committed groups of this thread are in flight (a
// barrier then makes every thread's landed copies visible to the block).
template <int PENDING>
__device__ __forceinline__ void copies_wait() {
#ifdef EMULATED_CUDA
    emu_cp_async_wait(PENDING);
#else
    asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory");
#endif
}

// Stores 16 bytes (4 words) to shared memory.
__device__ __forceinline__ void store16(smem_t dst, uint4 v) {
#ifdef EMULATED_CUDA
    emu_shared_write(dst, 16);
    std::memcpy(dst, &v, 16);
#else
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst), "r"(v.x), "r"(v.y),
                 "r"(v.z), "r"(v.w)
                 : "memory");
#endif
}

// A value of shared memory read (written) through a plain pointer: on a GPU the access
// itself; the emulation also checks it for races with the block's other threads.
template <class T>
__device__ __forceinline__ T shared_load(const T* p) {
#ifdef EMULATED_CUDA
    emu_shared_read(p, sizeof(T));
#endif
    return *p;
}

template <class T>
__device__ __forceinline__ void shared_store(T* p, T v) {
#ifdef EMULATED_CUDA
    emu_shared_write(p, sizeof(T));
#endif
    *p = v;
}

// Four 8×8 bf16 matrices from shared memory (ldmatrix .x4): lane 8i + r gives the address of
// row r of matrix i; lane 4g + t receives in x[i] the elements (g, 2t), (g, 2t + 1) of matrix
// i, or with TRANS (2t, g), (2t + 1, g). Rows are 16-byte aligned.
template <bool TRANS>
__device__ __forceinline__ void load_matrices(u32* x, smem_t row) {
#ifdef EMULATED_CUDA
    emu_ldmatrix_x4(x, row, TRANS);
#else
    if (TRANS) {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(x[0]), "=r"(x[1]), "=r"(x[2]), "=r"(x[3])
                     : "r"(row));
    } else {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(x[0]), "=r"(x[1]), "=r"(x[2]), "=r"(x[3])
                     : "r"(row));
    }
#endif
}

// Two bf16 (the first in the low half) of two floats, rounded to nearest even (finite values:
// the emulation rounds as bf16_bits, a GPU in one conversion of the pair).
__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
#ifdef EMULATED_CUDA
    return bf16_bits(lo) | (bf16_bits(hi) << 16);
#else
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#endif
}

// 2^x, ex2.approx.ftz on a GPU (relative error below 2^-22; results below 2^-126 flush to 0;
// 2^-∞ = 0).
__device__ __forceinline__ float exp2_fast(float x) {
#ifdef EMULATED_CUDA
    return exp2f(x);
#else
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
#endif
}

// log2(e): natural exponents times it are base-2 exponents.
#define LOG2E 1.4426950408889634f

// d += a·b on the tensor cores: one m16n8k16 product of bf16 fragments with f32 accumulation.
// Fragments (PTX ISA, lane = 4g + t): a[0] = A[g][2t, 2t+1], a[1] = A[g+8][2t, 2t+1],
// a[2] = A[g][2t+8, 2t+9], a[3] = A[g+8][2t+8, 2t+9]; b[0] = B[2t, 2t+1][g],
// b[1] = B[2t+8, 2t+9][g]; d[0], d[1] = D[g][2t, 2t+1], d[2], d[3] = D[g+8][2t, 2t+1].
__device__ __forceinline__ void mma_bf16(float* d, const u32* a, const u32* b) {
#ifdef EMULATED_CUDA
    emu_mma_m16n8k16_bf16(d, a, b);
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// The A fragment of the 16×16 tile at (row0, col0) of a row-major shared matrix (ld elements
// per row): matrices (rows +0, cols +0), (+8, +0), (+0, +8), (+8, +8) are a[0..3].
__device__ __forceinline__ void frag_a(u32* a, smem_t x, int ld, int row0, int col0) {
    const int lane = threadIdx.x % WARP, i = lane >> 3;
    load_matrices<false>(a, x + 2 * ((row0 + (lane & 7) + 8 * (i & 1)) * ld + col0 + 8 * (i >> 1)));
}

// The A fragment of the 16×16 tile at (row0, col0) of A = Mᵀ, where M is held row-major in
// shared memory (ld elements per row): the tile is M's rows col0 .. col0 + 16, columns row0 ..
// row0 + 16, read transposed; matrices (M rows +0, cols +0), (+0, +8), (+8, +0), (+8, +8).
__device__ __forceinline__ void frag_a_trans(u32* a, smem_t m, int ld, int row0, int col0) {
    const int lane = threadIdx.x % WARP, i = lane >> 3;
    load_matrices<true>(a, m + 2 * ((col0 + (lane & 7) + 8 * (i >> 1)) * ld + row0 + 8 * (i & 1)));
}

// The B fragments of two neighbouring 8-column tiles, B[k0 .. k0+16][n0 .. n0+16], from Bᵀ
// held row-major in shared memory (row n of `bt` is column n of B): b[0] for columns n0 ..
// n0+8, b[1] for n0+8 .. n0+16.
__device__ __forceinline__ void frags_b(u32 (*b)[2], smem_t bt, int ld, int n0, int k0) {
    const int lane = threadIdx.x % WARP, i = lane >> 3;
    u32 x[4];
    load_matrices<false>(x, bt + 2 * ((n0 + (lane & 7) + 8 * (i >> 1)) * ld + k0 + 8 * (i & 1)));
    b[0][0] = x[0];
    b[0][1] = x[1];
    b[1][0] = x[2];
    b[1][1] = x[3];
}

// The same two B fragments from B itself held row-major in shared memory (row k of `bm` is
// row k of B), transposed on the way.
__device__ __forceinline__ void frags_b_trans(u32 (*b)[2], smem_t bm, int ld, int n0, int k0) {
    const int lane = threadIdx.x % WARP, i = lane >> 3;
    u32 x[4];
    load_matrices<true>(x, bm + 2 * ((k0 + (lane & 7) + 8 * (i & 1)) * ld + n0 + 8 * (i >> 1)));
    b[0][0] = x[0];
    b[0][1] = x[1];
    b[1][0] = x[2];
    b[1][1] = x[3];
}

// The A fragments of a 16-column slice k of accumulator tiles: the m16n8 tiles 2k and 2k + 1
// of `c` (rounded to bf16) are the A operand of a product over their columns.
__device__ __forceinline__ void acc_to_a(u32* a, const float (*c)[4], int k) {
    a[0] = pack_bf16(c[2 * k][0], c[2 * k][1]);
    a[1] = pack_bf16(c[2 * k][2], c[2 * k][3]);
    a[2] = pack_bf16(c[2 * k + 1][0], c[2 * k + 1][1]);
    a[3] = pack_bf16(c[2 * k + 1][2], c[2 * k + 1][3]);
}

// N accumulator tiles set to zero.
template <int N>
__device__ __forceinline__ void zero_tiles(float (*c)[4]) {
    #pragma unroll
    for (int n = 0; n < N; ++n) c[n][0] = c[n][1] = c[n][2] = c[n][3] = 0.0f;
}

// acc (N tiles of 8 columns, N even) += A · B over 16·KS rows of B: A's k-th 16-column slice
// in the fragments a[k], B from Bᵀ held row-major in shared memory (or, with B_ROWS, from B
// itself held row-major).
template <int KS, int N, bool B_ROWS = false>
__device__ __forceinline__ void product_frags(float (*acc)[4], const u32 (*a)[4], smem_t b_at,
                                              int ld) {
    #pragma unroll
    for (int k = 0; k < KS; ++k) {
        #pragma unroll
        for (int n = 0; n < N; n += 2) {
            u32 b[2][2];
            if (B_ROWS) {
                frags_b_trans(b, b_at, ld, 8 * n, 16 * k);
            } else {
                frags_b(b, b_at, ld, 8 * n, 16 * k);
            }
            mma_bf16(acc[n], a[k], b[0]);
            mma_bf16(acc[n + 1], a[k], b[1]);
        }
    }
}

// acc (N tiles of 8 columns, N even) += A · B where A is the 2·KS accumulator tiles `c`
// (rounded to bf16, see acc_to_a) and B is held row-major in shared memory.
template <int KS, int N>
__device__ __forceinline__ void product_tiles(float (*acc)[4], const float (*c)[4], smem_t bm,
                                              int ld) {
    #pragma unroll
    for (int k = 0; k < KS; ++k) {
        // One 16-row slice of B at a time, so that one slice's A fragments are live at once.
        u32 a[1][4];
        acc_to_a(a[0], c, k);
        product_frags<1, N, true>(acc, a, bm + 2 * 16 * k * ld, ld);
    }
}

// Stores half r of N accumulator tiles (r = 0: row g, 1: row g + 8) times `scale`, rounded to
// bf16, into the row `row` points at (this lane's first column, 2t), or with `add` adds them to
// what it holds first. With `pairs` (the row 4-byte aligned) a pair of columns at a time.
template <int N>
__device__ __forceinline__ void store_row(bf16_t* row, const float (*acc)[4], int r, float scale,
                                          bool pairs, bool add = false) {
    #pragma unroll
    for (int n = 0; n < N; ++n) {
        float x0 = acc[n][2 * r] * scale, x1 = acc[n][2 * r + 1] * scale;
        if (add) {
            x0 += bf16_to_float(row[8 * n]);
            x1 += bf16_to_float(row[8 * n + 1]);
        }
        if (pairs) {
            *reinterpret_cast<u32*>(row + 8 * n) = pack_bf16(x0, x1);
        } else {
            row[8 * n] = (bf16_t)bf16_bits(x0);
            row[8 * n + 1] = (bf16_t)bf16_bits(x1);
        }
    }
}

// Whether `p` is 4-byte aligned (rows of bf16 pairs, see store_row).
__device__ __forceinline__ bool pairs_aligned(const void* p) { return ((u64)p & 3) == 0; }

// Rows row0 .. row0 + ROWS of one head (D elements each, rows `stride` elements apart) into a
// shared tile of `ld` elements per row, zeros from row `s` on (so that masked keys meet finite
// values). With `vec` (the head's rows 16-byte aligned) as 16-byte asynchronous copies for
// the caller to commit and wait for; else loaded and stored here, 2 bytes at a time. Thread
// `tid` copies chunk tid % (D/8) of rows tid / (D/8) + every (FA_THREADS / (D/8))-th row (the
// threads left over when D/8 does not divide FA_THREADS copy nothing).
template <int D, int ROWS>
__device__ __forceinline__ void tile_to_shared(smem_t dst, int ld, const bf16_t* __restrict__ src,
                                               i64 stride, u32 row0, u32 s, bool vec) {
    constexpr int CHUNKS = D / 8, STEP = FA_THREADS / CHUNKS;
    constexpr int PASSES = (ROWS + STEP - 1) / STEP;
    const int tr = threadIdx.x / CHUNKS, tk = threadIdx.x % CHUNKS;
    if (tr >= STEP) return;
    const bf16_t* from = src + (i64)(row0 + tr) * stride + 8 * tk;
    const smem_t to = dst + 2 * (tr * ld + 8 * tk);
    if (vec && row0 + ROWS <= s) {
        #pragma unroll
        for (int pass = 0; pass < PASSES; ++pass) {
            if (ROWS % STEP == 0 || tr + pass * STEP < ROWS) {
                copy_async<16>(to + 2 * pass * STEP * ld, from + pass * STEP * stride);
            }
        }
        return;
    }
    #pragma unroll
    for (int pass = 0; pass < PASSES; ++pass) {
        const int r = tr + pass * STEP;
        if (ROWS % STEP != 0 && r >= ROWS) break;
        const smem_t d = to + 2 * pass * STEP * ld;
        const bf16_t* p = from + pass * STEP * stride;
        if (row0 + r >= s) {
            store16(d, make_uint4(0u, 0u, 0u, 0u));
        } else if (vec) {
            copy_async<16>(d, p);
        } else {
            store16(d, make_uint4(p[0] | ((u32)p[1] << 16), p[2] | ((u32)p[3] << 16),
                                  p[4] | ((u32)p[5] << 16), p[6] | ((u32)p[7] << 16)));
        }
    }
}

// N floats of rows row0 .. row0 + N of a [b, heads, s] vector (from `src`, its row 0 of this
// head) into shared memory (`dst` its address, `at` the same as a pointer) as asynchronous
// copies, zeros from row `s` on.
template <int N>
__device__ __forceinline__ void rows_to_shared(smem_t dst, float* at, const float* __restrict__ src,
                                               u32 row0, u32 s) {
    for (int r = threadIdx.x; r < N; r += FA_THREADS) {
        if (row0 + r < s) {
            copy_async<4>(dst + 4 * r, src + row0 + r);
        } else {
            shared_store(&at[r], 0.0f);
        }
    }
}

// The A fragments (16 rows, all D columns) of rows row0 .. row0 + 16 of one head, straight from
// global memory (zeros from row `s` on).
template <int D>
__device__ __forceinline__ void global_frags(u32 (*a)[4], const bf16_t* __restrict__ src,
                                             i64 seq_stride, u32 row0, u32 s) {
    const int lane = threadIdx.x % WARP, g = lane >> 2, t = lane & 3;
    const u32 r0 = row0 + g, r1 = r0 + 8;
    const bf16_t* p0 = src + (i64)r0 * seq_stride + 2 * t;
    const bf16_t* p1 = src + (i64)r1 * seq_stride + 2 * t;
    #pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        a[kk][0] = r0 < s ? (u32)p0[16 * kk] | ((u32)p0[16 * kk + 1] << 16) : 0u;
        a[kk][1] = r1 < s ? (u32)p1[16 * kk] | ((u32)p1[16 * kk + 1] << 16) : 0u;
        a[kk][2] = r0 < s ? (u32)p0[16 * kk + 8] | ((u32)p0[16 * kk + 9] << 16) : 0u;
        a[kk][3] = r1 < s ? (u32)p1[16 * kk + 8] | ((u32)p1[16 * kk + 9] << 16) : 0u;
    }
}

// The dropout mask, row by row. Row r of the [b·heads·s, s] probabilities starts at local mask
// element r·s; when every row lies inside one run of the mask (`inner` a multiple of s, always
// so for attention), element j of the row is logical element `start + j` of that row, and the
// kernels find a row's logical start once instead of dividing for every element.
struct RowMask {
    // Whether rows lie inside runs (else `start`s are local elements, mapped per element).
    bool whole;
    // Whether also every row's logical start is a multiple of 4, so that the 4 elements a lane
    // pair holds in two neighbouring 8-column tiles are two whole Philox blocks (see
    // mask_pairs). The same for every lane of the kernel.
    bool aligned;
    // The round keys of the mask's Philox key (the kernels' parameter: the rounds read them from
    // the constant bank).
    PhiloxKeys keys;
};

__device__ __forceinline__ RowMask row_mask(const Mask& m, u64 s, const PhiloxKeys& keys) {
    RowMask rm;
    rm.whole = m.inner % s == 0;
    rm.aligned = rm.whole && mask_blocks(m) && s % 4 == 0;
    rm.keys = keys;
    return rm;
}

// Philox block `block` of the mask's stream.
__device__ __forceinline__ uint4 mask_block(const Mask& m, const RowMask& rm, u64 block) {
    return philox_rounds(philox_counter(block, m.stream), rm.keys);
}

// Where row `row` starts: its logical element when rows are whole, else its local one.
__device__ __forceinline__ u64 row_start(const Mask& m, const RowMask& rm, u64 row, u64 s) {
    return rm.whole ? mask_logical(m, row * s) : row * s;
}

__device__ __forceinline__ float keep_factor(const Mask& m, u32 word) {
    return word >= m.threshold ? m.scale : 0.0f;
}

// The dropout factor (scale or 0) of element j of the row starting at `start` (row_start).
// The paths for rows that are not aligned call it, one Philox block per element; kept out of
// line so that those paths, rarely taken, do not multiply the kernels' code (inlined, they
// doubled the forward's machine code, to about 140 KB per head size; see BENCHMARKS.md).
__device__ __noinline__ float row_factor(const Mask& m, const RowMask& rm, u64 start, u64 j) {
    if (m.threshold == 0) return m.scale;
    if (!rm.whole) return mask_factor(m, start + j);
    const u64 l = start + j;
    // Not mask_block: reading rm.keys through this out-of-line call's reference makes every
    // kernel keep RowMask in memory (more registers and instructions, tools/gpu/sass.sh).
    return keep_factor(m, word_of(dropout_block(l >> 2, m.key, m.stream), (int)(l & 3)));
}

// The factors of elements j, j + 1 (f0) and j + 8, j + 9 (f1) of the row starting at `start`,
// where j = col0 + 2t is this lane's pair in an 8-column accumulator tile and j + 8 its pair in
// the next. Every lane of the warp calls it together: with aligned rows each lane draws one
// Philox block, whose other half its neighbour t ^ 1 needs, and the two swap halves.
__device__ __forceinline__ void mask_pairs(const Mask& m, const RowMask& rm, u64 start, u64 col0,
                                           float2& f0, float2& f1) {
    const int t = threadIdx.x % 4;
    if (m.threshold == 0) {
        f0 = f1 = make_float2(m.scale, m.scale);
        return;
    }
    if (!rm.aligned) {
        const u64 j = col0 + 2 * t;
        f0 = make_float2(row_factor(m, rm, start, j), row_factor(m, rm, start, j + 1));
        f1 = make_float2(row_factor(m, rm, start, j + 8), row_factor(m, rm, start, j + 9));
        return;
    }
    // Lanes t = 0, 1 hold columns 0..3 of each tile, t = 2, 3 columns 4..7; the even lane of
    // a pair draws the block of the first tile, the odd lane that of the second.
    const int odd = t & 1;
    const u64 l = start + col0 + 8 * odd + 4 * (t >> 1);
    const uint4 w = mask_block(m, rm, l >> 2);
    // Each lane keeps words 2·odd, 2·odd + 1 of its block and gets the same words of its
    // neighbour's.
    const u32 give_lo = odd ? w.x : w.z, give_hi = odd ? w.y : w.w;
    const u32 got_lo = __shfl_xor_sync(0xffffffffu, give_lo, 1);
    const u32 got_hi = __shfl_xor_sync(0xffffffffu, give_hi, 1);
    const float2 own = make_float2(keep_factor(m, odd ? w.z : w.x), keep_factor(m, odd ? w.w : w.y));
    const float2 other = make_float2(keep_factor(m, got_lo), keep_factor(m, got_hi));
    f0 = odd ? other : own;
    f1 = odd ? own : other;
}

// The dropout's kept elements as bits, which the forward stores and the key/value kernel reads:
// per (batch entry, head) and block of 64 keys, a 64-bit word per query, rows up to the
// sequence rounded up to 64; bit jj of the word of query i and key block kb is element (i,
// 64·kb + jj). Only words of blocks a query sees (kb ≤ i / 64, i < s) are written. The word of
// query 0 of key block kb of head bh (bh = batch entry · heads + head).
__device__ __forceinline__ u64 keep_word_at(u64 bh, u32 kb, u32 s) {
    const u64 blocks = (s + 63) / 64;
    return (bh * blocks + kb) * (blocks * 64);
}

// Where one (batch entry, head) sits: element offsets of its row 0 in the q/k/v layout and in
// the output layout, and the index of its row 0 in [b, heads, s].
struct HeadAt {
    i64 qkv, o;
    u64 row;
};

__device__ __forceinline__ HeadAt head_at(i64 batch_stride, i64 head_stride, i64 o_batch_stride,
                                          i64 o_head_stride, u64 heads, u64 s) {
    const u64 b = blockIdx.z, h = blockIdx.y;
    HeadAt at;
    at.qkv = (i64)b * batch_stride + (i64)h * head_stride;
    at.o = (i64)b * o_batch_stride + (i64)h * o_head_stride;
    at.row = (b * heads + h) * s;
    return at;
}

// Whether every row of one head, at q, k and v, is 16-byte aligned.
__device__ __forceinline__ bool rows_aligned(const void* q, const void* k, const void* v,
                                             i64 seq_stride, i64 batch_stride, i64 head_stride) {
    return (((u64)q | (u64)k | (u64)v) & 15) == 0 &&
           ((seq_stride | batch_stride | head_stride) & 7) == 0;
}

// Sets `fill` where a tile of N 8-column accumulator tiles crosses the causal diagonal: this
// lane's element (row g + 8·(c >> 1), column 8n + 2t + (c & 1)) is past it when its column
// exceeds the row's limit, `lim0` for row g (lim0 + 8 for row g + 8): the row's position minus
// the tile's first column.
template <int N>
__device__ __forceinline__ void mask_past_diagonal(float (*x)[4], int lim0, float fill) {
    const int t = threadIdx.x % 4;
    const int lim[2] = {lim0 - 2 * t, lim0 + 8 - 2 * t};
    #pragma unroll
    for (int n = 0; n < N; ++n) {
        #pragma unroll
        for (int c = 0; c < 4; ++c) {
            if (8 * n + (c & 1) > lim[c >> 1]) x[n][c] = fill;
        }
    }
}

// Sets `fill` where a tile of N 8-column accumulator tiles lies before the rows' first visible
// keys: this lane's element (as mask_past_diagonal's) is before it when its column is below
// `first0` for row g (`first8` for row g + 8): the row's first visible key minus the tile's
// first column (with a sliding window alone, first8 = first0 + 8).
template <int N>
__device__ __forceinline__ void mask_before_window(float (*x)[4], int first0, int first8,
                                                   float fill) {
    const int t = threadIdx.x % 4;
    const int first[2] = {first0 - 2 * t, first8 - 2 * t};
    #pragma unroll
    for (int n = 0; n < N; ++n) {
        #pragma unroll
        for (int c = 0; c < 4; ++c) {
            if (8 * n + (c & 1) < first[c >> 1]) x[n][c] = fill;
        }
    }
}

// Packed documents (see the header): position i of batch entry b's document, its first
// position and the position after its last (the whole sequence without a table). Positions
// past the sequence read the last one's.
struct Span {
    u32 first, end;
};

__device__ __forceinline__ Span doc_span(const u64* __restrict__ docs, u64 b, u32 s, u32 i) {
    if (!docs) return Span{0, s};
    const u64 w = docs[b * s + min(i, s - 1)];
    return Span{(u32)w, (u32)(w >> 32)};
}

// The first key row i sees: its document's first position, and with a window i − window.
__device__ __forceinline__ u32 first_visible(const u64* __restrict__ docs, u64 b, u32 s, u32 i,
                                             u32 window) {
    const u32 by_window = i > window ? i - window : 0;
    return max(doc_span(docs, b, s, i).first, by_window);
}

// Counts a tile walked (the emulation's counter of the tiles each launch walks; nothing on a
// GPU). One thread of the block counts.
__device__ __forceinline__ void count_tile() {
#ifdef EMULATED_CUDA
    if (threadIdx.x == 0) emu_count_tile();
#endif
}

// The step of a loop over `tiles` tiles streamed through two shared-memory stages: starts tile
// it + 1 (if any) by `fetch(it + 1)`, which commits its copies, and waits until tile `it` is in
// shared memory for the whole block. Every warp must be done with stage (it + 1) % 2 (a barrier
// after its use).
template <class Fetch>
__device__ __forceinline__ void advance_tiles(int it, int tiles, const Fetch& fetch) {
    if (it + 1 < tiles) {
        fetch(it + 1);
        copies_wait<1>();
    } else {
        copies_wait<0>();
    }
    __syncthreads();
}

// Key tiles (KEYS keys each, from key 0) of one head and the tiles paired with them (W
// elements per key: the values, or the query-gradient kernel's transposed score gradients),
// streamed through two shared-memory stages: tile `it` lies in stage it % 2. For the kernels
// whose block of queries walks the keys it sees (the forward and the query gradients).
template <int D, int KEYS, int W = D>
struct KeyStream {
    static constexpr int LD = D + FA_PAD, LD_PAIRED = W + FA_PAD;
    // Bytes of a key tile and of a stage (the key tile, then the paired one).
    static constexpr int KEY_TILE = 2 * KEYS * LD, STAGE = KEY_TILE + 2 * KEYS * LD_PAIRED;
    smem_t stages;
    const bf16_t* k;
    const bf16_t* v;
    i64 k_stride, v_stride;
    u32 s;
    bool k_vec, v_vec;
    // Tiles up to the one holding key `last`.
    int tiles;

    __device__ __forceinline__ smem_t keys(int it) const { return stages + (it & 1) * STAGE; }
    __device__ __forceinline__ smem_t paired(int it) const { return keys(it) + KEY_TILE; }

    // Starts copying tile `it` into its stage.
    __device__ __forceinline__ void fetch(int it) const {
        const u32 k0 = it * KEYS;
        tile_to_shared<D, KEYS>(keys(it), LD, k, k_stride, k0, s, k_vec);
        tile_to_shared<W, KEYS>(paired(it), LD_PAIRED, v, v_stride, k0, s, v_vec);
        copies_commit();
    }

    // Starts the tile after `it` (if any) and waits until tile `it` is in shared memory for the
    // whole block (see advance_tiles).
    __device__ __forceinline__ void advance(int it) const {
        advance_tiles(it, tiles, [this](int next) { fetch(next); });
    }
};

// Keys from k (rows `k_stride` elements apart, 16-byte aligned with `k_vec`) and their paired
// rows from v (likewise) up to key `last`, the copies of tile `first` (where the loop starts)
// started.
template <int D, int KEYS, int W = D>
__device__ __forceinline__ KeyStream<D, KEYS, W> stream_keys(unsigned char* smem_raw,
                                                             const bf16_t* k, i64 k_stride,
                                                             bool k_vec, const bf16_t* v,
                                                             i64 v_stride, bool v_vec, u32 last,
                                                             u32 s, int first = 0) {
    KeyStream<D, KEYS, W> kv;
    kv.stages = smem(smem_raw);
    kv.k = k;
    kv.v = v;
    kv.k_stride = k_stride;
    kv.v_stride = v_stride;
    kv.s = s;
    kv.k_vec = k_vec;
    kv.v_vec = v_vec;
    kv.tiles = last / KEYS + 1;
    kv.fetch(first);
    return kv;
}

// ---------------------------------------------------------------------------------------------
// Forward: o = dropout(softmax(scale·q·kᵀ)) v and lse = log Σ exp(scale·q·kᵀ) per row. Grid:
// (query tiles, heads, batch); the last query tiles (the most keys) start first. Shared memory
// (dynamic): two stages of a key tile and its value tile, FA_FWD_KEYS rows each.
template <int D>
__device__ __forceinline__ void fa_forward(
    const bf16_t* __restrict__ q, const bf16_t* __restrict__ k, const bf16_t* __restrict__ v,
    i64 seq_stride, i64 batch_stride, i64 head_stride, bf16_t* __restrict__ o, i64 o_seq_stride,
    i64 o_batch_stride, i64 o_head_stride, float* __restrict__ lse, u64* __restrict__ keep_bits,
    u32 s, u64 heads, float scale, u32 window, const Mask& m, const PhiloxKeys& keys,
    const u64* __restrict__ docs, unsigned char* smem_raw) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, g = lane >> 2, t = lane & 3;
    const HeadAt at = head_at(batch_stride, head_stride, o_batch_stride, o_head_stride, heads, s);
    const bool vec = rows_aligned(q, k, v, seq_stride, batch_stride, head_stride);
    // With dropout, this head's kept-element words (see keep_word_at).
    u64* const keep_head =
        keep_bits ? keep_bits + keep_word_at((u64)blockIdx.z * heads + blockIdx.y, 0, s) : nullptr;
    const u32 q0 = (gridDim.x - 1 - blockIdx.x) * FA_ROWS;
    const u32 wq0 = q0 + 16 * warp;  // this warp's first query
    const u32 i0 = wq0 + g;          // this thread's rows: i0 and i0 + 8
    const RowMask rm = row_mask(m, s, keys);
    const u64 row_at[2] = {row_start(m, rm, at.row + i0, s), row_start(m, rm, at.row + i0 + 8, s)};
    // Raw scores times this are base-2 exponents of the scaled scores.
    const float scale2 = scale * LOG2E;
    // With documents, this thread's rows' first visible keys, and the block's first tile:
    // the one holding its first query's first visible key (every later row's is no earlier).
    const u64 b = blockIdx.z;
    const u32 fv[2] = {first_visible(docs, b, s, i0, window),
                       first_visible(docs, b, s, i0 + 8, window)};
    const int first_tile = docs ? first_visible(docs, b, s, q0, window) / FA_FWD_KEYS : 0;
    // The block's last query sees keys up to min(q0 + FA_ROWS, s) − 1.
    const auto kv = stream_keys<D, FA_FWD_KEYS>(smem_raw, k + at.qkv, seq_stride, vec,
                                                v + at.qkv, seq_stride, vec,
                                                min(q0 + FA_ROWS, s) - 1, s, first_tile);
    constexpr int LD = KeyStream<D, FA_FWD_KEYS>::LD;

    u32 qa[D / 16][4];
    global_frags<D>(qa, q + at.qkv, seq_stride, wq0, s);
    float acc[D / 8][4];
    zero_tiles<D / 8>(acc);
    // Per row (i0, i0 + 8): the largest raw score so far and the sum of exponentials.
    float mx[2] = {NEG_INF, NEG_INF}, sum[2] = {0.0f, 0.0f};

    for (int it = first_tile; it < kv.tiles; ++it) {
        kv.advance(it);
        count_tile();
        const u32 k0 = it * FA_FWD_KEYS;

        // Raw scores q·kᵀ of this warp's 16 queries and the tile's keys.
        float sc[FA_FWD_KEYS / 8][4];
        zero_tiles<FA_FWD_KEYS / 8>(sc);
        product_frags<D / 16, FA_FWD_KEYS / 8>(sc, qa, kv.keys(it), LD);
        // Where the tile crosses the diagonal, keys after the query are masked: query i sees key
        // k0 + jj when jj <= i − k0 (so a query before the end sees no key past it).
        if (k0 + FA_FWD_KEYS - 1 > wq0) {
            mask_past_diagonal<FA_FWD_KEYS / 8>(sc, (int)i0 - (int)k0, NEG_INF);
        }
        // With a sliding window, keys before a query's window are masked likewise: query i
        // sees key k0 + jj when jj >= i − window − k0 (only tiles that start before the last
        // row's window, wq0 + 15 − window).
        if (docs) {
            // With documents, per row: keys before its document or window.
            if (k0 < fv[1]) {
                mask_before_window<FA_FWD_KEYS / 8>(sc, (int)fv[0] - (int)k0,
                                                    (int)fv[1] - (int)k0, NEG_INF);
            }
        } else if ((i64)k0 < (i64)wq0 + 15 - (i64)window) {
            const int first0 = (int)i0 - (int)window - (int)k0;
            mask_before_window<FA_FWD_KEYS / 8>(sc, first0, first0 + 8, NEG_INF);
        }
        // The new row maxima (over the 4 lanes holding a row); the scale is positive, so the
        // largest raw score is the largest scaled one.
        float tile_mx[2] = {mx[0], mx[1]};
        #pragma unroll
        for (int n = 0; n < FA_FWD_KEYS / 8; ++n) {
            #pragma unroll
            for (int c = 0; c < 4; ++c) tile_mx[c >> 1] = fmaxf(tile_mx[c >> 1], sc[n][c]);
        }
        float base[2];
        #pragma unroll
        for (int r = 0; r < 2; ++r) {
            tile_mx[r] = fmaxf(tile_mx[r], __shfl_xor_sync(0xffffffffu, tile_mx[r], 1));
            tile_mx[r] = fmaxf(tile_mx[r], __shfl_xor_sync(0xffffffffu, tile_mx[r], 2));
            // A row that has seen only masked keys keeps nothing (its maximum stays −∞).
            const float top = tile_mx[r] == NEG_INF ? 0.0f : tile_mx[r];
            const float corr = exp2_fast((mx[r] - top) * scale2);
            base[r] = top * scale2;
            mx[r] = tile_mx[r];
            sum[r] *= corr;
            #pragma unroll
            for (int n = 0; n < D / 8; ++n) {
                acc[n][2 * r] *= corr;
                acc[n][2 * r + 1] *= corr;
            }
        }
        // Unnormalised probabilities exp(scale·(x − max)), their sums, then the dropout of
        // what meets v; with keep_bits, this lane's kept elements of rows i0 and i0 + 8 as bits
        // (keys 0..31 and 32..63 of the tile).
        u32 kept[2][2] = {{0u, 0u}, {0u, 0u}};
        #pragma unroll
        for (int n = 0; n < FA_FWD_KEYS / 8; n += 2) {
            #pragma unroll
            for (int r = 0; r < 2; ++r) {
                float2 f[2];
                mask_pairs(m, rm, row_at[r], k0 + 8 * n, f[0], f[1]);
                #pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const float p0 = exp2_fast(fmaf(sc[n + h][2 * r], scale2, -base[r]));
                    const float p1 = exp2_fast(fmaf(sc[n + h][2 * r + 1], scale2, -base[r]));
                    sum[r] += p0 + p1;
                    // Probabilities are finite: a product is exactly the masked value.
                    sc[n + h][2 * r] = p0 * f[h].x;
                    sc[n + h][2 * r + 1] = p1 * f[h].y;
                    if (keep_head) {
                        const int bit = (8 * (n + h) + 2 * t) % 32;
                        kept[r][(n + h) / 4] |= ((u32)(f[h].x != 0.0f) << bit) |
                                                ((u32)(f[h].y != 0.0f) << (bit + 1));
                    }
                }
            }
        }
        if (keep_head) {
            // A row's 64 bits are spread over its 4 lanes: gathered, stored by lane t = 0.
            #pragma unroll
            for (int r = 0; r < 2; ++r) {
                #pragma unroll
                for (int w = 0; w < 2; ++w) {
                    kept[r][w] |= __shfl_xor_sync(0xffffffffu, kept[r][w], 1);
                    kept[r][w] |= __shfl_xor_sync(0xffffffffu, kept[r][w], 2);
                }
                const u32 i = i0 + 8 * r;
                if (t == 0 && i < s) {
                    keep_head[keep_word_at(0, it, s) + i] =
                        (u64)kept[r][0] | ((u64)kept[r][1] << 32);
                }
            }
        }
        // Paired with the keys: their values.
        product_tiles<FA_FWD_KEYS / 16, D / 8>(acc, sc, kv.paired(it), LD);
        // Every warp is done with this stage before the next iteration refills it.
        __syncthreads();
    }

    // Normalise by the row sums (over the 4 lanes of a row) and store; the log-sum-exp is of
    // the scaled scores.
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
        sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 1);
        sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 2);
        const u32 i = i0 + 8 * r;
        if (i >= s) continue;
        store_row<D / 8>(o + at.o + (i64)i * o_seq_stride + 2 * t, acc, r, 1.0f / sum[r],
                         pairs_aligned(o));
        if (t == 0) lse[at.row + i] = __fmul_rn(mx[r], scale) + logf(sum[r]);
    }
}

// Backward, step 1: delta = Σ_d do·o per row (the row sums of the probability gradient's
// softmax term, dropout included; o as the forward stored it, in bf16) and do rounded to bf16
// for the products (do is f32, or with d_o_bf16 already bf16). One warp per row.
extern "C" __global__ __launch_bounds__(256) void flash_backward_prepare(
    const bf16_t* __restrict__ o, const void* __restrict__ d_o, int d_o_bf16,
    bf16_t* __restrict__ d_o16,
    i64 o_seq_stride, i64 o_batch_stride, i64 o_head_stride, float* __restrict__ delta, u64 s,
    u64 heads, u64 batch, u64 d) {
    const int lane = threadIdx.x % WARP;
    const u64 warps = (u64)gridDim.x * (blockDim.x / WARP);
    const u64 rows = batch * heads * s;
    for (u64 r = (u64)blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP; r < rows; r += warps) {
        const u64 i = r % s, h = (r / s) % heads, b = r / (s * heads);
        const i64 at = (i64)i * o_seq_stride + (i64)b * o_batch_stride + (i64)h * o_head_stride;
        float acc = 0.0f;
        for (u64 e = lane; e < d; e += WARP) {
            const float g = load_in(d_o, d_o_bf16 != 0, at + e);
            acc += g * bf16_to_float(o[at + e]);
            d_o16[at + e] = (bf16_t)bf16_bits(g);
        }
        acc = warp_sum(acc);
        if (lane == 0) delta[r] = acc;
    }
}

// The probability, dropped probability and score gradient of one (query i, key j) element from
// its raw score `x`, its dropped-probability gradient product `dz`, the query's log-sum-exp in
// base 2 (times LOG2E) and delta, the mask factor `f`, and the scale (also times LOG2E). Finite
// for any finite inputs except where the probability overflows (masked elements, which the
// callers then overwrite).
struct Grad {
    float dropped, d_score;
};

__device__ __forceinline__ Grad element_grad(float x, float dz, float lse2_i, float delta_i,
                                             float f, float scale, float scale2) {
    const float p = exp2_fast(fmaf(x, scale2, -lse2_i));
    Grad g;
    // Plain products are the masked values for finite p and dz (see above for the others).
    g.dropped = p * f;
    g.d_score = scale * p * (dz * f - delta_i);
    return g;
}

// One query tile of the key-gradient kernel in shared memory: its queries and output
// gradients (FA_BWD_COLS rows each), their log-sum-exps and deltas, and with dropout the words
// of their kept elements for the block's keys (keep_word_at).
template <int D>
struct QueryTile {
    static constexpr int LD = D + FA_PAD;
    // Bytes of one stage (a multiple of 16): the two row tiles, the two vectors, the words.
    static constexpr int ROWS_BYTES = FA_BWD_COLS * LD * 2;
    static constexpr int BYTES = 2 * ROWS_BYTES + 2 * FA_BWD_COLS * 4 + FA_BWD_COLS * 8;
    // Shared addresses for the copies and products, and pointers where the kernel reads the
    // vectors: both held, as converting per copy costs the loop ~40 instructions a tile.
    smem_t q, d_o, lse_at, delta_at, keep_at;
    float* lse;
    float* delta;
    u32* keep;

    __device__ __forceinline__ QueryTile(unsigned char* raw, smem_t at) {
        q = at;
        d_o = at + ROWS_BYTES;
        lse_at = at + 2 * ROWS_BYTES;
        delta_at = lse_at + 4 * FA_BWD_COLS;
        keep_at = delta_at + 4 * FA_BWD_COLS;
        lse = reinterpret_cast<float*>(raw + 2 * ROWS_BYTES);
        delta = lse + FA_BWD_COLS;
        keep = reinterpret_cast<u32*>(delta + FA_BWD_COLS);
    }
};

// The backward's score gradients dS (bf16) pass from the key/value kernel to the query-gradient
// kernel through a buffer that holds, per (batch entry, head), rows for keys 0 ..
// score_rows(s) − 1 and `ds_cols` columns for the queries c_begin .. c_begin + ds_cols − 1 of
// one chunk: element (key j, query i) at (head·score_rows(s) + j)·ds_cols + i − c_begin. The
// launcher runs both kernels once per chunk of queries (ds_cols and c_begin multiples of
// FA_ROWS), so the buffer stays within a budget whatever the sequence.
__device__ __forceinline__ u64 score_rows(u32 s) {
    return (u64)((s + FA_ROWS - 1) / FA_ROWS) * FA_ROWS;
}

// Backward, step 2: dk and dv of FA_ROWS keys per block (16 per warp), over the tiles of the
// queries c_begin .. c_end that see them, stored (the first chunk of queries that sees the
// block's keys) or added to the earlier chunks' sums; and the score gradients of those
// (key, query) pairs into `ds`. The dropout is the forward's: its kept elements from
// `keep_bits` (none without dropout: null), each kept one scaled by `keep_scale`. Grid: (key
// tiles up to c_end, heads, batch). Shared memory (dynamic): the block's keys and values and
// two stages of a query tile (QueryTile).
template <int D>
__device__ __forceinline__ void fa_backward_kv(
    const bf16_t* __restrict__ q, const bf16_t* __restrict__ k, const bf16_t* __restrict__ v,
    i64 seq_stride, i64 batch_stride, i64 head_stride, const bf16_t* __restrict__ d_o16,
    i64 o_seq_stride, i64 o_batch_stride, i64 o_head_stride, const float* __restrict__ lse,
    const float* __restrict__ delta, bf16_t* __restrict__ dk, bf16_t* __restrict__ dv,
    bf16_t* __restrict__ ds, u32 ds_cols, u32 c_begin, u32 c_end, u32 s, u64 heads,
    float scale, u32 window, const u64* __restrict__ keep_bits, float keep_scale,
    const u64* __restrict__ docs, unsigned char* smem_raw) {
    constexpr int LD = D + FA_PAD, KV_BYTES = FA_ROWS * LD * 2;
    const smem_t ks = smem(smem_raw), vs = ks + KV_BYTES;
    unsigned char* stages_raw = smem_raw + 2 * KV_BYTES;
    const smem_t stages = ks + 2 * KV_BYTES;

    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, g = lane >> 2, t = lane & 3;
    const HeadAt at = head_at(batch_stride, head_stride, o_batch_stride, o_head_stride, heads, s);
    const bool vec = rows_aligned(q, k, v, seq_stride, batch_stride, head_stride) &&
                     rows_aligned(d_o16, d_o16, d_o16, o_seq_stride, o_batch_stride,
                                  o_head_stride);
    const u32 k0 = blockIdx.x * FA_ROWS;
    const int w0 = 16 * warp;          // this warp's first key in the block's tile
    const u32 wk_last = k0 + w0 + 15;  // and its last key
    const bool dropout = keep_bits != nullptr;
    // The words of this block of keys, from query 0 (16-byte aligned: rows of 64 words).
    const u64* const keep_block =
        dropout ? keep_bits + keep_word_at((u64)blockIdx.z * heads + blockIdx.y, blockIdx.x, s)
                : nullptr;
    // Which half of a word holds this warp's keys.
    const int keep_half = w0 / 32;
    const float scale2 = scale * LOG2E;

    // Query tile `it` (queries c_first + it·FA_BWD_COLS ..) into stage it % 2; queries before
    // the block's first key see none of its keys.
    const u32 c_first = max(k0, c_begin);
    const auto stage = [&](int it) {
        const int at_byte = (it & 1) * QueryTile<D>::BYTES;
        return QueryTile<D>(stages_raw + at_byte, stages + at_byte);
    };
    const auto fetch = [&](int it) {
        const QueryTile<D> tile = stage(it);
        const u32 c0 = c_first + it * FA_BWD_COLS;
        tile_to_shared<D, FA_BWD_COLS>(tile.q, LD, q + at.qkv, seq_stride, c0, s, vec);
        tile_to_shared<D, FA_BWD_COLS>(tile.d_o, LD, d_o16 + at.o, o_seq_stride, c0, s, vec);
        rows_to_shared<FA_BWD_COLS>(tile.lse_at, tile.lse, lse + at.row, c0, s);
        rows_to_shared<FA_BWD_COLS>(tile.delta_at, tile.delta, delta + at.row, c0, s);
        // The tile's words, whole (rows up to the sequence rounded up to 64 exist; those of
        // queries past the end are never used).
        if (dropout && threadIdx.x < FA_BWD_COLS * 8 / 16) {
            copy_async<16>(tile.keep_at + 16 * threadIdx.x, keep_block + c0 + 2 * threadIdx.x);
        }
        copies_commit();
    };
    // The queries that see some key of the block end before c_end, the sequence's end and,
    // with documents, after the block's last key's document and window (queries of later
    // documents see none of its keys: their tiles are skipped).
    u32 q_end = min(c_end, s);
    if (docs) {
        const u32 last = min(k0 + FA_ROWS, s) - 1;
        q_end = min(q_end, min(doc_span(docs, blockIdx.z, s, last).end, last + window + 1));
    }
    const int tiles = ((int)q_end - (int)c_first + FA_BWD_COLS - 1) / FA_BWD_COLS;
    // A later chunk of queries than the block's keys' documents reach: nothing to add.
    if (tiles <= 0) return;
    // This thread's keys' document ends (queries from there on see neither).
    const u32 key_end[2] = {doc_span(docs, blockIdx.z, s, k0 + w0 + g).end,
                            doc_span(docs, blockIdx.z, s, k0 + w0 + g + 8).end};
    // This warp's rows of the score gradients (row g; row g + 8 is 8·ds_cols further).
    bf16_t* const ds_warp = ds + ((u64)blockIdx.z * heads + blockIdx.y) * score_rows(s) * ds_cols +
                            (u64)(k0 + w0 + g) * ds_cols + 2 * t;
    tile_to_shared<D, FA_ROWS>(ks, LD, k + at.qkv, seq_stride, k0, s, vec);
    tile_to_shared<D, FA_ROWS>(vs, LD, v + at.qkv, seq_stride, k0, s, vec);
    fetch(0);

    float dk_acc[D / 8][4], dv_acc[D / 8][4];
    zero_tiles<D / 8>(dk_acc);
    zero_tiles<D / 8>(dv_acc);

    for (int it = 0; it < tiles; ++it) {
        const u32 c0 = c_first + it * FA_BWD_COLS;
        advance_tiles(it, tiles, fetch);
        count_tile();
        const QueryTile<D> tile = stage(it);

        // The transposed scores k·qᵀ (keys × queries) and dropped-probability gradient v·doᵀ.
        float st[FA_BWD_COLS / 8][4], dz[FA_BWD_COLS / 8][4];
        zero_tiles<FA_BWD_COLS / 8>(st);
        zero_tiles<FA_BWD_COLS / 8>(dz);
        #pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            u32 ka[1][4], va[1][4];
            frag_a(ka[0], ks, LD, w0, 16 * kk);
            frag_a(va[0], vs, LD, w0, 16 * kk);
            product_frags<1, FA_BWD_COLS / 8>(st, ka, tile.q + 32 * kk, LD);
            product_frags<1, FA_BWD_COLS / 8>(dz, va, tile.d_o + 32 * kk, LD);
        }
        // Element (key j = row, query i = column): dropped probabilities into st, score
        // gradients into dz.
        #pragma unroll
        for (int n = 0; n < FA_BWD_COLS / 8; ++n) {
            #pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int key = w0 % 32 + g + 8 * (c >> 1), col = 8 * n + 2 * t + (c & 1);
                // Bit w0 + g + 8·(c >> 1) of the column's word: bit `key` of this warp's half.
                const float f =
                    !dropout ? keep_scale
                    : (shared_load(&tile.keep[2 * col + keep_half]) >> key) & 1u ? keep_scale
                                                                                 : 0.0f;
                const Grad e = element_grad(st[n][c], dz[n][c], shared_load(&tile.lse[col]) * LOG2E,
                                            shared_load(&tile.delta[col]), f, scale, scale2);
                st[n][c] = e.dropped;
                dz[n][c] = e.d_score;
            }
        }
        // Where the tile crosses the diagonal, the end, a key's sliding window or its
        // document's end, only queries i with j <= i < s, i <= j + window and i before the
        // end of j's document count: column col holds query c0 + col, row (c >> 1) key
        // k0 + w0 + g + 8·(c >> 1).
        if (c0 < wk_last || c0 + FA_BWD_COLS > s ||
            (i64)c0 + FA_BWD_COLS - 1 > (i64)(k0 + w0) + (i64)window ||
            c0 + FA_BWD_COLS > key_end[0]) {
            const int lo[2] = {(int)(k0 + w0 + g) - (int)c0 - 2 * t,
                               (int)(k0 + w0 + g + 8) - (int)c0 - 2 * t};
            const int end[2] = {(int)key_end[0] - 1 - (int)c0 - 2 * t,
                                (int)key_end[1] - 1 - (int)c0 - 2 * t};
            const int hi[2] = {min(end[0], lo[0] + (int)window),
                               min(end[1], lo[1] + (int)window)};
            #pragma unroll
            for (int n = 0; n < FA_BWD_COLS / 8; ++n) {
                #pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const int col = 8 * n + (c & 1);
                    if (col < lo[c >> 1] || col > hi[c >> 1]) st[n][c] = dz[n][c] = 0.0f;
                }
            }
        }
        // dv += droppedᵀ·do and dk += d_scoresᵀ·q over the tile's queries (st and dz hold the
        // transposes); the score gradients in bf16 are also stored for dq.
        product_tiles<FA_BWD_COLS / 16, D / 8>(dv_acc, st, tile.d_o, LD);
        u32 dsa[FA_BWD_COLS / 16][4];
        #pragma unroll
        for (int kq = 0; kq < FA_BWD_COLS / 16; ++kq) {
            acc_to_a(dsa[kq], dz, kq);
            // Fragment words: (row g, columns 16kq + 2t ..), (g + 8, same), (g, + 8), (g + 8, + 8).
            bf16_t* const row_g = ds_warp + (c0 - c_begin) + 16 * kq;
            u32* at_g = reinterpret_cast<u32*>(row_g);
            u32* at_g8 = reinterpret_cast<u32*>(row_g + 8 * (u64)ds_cols);
            at_g[0] = dsa[kq][0];
            at_g8[0] = dsa[kq][1];
            at_g[4] = dsa[kq][2];
            at_g8[4] = dsa[kq][3];
        }
        product_frags<FA_BWD_COLS / 16, D / 8, true>(dk_acc, dsa, tile.q, LD);
        // Every warp is done with this stage before it is refilled.
        __syncthreads();
    }

    // Queries before c_begin that see these keys were an earlier chunk's.
    const bool add = c_begin > k0, pairs = pairs_aligned(dk);
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
        const u32 j = k0 + w0 + g + 8 * r;
        if (j >= s) continue;
        const i64 at_j = at.qkv + (i64)j * seq_stride + 2 * t;
        store_row<D / 8>(dk + at_j, dk_acc, r, 1.0f, pairs, add);
        store_row<D / 8>(dv + at_j, dv_acc, r, 1.0f, pairs, add);
    }
}

// Backward, step 3: dq = dS·k for FA_ROWS queries per block (16 per warp) of the chunk from
// c_begin, from the score gradients the key/value kernel stored, over the tiles of the keys
// they see. Grid: (query tiles of the chunk, heads, batch); the last query tiles start first.
// Shared memory (dynamic): two stages of a key tile (FA_DQ_KEYS keys) and the score gradients
// of those keys and the block's queries.
template <int D>
__device__ __forceinline__ void fa_backward_q(const bf16_t* __restrict__ k, i64 seq_stride,
                                              i64 batch_stride, i64 head_stride,
                                              const bf16_t* __restrict__ ds, u32 ds_cols,
                                              u32 c_begin, bf16_t* __restrict__ dq, u32 s,
                                              u64 heads, u32 window,
                                              const u64* __restrict__ docs,
                                              unsigned char* smem_raw) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, g = lane >> 2, t = lane & 3;
    const i64 at = (i64)blockIdx.z * batch_stride + (i64)blockIdx.y * head_stride;
    const bool vec = rows_aligned(k, k, k, seq_stride, batch_stride, head_stride);
    const u32 q0 = c_begin + (gridDim.x - 1 - blockIdx.x) * FA_ROWS;
    // The block's columns of the score gradients (rows: keys; 16-byte aligned).
    const bf16_t* ds_at = ds + ((u64)blockIdx.z * heads + blockIdx.y) * score_rows(s) * ds_cols +
                          (q0 - c_begin);
    // With documents, the block's first tile holds its first query's first visible key, and
    // this thread's rows' first visible keys (the key-gradient kernel wrote no score gradient
    // for a key tile that a whole tile of its queries does not see).
    const u64 b = blockIdx.z;
    const u32 i0 = q0 + 16 * warp + g;
    const u32 fv[2] = {first_visible(docs, b, s, i0, window),
                       first_visible(docs, b, s, i0 + 8, window)};
    const int first_tile = docs ? first_visible(docs, b, s, q0, window) / FA_DQ_KEYS : 0;
    using Stream = KeyStream<D, FA_DQ_KEYS, FA_ROWS>;
    const Stream kv =
        stream_keys<D, FA_DQ_KEYS, FA_ROWS>(smem_raw, k + at, seq_stride, vec, ds_at, ds_cols,
                                            true, min(q0 + FA_ROWS, s) - 1, s, first_tile);

    float acc[D / 8][4];
    zero_tiles<D / 8>(acc);
    for (int it = first_tile; it < kv.tiles; ++it) {
        kv.advance(it);
        count_tile();
        // This warp's queries' score gradients over the tile's keys (stored as rows per key:
        // read transposed), times the keys. Keys past a query hold zeros; with documents, the
        // keys before a row's first visible one are zeroed here.
        u32 a[FA_DQ_KEYS / 16][4];
        const u32 k0 = it * FA_DQ_KEYS;
        #pragma unroll
        for (int kk = 0; kk < FA_DQ_KEYS / 16; ++kk) {
            frag_a_trans(a[kk], kv.paired(it), Stream::LD_PAIRED, 16 * warp, 16 * kk);
            if (docs && k0 < fv[1]) {
                // a[0]: row g, keys 2t, 2t + 1; a[1]: row g + 8, the same; a[2], a[3]: + 8.
                #pragma unroll
                for (int f = 0; f < 4; ++f) {
                    const u32 first = fv[f & 1];
                    const u32 key = k0 + 16 * kk + 2 * t + 8 * (f >> 1);
                    const u32 keep_lo = key >= first ? 0xffffu : 0u;
                    const u32 keep_hi = key + 1 >= first ? 0xffff0000u : 0u;
                    a[kk][f] &= keep_lo | keep_hi;
                }
            }
        }
        product_frags<FA_DQ_KEYS / 16, D / 8, true>(acc, a, kv.keys(it), Stream::LD);
        // Every warp is done with this stage before the next iteration refills it.
        __syncthreads();
    }

    #pragma unroll
    for (int r = 0; r < 2; ++r) {
        const u32 i = q0 + 16 * warp + g + 8 * r;
        if (i >= s) continue;
        store_row<D / 8>(dq + at + (i64)i * seq_stride + 2 * t, acc, r, 1.0f, pairs_aligned(dq));
    }
}

// The kernels take the head dimension at run time and run the instantiation for it (32, 64,
// 96 or 128; others do nothing: the launchers refuse them). Shared memory is dynamic, as many
// bytes as the launchers' `shared_bytes` say for (kernel, d).
#define FA_DISPATCH(d, CALL) \
    switch (d) {             \
        case 32: CALL(32); break; \
        case 64: CALL(64); break; \
        case 96: CALL(96); break; \
        case 128: CALL(128); break; \
        default: break;      \
    }

extern "C" __global__ __launch_bounds__(FA_THREADS) void flash_forward(
    const bf16_t* __restrict__ qkv, i64 seq_stride, i64 batch_stride, i64 head_stride,
    bf16_t* __restrict__ o, i64 o_seq_stride, i64 o_batch_stride, i64 o_head_stride,
    float* __restrict__ lse, u64* __restrict__ keep_bits, u64 s, u64 heads, int d, float scale,
    u32 window, u64 inner, u64 stride, u64 start, u32 key_lo, u32 key_hi, u64 stream,
    u32 threshold, float keep_scale, PhiloxKeys keys, const u64* __restrict__ docs) {
    DYNAMIC_SHARED(smem_raw);
    const Mask m = make_mask(inner, stride, start, key_lo, key_hi, stream, threshold, keep_scale);
#define FA_CALL(D)                                                                            \
    fa_forward<D>(qkv, qkv + (D), qkv + 2 * (D), seq_stride, batch_stride, head_stride, o,    \
                  o_seq_stride, o_batch_stride, o_head_stride, lse, keep_bits, s, heads,      \
                  scale, window, m, keys, docs, smem_raw)
    FA_DISPATCH(d, FA_CALL)
#undef FA_CALL
}

extern "C" __global__ __launch_bounds__(FA_THREADS) void flash_backward_kv(
    const bf16_t* __restrict__ qkv, i64 seq_stride, i64 batch_stride, i64 head_stride,
    const bf16_t* __restrict__ d_o16, i64 o_seq_stride, i64 o_batch_stride, i64 o_head_stride,
    const float* __restrict__ lse, const float* __restrict__ delta, bf16_t* __restrict__ dqkv,
    bf16_t* __restrict__ ds, u32 ds_cols, u32 c_begin, u32 c_end, u64 s, u64 heads, int d,
    float scale, u32 window, const u64* __restrict__ keep_bits, float keep_scale,
    const u64* __restrict__ docs) {
    DYNAMIC_SHARED(smem_raw);
#define FA_CALL(D)                                                                            \
    fa_backward_kv<D>(qkv, qkv + (D), qkv + 2 * (D), seq_stride, batch_stride, head_stride,   \
                      d_o16, o_seq_stride, o_batch_stride, o_head_stride, lse, delta,         \
                      dqkv + (D), dqkv + 2 * (D), ds, ds_cols, c_begin, c_end, s, heads,      \
                      scale, window, keep_bits, keep_scale, docs, smem_raw)
    FA_DISPATCH(d, FA_CALL)
#undef FA_CALL
}

extern "C" __global__ __launch_bounds__(FA_THREADS) void flash_backward_q(
    const bf16_t* __restrict__ qkv, i64 seq_stride, i64 batch_stride, i64 head_stride,
    const bf16_t* __restrict__ ds, u32 ds_cols, u32 c_begin, bf16_t* __restrict__ dqkv, u64 s,
    u64 heads, int d, u32 window, const u64* __restrict__ docs) {
    DYNAMIC_SHARED(smem_raw);
#define FA_CALL(D)                                                                            \
    fa_backward_q<D>(qkv + (D), seq_stride, batch_stride, head_stride, ds, ds_cols, c_begin,  \
                     dqkv, s, heads, window, docs, smem_raw)
    FA_DISPATCH(d, FA_CALL)
#undef FA_CALL
}
