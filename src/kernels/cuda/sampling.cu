// Token sampling on the GPU, one thread block per row of logits: the same rule as the CPU's
// `rollout::sample_row` (temperature, then top-k, then top-p on the renormalised rest, then an
// inverse-CDF draw with a uniform the host took from the row's own random stream), so a row
// picks the same token on either device unless its uniform falls within float rounding of a
// boundary. Only (token, log-prob) per row leaves the device.
//
// With s_i = logit_i / t (f32) and m = max_i s_i:
//   e_i = exp((double)(s_i - m)),  lse = m + log(sum_i e_i)   (f64, as on the CPU)
//   log-prob of the chosen token = s_tok - lse (over the whole vocabulary, before filtering)
// Order of the candidates (top-k, top-p, the draw): value descending, then index ascending
// (Rust's `f32::total_cmp`, reproduced with the usual order-preserving key of the f32 bits).
//
// Filtering works on prefixes of that order, found without sorting by a radix select over the
// 32-bit keys (four 8-bit passes, histograms of counts or of e_i), the elements equal to the
// final key taken in index order.

#include <stdint.h>

#define BLOCK 1024
#define WARPS (BLOCK / 32)

__device__ __forceinline__ unsigned int order_key(float x) {
  unsigned int b = __float_as_uint(x);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Sum over the block, the same order every time (deterministic).
__device__ double block_sum(double v, double* sh) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) sh[w] = v;
  __syncthreads();
  if (w == 0) {
    v = lane < WARPS ? sh[lane] : 0.0;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    if (lane == 0) sh[0] = v;
  }
  __syncthreads();
  const double r = sh[0];
  __syncthreads();
  return r;
}

// Exclusive prefix sum over the block in thread order; `total` receives the sum of all.
__device__ double block_exclusive_scan(double v, double* sh, double* total) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  double inc = v;
  for (int o = 1; o < 32; o <<= 1) {
    const double y = __shfl_up_sync(0xffffffffu, inc, o);
    if (lane >= o) inc += y;
  }
  double exc = __shfl_up_sync(0xffffffffu, inc, 1);
  if (lane == 0) exc = 0.0;
  __syncthreads();
  if (lane == 31) sh[w] = inc;
  __syncthreads();
  if (w == 0) {
    const double s = lane < WARPS ? sh[lane] : 0.0;
    double si = s;
    for (int o = 1; o < 32; o <<= 1) {
      const double y = __shfl_up_sync(0xffffffffu, si, o);
      if (lane >= o) si += y;
    }
    double se = __shfl_up_sync(0xffffffffu, si, 1);
    if (lane == 0) se = 0.0;
    sh[lane] = se;               // warps before this one
    if (lane == WARPS - 1) sh[32] = si;  // everything
  }
  __syncthreads();
  const double r = sh[w] + exc;
  *total = sh[32];
  __syncthreads();
  return r;
}

// Largest value with the lowest index among equals; NaN never wins. Every thread gets the result.
__device__ void block_argmax(float v, unsigned int i, float* shv, unsigned int* shi,
                             float* out_v, unsigned int* out_i) {
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_down_sync(0xffffffffu, v, o);
    const unsigned int oi = __shfl_down_sync(0xffffffffu, i, o);
    if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
  }
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) { shv[w] = v; shi[w] = i; }
  __syncthreads();
  if (w == 0) {
    v = lane < WARPS ? shv[lane] : -INFINITY;
    i = lane < WARPS ? shi[lane] : 0xffffffffu;
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_down_sync(0xffffffffu, v, o);
      const unsigned int oi = __shfl_down_sync(0xffffffffu, i, o);
      if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
    }
    if (lane == 0) { shv[0] = v; shi[0] = i; }
  }
  __syncthreads();
  *out_v = shv[0];
  *out_i = shi[0];
  __syncthreads();
}

struct Row {
  const float* logits;
  unsigned int vocab;
  float t;     // temperature (1 when greedy)
  float m;     // max_i logit_i / t
};

