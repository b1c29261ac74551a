// Scaled, optionally causal softmax over the last dimension of attention scores [batches, sq, sk],
// as megatron-core's kernels::softmax. Row r is query i = r % sq; with `causal` it sees keys
// first_key(..) <= j < visible_keys(i) (the first key is 0 unless a sliding window of `window`
// keys before the query leaves out earlier ones; no window: u64 max), all others get exactly 0. A row whose visible scaled scores are all −∞ (or
// NaN), or that sees no key, gets 0 where the scaled score is not NaN and NaN where it is.
//
// Attention fuses its dropout and the bf16 rounding of the products' operands into these
// kernels: the forward may also write the dropped probabilities, the backward takes the gradient
// of the dropped probabilities and may also write them again. Every input and output is f32 or
// bf16 (computation in f32). The mask is the dropout kernels' (a Mask over the [batches·sq·sk]
// buffer); a threshold of 0 is no dropout.
//
// One block per row (grid-stride over rows): max, then Σexp, then normalise, each a pass over
// the row with 16-byte float4 accesses when sk is a multiple of 4 and the buffers are aligned
// (checked here, at run time), scalar otherwise. The exponentials of the last pass are
// recomputed, bit-identical to those summed. Block reductions are in a fixed order.

#define SM_MAX_THREADS 512
#define CANONICAL_NAN __int_as_float(0x7fc00000)

// Keys query `i` sees: min(i + 1 + sk − sq, sk), at least 0, when causal; else all sk.
__device__ __forceinline__ u64 visible_keys(u64 i, u64 sq, u64 sk, bool causal) {
    if (!causal) return sk;
    const u64 t = i + 1 + sk;
    return t > sq ? min(t - sq, sk) : 0;
}

// The first key a causal query that sees keys before `vis` sees: the query (key vis − 1) and
// `window` keys before it.
__device__ __forceinline__ u64 first_key(u64 vis, bool causal, u64 window) {
    return causal && window < vis ? vis - 1 - window : 0;
}

// Whether key j is seen by a row that sees keys lo .. vis − 1.
__device__ __forceinline__ bool seen(u64 j, u64 lo, u64 vis) { return j >= lo && j < vis; }

// scale·v rounded on its own (no FMA contraction into the subtraction that follows), as on the
// CPU: the row's maximum then gives exactly exp(0) = 1.
__device__ __forceinline__ float scaled(float v, float scale) { return __fmul_rn(v, scale); }

// A row's maximum scaled score `m` (−∞ for a row with nothing to normalise) and 1/Σexp.
struct RowStats {
    float m, inv;
};

// Passes 1 and 2 over the visible keys lo .. vis − 1 of row r (elements r·sk .. of x; `x16`: x
// is bf16).
__device__ __forceinline__ RowStats row_stats(const void* __restrict__ x, bool x16, u64 r, u64 sk,
                                              u64 lo, u64 vis, float scale, bool vec,
                                              float* scratch) {
    const u64 lo4 = lo / 4, vis4 = (vis + 3) / 4;  // float4 groups holding a visible key
    const u64 at = r * sk, at4 = r * (sk / 4);
    // Pass 1: the maximum of the visible scaled scores (fmaxf skips NaN, as f32::max).
    float mx = NEG_INF;
    if (vec) {
        for (u64 k = lo4 + threadIdx.x; k < vis4; k += blockDim.x) {
            const float4 v = load_in4(x, x16, at4 + k);
            const u64 j = 4 * k;
            if (j >= lo) mx = fmaxf(mx, scaled(v.x, scale));
            if (seen(j + 1, lo, vis)) mx = fmaxf(mx, scaled(v.y, scale));
            if (seen(j + 2, lo, vis)) mx = fmaxf(mx, scaled(v.z, scale));
            if (seen(j + 3, lo, vis)) mx = fmaxf(mx, scaled(v.w, scale));
        }
    } else {
        for (u64 j = lo + threadIdx.x; j < vis; j += blockDim.x) {
            mx = fmaxf(mx, scaled(load_in(x, x16, at + j), scale));
        }
    }
    RowStats st;
    st.m = block_max(mx, scratch);
    st.inv = 0.0f;
    if (st.m == NEG_INF) return st;  // uniform over the block

    // Pass 2: Σ exp(scale·x − m) over the visible keys.
    float s = 0.0f;
    if (vec) {
        for (u64 k = lo4 + threadIdx.x; k < vis4; k += blockDim.x) {
            const float4 v = load_in4(x, x16, at4 + k);
            const u64 j = 4 * k;
            // 0 + the first term is that term: the same sums as without a window.
            float t = j >= lo ? exp_f32(scaled(v.x, scale) - st.m) : 0.0f;
            if (seen(j + 1, lo, vis)) t += exp_f32(scaled(v.y, scale) - st.m);
            if (seen(j + 2, lo, vis)) t += exp_f32(scaled(v.z, scale) - st.m);
            if (seen(j + 3, lo, vis)) t += exp_f32(scaled(v.w, scale) - st.m);
            s += t;
        }
    } else {
        for (u64 j = lo + threadIdx.x; j < vis; j += blockDim.x) {
            s += exp_f32(scaled(load_in(x, x16, at + j), scale) - st.m);
        }
    }
    st.inv = 1.0f / block_sum(s, scratch);
    return st;
}

