// Element-wise kernels: GeLU (tanh form, as GPT-2), SwiGLU, add, fill, bias, casts, copies, Σx².

#define GELU_A 1.5957691216057308f   // 2·√(2/π)
#define GELU_B 0.071354816f          // 2·√(2/π)·0.044715
#define GELU_3B 0.21406445f          // 3·GELU_B

// gelu(v) = v·σ(2u), u = √(2/π)(v + 0.044715v³), as the CPU kernel: v / (1 + e^(−2u)).
__device__ __forceinline__ float gelu_of(float v) {
    const float e = exp_f32(-v * (GELU_A + GELU_B * v * v));
    return v / (1.0f + e);
}

// dy · gelu'(v), as the CPU kernel.
__device__ __forceinline__ float gelu_grad_of(float v, float dy) {
    const float v2 = v * v;
    const float e = exp_f32(-v * (GELU_A + GELU_B * v2));
    const float s = 1.0f / (1.0f + e);
    const float one_minus_s = fminf(e * s, 1.0f);
    const float dz = GELU_A + GELU_3B * v2;
    return dy * (s + (v * s) * (one_minus_s * dz));
}

// y = gelu(x); x and y each f32 or, with their flags, bf16 (y rounded once). Four elements
// per thread when every buffer is aligned for it.
extern "C" __global__ void gelu_forward(const void* __restrict__ x, int x_bf16, void* __restrict__ y,
                                        int y_bf16, u64 n) {
    const u64 n4 = out4_aligned(x, x_bf16) && out4_aligned(y, y_bf16) ? n / 4 : 0;
    FOR_EACH(k, n4) {
        const float4 v = load_in4(x, x_bf16, k);
        store_out4(y, y_bf16, k, make_float4(gelu_of(v.x), gelu_of(v.y), gelu_of(v.z), gelu_of(v.w)));
    }
    FOR_EACH(i, n - 4 * n4) {
        const u64 j = 4 * n4 + i;
        store_out(y, y_bf16, j, gelu_of(load_in(x, x_bf16, j)));
    }
}

// dx = dy · gelu'(x); each buffer f32 or, with its flag, bf16.
extern "C" __global__ void gelu_backward(const void* __restrict__ x, int x_bf16,
                                         const void* __restrict__ dy, int dy_bf16,
                                         void* __restrict__ dx, int dx_bf16, u64 n) {
    const bool vec = out4_aligned(x, x_bf16) && out4_aligned(dy, dy_bf16) && out4_aligned(dx, dx_bf16);
    const u64 n4 = vec ? n / 4 : 0;
    FOR_EACH(k, n4) {
        const float4 v = load_in4(x, x_bf16, k), g = load_in4(dy, dy_bf16, k);
        store_out4(dx, dx_bf16, k,
                   make_float4(gelu_grad_of(v.x, g.x), gelu_grad_of(v.y, g.y),
                               gelu_grad_of(v.z, g.z), gelu_grad_of(v.w, g.w)));
    }
    FOR_EACH(i, n - 4 * n4) {
        const u64 j = 4 * n4 + i;
        store_out(dx, dx_bf16, j, gelu_grad_of(load_in(x, x_bf16, j), load_in(dy, dy_bf16, j)));
    }
}

// SwiGLU: each row of x[rows, 2·ffn] holds the gate, then the up projection;
// y[rows, ffn] = silu(gate)·up with silu(g) = g / (1 + e^(−g)), as the CPU kernel. x and y
// each f32 or, with their flags, bf16 (y rounded once).
extern "C" __global__ void swiglu_forward(const void* __restrict__ x, int x_bf16,
                                          void* __restrict__ y, int y_bf16, u64 rows, u64 ffn) {
    FOR_EACH(i, rows * ffn) {
        const u64 r = i / ffn, c = i % ffn;
        const float g = load_in(x, x_bf16, r * 2 * ffn + c);
        const float u = load_in(x, x_bf16, r * 2 * ffn + ffn + c);
        store_out(y, y_bf16, i, __fmul_rn(__fdiv_rn(g, 1.0f + exp_f32(-g)), u));
    }
}