__device__ __forceinline__ float scaled(const Row& r, unsigned int i) { return r.logits[i] / r.t; }
__device__ __forceinline__ double mass(const Row& r, float s) { return exp((double)(s - r.m)); }

// A prefix of the candidate order: every element with key > key, and those with key == key
// and index <= index. The whole vocabulary is (0, UINT_MAX).
struct Prefix {
  unsigned int key;
  unsigned int index;
};

__device__ __forceinline__ bool member(const Prefix& p, unsigned int k, unsigned int i) {
  return k > p.key || (k == p.key && i <= p.index);
}

struct Shared {
  double red[33];
  double hist[256];
  unsigned int counts[256];
  float v[WARPS];
  unsigned int idx[WARPS];
  unsigned int pick;
  unsigned int key;
  double above;
};

// Σ e_i over the members of `p`.
__device__ double prefix_mass(const Row& r, const Prefix& p, Shared* sh) {
  double acc = 0.0;
  for (unsigned int i = threadIdx.x; i < r.vocab; i += BLOCK) {
    const float s = scaled(r, i);
    if (member(p, order_key(s), i)) acc += mass(r, s);
  }
  return block_sum(acc, sh->red);
}

// The member of `p` at which the running weight, in candidate order, first reaches `target`
// (>= target; > target when `strict`), weights 1 (`by_mass` false) or e_i. When rounding
// keeps the total below the target, the last member. Returns it as the prefix ending there.
__device__ Prefix select(const Row& r, const Prefix& p, bool by_mass, double target, bool strict,
                         Shared* sh) {
  unsigned int fixed = 0, high_mask = 0;
  double above = 0.0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = threadIdx.x; b < 256; b += BLOCK) { sh->hist[b] = 0.0; sh->counts[b] = 0; }
    __syncthreads();
    for (unsigned int i = threadIdx.x; i < r.vocab; i += BLOCK) {
      const float s = scaled(r, i);
      const unsigned int k = order_key(s);
      if ((k & high_mask) != fixed || !member(p, k, i)) continue;
      const unsigned int bin = (k >> shift) & 0xffu;
      atomicAdd(&sh->hist[bin], by_mass ? mass(r, s) : 1.0);
      atomicAdd(&sh->counts[bin], 1u);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int chosen = -1, lowest = -1;
      double acc = above;
      for (int b = 255; b >= 0; --b) {
        if (sh->counts[b] == 0) continue;
        lowest = b;
        const double next = acc + sh->hist[b];
        if (strict ? next > target : next >= target) { chosen = b; break; }
        acc = next;
      }
      if (chosen < 0) {  // the target is past the total: the last member
        chosen = lowest;
        acc -= sh->hist[lowest];
      }
      sh->pick = (unsigned int)chosen;
      sh->above = acc;
    }
    __syncthreads();
    fixed |= sh->pick << shift;
    high_mask |= 0xffu << shift;
    above = sh->above;
    __syncthreads();
  }
  // `fixed` is the key of the crossing; the members with that key, in index order, each of
  // the same weight, take the running total past the target one at a time.
  const unsigned int chunk = (r.vocab + BLOCK - 1) / BLOCK;
  const unsigned int lo = threadIdx.x * chunk;
  const unsigned int hi = min(lo + chunk, r.vocab);
  double ties = 0.0;
  float tie_value = 0.0f;
  for (unsigned int i = lo; i < hi; ++i) {
    const float s = scaled(r, i);
    const unsigned int k = order_key(s);
    if (k == fixed && member(p, k, i)) { ties += 1.0; tie_value = s; }
  }
  double all_ties;
  const double before = block_exclusive_scan(ties, sh->red, &all_ties);
  // One tie's weight: every tie has the value of the key.
  if (ties > 0.0 && before == 0.0) sh->hist[0] = by_mass ? mass(r, tie_value) : 1.0;
  __syncthreads();
  if (threadIdx.x == 0) {
    const double w = sh->hist[0];
    double acc = above;
    unsigned int c = 0;
    const unsigned int n = (unsigned int)all_ties;
    for (; c + 1 < n; ++c) {
      acc += w;
      if (strict ? acc > target : acc >= target) break;
    }
    sh->pick = c;  // the c-th tie (0-based), the last one at most
  }
  __syncthreads();
  const unsigned int want = sh->pick;
  if (ties > 0.0 && before <= (double)want && (double)want < before + ties) {
    unsigned int seen = (unsigned int)before;
    for (unsigned int i = lo; i < hi; ++i) {
      const unsigned int k = order_key(scaled(r, i));
      if (k == fixed && member(p, k, i)) {
        if (seen == want) { sh->key = i; break; }
        ++seen;
      }
    }
  }
  __syncthreads();
  Prefix out = {fixed, sh->key};
  __syncthreads();
  return out;
}

