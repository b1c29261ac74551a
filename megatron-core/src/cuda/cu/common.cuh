// Shared by every megatron-rs kernel program (prepended by programs.rs).
// Compute is f32, as on the CPU backend; sizes are 64-bit.

typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

#define WARP 32
#define NEG_INF __int_as_float(0xff800000u)
#define POS_INF __int_as_float(0x7f800000u)

// Sum of `v` over the warp; every lane gets the result (butterfly order: deterministic).
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = WARP / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = WARP / 2; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ double warp_sum_f64(double v) {
    for (int o = WARP / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum of `v` over the block (blockDim.x a multiple of 32, at most 1024); every thread gets it.
// `scratch` holds 32 floats of shared memory; the block synchronises twice.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int warps = blockDim.x / WARP;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : 0.0f;
    return warp_sum(v);
}

// block_sum in f64 (`scratch` holds 32 doubles).
__device__ __forceinline__ double block_sum(double v, double* scratch) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int warps = blockDim.x / WARP;
    v = warp_sum_f64(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : 0.0;
    return warp_sum_f64(v);
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int warps = blockDim.x / WARP;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : NEG_INF;
    return warp_max(v);
}

// Philox4x32-10's round keys for key k: round r adds r·(W0, W1) to k (mod 2^32).
struct PhiloxKeys {
    u32 x[10], y[10];
};

__device__ __forceinline__ PhiloxKeys philox_keys(uint2 k) {
    PhiloxKeys keys;
    #pragma unroll
    for (int r = 0; r < 10; ++r) {
        keys.x[r] = k.x + (u32)r * 0x9E3779B9u;
        keys.y[r] = k.y + (u32)r * 0xBB67AE85u;
    }
    return keys;
}

// Philox4x32-10 (Random123) of counter c under the round keys `keys`, bit-identical to
// megatron-core's rng::philox4x32_10. Kernels drawing many blocks compute the keys once.
__device__ __forceinline__ uint4 philox_rounds(uint4 c, const PhiloxKeys& keys) {
    const u32 M0 = 0xD2511F53u, M1 = 0xCD9E8D57u;
    #pragma unroll
    for (int r = 0; r < 10; ++r) {
        const u32 hi0 = __umulhi(M0, c.x), lo0 = M0 * c.x;
        const u32 hi1 = __umulhi(M1, c.z), lo1 = M1 * c.z;
        c = make_uint4(hi1 ^ c.y ^ keys.x[r], lo1, hi0 ^ c.w ^ keys.y[r], lo0);
    }
    return c;
}

__device__ __forceinline__ uint4 philox4x32_10(uint4 c, uint2 k) {
    return philox_rounds(c, philox_keys(k));
}

// The counter of Philox block `block` of stream `stream`.
__device__ __forceinline__ uint4 philox_counter(u64 block, u64 stream) {
    return make_uint4((u32)block, (u32)(block >> 32), (u32)stream, (u32)(stream >> 32));
}

// The random word of logical element `i` of stream (key, stream): word i % 4 of block i / 4.
__device__ __forceinline__ uint4 dropout_block(u64 block, uint2 key, u64 stream) {
    return philox4x32_10(philox_counter(block, stream), key);
}

__device__ __forceinline__ u32 word_of(uint4 b, int w) {
    return w == 0 ? b.x : w == 1 ? b.y : w == 2 ? b.z : b.w;
}

// A dropout mask over a buffer laid out in runs of `inner` local elements (see dropout.cu):
// local element e has logical index (e / inner)·stride + start + e % inner and is kept with the
// factor `scale` when its Philox word is >= threshold, else multiplied by 0. A threshold of 0
// keeps everything (no Philox words are drawn).
struct Mask {
    u64 inner, stride, start;
    uint2 key;
    u64 stream;
    u32 threshold;
    float scale;
};

__device__ __forceinline__ Mask make_mask(u64 inner, u64 stride, u64 start, u32 key_lo, u32 key_hi,
                                          u64 stream, u32 threshold, float scale) {
    Mask m;
    m.inner = inner;
    m.stride = stride;
    m.start = start;
    m.key = make_uint2(key_lo, key_hi);
    m.stream = stream;
    m.threshold = threshold;
    m.scale = scale;
    return m;
}

// Whether every aligned group of 4 local elements is one Philox block (runs, their starts and
// their stride multiples of 4).
__device__ __forceinline__ bool mask_blocks(const Mask& m) {
    return m.inner % 4 == 0 && m.stride % 4 == 0 && m.start % 4 == 0;
}

__device__ __forceinline__ u64 mask_logical(const Mask& m, u64 e) {
    return (e / m.inner) * m.stride + m.start + (e % m.inner);
}

// The factor (scale or 0) of local element e.
__device__ __forceinline__ float mask_factor(const Mask& m, u64 e) {
    if (m.threshold == 0) return m.scale;
    const u64 logical = mask_logical(m, e);
    const u32 w = word_of(dropout_block(logical >> 2, m.key, m.stream), (int)(logical & 3));
    return w >= m.threshold ? m.scale : 0.0f;
}

// The factors of local elements e .. e + 3 (e a multiple of 4): one Philox block when `blocks`.
__device__ __forceinline__ float4 mask_factor4(const Mask& m, u64 e, bool blocks) {
    if (m.threshold == 0) return make_float4(m.scale, m.scale, m.scale, m.scale);
    if (!blocks) {
        return make_float4(mask_factor(m, e), mask_factor(m, e + 1), mask_factor(m, e + 2),
                           mask_factor(m, e + 3));
    }
    const uint4 w = dropout_block(mask_logical(m, e) >> 2, m.key, m.stream);
    return make_float4(w.x >= m.threshold ? m.scale : 0.0f, w.y >= m.threshold ? m.scale : 0.0f,
                       w.z >= m.threshold ? m.scale : 0.0f, w.w >= m.threshold ? m.scale : 0.0f);
}

// v times a mask factor, exactly 0 where dropped (also for v = ±∞ or NaN), as the CPU.
__device__ __forceinline__ float masked(float v, float k) { return k != 0.0f ? v * k : 0.0f; }

__device__ __forceinline__ float4 masked4(float4 v, float4 k) {
    return make_float4(masked(v.x, k.x), masked(v.y, k.y), masked(v.z, k.z), masked(v.w, k.w));
}

// The bf16 bits of x rounded to nearest even, as half::bf16::from_f32 (NaN stays a quiet NaN).
__device__ __forceinline__ u32 bf16_bits(float x) {
    const u32 b = __float_as_uint(x);
    if ((b & 0x7fffffffu) > 0x7f800000u) return (b >> 16) | 0x0040u;
    return (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
}

// IEEE half precision (fp16) bits widened to f32: exact.
__device__ __forceinline__ float f16_bits_to_f32(u32 h) {
    const u32 sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0x1fu) return __uint_as_float(sign | 0x7f800000u | (man << 13));  // inf, NaN
    if (exp != 0u) return __uint_as_float(sign | ((exp + 112u) << 23) | (man << 13));
    const float v = (float)man * 5.9604644775390625e-8f;  // subnormal: man × 2^-24
    return sign ? -v : v;
}

// f32 rounded to the nearest fp16 (ties to even; past 65504 to infinity), as bits.
__device__ __forceinline__ u32 f16_bits(float x) {
    const u32 b = __float_as_uint(x), sign = (b >> 16) & 0x8000u, a = b & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7e00u | ((a >> 13) & 0x3ffu);  // NaN stays NaN
    if (a >= 0x477ff000u) return sign | 0x7c00u;                       // 65520 and up: inf
    if (a >= 0x38800000u) {                                            // a normal fp16
        const u32 r = a - 0x38000000u;                                 // exponent rebiased
        return sign | ((r + 0xfffu + ((r >> 13) & 1u)) >> 13);
    }
    if (a <= 0x33000000u) return sign;  // at most 2^-25: zero (2^-25 itself ties to even)
    // A subnormal fp16: the significand in units of 2^-24, rounded to nearest even.
    const u32 e = a >> 23, m = (a & 0x7fffffu) | 0x800000u, shift = 126u - e;
    const u32 q = m >> shift, rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    return sign | (q + ((rem > half || (rem == half && (q & 1u))) ? 1u : 0u));
}

// Element i (or elements 4k .. 4k + 3) of an output that is f32 or, with `bf16`, bf16. The
// 4-wide store needs 16-byte (f32) or 8-byte (bf16) alignment.
__device__ __forceinline__ void store_out(void* out, bool bf16, u64 i, float v) {
    if (bf16) {
        reinterpret_cast<unsigned short*>(out)[i] = (unsigned short)bf16_bits(v);
    } else {
        reinterpret_cast<float*>(out)[i] = v;
    }
}

__device__ __forceinline__ void store_out4(void* out, bool bf16, u64 k, float4 v) {
    if (bf16) {
        reinterpret_cast<uint2*>(out)[k] =
            make_uint2(bf16_bits(v.x) | (bf16_bits(v.y) << 16), bf16_bits(v.z) | (bf16_bits(v.w) << 16));
    } else {
        reinterpret_cast<float4*>(out)[k] = v;
    }
}

// Whether `p` is 16-byte aligned (for float4 accesses).
__device__ __forceinline__ bool aligned16(const void* p) { return ((u64)p & 15) == 0; }

// Whether `p` is null or aligned for store_out4 and load_in4.
__device__ __forceinline__ bool out4_aligned(const void* p, bool bf16) {
    return ((u64)p & (bf16 ? 7 : 15)) == 0;
}

__device__ __forceinline__ float bf16_to_float(u32 bits) { return __uint_as_float(bits << 16); }

// Element i (or elements 4k .. 4k + 3) of an input that is f32 or, with `bf16`, bf16.
__device__ __forceinline__ float load_in(const void* in, bool bf16, u64 i) {
    if (bf16) return bf16_to_float(reinterpret_cast<const unsigned short*>(in)[i]);
    return reinterpret_cast<const float*>(in)[i];
}

__device__ __forceinline__ float4 load_in4(const void* in, bool bf16, u64 k) {
    if (bf16) {
        const uint2 p = reinterpret_cast<const uint2*>(in)[k];
        return make_float4(bf16_to_float(p.x & 0xffffu), bf16_to_float(p.x >> 16),
                           bf16_to_float(p.y & 0xffffu), bf16_to_float(p.y >> 16));
    }
    return reinterpret_cast<const float4*>(in)[k];
}

// exp(x) for the GeLU and softmax kernels (CUDA's expf: within 2 ulp).
__device__ __forceinline__ float exp_f32(float x) { return expf(x); }

// Grid-stride loop over [0, n).
#define FOR_EACH(i, n) \
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (u64)(n); \
         i += (u64)gridDim.x * blockDim.x)
