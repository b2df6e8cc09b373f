// neuronctl::attend: one new token's attention over the KV cache (token generation), for
// float32 queries and a float32 or bfloat16 cache, on AVX2 + FMA. Built with gemv.cpp into
// one library (kernel.py).
//
// Why: the traced graph widens the whole bucket of K and V to float32, runs two batched
// matmuls through MKL with a softmax kernel between them: four parallel regions and two
// copies of the cache per layer for a few kilobytes of arithmetic. On a 2-core AVX2 EPYC
// that was 28 us a layer, 0.85 ms of a SmolLM2-135M-shaped decode step (as much as int8
// saves over bf16 on a third of the weights). Here every query head of a group reads its KV
// head's rows once, widened in registers (bf16 as in gemv.cpp: a shift or a mask per 8
// values, the query in the matching even/odd order), in one parallel region.
#include <immintrin.h>
#include <omp.h>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace {
using neuronctl_simd::half8;  // a 16-value chunk of one cache row, as gemv.cpp reads weights
using neuronctl_simd::hsum;

constexpr int kChunk = 16;  // head-dim values per step
constexpr int kHeads = 4;   // query heads one pass carries (accumulators in registers)

// exp(x) for x <= 0, 8 lanes: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its Taylor
// series to r^7 (relative error below 1e-8 there), 2^n built in the exponent bits. Below
// -87 the result would leave the normal range; it is taken at -87 (e^-87 ~ 1e-38 weighs
// nothing beside the row's largest term, which is 1).
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);  // ln2, high bits
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);       // ln2, the rest
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  for (float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// A query in the order half8 gives the cache's values: for bf16 each 16-chunk becomes its 8
// even then its 8 odd elements; float32 stays as it is.
template <typename C>
void query_order(const float* q, int64_t d, float* out) {
  for (int64_t c = 0; c < d; c += kChunk)
    for (int j = 0; j < kChunk; j++)
      out[c + (std::is_same_v<C, float> ? j : (j % 2) * 8 + j / 2)] = q[c + j];
}

// The inverse of query_order for an output row kept as (half 0, half 1) accumulators.
template <typename C>
inline void store_chunk(__m256 h0, __m256 h1, float* out) {
  if constexpr (std::is_same_v<C, float>) {
    _mm256_storeu_ps(out, h0);
    _mm256_storeu_ps(out + 8, h1);
  } else {
    const __m256 lo = _mm256_unpacklo_ps(h0, h1), hi = _mm256_unpackhi_ps(h0, h1);
    _mm256_storeu_ps(out, _mm256_permute2f128_ps(lo, hi, 0x20));
    _mm256_storeu_ps(out + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
  }
}

// scores[h][s] = scale * q_h . k_s for the first `len` rows of one KV head.
template <typename C, int N>
void scores(const float* q, int64_t d, const C* k, int64_t row, int64_t len, float scale,
            int64_t lmax, float* out) {
  for (int64_t s = 0; s < len; s++) {
    const C* ks = k + s * row;
    __m256 acc[N];
    for (int h = 0; h < N; h++) acc[h] = _mm256_setzero_ps();
    for (int64_t c = 0; c < d; c += kChunk) {
#pragma GCC unroll 2
      for (int half = 0; half < 2; half++) {
        const __m256 kv = half8(ks + c, half);
#pragma GCC unroll 4
        for (int h = 0; h < N; h++)
          acc[h] = _mm256_fmadd_ps(kv, _mm256_loadu_ps(q + h * d + c + half * 8), acc[h]);
      }
    }
    for (int h = 0; h < N; h++) out[h * lmax + s] = hsum(acc[h]) * scale;
  }
}

// p[h][s] = exp(score - the row's largest), in place; most[h] and total[h]: that largest
// and the sum of the exps (the part's softmax before normalising, for combine).
void softmax_rows(float* p, int n, int64_t len, int64_t lmax, float* most, float* total) {
  for (int h = 0; h < n; h++) {
    float* row = p + h * lmax;
    const float top = *std::max_element(row, row + len);
    __m256 sum = _mm256_setzero_ps();
    int64_t s = 0;
    for (; s + 8 <= len; s += 8) {
      __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + s), _mm256_set1_ps(top)));
      _mm256_storeu_ps(row + s, e);
      sum = _mm256_add_ps(sum, e);
    }
    float t = hsum(sum);
    if (s < len) {  // the tail through an 8-lane buffer, padded with -inf's stand-in
      alignas(32) float tail[8];
      for (int j = 0; j < 8; j++) tail[j] = s + j < len ? row[s + j] - top : -100.0f;
      _mm256_store_ps(tail, exp8(_mm256_load_ps(tail)));
      for (int64_t j = 0; s + j < len; j++) t += row[s + j] = tail[j];
    }
    most[h] = top;
    total[h] = t;
  }
}

