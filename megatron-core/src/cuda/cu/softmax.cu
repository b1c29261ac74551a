// Scaled, optionally causal softmax over the last dimension of attention scores [batches, sq, sk],
// as megatron-core's kernels::softmax. Row r is query i = r % sq; with `causal` it sees keys
// j < visible_keys(i), all others get exactly 0. A row whose visible scaled scores are all −∞ (or
// NaN), or that sees no key, gets 0 where the scaled score is not NaN and NaN where it is.
//
// One block per row (grid-stride over rows): max, then Σexp, then normalise, each a pass over
// the row with 16-byte float4 accesses when sk is a multiple of 4 and the buffers are 16-byte
// aligned (checked here, at run time), scalar otherwise. The exponentials of the last pass are
// recomputed, bit-identical to those summed. Block reductions are in a fixed order.

#define SM_MAX_THREADS 512
#define CANONICAL_NAN __int_as_float(0x7fc00000)

__device__ __forceinline__ bool sm_aligned16(const void* p) { return ((u64)p & 15) == 0; }

// Keys query `i` sees: min(i + 1 + sk − sq, sk), at least 0, when causal; else all sk.
__device__ __forceinline__ u64 visible_keys(u64 i, u64 sq, u64 sk, bool causal) {
    if (!causal) return sk;
    const u64 t = i + 1 + sk;
    return t > sq ? min(t - sq, sk) : 0;
}

// scale·v rounded on its own (no FMA contraction into the subtraction that follows), as on the
// CPU: the row's maximum then gives exactly exp(0) = 1.
__device__ __forceinline__ float scaled(float v, float scale) { return __fmul_rn(v, scale); }

// The value written for visible key j of a row with maximum `m` and 1/Σ `inv`.
__device__ __forceinline__ float prob(float v, float scale, float m, float inv) {
    return exp_f32(scaled(v, scale) - m) * inv;
}

extern "C" __global__ __launch_bounds__(SM_MAX_THREADS) void softmax_forward(
    const float* __restrict__ x, float* __restrict__ y, u64 rows, u64 sq, u64 sk, float scale,
    int causal) {
    __shared__ float scratch[32];
    const bool vec = sk % 4 == 0 && sm_aligned16(x) && sm_aligned16(y);
    const u64 k4 = sk / 4;
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* xr = x + r * sk;
        float* yr = y + r * sk;
        const u64 vis = visible_keys(r % sq, sq, sk, causal != 0);
        const u64 vis4 = (vis + 3) / 4;  // float4 groups holding a visible key
        const float4* x4 = reinterpret_cast<const float4*>(xr);
        float4* y4 = reinterpret_cast<float4*>(yr);

        // Pass 1: the maximum of the visible scaled scores (fmaxf skips NaN, as f32::max).
        float mx = NEG_INF;
        if (vec) {
            for (u64 k = threadIdx.x; k < vis4; k += blockDim.x) {
                const float4 v = x4[k];
                const u64 j = 4 * k;
                mx = fmaxf(mx, scaled(v.x, scale));
                if (j + 1 < vis) mx = fmaxf(mx, scaled(v.y, scale));
                if (j + 2 < vis) mx = fmaxf(mx, scaled(v.z, scale));
                if (j + 3 < vis) mx = fmaxf(mx, scaled(v.w, scale));
            }
        } else {
            for (u64 j = threadIdx.x; j < vis; j += blockDim.x) {
                mx = fmaxf(mx, scaled(xr[j], scale));
            }
        }
        const float m = block_max(mx, scratch);

        if (m == NEG_INF) {
            // Nothing visible, or every visible score is −∞ or NaN: 0, NaN kept.
            if (vec) {
                for (u64 k = threadIdx.x; k < k4; k += blockDim.x) {
                    float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                    if (k < vis4) {
                        const float4 v = x4[k];
                        const u64 j = 4 * k;
                        if (isnan(scaled(v.x, scale))) o.x = CANONICAL_NAN;
                        if (j + 1 < vis && isnan(scaled(v.y, scale))) o.y = CANONICAL_NAN;
                        if (j + 2 < vis && isnan(scaled(v.z, scale))) o.z = CANONICAL_NAN;
                        if (j + 3 < vis && isnan(scaled(v.w, scale))) o.w = CANONICAL_NAN;
                    }
                    y4[k] = o;
                }
            } else {
                for (u64 j = threadIdx.x; j < sk; j += blockDim.x) {
                    yr[j] = j < vis && isnan(scaled(xr[j], scale)) ? CANONICAL_NAN : 0.0f;
                }
            }
            continue;
        }

        // Pass 2: Σ exp(scale·x − m) over the visible keys.
        float s = 0.0f;
        if (vec) {
            for (u64 k = threadIdx.x; k < vis4; k += blockDim.x) {
                const float4 v = x4[k];
                const u64 j = 4 * k;
                float t = exp_f32(scaled(v.x, scale) - m);
                if (j + 1 < vis) t += exp_f32(scaled(v.y, scale) - m);
                if (j + 2 < vis) t += exp_f32(scaled(v.z, scale) - m);
                if (j + 3 < vis) t += exp_f32(scaled(v.w, scale) - m);
                s += t;
            }
        } else {
            for (u64 j = threadIdx.x; j < vis; j += blockDim.x) {
                s += exp_f32(scaled(xr[j], scale) - m);
            }
        }
        const float inv = 1.0f / block_sum(s, scratch);

        // Pass 3: normalise; masked keys get exactly 0.
        if (vec) {
            for (u64 k = threadIdx.x; k < k4; k += blockDim.x) {
                float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                if (k < vis4) {
                    const float4 v = x4[k];
                    const u64 j = 4 * k;
                    o.x = prob(v.x, scale, m, inv);
                    if (j + 1 < vis) o.y = prob(v.y, scale, m, inv);
                    if (j + 2 < vis) o.z = prob(v.z, scale, m, inv);
                    if (j + 3 < vis) o.w = prob(v.w, scale, m, inv);
                }
                y4[k] = o;
            }
        } else {
            for (u64 j = threadIdx.x; j < sk; j += blockDim.x) {
                yr[j] = j < vis ? prob(xr[j], scale, m, inv) : 0.0f;
            }
        }
    }
}

