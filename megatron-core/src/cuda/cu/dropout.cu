// Layout-invariant dropout, bit-identical to the CPU kernel: local element (o, k) of a buffer
// with runs of `inner` elements has logical index o·stride + start + k; it is kept when the
// Philox word of that index is >= threshold, and kept values are multiplied by `scale`.

// r + v, rounded as the separate sum is (no contraction with the product inside v).
__device__ __forceinline__ float plus_residual(const float* r, u64 e, float v) {
    return r != nullptr ? __fadd_rn(r[e], v) : v;
}

// y = mask(x), plus r when r is non-null (dropout and the residual connection in one pass), in
// f32 or, with y_bf16, rounded to bf16 (a gradient on its way to bf16 products); with x_b
// non-null, y_b = mask(x_b) too (one mask, two buffers). When runs, their starts and their
// stride are multiples of 4 elements, every aligned group of 4 local elements is one Philox block:
// one block per thread, 16-byte accesses when aligned.
extern "C" __global__ void dropout_apply(const float* __restrict__ x, void* __restrict__ y,
                                         int y_bf16, const float* __restrict__ x_b,
                                         float* __restrict__ y_b,
                                         const float* __restrict__ r, u64 n, u64 inner, u64 stride,
                                         u64 start, u32 key_lo, u32 key_hi, u64 stream,
                                         u32 threshold, float scale) {
    const Mask m = make_mask(inner, stride, start, key_lo, key_hi, stream, threshold, scale);
    const bool blocks = mask_blocks(m) && n % 4 == 0;
    const bool vec = blocks && (((u64)x | (u64)x_b | (u64)y_b | (u64)r) & 15) == 0 &&
                     out4_aligned(y, y_bf16);
    if (blocks) {
        FOR_EACH(g, n / 4) {
            const u64 e = 4 * g;
            const float4 k = mask_factor4(m, e, true);
            if (vec) {
                float4 v = masked4(reinterpret_cast<const float4*>(x)[g], k);
                if (r != nullptr) {
                    const float4 rv = reinterpret_cast<const float4*>(r)[g];
                    v = make_float4(__fadd_rn(rv.x, v.x), __fadd_rn(rv.y, v.y),
                                    __fadd_rn(rv.z, v.z), __fadd_rn(rv.w, v.w));
                }
                store_out4(y, y_bf16, g, v);
                if (x_b != nullptr) {
                    reinterpret_cast<float4*>(y_b)[g] =
                        masked4(reinterpret_cast<const float4*>(x_b)[g], k);
                }
            } else {
                const float ks[4] = {k.x, k.y, k.z, k.w};
                for (int j = 0; j < 4; ++j) {
                    store_out(y, y_bf16, e + j, plus_residual(r, e + j, masked(x[e + j], ks[j])));
                    if (x_b != nullptr) y_b[e + j] = masked(x_b[e + j], ks[j]);
                }
            }
        }
        return;
    }
    FOR_EACH(e, n) {
        const float k = mask_factor(m, e);
        store_out(y, y_bf16, e, plus_residual(r, e, masked(x[e], k)));
        if (x_b != nullptr) y_b[e] = masked(x_b[e], k);
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
