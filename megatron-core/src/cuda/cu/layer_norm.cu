// Layer normalisation over the last dimension of a row-major [rows, hidden] matrix, as
// megatron-core's kernels::layer_norm: two-pass f32 mean and biased variance, rstd = 1/sqrt(var +
// eps) (correctly rounded division and square root), mean and rstd saved per row. The forward's
// output is f32 or, for bf16 products, bf16 (rounded once).
//
// Row kernels: one block per row (grid-stride over rows), 16-byte float4 accesses when hidden is a
// multiple of 4 and every row buffer is 16-byte aligned (checked here, at run time), scalar
// otherwise. Block sums are butterfly reductions in a fixed order: the same inputs and launch give
// the same bits. dgamma/dbeta use no atomics: per-chunk f64 partial column sums (rows in order
// within a chunk), then a second kernel adds the chunks in order, rounds once and adds to the
// f32 gradient, as the CPU's f64 column sums.
//
// RMSNorm is the same kernels without the mean and the bias: a null beta (forward), centered 0
// (dx) and a null dbeta (finalize); mean is then written, and read, as 0.

#define LN_MAX_THREADS 512
// The partial column sums' block: LN_COLS consecutive columns × LN_ROW_LANES row lanes.
#define LN_COLS 32
#define LN_ROW_LANES 8

extern "C" __global__ __launch_bounds__(LN_MAX_THREADS) void layer_norm_forward(
    const float* __restrict__ x, const float* __restrict__ gamma, const float* __restrict__ beta,
    void* __restrict__ y, int y_bf16, float* __restrict__ mean, float* __restrict__ rstd, u64 rows,
    u64 hidden, float eps) {
    __shared__ float scratch[32];
    const float inv_h = 1.0f / (float)hidden;
    const bool centered = beta != nullptr;
    const bool vec = hidden % 4 == 0 && aligned16(x) && aligned16(gamma) &&
                     (!centered || aligned16(beta)) && out4_aligned(y, y_bf16);
    const u64 h4 = hidden / 4;
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* xr = x + r * hidden;
        // Pass 1: the mean (RMSNorm: none).
        float s = 0.0f;
        if (!centered) {
        } else if (vec) {
            const float4* x4 = reinterpret_cast<const float4*>(xr);
            for (u64 k = threadIdx.x; k < h4; k += blockDim.x) {
                const float4 v = x4[k];
                s += (v.x + v.y) + (v.z + v.w);
            }
        } else {
            for (u64 k = threadIdx.x; k < hidden; k += blockDim.x) s += xr[k];
        }
        const float m = centered ? block_sum(s, scratch) * inv_h : 0.0f;
        // Pass 2: the biased variance around it.
        float q = 0.0f;
        if (vec) {
            const float4* x4 = reinterpret_cast<const float4*>(xr);
            for (u64 k = threadIdx.x; k < h4; k += blockDim.x) {
                const float4 v = x4[k];
                const float a = v.x - m, b = v.y - m, c = v.z - m, d = v.w - m;
                q += (a * a + b * b) + (c * c + d * d);
            }
        } else {
            for (u64 k = threadIdx.x; k < hidden; k += blockDim.x) {
                const float d = xr[k] - m;
                q += d * d;
            }
        }
        const float var = block_sum(q, scratch) * inv_h;
        const float rs = 1.0f / sqrtf(var + eps);
        // Pass 3: y = (x − m)·rstd·gamma + beta (RMSNorm: x·rstd·gamma).
        if (!centered) {
            for (u64 k = threadIdx.x; k < hidden; k += blockDim.x) {
                store_out(y, y_bf16, r * hidden + k, __fmul_rn(__fmul_rn(xr[k], rs), gamma[k]));
            }
        } else if (vec) {
            const float4* x4 = reinterpret_cast<const float4*>(xr);
            const float4* g4 = reinterpret_cast<const float4*>(gamma);
            const float4* b4 = reinterpret_cast<const float4*>(beta);
            for (u64 k = threadIdx.x; k < h4; k += blockDim.x) {
                const float4 v = x4[k], g = g4[k], b = b4[k];
                store_out4(y, y_bf16, r * h4 + k,
                           make_float4((v.x - m) * rs * g.x + b.x, (v.y - m) * rs * g.y + b.y,
                                       (v.z - m) * rs * g.z + b.z, (v.w - m) * rs * g.w + b.w));
            }
        } else {
            for (u64 k = threadIdx.x; k < hidden; k += blockDim.x) {
                store_out(y, y_bf16, r * hidden + k, (xr[k] - m) * rs * gamma[k] + beta[k]);
            }
        }
        if (threadIdx.x == 0) {
            mean[r] = m;
            rstd[r] = rs;
        }
    }
}