// The probability of key j with scaled score from v: 0 where masked; in a row with nothing to
// normalise, NaN where the scaled score is NaN and 0 elsewhere.
__device__ __forceinline__ float prob(float v, u64 j, u64 lo, u64 vis, float scale,
                                      RowStats st) {
    if (!seen(j, lo, vis)) return 0.0f;
    if (st.m == NEG_INF) return isnan(scaled(v, scale)) ? CANONICAL_NAN : 0.0f;
    return exp_f32(scaled(v, scale) - st.m) * st.inv;
}

// y = softmax(scale·x); with `dropped` non-null also dropped = mask(y), mask element r·sk + j
// for row r, key j. The *_bf16 flags say which buffers are bf16.
extern "C" __global__ __launch_bounds__(SM_MAX_THREADS) void softmax_forward(
    const void* __restrict__ x, int x_bf16, void* __restrict__ y, int y_bf16,
    void* __restrict__ dropped, int dropped_bf16, u64 rows, u64 sq, u64 sk, float scale,
    int causal, u64 window, u64 inner, u64 stride, u64 start, u32 key_lo, u32 key_hi, u64 stream,
    u32 threshold, float keep_scale) {
    __shared__ float scratch[32];
    const Mask m = make_mask(inner, stride, start, key_lo, key_hi, stream, threshold, keep_scale);
    const bool x16 = x_bf16 != 0, y16 = y_bf16 != 0, d16 = dropped_bf16 != 0;
    const bool vec = sk % 4 == 0 && out4_aligned(x, x16) && out4_aligned(y, y16) &&
                     out4_aligned(dropped, d16);
    const bool blocks = mask_blocks(m);
    const u64 k4 = sk / 4;
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const u64 vis = visible_keys(r % sq, sq, sk, causal != 0);
        const u64 lo = first_key(vis, causal != 0, window);
        const RowStats st = row_stats(x, x16, r, sk, lo, vis, scale, vec, scratch);
        // Pass 3: normalise (masked keys get exactly 0), then the dropout.
        if (vec) {
            const u64 lo4 = lo / 4, vis4 = (vis + 3) / 4;
            for (u64 k = threadIdx.x; k < k4; k += blockDim.x) {
                float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                const u64 j = 4 * k;
                const bool any = k >= lo4 && k < vis4;
                if (any) {
                    const float4 v = load_in4(x, x16, r * k4 + k);
                    o = make_float4(prob(v.x, j, lo, vis, scale, st),
                                    prob(v.y, j + 1, lo, vis, scale, st),
                                    prob(v.z, j + 2, lo, vis, scale, st),
                                    prob(v.w, j + 3, lo, vis, scale, st));
                }
                store_out4(y, y16, r * k4 + k, o);
                if (dropped != nullptr) {
                    // Masked keys are 0 whatever the mask says: no Philox words for them.
                    const float4 d = any ? masked4(o, mask_factor4(m, r * sk + j, blocks)) : o;
                    store_out4(dropped, d16, r * k4 + k, d);
                }
            }
        } else {
            for (u64 j = threadIdx.x; j < sk; j += blockDim.x) {
                const bool in = seen(j, lo, vis);
                const float o = prob(in ? load_in(x, x16, r * sk + j) : 0.0f, j, lo, vis, scale, st);
                store_out(y, y16, r * sk + j, o);
                if (dropped != nullptr) {
                    const float d = in ? masked(o, mask_factor(m, r * sk + j)) : o;
                    store_out(dropped, d16, r * sk + j, d);
                }
            }
        }
    }
}

