// The f32 FMA peak of this machine, measured: each thread runs 12 independent chains of
// 256-bit (AVX2) or 512-bit (AVX-512) fused multiply-adds, enough to cover the FMA latency on
// every x86-64 core of the last ten years, and the GFLOP/s of all threads together is printed.
// The bound the benchmarks' "fraction of the machine" figures divide by.
//   gcc -O2 -mavx2 -mfma -pthread scripts/bench/fma_peak.c -o /tmp/fma_peak && /tmp/fma_peak 2
//   gcc -O2 -mavx512f -pthread -DWIDE scripts/bench/fma_peak.c -o /tmp/fma_peak512 && /tmp/fma_peak512 2
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#ifdef WIDE
typedef __m512 vec;
#define LANES 16
#define SET1 _mm512_set1_ps
#define FMA _mm512_fmadd_ps
#define ADD _mm512_add_ps
#define SUM(x) _mm512_reduce_add_ps(x)
#else
typedef __m256 vec;
#define LANES 8
#define SET1 _mm256_set1_ps
#define FMA _mm256_fmadd_ps
#define ADD _mm256_add_ps
static float SUM(__m256 x) {
  float f[8];
  _mm256_storeu_ps(f, x);
  return f[0] + f[1] + f[2] + f[3] + f[4] + f[5] + f[6] + f[7];
}
#endif

#define CHAINS 12
static const long ITERS = 200000000L;

// The chains as named variables (an array stayed in memory at -O2: loads and stores, not FMAs,
// bounded the loop).
#define CH(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#define DECL(i) vec c##i = SET1(0.001f * i);
#define STEP(i) c##i = FMA(c##i, a, b);
#define ACC(i) s = ADD(s, c##i);

static void *work(void *out) {
  CH(DECL)
  vec a = SET1(0.999999f), b = SET1(1e-7f);
  for (long it = 0; it < ITERS; it++) {
    CH(STEP)
    __asm__ volatile("" ::: "memory");
  }
  vec s = SET1(0.0f);
  CH(ACC)
  *(float *)out = SUM(s);
  return NULL;
}

int main(int argc, char **argv) {
  int threads = argc > 1 ? atoi(argv[1]) : 1;
  if (threads < 1 || threads > 256) return 2;
  pthread_t t[256];
  float sink[256];
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (int i = 0; i < threads; i++) pthread_create(&t[i], NULL, work, &sink[i]);
  for (int i = 0; i < threads; i++) pthread_join(t[i], NULL);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  double s = (t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec);
  double flops = 2.0 * LANES * CHAINS * (double)ITERS * threads;
  printf("%d thread(s), %d-bit FMA: %.1f GFLOP/s (f32)  [checksum %g]\n", threads, LANES * 32,
         flops / s / 1e9, (double)sink[0]);
  return 0;
}
