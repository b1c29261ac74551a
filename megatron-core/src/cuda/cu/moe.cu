// The MoE router and the all-to-all dispatcher's preprocessing on the device (Megatron-LM's
// TopKRouter and MoEAlltoAllTokenDispatcher's preprocess and first permutation), computed as
// megatron-core's host router computes them (moe/router.rs): f32, the same operations in the same
// order, products rounded on their own (no fused multiply-add); a top-k orders by IEEE total order
// (f32::total_cmp), ties to the lower index.
//
// Per-token kernels take a thread per token. A sum over tokens runs in token order on one thread
// (per expert, or one for a loss), so no result depends on the launch. Nothing is read back: the
// counts and the routing stay on the device until the host asks for them (after a graph's replay).

// The routers' score functions (`mode`).
#define MOE_SOFTMAX_AFTER_TOPK 0
#define MOE_SOFTMAX_BEFORE_TOPK 1
#define MOE_SIGMOID 2

// f32::total_cmp's key: two floats compare as their keys do as signed integers.
__device__ __forceinline__ int moe_total_key(float x) {
    const int b = (int)__float_as_uint(x);
    return b ^ (int)(((u32)(b >> 31)) >> 1);
}

// The indices of the k largest of v[0..n) (plus bias[j] when bias is not null) into out[0..k),
// largest first, ties to the lower index; only among the j with allowed[j] != 0 when allowed is
// not null.
__device__ void moe_top_k(const float* v, const float* bias, const i64* allowed, u64 n, u64 k,
                          i64* out) {
    for (u64 i = 0; i < k; ++i) {
        i64 best = -1;
        int best_key = 0;
        for (u64 j = 0; j < n; ++j) {
            bool taken = allowed != nullptr && allowed[j] == 0;
            for (u64 q = 0; q < i; ++q) taken = taken || out[q] == (i64)j;
            if (taken) continue;
            const int key = moe_total_key(bias ? __fadd_rn(v[j], bias[j]) : v[j]);
            if (best < 0 || key > best_key) {
                best = (i64)j;
                best_key = key;
            }
        }
        out[i] = best;
    }
}

// v[j] plus bias[j] when bias is not null: what a top-k ranks.
__device__ __forceinline__ float moe_ranked(const float* v, const float* bias, u64 j) {
    return bias ? __fadd_rn(v[j], bias[j]) : v[j];
}

// Group-limited routing's groups: allowed[j] = 1 for the experts of the group_topk groups (of
// `groups` equal groups of v[0..n)) whose `best` largest values (plus bias) sum highest, summed
// largest first from 0, ties to the lower index and the lower group; 0 elsewhere. `sums` holds
// `groups` floats of scratch.
__device__ void moe_group_mask(const float* v, const float* bias, u64 n, u64 groups,
                               u64 group_topk, u64 best, float* sums, i64* allowed) {
    const u64 per = n / groups;
    for (u64 g = 0; g < groups; ++g) {
        float sum = 0.0f;
        // The r-th largest of the group: the one exactly r others come before.
        for (u64 r = 0; r < best; ++r) {
            for (u64 a = 0; a < per; ++a) {
                const int ka = moe_total_key(moe_ranked(v, bias, g * per + a));
                u64 before = 0;
                for (u64 b = 0; b < per; ++b) {
                    const int kb = moe_total_key(moe_ranked(v, bias, g * per + b));
                    before += kb > ka || (kb == ka && b < a);
                }
                if (before == r) {
                    sum = __fadd_rn(sum, moe_ranked(v, bias, g * per + a));
                    break;
                }
            }
        }
        sums[g] = sum;
    }
    for (u64 g = 0; g < groups; ++g) {
        const int kg = moe_total_key(sums[g]);
        u64 ahead = 0;
        for (u64 h = 0; h < groups; ++h) {
            const int kh = moe_total_key(sums[h]);
            ahead += kh > kg || (kh == kg && h < g);
        }
        for (u64 a = 0; a < per; ++a) allowed[g * per + a] = ahead < group_topk ? 1 : 0;
    }
}

// out[0..n) = softmax(x[0..n)) (in place when out == x): the maximum skips NaN, as f32::max.
__device__ void moe_softmax(const float* x, u64 n, float* out) {
    float m = NEG_INF;
    for (u64 j = 0; j < n; ++j) m = fmaxf(m, x[j]);
    float sum = 0.0f;
    for (u64 j = 0; j < n; ++j) {
        out[j] = exp_f32(__fsub_rn(x[j], m));
        sum = __fadd_rn(sum, out[j]);
    }
    for (u64 j = 0; j < n; ++j) out[j] = __fdiv_rn(out[j], sum);
}

