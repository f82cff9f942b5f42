// The optimizer's element-wise work on the GPU: AdamW in place on a parameter and its two
// moments, and gradient accumulation in place. The arithmetic is the CPU's `kernels::adamw`
// rule operation for operation with round-to-nearest intrinsics, which the compiler never fuses
// into FMAs, so both devices give the same bits.

extern "C" __global__ void adamw_f32(float* p, float* m, float* v, const float* g,
                                     unsigned long long n, float b1, float b2, float eps,
                                     float step_size, float sqrt_bc2, float decay,
                                     float grad_scale) {
  const float c1 = __fsub_rn(1.0f, b1), c2 = __fsub_rn(1.0f, b2);
  for (unsigned long long k = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; k < n;
       k += (unsigned long long)gridDim.x * blockDim.x) {
    const float gk = __fmul_rn(g[k], grad_scale);
    const float mk = __fadd_rn(__fmul_rn(b1, m[k]), __fmul_rn(c1, gk));
    const float vk = __fadd_rn(__fmul_rn(b2, v[k]), __fmul_rn(__fmul_rn(c2, gk), gk));
    m[k] = mk;
    v[k] = vk;
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vk), sqrt_bc2), eps);
    p[k] = __fsub_rn(__fmul_rn(p[k], decay), __fdiv_rn(__fmul_rn(step_size, mk), denom));
  }
}

// acc += g, element-wise over n values.
extern "C" __global__ void add_assign_f32(float* acc, const float* g, unsigned long long n) {
  for (unsigned long long k = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; k < n;
       k += (unsigned long long)gridDim.x * blockDim.x) {
    acc[k] = __fadd_rn(acc[k], g[k]);
  }
}
