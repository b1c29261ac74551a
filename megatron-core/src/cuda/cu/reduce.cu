// Rank-order reductions for the device-local communicator: out = src[0] op src[1] op ... in f32,
// rounded once to the element type, exactly as megatron-core's comm::reduce on the host.
// `srcs` is a device array of k pointers to n elements each; `op` 0 = sum, 1 = max, 2 = min.

__device__ __forceinline__ float combine(float a, float b, int op) {
    return op == 0 ? a + b : op == 1 ? fmaxf(a, b) : fminf(a, b);
}

__device__ __forceinline__ float bf16_bits_to_f32(unsigned short h) {
    return __uint_as_float(((u32)h) << 16);
}

__device__ __forceinline__ unsigned short f32_to_bf16_bits(float f) {
    const u32 b = __float_as_uint(f);
    if ((b & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((b >> 16) | 0x0040u);
    return (unsigned short)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

extern "C" __global__ void fold_f32(const float* const* __restrict__ srcs, int k,
                                    float* __restrict__ out, u64 n, int op) {
    FOR_EACH(i, n) {
        float acc = srcs[0][i];
        for (int r = 1; r < k; ++r) acc = combine(acc, srcs[r][i], op);
        out[i] = acc;
    }
}

extern "C" __global__ void fold_bf16(const unsigned short* const* __restrict__ srcs, int k,
                                     unsigned short* __restrict__ out, u64 n, int op) {
    FOR_EACH(i, n) {
        float acc = bf16_bits_to_f32(srcs[0][i]);
        for (int r = 1; r < k; ++r) acc = combine(acc, bf16_bits_to_f32(srcs[r][i]), op);
        out[i] = f32_to_bf16_bits(acc);
    }
}

extern "C" __global__ void fold_f16(const unsigned short* const* __restrict__ srcs, int k,
                                    unsigned short* __restrict__ out, u64 n, int op) {
    FOR_EACH(i, n) {
        float acc = f16_bits_to_f32(srcs[0][i]);
        for (int r = 1; r < k; ++r) acc = combine(acc, f16_bits_to_f32(srcs[r][i]), op);
        out[i] = (unsigned short)f16_bits(acc);
    }
}

extern "C" __global__ void fold_i64(const i64* const* __restrict__ srcs, int k,
                                    i64* __restrict__ out, u64 n, int op) {
    FOR_EACH(i, n) {
        i64 acc = srcs[0][i];
        for (int r = 1; r < k; ++r) {
            const i64 v = srcs[r][i];
            acc = op == 0 ? acc + v : op == 1 ? (v > acc ? v : acc) : (v < acc ? v : acc);
        }
        out[i] = acc;
    }
}