__device__ __forceinline__ float moe_sigmoid(float x) {
    return __fdiv_rn(1.0f, __fadd_rn(1.0f, exp_f32(-x)));
}

// Each token's top-k experts and their weights: chosen[t, k] (best first), probs[t, experts]
// (scaled by `scale`, 0 where the token does not go), map[t, experts] (1 where it goes), and the
// scores the backward reads: [t, experts] before the top-k (softmax or sigmoid), [t, k] after it.
// bias (sigmoid only, may be null) moves the choice, not the weights. With `groups` > 0 the
// choice is group-limited (moe_group_mask, its scratch the token's rows of probs and map, cleared
// after).
extern "C" __global__ void moe_route_topk(const float* __restrict__ logits,
                                          const float* __restrict__ bias, u64 tokens, u64 experts,
                                          u64 k, int mode, float scale, u64 groups,
                                          u64 group_topk, float* __restrict__ probs,
                                          i64* __restrict__ map, i64* __restrict__ chosen,
                                          float* __restrict__ scores) {
    FOR_EACH(t, tokens) {
        const float* row = logits + t * experts;
        float* p = probs + t * experts;
        i64* m = map + t * experts;
        i64* c = chosen + t * k;
        // The top-k of v (plus b), within the kept groups when routing is group-limited.
        auto pick = [&](const float* v, const float* b) {
            if (groups > 0) {
                moe_group_mask(v, b, experts, groups, group_topk, k / group_topk, p, m);
                moe_top_k(v, b, m, experts, k, c);
            } else {
                moe_top_k(v, b, nullptr, experts, k, c);
            }
            for (u64 j = 0; j < experts; ++j) {
                p[j] = 0.0f;
                m[j] = 0;
            }
        };
        if (mode == MOE_SOFTMAX_BEFORE_TOPK) {
            float* s = scores + t * experts;
            moe_softmax(row, experts, s);
            pick(s, nullptr);
            for (u64 i = 0; i < k; ++i) p[c[i]] = __fmul_rn(s[c[i]], scale);
        } else if (mode == MOE_SOFTMAX_AFTER_TOPK) {
            pick(row, nullptr);
            float* s = scores + t * k;
            for (u64 i = 0; i < k; ++i) s[i] = row[c[i]];
            moe_softmax(s, k, s);
            for (u64 i = 0; i < k; ++i) p[c[i]] = __fmul_rn(s[i], scale);
        } else {
            float* s = scores + t * experts;
            for (u64 j = 0; j < experts; ++j) s[j] = moe_sigmoid(row[j]);
            pick(s, bias);
            float sum = 0.0f;
            for (u64 i = 0; i < k; ++i) sum = __fadd_rn(sum, s[c[i]]);
            sum = __fadd_rn(sum, 1e-20f);
            for (u64 i = 0; i < k; ++i) {
                const float w = k > 1 ? __fdiv_rn(s[c[i]], sum) : s[c[i]];
                p[c[i]] = __fmul_rn(w, scale);
            }
        }
        for (u64 i = 0; i < k; ++i) m[c[i]] = 1;
    }
}

// Capacity: keep[t, e] = 1 when token t is among expert e's first `capacity` tokens, ordered by
// probability (highest first, ties to the lower token) or, `by_position`, routed tokens first in
// token order. A thread per (token, expert) counts the tokens ahead of it.
extern "C" __global__ void moe_route_keep(const float* __restrict__ probs,
                                          const i64* __restrict__ map, u64 tokens, u64 experts,
                                          u64 capacity, int by_position, i64* __restrict__ keep) {
    FOR_EACH(i, tokens * experts) {
        const u64 t = i / experts, e = i % experts;
        u64 ahead = 0;
        if (by_position) {
            const bool mine = map[i] != 0;
            for (u64 u = 0; u < tokens; ++u) {
                const bool theirs = map[u * experts + e] != 0;
                ahead += (theirs && !mine) || (theirs == mine && u < t);
            }
        } else {
            const int mine = moe_total_key(probs[i]);
            for (u64 u = 0; u < tokens; ++u) {
                const int theirs = moe_total_key(probs[u * experts + e]);
                ahead += theirs > mine || (theirs == mine && u < t);
            }
        }
        keep[i] = ahead < capacity ? 1 : 0;
    }
}