// rstd·(dy·gamma − a − x̂·b) with every product rounded on its own (no FMA contraction), as the
// CPU: dy·gamma is then the very value summed into a, so hidden = 1 gives exactly 0.
__device__ __forceinline__ float ln_dx(float d, float g, float v, float m, float rs, float a,
                                       float b) {
    const float xhat = __fmul_rn(v - m, rs);
    return __fmul_rn(rs, (__fmul_rn(d, g) - a) - __fmul_rn(xhat, b));
}

// dx = rstd·(g − mean(g) − x̂·mean(g·x̂)) with g = dy·gamma, x̂ = (x − mean)·rstd; one block per
// row. mean(g·x̂) is computed as rstd·Σ(g·(x − mean))/hidden, as the CPU kernel. With `plus`
// non-null, dx = plus + that (another gradient of the same input, summed in the same pass).
extern "C" __global__ __launch_bounds__(LN_MAX_THREADS) void layer_norm_backward_dx(
    const float* __restrict__ dy, const float* __restrict__ x, const float* __restrict__ mean,
    const float* __restrict__ rstd, const float* __restrict__ gamma,
    const float* __restrict__ plus, float* __restrict__ dx, u64 rows, u64 hidden, int centered) {
    __shared__ float scratch[32];
    const float inv_h = 1.0f / (float)hidden;
    const bool vec = hidden % 4 == 0 && aligned16(dy) && aligned16(x) && aligned16(gamma) &&
                     aligned16(dx) && (plus == nullptr || aligned16(plus));
    const u64 h4 = hidden / 4;
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* dyr = dy + r * hidden;
        const float* xr = x + r * hidden;
        const float* pr = plus != nullptr ? plus + r * hidden : nullptr;
        float* dxr = dx + r * hidden;
        const float m = mean[r], rs = rstd[r];
        float s1 = 0.0f, s2 = 0.0f;
        if (vec) {
            const float4* d4 = reinterpret_cast<const float4*>(dyr);
            const float4* x4 = reinterpret_cast<const float4*>(xr);
            const float4* g4 = reinterpret_cast<const float4*>(gamma);
            for (u64 k = threadIdx.x; k < h4; k += blockDim.x) {
                const float4 d = d4[k], v = x4[k], g = g4[k];
                const float a = __fmul_rn(d.x, g.x), b = __fmul_rn(d.y, g.y);
                const float c = __fmul_rn(d.z, g.z), e = __fmul_rn(d.w, g.w);
                s1 += (a + b) + (c + e);
                s2 += (a * (v.x - m) + b * (v.y - m)) + (c * (v.z - m) + e * (v.w - m));
            }
        } else {
            for (u64 k = threadIdx.x; k < hidden; k += blockDim.x) {
                const float dg = __fmul_rn(dyr[k], gamma[k]);
                s1 += dg;
                s2 += dg * (xr[k] - m);
            }
        }
        // RMSNorm has no mean, so no mean(g) to subtract.
        const float a = centered ? block_sum(s1, scratch) * inv_h : 0.0f;
        const float b = block_sum(s2, scratch) * rs * inv_h;
        if (vec) {
            const float4* d4 = reinterpret_cast<const float4*>(dyr);
            const float4* x4 = reinterpret_cast<const float4*>(xr);
            const float4* g4 = reinterpret_cast<const float4*>(gamma);
            float4* o4 = reinterpret_cast<float4*>(dxr);
            for (u64 k = threadIdx.x; k < h4; k += blockDim.x) {
                const float4 d = d4[k], v = x4[k], g = g4[k];
                float4 o = make_float4(ln_dx(d.x, g.x, v.x, m, rs, a, b),
                                       ln_dx(d.y, g.y, v.y, m, rs, a, b),
                                       ln_dx(d.z, g.z, v.z, m, rs, a, b),
                                       ln_dx(d.w, g.w, v.w, m, rs, a, b));
                if (pr != nullptr) {
                    const float4 p = reinterpret_cast<const float4*>(pr)[k];
                    o = make_float4(__fadd_rn(p.x, o.x), __fadd_rn(p.y, o.y), __fadd_rn(p.z, o.z),
                                    __fadd_rn(p.w, o.w));
                }
                o4[k] = o;
            }
        } else {
            for (u64 k = threadIdx.x; k < hidden; k += blockDim.x) {
                const float o = ln_dx(dyr[k], gamma[k], xr[k], m, rs, a, b);
                dxr[k] = pr != nullptr ? __fadd_rn(pr[k], o) : o;
            }
        }
    }
}