// out[h] = sum_s p[h][s] v_s, one 16-value chunk of the head dim at a time.
template <typename C, int N>
void weighted_sum(const float* p, int64_t lmax, const C* v, int64_t row, int64_t len,
                  int64_t d, float* out) {
  for (int64_t c = 0; c < d; c += kChunk) {
    __m256 acc[N][2];
    for (int h = 0; h < N; h++) acc[h][0] = acc[h][1] = _mm256_setzero_ps();
    for (int64_t s = 0; s < len; s++) {
      const C* vs = v + s * row + c;
      const __m256 v0 = half8(vs, 0), v1 = half8(vs, 1);
#pragma GCC unroll 4
      for (int h = 0; h < N; h++) {
        const __m256 w = _mm256_broadcast_ss(p + h * lmax + s);
        acc[h][0] = _mm256_fmadd_ps(w, v0, acc[h][0]);
        acc[h][1] = _mm256_fmadd_ps(w, v1, acc[h][1]);
      }
    }
    for (int h = 0; h < N; h++) store_chunk<C>(acc[h][0], acc[h][1], out + h * d + c);
  }
}

// What one part of the positions gives each of its query heads: the output before
// normalising, the largest score and the sum of exps (combine puts parts together).
struct Part {
  float* out;    // [heads][d]
  float* most;   // [heads]
  float* total;  // [heads]
};

// N query heads (consecutive, sharing one KV head) against `len` rows of K and V.
template <typename C, int N>
void heads(const float* q, const C* k, const C* v, int64_t row, int64_t len, int64_t d,
           float scale, Part part) {
  thread_local std::vector<float> scratch;  // no allocation per call once grown
  scratch.resize(N * d + N * len);
  float *qo = scratch.data(), *p = qo + N * d;
  for (int h = 0; h < N; h++) query_order<C>(q + h * d, d, qo + h * d);
  scores<C, N>(qo, d, k, row, len, scale, len, p);
  softmax_rows(p, N, len, len, part.most, part.total);
  weighted_sum<C, N>(p, len, v, row, len, d, part.out);
}

template <typename C>
void group(const float* q, const C* k, const C* v, int64_t row, int64_t len, int64_t d,
           int64_t g, float scale, Part part) {
  for (int64_t h = 0; h < g; h += kHeads) {
    const Part ph{part.out + h * d, part.most + h, part.total + h};
    switch (std::min<int64_t>(kHeads, g - h)) {
      case 4: heads<C, 4>(q + h * d, k, v, row, len, d, scale, ph); break;
      case 3: heads<C, 3>(q + h * d, k, v, row, len, d, scale, ph); break;
      case 2: heads<C, 2>(q + h * d, k, v, row, len, d, scale, ph); break;
      default: heads<C, 1>(q + h * d, k, v, row, len, d, scale, ph); break;
    }
  }
}

// One head's output from its parts: each part's sums rescaled to the largest score of all.
void combine(const float* out, const float* most, const float* total, int64_t parts,
             int64_t stride, int64_t d, float* dst) {
  float top = most[0];
  for (int64_t p = 1; p < parts; p++) top = std::max(top, most[p * stride]);
  float weight[64], sum = 0.0f;  // parts <= 64 (parts_for)
  for (int64_t p = 0; p < parts; p++) sum += weight[p] = std::exp(most[p * stride] - top) *
                                                         total[p * stride];
  for (int64_t p = 0; p < parts; p++) weight[p] /= total[p * stride] * sum;
  for (int64_t j = 0; j < d; j++) {
    float acc = 0.0f;
    for (int64_t p = 0; p < parts; p++) acc += weight[p] * out[p * stride * d + j];
    dst[j] = acc;
  }
}