// Per expert, in token order: applies the capacity (with `all`, every token goes to every expert,
// as padding to a capacity above the tokens does; with keep, a token stays where kept — or, `pad`,
// goes wherever kept — and a dropped one's weight is 0), then counts tokens_per_expert[e] and the
// chosen pairs capacity dropped, dropped[e].
extern "C" __global__ void moe_route_counts(float* __restrict__ probs, i64* __restrict__ map,
                                            const i64* __restrict__ keep, u64 tokens, u64 experts,
                                            int all, int pad, i64* __restrict__ tokens_per_expert,
                                            i64* __restrict__ dropped) {
    FOR_EACH(e, experts) {
        i64 n = 0, d = 0;
        for (u64 t = 0; t < tokens; ++t) {
            const u64 i = t * experts + e;
            if (all) {
                map[i] = 1;
            } else if (keep) {
                const bool routed = map[i] != 0, kept_here = keep[i] != 0;
                const bool kept = pad ? kept_here : routed && kept_here;
                d += routed && !kept_here;
                map[i] = kept ? 1 : 0;
                if (!kept) probs[i] = 0.0f;
            }
            n += map[i];
        }
        tokens_per_expert[e] = n;
        dropped[e] = d;
    }
}

// The load-balancing loss's scores (softmax of the logits, or their sigmoids normalised) and each
// token's top-k of them (a fresh choice, no bias, no capacity).
extern "C" __global__ void moe_aux_scores(const float* __restrict__ logits, u64 tokens,
                                          u64 experts, u64 k, int sigmoid,
                                          float* __restrict__ scores, i64* __restrict__ chosen) {
    FOR_EACH(t, tokens) {
        const float* row = logits + t * experts;
        float* s = scores + t * experts;
        if (sigmoid) {
            float sum = 0.0f;
            for (u64 j = 0; j < experts; ++j) {
                s[j] = moe_sigmoid(row[j]);
                sum = __fadd_rn(sum, s[j]);
            }
            sum = __fadd_rn(sum, 1e-20f);
            for (u64 j = 0; j < experts; ++j) s[j] = __fdiv_rn(s[j], sum);
        } else {
            moe_softmax(row, experts, s);
        }
        moe_top_k(s, nullptr, nullptr, experts, k, chosen + t * k);
    }
}

// counts[g, e]: the tokens of group g whose top-k holds expert e. One group (the micro-batch), or
// `groups` sequences, token t in sequence t % groups.
extern "C" __global__ void moe_aux_counts(const i64* __restrict__ chosen, u64 tokens, u64 experts,
                                          u64 k, u64 groups, float* __restrict__ counts) {
    FOR_EACH(i, groups * experts) {
        const u64 g = i / experts, e = i % experts;
        float n = 0.0f;
        for (u64 t = 0; t < tokens; ++t) {
            if (groups > 1 && t % groups != g) continue;
            for (u64 q = 0; q < k; ++q) n += chosen[t * k + q] == (i64)e ? 1.0f : 0.0f;
        }
        counts[i] = n;
    }
}

// Each token's log-sum-exp of its logits (the z loss's).
extern "C" __global__ void moe_logsumexp(const float* __restrict__ logits, u64 tokens,
                                         u64 experts, float* __restrict__ lse) {
    FOR_EACH(t, tokens) {
        const float* row = logits + t * experts;
        float m = NEG_INF;
        for (u64 j = 0; j < experts; ++j) m = fmaxf(m, row[j]);
        float sum = 0.0f;
        for (u64 j = 0; j < experts; ++j) sum = __fadd_rn(sum, exp_f32(__fsub_rn(row[j], m)));
        lse[t] = __fadd_rn(m, logf(sum));
    }
}

