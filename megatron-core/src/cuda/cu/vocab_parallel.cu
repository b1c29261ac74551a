// The vocab-parallel layers on the device: the fused vocab-parallel cross-entropy (local pieces
// between the tensor-parallel all-reduces, and its backward), the tied output layer's −∞ mask of
// the padding rows, and the learned position embedding's position ids.
//
// A rank holds the logits of its vocabulary slice start .. start + local, as rows of
// logits[rows, local]. Row kernels take one block per row (grid-stride over rows), their
// reductions in a fixed order; the arithmetic is the CPU's (f32, sums of exponentials in f64,
// products and differences rounded on their own).

#define CANONICAL_NAN __int_as_float(0x7fc00000)

// Column of this slice holding global vocabulary entry `t`, or ~0 when the slice does not hold it.
__device__ __forceinline__ u64 vp_local_column(i64 t, u64 start, u64 local) {
    if (t < 0) return ~0ull;
    const u64 u = (u64)t;
    return u >= start && u - start < local ? u - start : ~0ull;
}

// Step 1, before the max all-reduce: max[r] = the row's maximum (fmaxf skips NaN, as the CPU's
// f32::max fold); target_logit[r] = the logit of targets[r] when this slice holds it, else 0.
extern "C" __global__ void vocab_parallel_ce_local(const float* __restrict__ logits,
                                                   const i64* __restrict__ targets, u64 rows,
                                                   u64 local, u64 start, float* __restrict__ max,
                                                   float* __restrict__ target_logit) {
    __shared__ float scratch[32];
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* row = logits + r * local;
        float m = NEG_INF;
        for (u64 c = threadIdx.x; c < local; c += blockDim.x) m = fmaxf(m, row[c]);
        m = block_max(m, scratch);
        if (threadIdx.x == 0) {
            max[r] = m;
            const u64 c = vp_local_column(targets[r], start, local);
            target_logit[r] = c == ~0ull ? 0.0f : row[c];
        }
    }
}

// Step 2, between the max and the sum all-reduces: sum[r] = Σ exp(logit − max[r]) over the
// slice, each exponential in f32 and the sum in f64, rounded to f32 at the end.
extern "C" __global__ void vocab_parallel_ce_sum_exp(const float* __restrict__ logits,
                                                     const float* __restrict__ max, u64 rows,
                                                     u64 local, float* __restrict__ sum) {
    __shared__ double scratch[32];
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* row = logits + r * local;
        const float m = max[r];
        double s = 0.0;
        for (u64 c = threadIdx.x; c < local; c += blockDim.x) s += (double)exp_f32(row[c] - m);
        s = block_sum(s, scratch);
        if (threadIdx.x == 0) sum[r] = (float)s;
    }
}

// Step 3, after the all-reduces: logsumexp[r] = max + ln(sum), losses[r] = logsumexp − target
// logit. A target outside [0, total) (not checked on the host when the targets live on the
// device) gives a NaN loss rather than a silently wrong one.
extern "C" __global__ void vocab_parallel_ce_finish(const float* __restrict__ max,
                                                    const float* __restrict__ sum,
                                                    const float* __restrict__ target_logit,
                                                    const i64* __restrict__ targets, u64 rows,
                                                    u64 total, float* __restrict__ losses,
                                                    float* __restrict__ logsumexp) {
    FOR_EACH(r, rows) {
        const float lse = max[r] + logf(sum[r]);
        logsumexp[r] = lse;
        const i64 t = targets[r];
        losses[r] = t >= 0 && (u64)t < total ? lse - target_logit[r] : CANONICAL_NAN;
    }
}

// The backward: dlogits[r, c] = exp(logit − logsumexp[r])·dloss[r], minus dloss[r] at the target
// when this slice holds it (product, then difference, each rounded: no fused multiply-add); in
// f32 or, with dlogits_bf16, rounded to bf16 (a gradient only the output layer's products read).
extern "C" __global__ void vocab_parallel_ce_backward(const float* __restrict__ logits,
                                                      const i64* __restrict__ targets,
                                                      const float* __restrict__ logsumexp,
                                                      const float* __restrict__ dloss, u64 rows,
                                                      u64 local, u64 start,
                                                      void* __restrict__ dlogits,
                                                      int dlogits_bf16) {
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* row = logits + r * local;
        const float lse = logsumexp[r], g = dloss[r];
        const u64 hit = vp_local_column(targets[r], start, local);
        for (u64 c = threadIdx.x; c < local; c += blockDim.x) {
            const float o = __fmul_rn(exp_f32(row[c] - lse), g);
            store_out(dlogits, dlogits_bf16, r * local + c, c == hit ? __fsub_rn(o, g) : o);
        }
    }
}

// x[r, c] = −inf for the columns c ≥ from of x[rows, cols]: the logits of the padding rows of
// the vocabulary in the tied output layer.
extern "C" __global__ void vocab_parallel_mask_columns(float* __restrict__ x, u64 rows, u64 cols,
                                                       u64 from) {
    const u64 w = cols - from;
    FOR_EACH(i, rows * w) x[(i / w) * cols + from + i % w] = NEG_INF;
}

// ids[t] = t / batch: the position of token t of a sequence-first [seq, batch] layout.
extern "C" __global__ void position_ids(i64* __restrict__ ids, u64 n, u64 batch) {
    FOR_EACH(t, n) ids[t] = (i64)(t / batch);
}