// How many parts each KV head's positions are cut into: enough items for two per thread
// (one (row, KV head) each is three items for two threads at batch 1: one thread did two),
// never parts under 16 positions.
int64_t parts_for(int64_t items, int64_t shortest) {
  const int64_t want = (2 * omp_get_max_threads() + items - 1) / items;
  return std::max<int64_t>(1, std::min<int64_t>({want, shortest / 16, 64}));
}

// q [B, Hq, 1, D] float32; k, v [B, Hkv, S, D] (the bucket's view of the cache: any strides
// but the last); lengths [B]: row b attends to its first lengths[b] positions -> [B, 1, Hq*D].
at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& lengths) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.dim() == 4 && q.size(2) == 1,
              "attend takes float32 queries [B, Hq, 1, D]");
  TORCH_CHECK(k.dim() == 4 && k.sizes() == v.sizes() && k.strides() == v.strides() &&
                  k.scalar_type() == v.scalar_type() && k.stride(3) == 1,
              "attend: K and V are [B, Hkv, S, D] of one dtype, rows contiguous");
  TORCH_CHECK(k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16,
              "attend: the cache is float32 or bfloat16");
  const int64_t b = q.size(0), hq = q.size(1), d = q.size(3), hkv = k.size(1), s = k.size(2);
  TORCH_CHECK(k.size(0) == b && k.size(3) == d && hkv > 0 && hq % hkv == 0 && d % kChunk == 0,
              "attend: shapes do not fit (head dim a multiple of 16, query heads a multiple "
              "of KV heads)");
  auto len = lengths.to(at::kLong).contiguous();
  TORCH_CHECK(len.numel() == b, "attend: one length per row");
  const int64_t* lp = len.data_ptr<int64_t>();
  for (int64_t i = 0; i < b; i++)
    TORCH_CHECK(lp[i] >= 1 && lp[i] <= s, "attend: a length is outside 1..", s);
  auto qc = q.contiguous();
  at::Tensor out = at::empty({b, 1, hq * d}, q.options());
  const float* qp = qc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t g = hq / hkv, row = k.stride(2);
  const int64_t parts = parts_for(b * hkv, *std::min_element(lp, lp + b));
  const int64_t items = b * hkv * parts;
  // Per item: g heads' outputs, largest scores and sums (parts side by side per head).
  std::vector<float> partial(items * g * (d + 2));
  float *po = partial.data(), *pm = po + items * g * d, *pt = pm + items * g;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  auto run = [&](auto* kp, auto* vp) {
#pragma omp parallel if (items > 1)
    {
      // One item per (row, KV head, part): the query heads of a group read its rows once.
#pragma omp for schedule(static)
      for (int64_t i = 0; i < items; i++) {
        const int64_t bi = i / (hkv * parts), h = i / parts % hkv, p = i % parts;
        const int64_t from = lp[bi] * p / parts, to = lp[bi] * (p + 1) / parts;
        const int64_t at = bi * k.stride(0) + h * k.stride(1) + from * row;
        group(qp + (bi * hq + h * g) * d, kp + at, vp + at, row, to - from, d, g, scale,
              Part{po + i * g * d, pm + i * g, pt + i * g});
      }
#pragma omp for schedule(static)
      for (int64_t j = 0; j < b * hq; j++) {  // query head j: its parts are items i..i+parts
        const int64_t first = (j / g) * parts;  // the (row, KV head) of j, part 0
        combine(po + (first * g + j % g) * d, pm + first * g + j % g,
                pt + first * g + j % g, parts, g, d, op + j * d);
      }
    }
  };
  if (k.scalar_type() == at::kFloat)
    run(k.data_ptr<float>(), v.data_ptr<float>());
  else
    run(static_cast<const uint16_t*>(k.data_ptr()), static_cast<const uint16_t*>(v.data_ptr()));
  return out;
}
}  // namespace

// The schema is defined in Python (kernel.py), as linear_blocked's.
TORCH_LIBRARY_IMPL(neuronctl, CPU, m) { m.impl("attend", attend); }
