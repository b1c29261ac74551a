// Embedding lookup (gather) and its scatter-add gradient, for a full or vocab-parallel shard of
// the table: rows vocab_start .. vocab_start + v_local of the logical [vocab, hidden] table.
//
// Column layout shared by both kernels: a thread owns "column group" j of q = ceil(hidden / 4).
// When hidden % 4 == 0 and the buffers are 16-byte aligned the group is the float4 at columns
// 4j .. 4j + 3; otherwise it is the strided columns j, j + q, j + 2q, j + 3q (below hidden), so
// neighbouring threads still touch neighbouring addresses.

#define EMB_BWD_THREADS 256

// Row of the shard holding token `id`, or -1 (as the CPU's local_row: negative ids, ids below
// vocab_start and ids past the shard are not held).
__device__ __forceinline__ i64 emb_local_row(i64 id, u64 vocab_start, u64 v_local) {
    if (id < 0) return -1;
    const u64 u = (u64)id;
    if (u < vocab_start) return -1;
    const u64 r = u - vocab_start;
    return r < v_local ? (i64)r : -1;
}

// out[t, :] = table[ids[t] - vocab_start, :], or zeros for ids the shard does not hold.
// grid.x covers the column groups, grid.y walks the tokens (grid-stride).
extern "C" __global__ void embedding_forward(const i64* __restrict__ ids,
                                             const float* __restrict__ table,
                                             float* __restrict__ out, u64 n, u64 hidden,
                                             u64 vocab_start, u64 v_local) {
    const u64 q = (hidden + 3) / 4;
    const u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= q) return;
    const bool vec = hidden % 4 == 0 && (((u64)table | (u64)out) & 15) == 0;
    for (u64 t = blockIdx.y; t < n; t += gridDim.y) {
        const i64 r = emb_local_row(ids[t], vocab_start, v_local);
        float* o = out + t * hidden;
        if (vec) {
            float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (r >= 0) v = reinterpret_cast<const float4*>(table + (u64)r * hidden)[j];
            reinterpret_cast<float4*>(o)[j] = v;
        } else {
            #pragma unroll
            for (int k = 0; k < 4; ++k) {
                const u64 c = j + (u64)k * q;
                if (c < hidden) o[c] = r >= 0 ? table[(u64)r * hidden + c] : 0.0f;
            }
        }
    }
}

// dtable[r, :] += dout[t, :] for every token t whose id is row r of the shard, tokens in order.
//
// Deterministic and bit-identical to the CPU loop: every element of dtable is owned by exactly
// one thread, which adds its tokens' gradients in token order (no atomics). Block (x, y) owns
// the column groups of blockIdx.x and the shard rows r with r % parts == blockIdx.y; it walks
// the tokens in chunks of EMB_BWD_THREADS, compacts the chunk's tokens that hit its rows into
// shared memory (order kept), and each thread then adds those rows for its columns. Every block
// reads all the ids (cheap, from L2); the adds are spread over parts × column tiles blocks.
extern "C" __global__ void __launch_bounds__(EMB_BWD_THREADS)
embedding_backward(const i64* __restrict__ ids, const float* __restrict__ dout,
                   float* __restrict__ dtable, u64 n, u64 hidden, u64 vocab_start, u64 v_local,
                   u64 parts) {
    __shared__ u64 s_tok[EMB_BWD_THREADS];
    __shared__ u64 s_row[EMB_BWD_THREADS];
    __shared__ u32 s_count[EMB_BWD_THREADS / WARP];
    const u64 q = (hidden + 3) / 4;
    const u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const bool active = j < q;
    const bool vec = hidden % 4 == 0 && (((u64)dout | (u64)dtable) & 15) == 0;
    const u64 part = blockIdx.y;
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int warps = blockDim.x / WARP;
    for (u64 base = 0; base < n; base += blockDim.x) {
        // Compact this chunk's tokens held by this block's rows, in token order.
        const u64 t = base + threadIdx.x;
        const i64 r = t < n ? emb_local_row(ids[t], vocab_start, v_local) : -1;
        const bool mine = r >= 0 && (u64)r % parts == part;
        const u32 ballot = __ballot_sync(0xffffffffu, mine);
        if (lane == 0) s_count[warp] = __popc(ballot);
        __syncthreads();
        u32 before = 0, total = 0;
        for (int w = 0; w < warps; ++w) {
            const u32 c = s_count[w];
            before += w < warp ? c : 0u;
            total += c;
        }
        if (mine) {
            const u32 at = before + __popc(ballot & ((1u << lane) - 1u));
            s_tok[at] = t;
            s_row[at] = (u64)r;
        }
        __syncthreads();
        if (active) {
            for (u32 k = 0; k < total; ++k) {
                const u64 tok = s_tok[k], row = s_row[k];
                if (vec) {
                    float4* d = reinterpret_cast<float4*>(dtable + row * hidden) + j;
                    const float4 g = reinterpret_cast<const float4*>(dout + tok * hidden)[j];
                    float4 a = *d;
                    a.x = __fadd_rn(a.x, g.x);
                    a.y = __fadd_rn(a.y, g.y);
                    a.z = __fadd_rn(a.z, g.z);
                    a.w = __fadd_rn(a.w, g.w);
                    *d = a;
                } else {
                    #pragma unroll
                    for (int c4 = 0; c4 < 4; ++c4) {
                        const u64 c = j + (u64)c4 * q;
                        if (c < hidden) {
                            float* d = dtable + row * hidden + c;
                            *d = __fadd_rn(*d, dout[tok * hidden + c]);
                        }
                    }
                }
            }
        }
        // The next chunk overwrites the shared lists.
        __syncthreads();
    }
}