// One thread, in token order: losses[0] = Σ score·count·factor (the load-balancing loss) with its
// gradient aux_grad[t, e] = count·factor, when scores is not null; losses[1] = Σ lse² / tokens ·
// z_coeff (the z loss), when lse is not null.
extern "C" __global__ void moe_route_losses(const float* __restrict__ scores,
                                            const float* __restrict__ counts, u64 tokens,
                                            u64 experts, u64 groups, float factor,
                                            const float* __restrict__ lse, float z_coeff,
                                            float* __restrict__ aux_grad,
                                            float* __restrict__ losses) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    float aux = 0.0f;
    if (scores) {
        for (u64 t = 0; t < tokens; ++t) {
            const u64 g = groups > 1 ? t % groups : 0;
            for (u64 e = 0; e < experts; ++e) {
                const float c = counts[g * experts + e];
                aux = __fadd_rn(aux, __fmul_rn(__fmul_rn(scores[t * experts + e], c), factor));
                aux_grad[t * experts + e] = __fmul_rn(c, factor);
            }
        }
    }
    float z = 0.0f;
    if (lse) {
        for (u64 t = 0; t < tokens; ++t) z = __fadd_rn(z, __fmul_rn(lse[t], lse[t]));
        z = __fmul_rn(__fdiv_rn(z, (float)tokens), z_coeff);
    }
    losses[0] = aux;
    losses[1] = z;
}

// The dispatch's index tables for the experts first .. first + count of map[tokens, experts]
// (1 where a token goes): their pairs laid out expert-major (each expert's in token order),
// slots[t, e] = the row of pair (t, e) (−1 where the token does not go or the expert is outside
// the range) and source[r] = the token of row r (−1 past the last row: a buffer of `rows` rows
// holds at most that many). Thread e counts the pairs of the experts before it, then writes its
// column; the range's last also the tail.
extern "C" __global__ void moe_expert_slots(const i64* __restrict__ map, u64 tokens, u64 experts,
                                            u64 first, u64 count, u64 rows,
                                            i64* __restrict__ slots, i64* __restrict__ source) {
    FOR_EACH(e, experts) {
        const bool mine = e >= first && e < first + count;
        u64 at = 0;
        for (u64 q = first; mine && q < e; ++q) {
            for (u64 t = 0; t < tokens; ++t) at += map[t * experts + q] != 0;
        }
        for (u64 t = 0; t < tokens; ++t) {
            i64 slot = -1;
            if (mine && map[t * experts + e] != 0 && at < rows) {
                source[at] = (i64)t;
                slot = (i64)at++;
            }
            slots[t * experts + e] = slot;
        }
        if (mine && e + 1 == first + count) {
            for (; at < rows; ++at) source[at] = -1;
        }
    }
}

// counts[j] = the pairs of expert first + j in map[tokens, experts] (1 where a token goes), for
// j < count: a thread per expert, in token order.
extern "C" __global__ void moe_column_counts(const i64* __restrict__ map, u64 tokens, u64 experts,
                                             u64 first, u64 count, i64* __restrict__ counts) {
    FOR_EACH(j, count) {
        i64 n = 0;
        for (u64 t = 0; t < tokens; ++t) n += map[t * experts + first + j] != 0;
        counts[j] = n;
    }
}

// The regrouping of rows received in chunks: counts[ranks, local] rows from each rank for each
// local expert arrive rank-major (each rank's chunk expert-major); sorted by local expert they
// are expert-major (each expert's by rank). Forward (inverse = 0): index[sorted position] =
// received position; inverse: index[received position] = sorted position. A thread per chunk.
extern "C" __global__ void moe_chunk_order(const i64* __restrict__ counts, u64 ranks, u64 local,
                                           u64 inverse, i64* __restrict__ index) {
    FOR_EACH(c, ranks * local) {
        const u64 r = c / local, le = c % local;
        u64 received = 0, sorted = 0;
        for (u64 q = 0; q < c; ++q) received += (u64)counts[q];
        for (u64 q = 0; q < le; ++q) {
            for (u64 p = 0; p < ranks; ++p) sorted += (u64)counts[p * local + q];
        }
        for (u64 p = 0; p < r; ++p) sorted += (u64)counts[p * local + le];
        for (u64 j = 0; j < (u64)counts[c]; ++j) {
            if (inverse) {
                index[received + j] = (i64)(sorted + j);
            } else {
                index[sorted + j] = (i64)(received + j);
            }
        }
    }
}

// index[i] = (i mod m)·a + (i / m)·b for i < n: the repeated and strided indices of the
// expert-tensor-parallel exchanges.
extern "C" __global__ void moe_affine_index(u64 n, u64 m, u64 a, u64 b, i64* __restrict__ index) {
    FOR_EACH(i, n) index[i] = (i64)((i % m) * a + (i / m) * b);
}

