// Softmax cross-entropy over the rows of logits[rows, vocab] with i64 targets: one block per row,
// float4 loads when vocab % 4 == 0 and the buffers are 16-byte aligned (checked here, at run
// time), scalar loads otherwise.
//
// Targets outside [0, vocab) are an error, as on the CPU: cross_entropy_check_targets records
// the first such row in *bad_row (initialised to ~0 by the launcher), and the forward and
// backward kernels, queued after it, leave their outputs untouched when it found one.

#define NO_BAD_ROW 0xffffffffffffffffull

// Adds one group of values to a thread's running (max m, Σ exp(x − m) in f64): the sum is
// rescaled (in f64) only when the maximum grows. A −inf logit adds exp(−inf) = 0 as on the CPU
// (where the row's maximum is finite; a row of −inf only is handled by the caller), rather than
// exp(−inf − (−inf)) = NaN while this thread has seen nothing larger.
__device__ __forceinline__ void ce_online(float& m, double& s, float mx, const float* v, int k) {
    if (mx > m) {
        s *= exp((double)m - (double)mx);
        m = mx;
    }
    for (int i = 0; i < k; ++i) s += v[i] == NEG_INF ? 0.0 : (double)exp_f32(v[i] - m);
}

extern "C" __global__ void cross_entropy_check_targets(const i64* __restrict__ targets, u64 rows,
                                                       u64 vocab, u64* __restrict__ bad_row) {
    FOR_EACH(r, rows) {
        const i64 t = targets[r];
        if (t < 0 || (u64)t >= vocab) atomicMin(bad_row, (u64)r);
    }
}

// losses[r] = lse − logits[r, t], logsumexp[r] = lse = max + ln Σ exp(x − max) (sum in f64).
// One pass over the row: each thread keeps its own running maximum and rescaled sum, and the
// block combines them against the row's maximum.
extern "C" __global__ void cross_entropy_forward(const float* __restrict__ logits,
                                                 const i64* __restrict__ targets,
                                                 const u64* __restrict__ bad_row, u64 vocab,
                                                 float* __restrict__ losses,
                                                 float* __restrict__ logsumexp) {
    if (*bad_row != NO_BAD_ROW) return;
    __shared__ float fscratch[32];
    __shared__ double dscratch[32];
    const u64 r = blockIdx.x;
    const float* row = logits + r * vocab;
    float m = NEG_INF;
    double s = 0.0;
    if (vocab % 4 == 0 && ((u64)logits & 15) == 0) {
        const float4* row4 = reinterpret_cast<const float4*>(row);
        for (u64 i = threadIdx.x; i < vocab / 4; i += blockDim.x) {
            const float4 x = row4[i];
            const float v[4] = {x.x, x.y, x.z, x.w};
            ce_online(m, s, fmaxf(fmaxf(x.x, x.y), fmaxf(x.z, x.w)), v, 4);
        }
    } else {
        for (u64 i = threadIdx.x; i < vocab; i += blockDim.x) {
            const float v = row[i];
            ce_online(m, s, v, &v, 1);
        }
    }
    const float row_max = block_max(m, fscratch);
    // A thread with nothing to add contributes 0; a NaN sum (from NaN or ±inf logits) stays NaN.
    const double part = s == 0.0 ? 0.0 : s * exp((double)m - (double)row_max);
    double sum = block_sum(part, dscratch);
    // Every logit −inf: the CPU's exp(−inf − (−inf)) makes the sum, and so the row, NaN.
    if (row_max == NEG_INF) sum = __longlong_as_double(0x7ff8000000000000ll);
    if (threadIdx.x == 0) {
        const double lse = (double)row_max + log(sum);
        logsumexp[r] = (float)lse;
        losses[r] = (float)(lse - (double)row[targets[r]]);
    }
}

// dlogits[r, i] = exp(logits[r, i] − lse[r])·dloss[r], minus dloss[r] at the target (rounded as
// the CPU: product, then difference; no fused multiply-add).
extern "C" __global__ void cross_entropy_backward(const float* __restrict__ logits,
                                                  const i64* __restrict__ targets,
                                                  const float* __restrict__ logsumexp,
                                                  const float* __restrict__ dloss,
                                                  const u64* __restrict__ bad_row, u64 vocab,
                                                  float* __restrict__ dlogits) {
    if (*bad_row != NO_BAD_ROW) return;
    const u64 r = blockIdx.x;
    const float lse = logsumexp[r], g = dloss[r];
    const u64 t = (u64)targets[r];
    const float* row = logits + r * vocab;
    float* drow = dlogits + r * vocab;
    if (vocab % 4 == 0 && (((u64)logits | (u64)dlogits) & 15) == 0) {
        const float4* row4 = reinterpret_cast<const float4*>(row);
        float4* drow4 = reinterpret_cast<float4*>(drow);
        for (u64 i = threadIdx.x; i < vocab / 4; i += blockDim.x) {
            const float4 x = row4[i];
            float4 o = make_float4(__fmul_rn(exp_f32(x.x - lse), g), __fmul_rn(exp_f32(x.y - lse), g),
                                   __fmul_rn(exp_f32(x.z - lse), g), __fmul_rn(exp_f32(x.w - lse), g));
            if (t / 4 == i) {
                const u64 k = t % 4;
                if (k == 0) o.x = __fsub_rn(o.x, g);
                else if (k == 1) o.y = __fsub_rn(o.y, g);
                else if (k == 2) o.z = __fsub_rn(o.z, g);
                else o.w = __fsub_rn(o.w, g);
            }
            drow4[i] = o;
        }
    } else {
        for (u64 i = threadIdx.x; i < vocab; i += blockDim.x) {
            const float o = __fmul_rn(exp_f32(row[i] - lse), g);
            drow[i] = i == t ? __fsub_rn(o, g) : o;
        }
    }
}