// Gradient of swiglu_forward: dx[rows, 2·ffn] (the gate's, then the up projection's) from
// dy[rows, ffn] and the kept x: dgate = dy·up·(s + g·s·(1 − s)), dup = dy·g·s with s = σ(g).
extern "C" __global__ void swiglu_backward(const void* __restrict__ x, int x_bf16,
                                           const void* __restrict__ dy, int dy_bf16,
                                           void* __restrict__ dx, int dx_bf16, u64 rows, u64 ffn) {
    FOR_EACH(i, rows * ffn) {
        const u64 r = i / ffn, c = i % ffn;
        const float g = load_in(x, x_bf16, r * 2 * ffn + c);
        const float u = load_in(x, x_bf16, r * 2 * ffn + ffn + c);
        const float d = load_in(dy, dy_bf16, i);
        const float e = exp_f32(-g);
        const float s = 1.0f / (1.0f + e);
        const float one_minus_s = fminf(e * s, 1.0f);
        store_out(dx, dx_bf16, r * 2 * ffn + c, d * u * (s + g * s * one_minus_s));
        store_out(dx, dx_bf16, r * 2 * ffn + ffn + c, d * (g * s));
    }
}

// out = a + b, with 16-byte accesses when all three buffers are 16-byte aligned.
extern "C" __global__ void add(const float* __restrict__ a, const float* __restrict__ b,
                               float* __restrict__ out, u64 n) {
    if ((((u64)a | (u64)b | (u64)out) & 15) != 0) {
        FOR_EACH(i, n) { out[i] = a[i] + b[i]; }
        return;
    }
    const u64 n4 = n / 4;
    const float4* a4 = reinterpret_cast<const float4*>(a);
    const float4* b4 = reinterpret_cast<const float4*>(b);
    float4* o4 = reinterpret_cast<float4*>(out);
    FOR_EACH(i, n4) {
        const float4 x = a4[i], y = b4[i];
        o4[i] = make_float4(x.x + y.x, x.y + y.y, x.z + y.z, x.w + y.w);
    }
    FOR_EACH(j, n - 4 * n4) { out[4 * n4 + j] = a[4 * n4 + j] + b[4 * n4 + j]; }
}

extern "C" __global__ void add_assign(float* __restrict__ acc, const float* __restrict__ x, u64 n) {
    FOR_EACH(i, n) { acc[i] += x[i]; }
}

extern "C" __global__ void fill(float* __restrict__ x, float value, u64 n) {
    FOR_EACH(i, n) { x[i] = value; }
}

// y[r, c] = x[r, c] + bias[c] for a row-major f32 [rows, cols] x; y f32 or bf16 (the sum
// rounded once), possibly x itself. Columns along the grid's x (four per thread when cols is a
// multiple of 4 and the buffers are aligned for it), rows along its y, both grid-strided: no
// division per element.
__device__ __forceinline__ void bias_rows(const float* x, const float* __restrict__ bias, void* y,
                                          bool y_bf16, u64 rows, u64 cols) {
    const bool vec = cols % 4 == 0 && aligned16(x) && aligned16(bias) && out4_aligned(y, y_bf16);
    const u64 units = vec ? cols / 4 : cols;
    for (u64 r = blockIdx.y; r < rows; r += gridDim.y) {
        for (u64 c = (u64)blockIdx.x * blockDim.x + threadIdx.x; c < units;
             c += (u64)gridDim.x * blockDim.x) {
            if (vec) {
                const float4 v = reinterpret_cast<const float4*>(x)[r * units + c];
                const float4 b = reinterpret_cast<const float4*>(bias)[c];
                store_out4(y, y_bf16, r * units + c,
                           make_float4(v.x + b.x, v.y + b.y, v.z + b.z, v.w + b.w));
            } else {
                store_out(y, y_bf16, r * cols + c, x[r * cols + c] + bias[c]);
            }
        }
    }
}

// x[r, c] += bias[c], in place.
extern "C" __global__ void bias_add_forward(float* x, const float* __restrict__ bias, u64 rows,
                                            u64 cols) {
    bias_rows(x, bias, x, false, rows, cols);
}