// out[r, :] = x[source[r], :] (rows of `hidden` f32), zeros where source[r] < 0.
extern "C" __global__ void moe_permute_rows(const float* __restrict__ x,
                                            const i64* __restrict__ source, u64 rows, u64 hidden,
                                            float* __restrict__ out) {
    FOR_EACH(i, rows * hidden) {
        const i64 s = source[i / hidden];
        out[i] = s >= 0 ? x[(u64)s * hidden + i % hidden] : 0.0f;
    }
}

// The router's backward, a thread per token: dlogits[t, :] from the weights' gradient
// dprobs[t, experts] (only the pairs capacity kept reach the output), plus loss_scale[0] times the
// gradients of the load-balancing loss (when aux_grad is not null) and of the z loss (when lse is
// not null). As route_backward on the host: the same operations in the same order, sums starting
// from −0 as Rust's f32 sums do. loss_scale lives on the device, so that a graph replays the
// current one.
extern "C" __global__ void moe_route_backward(
    const float* __restrict__ logits, const float* __restrict__ dprobs,
    const i64* __restrict__ map, const i64* __restrict__ chosen, const float* __restrict__ scores,
    const float* __restrict__ aux_scores, const float* __restrict__ aux_grad,
    const float* __restrict__ lse, const float* __restrict__ loss_scale, u64 tokens, u64 experts,
    u64 k, int mode, float scale, float z_coeff, float* __restrict__ dlogits) {
    const float ls = loss_scale[0];
    FOR_EACH(t, tokens) {
        const float* row = logits + t * experts;
        const i64* top = chosen + t * k;
        float* d = dlogits + t * experts;
        for (u64 j = 0; j < experts; ++j) d[j] = 0.0f;
#define MOE_DP(j) (map[t * experts + (j)] ? __fmul_rn(dprobs[t * experts + (j)], scale) : 0.0f)
        if (mode == MOE_SOFTMAX_BEFORE_TOPK) {
            const float* s = scores + t * experts;
            float dot = -0.0f;
            for (u64 i = 0; i < k; ++i) dot = __fadd_rn(dot, __fmul_rn(s[top[i]], MOE_DP(top[i])));
            for (u64 j = 0; j < experts; ++j) {
                bool in_top = false;
                for (u64 i = 0; i < k; ++i) in_top = in_top || top[i] == (i64)j;
                const float ds = in_top ? MOE_DP(j) : 0.0f;
                d[j] = __fmul_rn(s[j], __fsub_rn(ds, dot));
            }
        } else if (mode == MOE_SOFTMAX_AFTER_TOPK) {
            const float* s = scores + t * k;
            float dot = -0.0f;
            for (u64 i = 0; i < k; ++i) dot = __fadd_rn(dot, __fmul_rn(s[i], MOE_DP(top[i])));
            for (u64 i = 0; i < k; ++i) d[top[i]] = __fmul_rn(s[i], __fsub_rn(MOE_DP(top[i]), dot));
        } else {
            const float* s = scores + t * experts;
            float sum = -0.0f, dot = -0.0f;
            for (u64 i = 0; i < k; ++i) sum = __fadd_rn(sum, s[top[i]]);
            sum = __fadd_rn(sum, 1e-20f);
            for (u64 i = 0; i < k; ++i) dot = __fadd_rn(dot, __fmul_rn(MOE_DP(top[i]), s[top[i]]));
            for (u64 i = 0; i < k; ++i) {
                const u64 j = (u64)top[i];
                const float ds = k > 1 ? __fsub_rn(__fdiv_rn(MOE_DP(j), sum),
                                                   __fdiv_rn(dot, __fmul_rn(sum, sum)))
                                       : MOE_DP(j);
                d[j] = __fmul_rn(__fmul_rn(ds, s[j]), __fsub_rn(1.0f, s[j]));
            }
        }
#undef MOE_DP
        if (aux_grad) {
            const float* s = aux_scores + t * experts;
            const float* g = aux_grad + t * experts;
            if (mode != MOE_SIGMOID) {
                float dot = -0.0f;
                for (u64 j = 0; j < experts; ++j) dot = __fadd_rn(dot, __fmul_rn(s[j], g[j]));
                for (u64 j = 0; j < experts; ++j)
                    d[j] = __fadd_rn(d[j], __fmul_rn(__fmul_rn(ls, s[j]), __fsub_rn(g[j], dot)));
            } else {
                float sum = -0.0f, dot = -0.0f;
                for (u64 j = 0; j < experts; ++j) sum = __fadd_rn(sum, moe_sigmoid(row[j]));
                sum = __fadd_rn(sum, 1e-20f);
                for (u64 j = 0; j < experts; ++j)
                    dot = __fadd_rn(dot, __fmul_rn(g[j], moe_sigmoid(row[j])));
                for (u64 j = 0; j < experts; ++j) {
                    const float sig = moe_sigmoid(row[j]);
                    const float dsig =
                        __fsub_rn(__fdiv_rn(g[j], sum), __fdiv_rn(dot, __fmul_rn(sum, sum)));
                    const float v = __fmul_rn(__fmul_rn(__fmul_rn(ls, dsig), sig), __fsub_rn(1.0f, sig));
                    d[j] = __fadd_rn(d[j], v);
                }
            }
        }
        if (lse) {
            // z = coeff · mean_t lse_t²: d/dlogit = coeff · 2 lse_t · softmax_t / T.
            float m = NEG_INF;
            for (u64 j = 0; j < experts; ++j) m = fmaxf(m, row[j]);
            float sum = 0.0f;
            for (u64 j = 0; j < experts; ++j) sum = __fadd_rn(sum, exp_f32(__fsub_rn(row[j], m)));
            const float c = __fdiv_rn(
                __fmul_rn(__fmul_rn(__fmul_rn(ls, z_coeff), 2.0f), lse[t]), (float)tokens);
            for (u64 j = 0; j < experts; ++j) {
                const float sm = __fdiv_rn(exp_f32(__fsub_rn(row[j], m)), sum);
                d[j] = __fadd_rn(d[j], __fmul_rn(c, sm));
            }
        }
    }
}

