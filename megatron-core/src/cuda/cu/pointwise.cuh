// The element-wise functions of a module's forward (kernels/pointwise.rs on the host), for the
// kernels #[megatron::module] generates from each chain of them (ops/fused.rs). A `_grad` is
// f'(x); sigmoid, tanh, exp, sqrt and rsqrt have theirs written from their output.
#pragma once

#define PW_GELU_A -1.5957691216057308f   // −2·√(2/π)
#define PW_GELU_B -0.071354816f          // −2·√(2/π)·0.044715
#define PW_GELU_3B -0.21406445f          // 3·PW_GELU_B

__device__ __forceinline__ float pw_relu(float x) { return x < 0.0f ? 0.0f : x; }
__device__ __forceinline__ float pw_relu_grad(float x) { return x > 0.0f ? 1.0f : 0.0f; }
__device__ __forceinline__ float pw_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float pw_silu(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float pw_silu_grad(float x) {
    const float s = pw_sigmoid(x);
    return s + x * s * (1.0f - s);
}
__device__ __forceinline__ float pw_gelu(float x) {
    const float e = expf(x * (PW_GELU_A + PW_GELU_B * (x * x)));
    return x / (1.0f + e);
}
__device__ __forceinline__ float pw_gelu_grad(float x) {
    const float x2 = x * x;
    const float e = expf(x * (PW_GELU_A + PW_GELU_B * x2));
    const float s = 1.0f / (1.0f + e);
    const float one_minus_s = fminf(e * s, 1.0f);
    const float dz = PW_GELU_A + PW_GELU_3B * x2;
    return s - (x * s) * (one_minus_s * dz);
}
__device__ __forceinline__ float pw_gelu_erf(float x) {
    return 0.5f * x * (1.0f + erff(x * 0.70710678f));
}
__device__ __forceinline__ float pw_gelu_erf_grad(float x) {
    const float cdf = 0.5f * (1.0f + erff(x * 0.70710678f));
    return cdf + x * 0.39894228f * expf(-0.5f * x * x);
}
__device__ __forceinline__ float pw_softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }
__device__ __forceinline__ float pw_softplus_grad(float x) { return x > 20.0f ? 1.0f : pw_sigmoid(x); }
__device__ __forceinline__ float pw_exp(float x) { return expf(x); }
__device__ __forceinline__ float pw_tanh(float x) { return tanhf(x); }
__device__ __forceinline__ float pw_log(float x) { return logf(x); }
__device__ __forceinline__ float pw_sqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ float pw_rsqrt(float x) { return 1.0f / sqrtf(x); }
__device__ __forceinline__ float pw_abs(float x) { return fabsf(x); }
__device__ __forceinline__ float pw_abs_grad(float x) { return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : 0.0f); }
__device__ __forceinline__ float pw_clamp(float x, float lo, float hi) {
    const float y = x < lo ? lo : x;
    return y > hi ? hi : y;
}
__device__ __forceinline__ float pw_clamp_grad(float x, float lo, float hi) {
    return x >= lo && x <= hi ? 1.0f : 0.0f;
}
__device__ __forceinline__ float pw_select(bool c, float a, float b) { return c ? a : b; }