// The gradient through dropout and softmax from the saved probabilities y: g = mask(dy),
// dx = scale · y ⊙ (g − Σ_j g·y) per row (masked keys have y = 0 and get 0); with `dropped`
// non-null also dropped = mask(y) (the forward's, for the value gradient). With `causal` the
// keys a query does not see (y = 0 there) are not read and draw no mask: they get 0 in dx and
// in dropped. The *_bf16 flags say which buffers are bf16.
extern "C" __global__ __launch_bounds__(SM_MAX_THREADS) void softmax_backward(
    const void* __restrict__ y, int y_bf16, const void* __restrict__ dy, int dy_bf16,
    void* __restrict__ dx, int dx_bf16, void* __restrict__ dropped, int dropped_bf16, u64 rows,
    u64 sq, u64 sk, float scale, int causal, u64 window, u64 inner, u64 stride, u64 start,
    u32 key_lo, u32 key_hi, u64 stream, u32 threshold, float keep_scale) {
    __shared__ float scratch[32];
    const Mask m = make_mask(inner, stride, start, key_lo, key_hi, stream, threshold, keep_scale);
    const bool y16 = y_bf16 != 0, dy16 = dy_bf16 != 0, dx16 = dx_bf16 != 0, d16 = dropped_bf16 != 0;
    const bool vec = sk % 4 == 0 && out4_aligned(y, y16) && out4_aligned(dy, dy16) &&
                     out4_aligned(dx, dx16) && out4_aligned(dropped, d16);
    const bool blocks = mask_blocks(m);
    const u64 k4 = sk / 4;
    const float4 zero4 = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const u64 vis = visible_keys(r % sq, sq, sk, causal != 0);
        const u64 lo = first_key(vis, causal != 0, window);
        // float4 groups holding a visible key (the others have y = 0)
        const u64 lo4 = lo / 4, vis4 = (vis + 3) / 4;
        float s = 0.0f;
        if (vec) {
            for (u64 k = lo4 + threadIdx.x; k < vis4; k += blockDim.x) {
                const float4 p = load_in4(y, y16, r * k4 + k);
                const float4 g = masked4(load_in4(dy, dy16, r * k4 + k),
                                         mask_factor4(m, r * sk + 4 * k, blocks));
                s += (g.x * p.x + g.y * p.y) + (g.z * p.z + g.w * p.w);
            }
        } else {
            for (u64 j = lo + threadIdx.x; j < vis; j += blockDim.x) {
                const u64 e = r * sk + j;
                s += masked(load_in(dy, dy16, e), mask_factor(m, e)) * load_in(y, y16, e);
            }
        }
        const float dot = block_sum(s, scratch);
        if (vec) {
            for (u64 k = threadIdx.x; k < k4; k += blockDim.x) {
                if (k < lo4 || k >= vis4) {
                    store_out4(dx, dx16, r * k4 + k, zero4);
                    if (dropped != nullptr) store_out4(dropped, d16, r * k4 + k, zero4);
                    continue;
                }
                const float4 p = load_in4(y, y16, r * k4 + k);
                const float4 f = mask_factor4(m, r * sk + 4 * k, blocks);
                const float4 g = masked4(load_in4(dy, dy16, r * k4 + k), f);
                store_out4(dx, dx16, r * k4 + k,
                           make_float4(scale * p.x * (g.x - dot), scale * p.y * (g.y - dot),
                                       scale * p.z * (g.z - dot), scale * p.w * (g.w - dot)));
                if (dropped != nullptr) store_out4(dropped, d16, r * k4 + k, masked4(p, f));
            }
        } else {
            for (u64 j = threadIdx.x; j < sk; j += blockDim.x) {
                const u64 e = r * sk + j;
                if (!seen(j, lo, vis)) {
                    store_out(dx, dx16, e, 0.0f);
                    if (dropped != nullptr) store_out(dropped, d16, e, 0.0f);
                    continue;
                }
                const float f = mask_factor(m, e), p = load_in(y, y16, e);
                store_out(dx, dx16, e, scale * p * (masked(load_in(dy, dy16, e), f) - dot));
                if (dropped != nullptr) store_out(dropped, d16, e, masked(p, f));
            }
        }
    }
}