// rows: one block per row of `logits` ([rows, ld] f32, `vocab` <= ld used). `u[row]` is the
// row's uniform in [0, 1) (ignored when greedy). top_k = 0: none; top_p >= 1: none.
extern "C" __global__ void sample_rows(const float* logits, unsigned long long ld,
                                       unsigned int vocab, float temperature, int greedy,
                                       unsigned int top_k, double top_p, const double* u,
                                       unsigned int* tokens, float* log_probs) {
  __shared__ Shared sh;
  const unsigned int row = blockIdx.x;
  Row r;
  r.logits = logits + (unsigned long long)row * ld;
  r.vocab = vocab;
  r.t = greedy ? 1.0f : temperature;
  // Largest logit, first index among equals (the greedy choice); m = max / t.
  float best = -INFINITY;
  unsigned int best_i = 0xffffffffu;
  for (unsigned int i = threadIdx.x; i < vocab; i += BLOCK) {
    const float l = r.logits[i];
    if (l > best || (l == best && i < best_i)) { best = l; best_i = i; }
  }
  float maxl;
  unsigned int argmax;
  block_argmax(best, best_i, sh.v, sh.idx, &maxl, &argmax);
  if (argmax == 0xffffffffu) argmax = 0;  // every logit NaN
  r.m = maxl / r.t;
  double part = 0.0;
  for (unsigned int i = threadIdx.x; i < vocab; i += BLOCK) part += mass(r, scaled(r, i));
  const double total = block_sum(part, sh.red);
  const double lse = (double)r.m + log(total);
  unsigned int pick;
  if (greedy) {
    pick = argmax;
  } else if (!(top_k > 0 && top_k < vocab) && !(top_p < 1.0)) {
    // The whole distribution, in index order: the first i with u < Σ_{j<=i} e_j / total.
    const double target = u[row];
    const unsigned int chunk = (vocab + BLOCK - 1) / BLOCK;
    const unsigned int lo = threadIdx.x * chunk;
    const unsigned int hi = min(lo + chunk, vocab);
    double mine = 0.0;
    for (unsigned int i = lo; i < hi; ++i) mine += mass(r, scaled(r, i)) / total;
    double all;
    const double before = block_exclusive_scan(mine, sh.red, &all);
    if (threadIdx.x == 0) sh.pick = vocab - 1;
    __syncthreads();
    if (lo < hi && before + mine > target) {
      unsigned int found = hi - 1;
      double acc = before;
      for (unsigned int i = lo; i < hi; ++i) {
        acc += mass(r, scaled(r, i)) / total;
        if (target < acc) { found = i; break; }
      }
      atomicMin(&sh.pick, found);
    }
    __syncthreads();
    pick = sh.pick;
  } else {
    Prefix p = {0u, 0xffffffffu};
    if (top_k > 0 && top_k < vocab) p = select(r, p, false, (double)top_k, false, &sh);
    if (top_p < 1.0) {
      const double kept = prefix_mass(r, p, &sh);
      p = select(r, p, true, top_p * kept, false, &sh);
    }
    const double kept = prefix_mass(r, p, &sh);
    pick = select(r, p, true, u[row] * kept, true, &sh).index;
  }
  if (threadIdx.x == 0) {
    tokens[row] = pick;
    log_probs[row] = (float)((double)scaled(r, pick) - lse);
  }
}