// Partial column sums of dy·x̂ (dgamma) and dy (dbeta) in f64 over one chunk of rows:
// block (LN_COLS, LN_ROW_LANES), grid (column tiles, chunks). Row lane t adds rows r0 + t,
// r0 + t + LN_ROW_LANES, ... in order; the lanes are then added in order 0, 1, ... . Writes
// partials[chunk·hidden + c] (dgamma) and partials[(chunks + chunk)·hidden + c] (dbeta).
extern "C" __global__ __launch_bounds__(LN_COLS * LN_ROW_LANES) void layer_norm_backward_partials(
    const float* __restrict__ dy, const float* __restrict__ x, const float* __restrict__ mean,
    const float* __restrict__ rstd, double* __restrict__ partials, u64 rows, u64 hidden,
    u64 rows_per_chunk) {
    __shared__ double sg[LN_ROW_LANES][LN_COLS];
    __shared__ double sb[LN_ROW_LANES][LN_COLS];
    const u64 c = (u64)blockIdx.x * LN_COLS + threadIdx.x;
    const u64 chunk = blockIdx.y, chunks = gridDim.y;
    const u64 r0 = chunk * rows_per_chunk;
    const u64 r1 = min(r0 + rows_per_chunk, rows);
    double ag = 0.0, ab = 0.0;
    if (c < hidden) {
        for (u64 r = r0 + threadIdx.y; r < r1; r += LN_ROW_LANES) {
            const float d = dy[r * hidden + c];
            const float xhat = (x[r * hidden + c] - mean[r]) * rstd[r];
            ag += (double)d * (double)xhat;
            ab += (double)d;
        }
    }
    sg[threadIdx.y][threadIdx.x] = ag;
    sb[threadIdx.y][threadIdx.x] = ab;
    __syncthreads();
    if (threadIdx.y == 0 && c < hidden) {
        double g = 0.0, b = 0.0;
        for (int t = 0; t < LN_ROW_LANES; ++t) {
            g += sg[t][threadIdx.x];
            b += sb[t][threadIdx.x];
        }
        partials[chunk * hidden + c] = g;
        partials[(chunks + chunk) * hidden + c] = b;
    }
}

// dgamma[c] += Σ_chunks partial, dbeta likewise: chunks added in order in f64, rounded once.
extern "C" __global__ void layer_norm_backward_finalize(const double* __restrict__ partials,
                                                        float* __restrict__ dgamma,
                                                        float* __restrict__ dbeta, u64 chunks,
                                                        u64 hidden) {
    FOR_EACH(c, hidden) {
        double g = 0.0, b = 0.0;
        for (u64 k = 0; k < chunks; ++k) {
            g += partials[k * hidden + c];
            b += partials[(chunks + k) * hidden + c];
        }
        dgamma[c] += (float)g;
        if (dbeta != nullptr) dbeta[c] += (float)b;
    }
}
