// Adam / AdamW step in place on flat f32 buffers, with the f32 scalars the host rounded from the
// f64 hyper-parameters (AdamScalars on the CPU). Every operation is an explicitly rounded
// intrinsic in the CPU's order (no fused multiply-adds, IEEE sqrt and division), so a step gives
// the CPU's bits. The gradient is multiplied by `grad_scale` first (gradient clipping's
// coefficient, 1 without), and with `copy` not null the new parameters are also written rounded
// to bf16 (the products' weight copies): clipping, the update and the refresh in one pass.

__device__ __forceinline__ void adam_one(float& p, float g, float& m, float& v, float b1, float b2,
                                         float omb1, float omb2, float eps, float step_size,
                                         float inv_sqrt_bc2, float decay, float l2, float grad_scale) {
    g = __fadd_rn(__fmul_rn(g, grad_scale), __fmul_rn(l2, p));
    m = __fadd_rn(__fmul_rn(b1, m), __fmul_rn(omb1, g));
    v = __fadd_rn(__fmul_rn(b2, v), __fmul_rn(__fmul_rn(omb2, g), g));
    const float denom = __fadd_rn(__fmul_rn(__fsqrt_rn(v), inv_sqrt_bc2), eps);
    p = __fsub_rn(__fmul_rn(p, decay), __fdiv_rn(__fmul_rn(step_size, m), denom));
}

// 16-byte accesses when the four f32 buffers are 16-byte aligned and the copy (if any) 8-byte
// aligned, scalar otherwise.
extern "C" __global__ void adam_step(float* __restrict__ param, const float* __restrict__ grad,
                                     float* __restrict__ exp_avg, float* __restrict__ exp_avg_sq,
                                     unsigned short* __restrict__ copy, u64 n, float grad_scale,
                                     float b1, float b2, float omb1, float omb2, float eps,
                                     float step_size, float inv_sqrt_bc2, float decay, float l2) {
    u64 done = 0;
    if ((((u64)param | (u64)grad | (u64)exp_avg | (u64)exp_avg_sq) & 15) == 0 &&
        ((u64)copy & 7) == 0) {
        const u64 n4 = n / 4;
        float4* p4 = reinterpret_cast<float4*>(param);
        const float4* g4 = reinterpret_cast<const float4*>(grad);
        float4* m4 = reinterpret_cast<float4*>(exp_avg);
        float4* v4 = reinterpret_cast<float4*>(exp_avg_sq);
        FOR_EACH(i, n4) {
            float4 p = p4[i], m = m4[i], v = v4[i];
            const float4 g = g4[i];
            adam_one(p.x, g.x, m.x, v.x, b1, b2, omb1, omb2, eps, step_size, inv_sqrt_bc2, decay, l2, grad_scale);
            adam_one(p.y, g.y, m.y, v.y, b1, b2, omb1, omb2, eps, step_size, inv_sqrt_bc2, decay, l2, grad_scale);
            adam_one(p.z, g.z, m.z, v.z, b1, b2, omb1, omb2, eps, step_size, inv_sqrt_bc2, decay, l2, grad_scale);
            adam_one(p.w, g.w, m.w, v.w, b1, b2, omb1, omb2, eps, step_size, inv_sqrt_bc2, decay, l2, grad_scale);
            p4[i] = p;
            m4[i] = m;
            v4[i] = v;
            if (copy != nullptr) store_out4(copy, true, i, p);
        }
        done = 4 * n4;
    }
    FOR_EACH(k, n - done) {
        const u64 i = done + k;
        float p = param[i], m = exp_avg[i], v = exp_avg_sq[i];
        adam_one(p, grad[i], m, v, b1, b2, omb1, omb2, eps, step_size, inv_sqrt_bc2, decay, l2, grad_scale);
        param[i] = p;
        exp_avg[i] = m;
        exp_avg_sq[i] = v;
        if (copy != nullptr) copy[i] = (unsigned short)bf16_bits(p);
    }
}