// The combine (MoEAlltoAllTokenDispatcher's unpermute): out[t, :] = the sum over k of
// weight[t, k] · rows[slots[t, k], :] (weight 1 when weights is null; slots < 0 skipped), in k
// order from +0, products rounded on their own, as the host's combine adds them.
extern "C" __global__ void moe_slot_sum(const float* __restrict__ rows,
                                        const i64* __restrict__ slots,
                                        const float* __restrict__ weights, u64 tokens, u64 k,
                                        u64 hidden, float* __restrict__ out) {
    FOR_EACH(i, tokens * hidden) {
        const u64 t = i / hidden, c = i % hidden;
        float acc = 0.0f;
        for (u64 j = 0; j < k; ++j) {
            const i64 s = slots[t * k + j];
            if (s < 0) continue;
            const float w = weights ? weights[t * k + j] : 1.0f;
            acc = __fadd_rn(acc, __fmul_rn(w, rows[(u64)s * hidden + c]));
        }
        out[i] = acc;
    }
}

// The combine's backward for the routing weights, a thread per pair: dots[t, k] =
// d[t, :] · rows[slots[t, k], :], summed in order from −0 as Rust's f32 sums do (+0 where
// slots[t, k] < 0).
extern "C" __global__ void moe_slot_dots(const float* __restrict__ d,
                                         const float* __restrict__ rows,
                                         const i64* __restrict__ slots, u64 tokens, u64 k,
                                         u64 hidden, float* __restrict__ dots) {
    FOR_EACH(p, tokens * k) {
        const i64 s = slots[p];
        float acc = 0.0f;
        if (s >= 0) {
            const float* a = d + (p / k) * hidden;
            const float* b = rows + (u64)s * hidden;
            acc = -0.0f;
            for (u64 c = 0; c < hidden; ++c) acc = __fadd_rn(acc, __fmul_rn(a[c], b[c]));
        }
        dots[p] = acc;
    }
}

// The combine's backward for the rows: out[slots[t, k], :] = +0 + weight[t, k] · d[t, :] for
// every pair with a slot, as the host adds the scaled gradient into zeros (the rows no pair
// names are left as they are).
extern "C" __global__ void moe_slot_scale(const float* __restrict__ d,
                                          const i64* __restrict__ slots,
                                          const float* __restrict__ weights, u64 tokens, u64 k,
                                          u64 hidden, float* __restrict__ out) {
    FOR_EACH(i, tokens * k * hidden) {
        const u64 p = i / hidden, c = i % hidden;
        const i64 s = slots[p];
        if (s < 0) continue;
        out[(u64)s * hidden + c] = __fadd_rn(0.0f, __fmul_rn(weights[p], d[(p / k) * hidden + c]));
    }
}
