// Layout-invariant dropout, bit-identical to the CPU kernel: local element (o, k) of a buffer
// with runs of `inner` elements has logical index o·stride + start + k; it is kept when the
// Philox word of that index is >= threshold, and kept values are multiplied by `scale`.

__device__ __forceinline__ u32 dropout_word(u64 e, u64 inner, u64 stride, u64 start, uint2 key,
                                            u64 stream) {
    const u64 logical = (e / inner) * stride + start + (e % inner);
    return word_of(dropout_block(logical >> 2, key, stream), (int)(logical & 3));
}

// y = mask(x)·scale; with x_b non-null, y_b = mask(x_b)·scale too (one mask, two buffers).
// When runs, their starts and their stride are multiples of 4 elements, every aligned group of 4
// local elements is one Philox block: one block per thread, 16-byte accesses when aligned.
extern "C" __global__ void dropout_apply(const float* __restrict__ x, float* __restrict__ y,
                                         const float* __restrict__ x_b, float* __restrict__ y_b,
                                         u64 n, u64 inner, u64 stride, u64 start, u32 key_lo,
                                         u32 key_hi, u64 stream, u32 threshold, float scale) {
    const uint2 key = make_uint2(key_lo, key_hi);
    const bool blocks = inner % 4 == 0 && stride % 4 == 0 && start % 4 == 0 && n % 4 == 0;
    const bool vec = blocks && (((u64)x | (u64)y | (u64)x_b | (u64)y_b) & 15) == 0;
    if (blocks) {
        FOR_EACH(g, n / 4) {
            const u64 e = 4 * g;
            const u64 logical = (e / inner) * stride + start + (e % inner);
            const uint4 w = dropout_block(logical >> 2, key, stream);
            const float k0 = w.x >= threshold ? scale : 0.0f, k1 = w.y >= threshold ? scale : 0.0f;
            const float k2 = w.z >= threshold ? scale : 0.0f, k3 = w.w >= threshold ? scale : 0.0f;
            if (vec) {
                const float4 v = reinterpret_cast<const float4*>(x)[g];
                reinterpret_cast<float4*>(y)[g] = make_float4(
                    k0 != 0.0f ? v.x * k0 : 0.0f, k1 != 0.0f ? v.y * k1 : 0.0f,
                    k2 != 0.0f ? v.z * k2 : 0.0f, k3 != 0.0f ? v.w * k3 : 0.0f);
                if (x_b != nullptr) {
                    const float4 u = reinterpret_cast<const float4*>(x_b)[g];
                    reinterpret_cast<float4*>(y_b)[g] = make_float4(
                        k0 != 0.0f ? u.x * k0 : 0.0f, k1 != 0.0f ? u.y * k1 : 0.0f,
                        k2 != 0.0f ? u.z * k2 : 0.0f, k3 != 0.0f ? u.w * k3 : 0.0f);
                }
            } else {
                const float k[4] = {k0, k1, k2, k3};
                for (int j = 0; j < 4; ++j) {
                    y[e + j] = k[j] != 0.0f ? x[e + j] * k[j] : 0.0f;
                    if (x_b != nullptr) y_b[e + j] = k[j] != 0.0f ? x_b[e + j] * k[j] : 0.0f;
                }
            }
        }
        return;
    }
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