// y[r, c] = x[r, c] + bias[c] into another buffer, f32 or (with y_bf16) bf16.
extern "C" __global__ void bias_add_cast(const float* __restrict__ x, const float* __restrict__ bias,
                                         void* __restrict__ y, int y_bf16, u64 rows, u64 cols) {
    bias_rows(x, bias, y, y_bf16 != 0, rows, cols);
}

// dbias[c] += Σ_r dy[r, c], the rows summed in order in f64 (one thread per column:
// deterministic), as the CPU kernel.
extern "C" __global__ void bias_add_backward(const float* __restrict__ dy, float* __restrict__ dbias,
                                             u64 rows, u64 cols) {
    FOR_EACH(c, cols) {
        double s = 0.0;
        for (u64 r = 0; r < rows; ++r) s += (double)dy[r * cols + c];
        dbias[c] += (float)s;
    }
}

// bf16 ↔ f32 (round to nearest even, as half::bf16::from_f32).
extern "C" __global__ void f32_to_bf16(const float* __restrict__ x, unsigned short* __restrict__ y,
                                       u64 n) {
    FOR_EACH(i, n) { y[i] = (unsigned short)bf16_bits(x[i]); }
}

extern "C" __global__ void bf16_to_f32(const unsigned short* __restrict__ x, float* __restrict__ y,
                                       u64 n) {
    FOR_EACH(i, n) { y[i] = __uint_as_float(((u32)x[i]) << 16); }
}

// Partial Σx² in f64 per block of `block_len` elements (one CUDA block each); the host adds the
// partials in order, so the result does not depend on the launch.
extern "C" __global__ void sum_squares_partials(const float* __restrict__ x, u64 n, u64 block_len,
                                                double* __restrict__ partials) {
    __shared__ double scratch[32];
    const u64 start = (u64)blockIdx.x * block_len;
    const u64 end = min(start + block_len, n);
    double acc = 0.0;
    for (u64 i = start + threadIdx.x; i < end; i += blockDim.x) acc += (double)x[i] * (double)x[i];
    acc = warp_sum_f64(acc);
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    if (lane == 0) scratch[warp] = acc;
    __syncthreads();
    if (warp == 0) {
        acc = lane < (int)(blockDim.x / WARP) ? scratch[lane] : 0.0;
        acc = warp_sum_f64(acc);
        if (lane == 0) partials[blockIdx.x] = acc;
    }
}

// Element type codes of the copies: 0 = f32, 1 = bf16, 3 = i64.
// Element types: 0 f32, 1 bf16, 2 fp16, 3 i64.
__device__ __forceinline__ float load_as_f32(const void* p, int type, i64 i) {
    if (type == 0) return ((const float*)p)[i];
    if (type == 1) return __uint_as_float(((u32)((const unsigned short*)p)[i]) << 16);
    if (type == 2) return f16_bits_to_f32(((const unsigned short*)p)[i]);
    return (float)((const i64*)p)[i];
}

__device__ __forceinline__ void store_from_f32(void* p, int type, u64 i, float v) {
    if (type == 0) {
        ((float*)p)[i] = v;
    } else if (type == 1) {
        ((unsigned short*)p)[i] = (unsigned short)bf16_bits(v);
    } else if (type == 2) {
        ((unsigned short*)p)[i] = (unsigned short)f16_bits(v);
    } else {
        ((i64*)p)[i] = (i64)v;
    }
}

// x *= scale (the loss scale's inverse), and found[0] = 1 when an element is then infinite or
// NaN (Megatron-LM's unscale of the main gradients with its check for inf and NaN).
extern "C" __global__ void unscale_and_check(float* __restrict__ x, u64 n, float scale,
                                             float* __restrict__ found) {
    FOR_EACH(i, n) {
        const float v = x[i] * scale;
        x[i] = v;
        if (!isfinite(v)) found[0] = 1.0f;
    }
}

// One element from src[at] to dst[i]: the bits when the types match, else through f32.
__device__ __forceinline__ void copy_element(const void* src, int src_type, i64 at, void* dst,
                                             int dst_type, u64 i, int elem_bytes) {
    if (src_type == dst_type) {
        if (elem_bytes == 8) ((i64*)dst)[i] = ((const i64*)src)[at];
        else if (elem_bytes == 4) ((u32*)dst)[i] = ((const u32*)src)[at];
        else ((unsigned short*)dst)[i] = ((const unsigned short*)src)[at];
    } else {
        store_from_f32(dst, dst_type, i, load_as_f32(src, src_type, at));
    }
}

