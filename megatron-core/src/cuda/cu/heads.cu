// Grouped-query attention's fused projection as multi-head attention reads it, and back, as
// megatron-core's kernels::heads: a grouped row is `groups` blocks of `per_group` queries, the
// key and the value (head_dim each); a per-head row is [q | k | v] per query head. The
// backward sums each group's key and value gradients over its query heads in head order, as
// the CPU. x, y, dy and dx each f32 or, with their flags, bf16 (rounded once).

// The grouped offset of per-head element (group g, query j, part p, element k).
__device__ __forceinline__ u64 grouped_source(u64 g, u64 j, u64 part, u64 k, u64 per_group,
                                              u64 d) {
    const u64 block = g * (per_group + 2) * d;
    return part == 0 ? block + j * d + k : block + (per_group + part - 1) * d + k;
}

extern "C" __global__ void expand_groups(const void* __restrict__ x, int x_bf16,
                                         void* __restrict__ y, int y_bf16, u64 rows, u64 groups,
                                         u64 per_group, u64 d) {
    const u64 per_head = groups * per_group * 3 * d, grouped = groups * (per_group + 2) * d;
    FOR_EACH(i, rows * per_head) {
        const u64 r = i / per_head, e = i % per_head;
        const u64 head = e / (3 * d), part = (e / d) % 3, k = e % d;
        const u64 g = head / per_group, j = head % per_group;
        store_out(y, y_bf16, i,
                  load_in(x, x_bf16, r * grouped + grouped_source(g, j, part, k, per_group, d)));
    }
}

extern "C" __global__ void reduce_groups(const void* __restrict__ dy, int dy_bf16,
                                         void* __restrict__ dx, int dx_bf16, u64 rows, u64 groups,
                                         u64 per_group, u64 d) {
    const u64 per_head = groups * per_group * 3 * d, grouped = groups * (per_group + 2) * d;
    FOR_EACH(i, rows * grouped) {
        const u64 r = i / grouped, e = i % grouped;
        const u64 g = e / ((per_group + 2) * d), slot = (e / d) % (per_group + 2), k = e % d;
        const u64 row = r * per_head;
        float v;
        if (slot < per_group) {
            v = load_in(dy, dy_bf16, row + ((g * per_group + slot) * 3) * d + k);
        } else {
            const u64 part = slot - per_group + 1;
            v = 0.0f;
            for (u64 j = 0; j < per_group; ++j) {
                v = __fadd_rn(v, load_in(dy, dy_bf16, row + ((g * per_group + j) * 3 + part) * d + k));
            }
        }
        store_out(dx, dx_bf16, i, v);
    }
}