// dx = scale · y ⊙ (dy − Σ_j dy·y) per row (masked keys have y = 0 and get 0); one block per row.
extern "C" __global__ __launch_bounds__(SM_MAX_THREADS) void softmax_backward(
    const float* __restrict__ y, const float* __restrict__ dy, float* __restrict__ dx, u64 rows,
    u64 sk, float scale) {
    __shared__ float scratch[32];
    const bool vec =
        sk % 4 == 0 && sm_aligned16(y) && sm_aligned16(dy) && sm_aligned16(dx);
    const u64 k4 = sk / 4;
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* yr = y + r * sk;
        const float* dyr = dy + r * sk;
        float* dxr = dx + r * sk;
        float s = 0.0f;
        if (vec) {
            const float4* p4 = reinterpret_cast<const float4*>(yr);
            const float4* g4 = reinterpret_cast<const float4*>(dyr);
            for (u64 k = threadIdx.x; k < k4; k += blockDim.x) {
                const float4 p = p4[k], g = g4[k];
                s += (g.x * p.x + g.y * p.y) + (g.z * p.z + g.w * p.w);
            }
        } else {
            for (u64 j = threadIdx.x; j < sk; j += blockDim.x) s += dyr[j] * yr[j];
        }
        const float dot = block_sum(s, scratch);
        if (vec) {
            const float4* p4 = reinterpret_cast<const float4*>(yr);
            const float4* g4 = reinterpret_cast<const float4*>(dyr);
            float4* o4 = reinterpret_cast<float4*>(dxr);
            for (u64 k = threadIdx.x; k < k4; k += blockDim.x) {
                const float4 p = p4[k], g = g4[k];
                o4[k] = make_float4(scale * p.x * (g.x - dot), scale * p.y * (g.y - dot),
                                    scale * p.z * (g.z - dot), scale * p.w * (g.w - dot));
            }
        } else {
            for (u64 j = threadIdx.x; j < sk; j += blockDim.x) {
                dxr[j] = scale * yr[j] * (dyr[j] - dot);
            }
        }
    }
}