// dst[i] = src[i] for a contiguous source: the bits of one type 16 bytes per thread, f32 and
// bf16 either way four elements per thread, when both ends are aligned for it (else one
// element per thread).
extern "C" __global__ void copy_dense(const void* __restrict__ src, int src_type,
                                      void* __restrict__ dst, int dst_type, u64 n, int elem_bytes) {
    if (src_type == dst_type && (((u64)src | (u64)dst) & 15) == 0) {
        // The bits, 16 bytes per thread, then the elements past the last whole 16 bytes.
        const u64 chunks = n * elem_bytes / 16, done = chunks * 16 / elem_bytes;
        FOR_EACH(k, chunks) { reinterpret_cast<uint4*>(dst)[k] = reinterpret_cast<const uint4*>(src)[k]; }
        FOR_EACH(i, n - done) { copy_element(src, src_type, (i64)(done + i), dst, dst_type, done + i, elem_bytes); }
        return;
    }
    const bool floats = src_type <= 1 && dst_type <= 1;
    const u64 align = (src_type == 1 ? 7 : 15) | (dst_type == 1 ? 7 : 15);
    if (floats && (((u64)src | (u64)dst) & align) == 0) {
        FOR_EACH(k, n / 4) { store_out4(dst, dst_type == 1, k, load_in4(src, src_type == 1, k)); }
        FOR_EACH(i, n % 4) {
            const u64 e = n - n % 4 + i;
            copy_element(src, src_type, (i64)e, dst, dst_type, e, elem_bytes);
        }
        return;
    }
    FOR_EACH(i, n) { copy_element(src, src_type, (i64)i, dst, dst_type, i, elem_bytes); }
}

// dst[i] = src[offset + the strided view's element i, row-major], converting between element
// types. The view has at most 8 dimensions (the launcher merges what it can) and fewer than
// 2³² elements, so the index arithmetic is 32-bit.
struct View8 {
    long long dims[8];
    long long strides[8];
};

// Where the view's element i (row-major) lies: offset plus its index along each dimension
// times that dimension's stride.
__device__ __forceinline__ i64 view_element(u64 i, int ndim, long long offset, const View8& view) {
    i64 at = offset;
    u32 rest = (u32)i;
    for (int d = ndim - 1; d > 0; --d) {
        const u32 size = (u32)view.dims[d];
        const u32 q = rest / size;
        at += (i64)(rest - q * size) * view.strides[d];
        rest = q;
    }
    return at + (i64)rest * view.strides[0];
}

extern "C" __global__ void copy_strided(const void* __restrict__ src, int src_type,
                                        void* __restrict__ dst, int dst_type, u64 n, int ndim,
                                        long long offset, View8 view, int elem_bytes) {
    FOR_EACH(i, n) {
        copy_element(src, src_type, view_element(i, ndim, offset, view), dst, dst_type, i,
                     elem_bytes);
    }
}

// dst[offset + the strided view's element i, row-major] = src[i], converting between element
// types: copy_strided's mirror, writing into a part of a wider tensor.
extern "C" __global__ void copy_to_strided(const void* __restrict__ src, int src_type,
                                           void* __restrict__ dst, int dst_type, u64 n, int ndim,
                                           long long offset, View8 view, int elem_bytes) {
    FOR_EACH(i, n) {
        copy_element(src, src_type, (i64)i, dst, dst_type, view_element(i, ndim, offset, view),
                     elem_bytes);
    }
}

// x[i] = value (bits of one element of `elem_bytes` bytes).
extern "C" __global__ void fill_bits(void* __restrict__ x, u64 bits, int elem_bytes, u64 n) {
    FOR_EACH(i, n) {
        if (elem_bytes == 8) ((u64*)x)[i] = bits;
        else if (elem_bytes == 4) ((u32*)x)[i] = (u32)bits;
        else ((unsigned short*)x)[i] = (unsigned short)bits;
    }
}
