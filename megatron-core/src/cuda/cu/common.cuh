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

// Philox4x32-10 (Random123), bit-identical to megatron-core's rng::philox4x32_10.
__device__ __forceinline__ uint4 philox4x32_10(uint4 c, uint2 k) {
    const u32 M0 = 0xD2511F53u, M1 = 0xCD9E8D57u;
    const u32 W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
    #pragma unroll
    for (int r = 0; r < 10; ++r) {
        if (r > 0) { k.x += W0; k.y += W1; }
        const u32 hi0 = __umulhi(M0, c.x), lo0 = M0 * c.x;
        const u32 hi1 = __umulhi(M1, c.z), lo1 = M1 * c.z;
        c = make_uint4(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
    }
    return c;
}

// The random word of logical element `i` of stream (key, stream): word i % 4 of block i / 4.
__device__ __forceinline__ uint4 dropout_block(u64 block, uint2 key, u64 stream) {
    return philox4x32_10(
        make_uint4((u32)block, (u32)(block >> 32), (u32)stream, (u32)(stream >> 32)), key);
}

__device__ __forceinline__ u32 word_of(uint4 b, int w) {
    return w == 0 ? b.x : w == 1 ? b.y : w == 2 ? b.z : b.w;
}

// exp(x) for the GeLU and softmax kernels (CUDA's expf: within 2 ulp).
__device__ __forceinline__ float exp_f32(float x) { return expf(x); }

// Grid-stride loop over [0, n).
#define FOR_EACH(i, n) \
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (u64)(n); \
         i += (u64)gridDim.x * blockDim.x)
