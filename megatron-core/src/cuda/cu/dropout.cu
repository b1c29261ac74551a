// Layout-invariant dropout, bit-identical to the CPU kernel: local element (o, k) of a buffer
// with runs of `inner` elements has logical index o·stride + start + k; it is kept when the
// Philox word of that index is >= threshold, and kept values are multiplied by `scale`.

__device__ __forceinline__ u32 dropout_word(u64 e, u64 inner, u64 stride, u64 start, uint2 key,
                                            u64 stream) {
    const u64 logical = (e / inner) * stride + start + (e % inner);
    return word_of(dropout_block(logical >> 2, key, stream), (int)(logical & 3));
}

// y = mask(x)·scale; with x_b non-null, y_b = mask(x_b)·scale too (one mask, two buffers).
extern "C" __global__ void dropout_apply(const float* __restrict__ x, float* __restrict__ y,
                                         const float* __restrict__ x_b, float* __restrict__ y_b,
                                         u64 n, u64 inner, u64 stride, u64 start, u32 key_lo,
                                         u32 key_hi, u64 stream, u32 threshold, float scale) {
    const uint2 key = make_uint2(key_lo, key_hi);
    FOR_EACH(e, n) {
        const bool keep = dropout_word(e, inner, stride, start, key, stream) >= threshold;
        y[e] = keep ? x[e] * scale : 0.0f;
        if (x_b != nullptr) y_b[e] = keep ? x_b[e] * scale : 0.0f;
    }
}

// The raw words of logical elements first .. first + n (tests compare them with the CPU's).
extern "C" __global__ void philox_words(u32* __restrict__ out, u64 first, u64 n, u32 key_lo,
                                        u32 key_hi, u64 stream) {
    const uint2 key = make_uint2(key_lo, key_hi);
    FOR_EACH(i, n) {
        const u64 logical = first + i;
        out[i] = word_of(dropout_block(logical >> 2, key, stream), (int)(logical & 3));
    }
}
