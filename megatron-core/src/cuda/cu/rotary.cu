// Rotary position embeddings on a fused attention projection, as megatron-core's
// kernels::rotary: a row of [seq, batch, row] is `groups` blocks of `parts` heads of head_dim;
// the first `rotated` heads of each block have their first `rot` elements turned, pair by
// pair, by the angle position · freqs[j] (f32, as the CPU), the cosines and sines times
// `amplitude` (YaRN's, else 1); `inverse` turns them back (the backward, the transpose). Pairs
// are (j, j + rot/2), or (2j, 2j + 1) when `interleaved`. x and y each f32 or, with their
// flags, bf16 (y rounded once). Every product is rounded on its own, as the CPU.

// The most frequencies a launch passes by value (head sizes up to 256 turned whole).
#define ROPE_MAX_FREQS 128
struct RopeFreqs {
    float f[ROPE_MAX_FREQS];
};

extern "C" __global__ void rope(const void* __restrict__ x, int x_bf16, void* __restrict__ y,
                                int y_bf16, u64 seq, u64 batch, u64 groups, u64 parts,
                                u64 rotated, u64 head_dim, u64 rot, int interleaved, u64 offset,
                                int inverse, float amplitude, const RopeFreqs freqs) {
    const u64 row = groups * parts * head_dim, n = seq * batch * row;
    FOR_EACH(i, n) {
        const u64 token = i / row, e = i % row;
        const u64 part = (e / head_dim) % parts, k = e % head_dim;
        float v = load_in(x, x_bf16, i);
        if (part < rotated && k < rot) {
            const u64 half = rot / 2;
            const bool first = interleaved ? (k & 1) == 0 : k < half;
            const u64 other = interleaved ? (k ^ 1) : (first ? k + half : k - half);
            const u64 j = interleaved ? k / 2 : (first ? k : k - half);
            const float p = (float)(offset + token / batch);
            float s, c;
            sincosf(__fmul_rn(p, freqs.f[j]), &s, &c);
            s = __fmul_rn(s, amplitude);
            c = __fmul_rn(c, amplitude);
            if (inverse) s = -s;
            const float w = load_in(x, x_bf16, i - k + other);
            v = first ? __fsub_rn(__fmul_rn(v, c), __fmul_rn(w, s))
                      : __fadd_rn(__fmul_rn(v, c), __fmul_rn(w, s));
        }
        store_out(y, y_bf16, i, v);
    }
}
