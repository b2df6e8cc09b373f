// neuronctl::linear_blocked and neuronctl::linear_rows: x @ W.T for float32 activations and
// float32, bfloat16 or int8 weights, on AVX2 + FMA, from a blocked or a plain [N, K] weight.
// Built at first use by kernel.py (torch.utils.cpp_extension).
//
// Why: on a CPU without bf16 units, aten and inductor either widen a bf16 matrix to float32
// before every matmul (a full extra write and read of the weights) or widen it lane by lane
// through shuffles at half the memory bandwidth. Here a weight is widened in registers as it
// streams: bf16 by one shift and one mask per 16 values. int8 weights multiply the
// activations as int16 instead (each row scaled to +-32767 once per call, its scale applied
// to the result): one sign extension and one multiply-add sum 16 products exactly in int32,
// a third of the instructions of widening int8 to float, which left int8 short of its bytes.
//
// linear_blocked reads weights blocked at load time (kernel.block): [N/4][K/16][4][16], so the
// 4 rows one thread works on are one sequential stream. linear_rows reads the plain row-major
// [N, K] that aten and oneDNN read too, so one copy of the weights serves whichever path is
// faster at a row count: the same 4 rows are then 4 streams, each prefetched. One code serves
// both layouts; a layout only says where row i's chunk at column k starts (Blocked, Plain).
// On the AVX2 EPYC plain ran 0.85-0.92x blocked for float32 and bf16 at 1 row, 0.52x for int8
// (bench/kernel.py, docs/performance.md). bf16 weights need the activations in their lane
// order (each 16-chunk as its 8 even then its 8 odd elements): copied once per call.
// Rows of x are taken 1, 2 or 3 at a time against each block of 4 weight rows, so one pass
// over the weights serves every row, and larger M (context encoding) keeps the block in L1.
#include <immintrin.h>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace {
using neuronctl_simd::half8;  // one row's 16-column chunk, in the activations' lane order
using neuronctl_simd::hsum;

constexpr int kRows = 4;    // weight rows per block
constexpr int kChunk = 16;  // weight columns per chunk

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// How far ahead (bytes) to prefetch the weights by hand; 0: leave it to the hardware. float32
// streams 256 B per chunk and the hardware prefetcher keeps up (a hint only costs issue
// slots: 10-15 % slower at 512 B); bf16 and int8 chunks (128 and 64 B) do more work per byte
// and gain 5-20 % from a KiB ahead, int8 a few % more from two (its chunks go fastest).
// Measured on an AVX2 AMD EPYC, 2 threads, over one decode step's matrices (SmolLM2-135M
// shape, bench/kernel.py).
template <typename W>
constexpr int kAhead = std::is_same_v<W, float> ? 0 : std::is_same_v<W, int8_t> ? 2048 : 1024;

// Where weight row i (0..3) of a block's 4 rows has its chunk at column k (a multiple of 16),
// from the block's start (w + b * 4 * K elements in both layouts); kp is K.
struct Blocked {  // [N/4][K/16][4][16]: the block's chunks one after another
  template <typename W>
  static const W* at(const W* wb, int64_t kp, int i, int64_t k) {
    return wb + k * kRows + i * kChunk;
  }
};
struct Plain {  // [N][K]: row i of the block K elements after row i - 1
  template <typename W>
  static const W* at(const W* wb, int64_t kp, int i, int64_t k) {
    return wb + i * kp + k;
  }
};

// Plain rows are 4 streams: each gets one hint per cache line of its stream, kAheadRow bytes
// ahead (a quarter of kAhead: as many chunks ahead as the blocked stream, so as long ahead).
template <typename W>
constexpr int kAheadRow = kAhead<W> / kRows;

// Hint the bytes a few chunks past column k of the block into L1 (kAhead, kAheadRow).
template <typename L, typename W>
inline void prefetch(const W* wb, int64_t kp, int64_t k) {
  if constexpr (std::is_same_v<L, Blocked>) {
    if constexpr (kAhead<W> > 0)
      for (int b = 0; b < kRows * kChunk * int(sizeof(W)); b += 64)
        _mm_prefetch(reinterpret_cast<const char*>(L::at(wb, kp, 0, k)) + kAhead<W> + b,
                     _MM_HINT_T0);
  } else if constexpr (kAheadRow<W> > 0) {
    // A row's line holds 2 bf16 or 4 int8 chunks: each chunk hints the next rows in turn, so
    // every row gets one hint a line with no branch. (Hints under a test of k, e.g. "k is
    // at a line", were dropped from the loop by GCC 12 at -O1 and up, condition and all.)
    constexpr int per_line = 64 / (kChunk * sizeof(W));
    constexpr int rows = kRows / per_line;
    const int first = int((k / kChunk) % per_line) * rows;
    for (int j = 0; j < rows; j++)
      _mm_prefetch(reinterpret_cast<const char*>(L::at(wb, kp, first + j, k)) + kAheadRow<W>,
                   _MM_HINT_T0);
  }
}

// What the activations are multiplied as: int16 for int8 weights, float32 otherwise.
template <typename W>
using Act = std::conditional_t<std::is_same_v<W, int8_t>, int16_t, float>;

// acc[i][m] = lane sums of weight row i times activation row m over the whole K.
template <typename L, typename W, int MG>
inline void block_dot(const float* xs, int64_t kp, const W* wb, __m256 (&acc)[kRows][MG]) {
  for (int i = 0; i < kRows; i++)
    for (int m = 0; m < MG; m++) acc[i][m] = _mm256_setzero_ps();
  for (int64_t k = 0; k < kp; k += kChunk) {
    prefetch<L>(wb, kp, k);
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
      __m256 xv[MG];
#pragma GCC unroll 4
      for (int m = 0; m < MG; m++) xv[m] = _mm256_loadu_ps(xs + m * kp + k + h * 8);
#pragma GCC unroll 4
      for (int i = 0; i < kRows; i++) {
        __m256 wv = half8(L::at(wb, kp, i, k), h);
#pragma GCC unroll 4
        for (int m = 0; m < MG; m++) acc[i][m] = _mm256_fmadd_ps(wv, xv[m], acc[i][m]);
      }
    }
  }
}

// int8 weights by int16 activations. A lane's int32 sum gains at most 2 * 128 * 32767 per
// chunk, so sums move into float every kSpan chunks, far below 2^31.
constexpr int64_t kSpan = 128;

template <typename L, int MG>
inline void block_dot_i8(const int16_t* xs, int64_t kp, const int8_t* wb,
                         __m256 (&acc)[kRows][MG]) {
  for (int i = 0; i < kRows; i++)
    for (int m = 0; m < MG; m++) acc[i][m] = _mm256_setzero_ps();
  for (int64_t k0 = 0; k0 < kp; k0 += kSpan * kChunk) {
    __m256i sum[kRows][MG];
    for (int i = 0; i < kRows; i++)
      for (int m = 0; m < MG; m++) sum[i][m] = _mm256_setzero_si256();
    const int64_t k1 = std::min(kp, k0 + kSpan * kChunk);
    for (int64_t k = k0; k < k1; k += kChunk) {
      prefetch<L>(wb, kp, k);
      __m256i xv[MG];
#pragma GCC unroll 4
      for (int m = 0; m < MG; m++)
        xv[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs + m * kp + k));
#pragma GCC unroll 4
      for (int i = 0; i < kRows; i++) {
        __m256i wv = _mm256_cvtepi8_epi16(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(L::at(wb, kp, i, k))));
#pragma GCC unroll 4
        for (int m = 0; m < MG; m++)
          sum[i][m] = _mm256_add_epi32(sum[i][m], _mm256_madd_epi16(wv, xv[m]));
      }
    }
    for (int i = 0; i < kRows; i++)
      for (int m = 0; m < MG; m++)
        acc[i][m] = _mm256_add_ps(acc[i][m], _mm256_cvtepi32_ps(sum[i][m]));
  }
}

// block_dot_i8 for one activation row (token generation at batch 1), two chunks a step. The
// sums are four named registers, tied to themselves once a step: with an array of them GCC 12
// added into fresh registers and copied each back, a third more vector instructions in a
// loop that is bound by them. 8-12 % faster over a decode step's matrices.
template <typename L>
inline void block_dot_i8_row(const int16_t* xs, int64_t kp, const int8_t* wb,
                             __m256 (&acc)[kRows][1]) {
  auto product = [&](int64_t k, int i, __m256i x) {
    const int8_t* p = L::at(wb, kp, i, k);
    return _mm256_madd_epi16(
        _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), x);
  };
  for (int i = 0; i < kRows; i++) acc[i][0] = _mm256_setzero_ps();
  for (int64_t k0 = 0; k0 < kp; k0 += kSpan * kChunk) {
    __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
    const int64_t k1 = std::min(kp, k0 + kSpan * kChunk);
    int64_t k = k0;
    for (; k + 2 * kChunk <= k1; k += 2 * kChunk) {
      prefetch<L>(wb, kp, k);
      prefetch<L>(wb, kp, k + kChunk);
      const __m256i xa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs + k));
      const __m256i xb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs + k + kChunk));
      const int64_t k2 = k + kChunk;
      s0 = _mm256_add_epi32(s0, _mm256_add_epi32(product(k, 0, xa), product(k2, 0, xb)));
      s1 = _mm256_add_epi32(s1, _mm256_add_epi32(product(k, 1, xa), product(k2, 1, xb)));
      s2 = _mm256_add_epi32(s2, _mm256_add_epi32(product(k, 2, xa), product(k2, 2, xb)));
      s3 = _mm256_add_epi32(s3, _mm256_add_epi32(product(k, 3, xa), product(k2, 3, xb)));
      asm("" : "+x"(s0), "+x"(s1), "+x"(s2), "+x"(s3));
    }
    if (k < k1) {  // an odd chunk left in this span
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs + k));
      s0 = _mm256_add_epi32(s0, product(k, 0, x));
      s1 = _mm256_add_epi32(s1, product(k, 1, x));
      s2 = _mm256_add_epi32(s2, product(k, 2, x));
      s3 = _mm256_add_epi32(s3, product(k, 3, x));
    }
    acc[0][0] = _mm256_add_ps(acc[0][0], _mm256_cvtepi32_ps(s0));
    acc[1][0] = _mm256_add_ps(acc[1][0], _mm256_cvtepi32_ps(s1));
    acc[2][0] = _mm256_add_ps(acc[2][0], _mm256_cvtepi32_ps(s2));
    acc[3][0] = _mm256_add_ps(acc[3][0], _mm256_cvtepi32_ps(s3));
  }
}

// Each row of x as int16, its largest magnitude at 32767 (never -32768: no madd overflows);
// scale[r] takes the row back. k is a multiple of 16.
void to_int16(const float* x, int64_t rows, int64_t k, int16_t* q, float* scale) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t r = 0; r < rows; r++) {
    const float* xr = x + r * k;
    __m256 big = _mm256_setzero_ps();
    for (int64_t j = 0; j < k; j += 8)
      big = _mm256_max_ps(big, _mm256_andnot_ps(sign, _mm256_loadu_ps(xr + j)));
    const float most = hmax(big);
    scale[r] = most / 32767.0f;
    const __m256 inv = _mm256_set1_ps(most > 0 ? 32767.0f / most : 0.0f);
    for (int64_t j = 0; j < k; j += 16) {
      __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xr + j), inv));
      __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xr + j + 8), inv));
      // packs interleaves the 128-bit halves; the permute puts the 16 values back in order.
      __m256i both = _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + r * k + j), both);
    }
  }
}

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// wscale: one bf16 per output row (int8 weights), read as it is: no converted copy per call.
// xscale: one float per activation row (int16 activations), else none.
template <typename L, typename W, int MG>
inline void store(const Act<W>* xs, const float* xscale, int64_t kp, const W* wb, int64_t n0,
                  int64_t n, const uint16_t* wscale, float* out) {
  __m256 acc[kRows][MG];
  if constexpr (std::is_same_v<W, int8_t> && MG == 1)
    block_dot_i8_row<L>(xs, kp, wb, acc);
  else if constexpr (std::is_same_v<W, int8_t>)
    block_dot_i8<L, MG>(xs, kp, wb, acc);
  else
    block_dot<L, W, MG>(xs, kp, wb, acc);
  for (int i = 0; i < kRows; i++)
    for (int m = 0; m < MG; m++) {
      float s = hsum(acc[i][m]);
      if (xscale) s *= xscale[m];
      out[m * n + n0 + i] = wscale ? s * bf16_to_float(wscale[n0 + i]) : s;
    }
}

// Every activation row against one block: threes while they last (12 accumulators fit the
// 16 registers), then the remainder.
template <typename L, typename W>
void one_block(const Act<W>* xs, const float* xscale, int64_t m_rows, int64_t kp, const W* wb,
               int64_t n0, int64_t n, const uint16_t* wscale, float* out) {
  auto at = [&](int64_t m) { return xscale ? xscale + m : nullptr; };
  int64_t m = 0;
  for (; m + 3 <= m_rows; m += 3)
    store<L, W, 3>(xs + m * kp, at(m), kp, wb, n0, n, wscale, out + m * n);
  if (m_rows - m == 2) store<L, W, 2>(xs + m * kp, at(m), kp, wb, n0, n, wscale, out + m * n);
  if (m_rows - m == 1) store<L, W, 1>(xs + m * kp, at(m), kp, wb, n0, n, wscale, out + m * n);
}

template <typename L, typename W>
void run(const Act<W>* xs, const float* xscale, int64_t m_rows, int64_t kp, const W* w,
         int64_t n, const uint16_t* wscale, float* out) {
  int64_t blocks = n / kRows;
  // Block b's rows start at w + b * 4 * K in either layout. OpenMP, as inductor's own kernels: the team torch.set_num_threads sized. (at::parallel_for
  // measured 1.5x slower here for these ~10 us calls.)
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; b++)
    one_block<L, W>(xs, xscale, m_rows, kp, w + b * kRows * kp, b * kRows, n, wscale, out);
}

// x [..., K] float32 times w, in layout L, of n rows and kp columns (checked by the callers);
// scale [N] (int8 weights) or none -> [..., N]. `op` names the op in errors.
template <typename L>
at::Tensor multiply(const char* op, const at::Tensor& x, const at::Tensor& w, int64_t n,
                    int64_t kp, const std::optional<at::Tensor>& scale) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, op, " takes float32 activations");
  const int64_t k = x.size(-1);
  TORCH_CHECK(k == kp, op, ": activations have ", k, " columns, weights ", kp);
  const int64_t m_rows = k ? x.numel() / k : 0;
  auto xc = x.contiguous();
  const float* xs = xc.data_ptr<float>();
  std::vector<float> split;
  if (w.scalar_type() == at::kBFloat16) {  // the lane order half8 gives bf16 weights
    split.resize(m_rows * k);
    for (int64_t r = 0; r < m_rows * k; r += kChunk)
      for (int j = 0; j < kChunk; j++) split[r + (j % 2) * 8 + j / 2] = xs[r + j];
    xs = split.data();
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor out = at::empty(shape, x.options());
  at::Tensor sc;
  const uint16_t* sp = nullptr;
  if (scale.has_value()) {
    TORCH_CHECK(scale->numel() == n, op, ": one scale per output row (", n, "), got ",
                scale->numel());
    sc = scale->to(at::kBFloat16).contiguous();  // a no-op for the bf16 scales graphs pass
    sp = static_cast<const uint16_t*>(sc.data_ptr());
  }
  float* o = out.data_ptr<float>();
  switch (w.scalar_type()) {
    case at::kFloat:
      run<L, float>(xs, nullptr, m_rows, kp, w.data_ptr<float>(), n, sp, o);
      break;
    case at::kBFloat16:
      run<L, uint16_t>(xs, nullptr, m_rows, kp, static_cast<const uint16_t*>(w.data_ptr()), n,
                       sp, o);
      break;
    case at::kChar: {
      std::vector<int16_t> q(m_rows * k);
      std::vector<float> xscale(m_rows);
      to_int16(xs, m_rows, k, q.data(), xscale.data());
      run<L, int8_t>(q.data(), xscale.data(), m_rows, kp, w.data_ptr<int8_t>(), n, sp, o);
      break;
    }
    default:
      TORCH_CHECK(false, op, ": weights are float32, bfloat16 or int8, not ", w.scalar_type());
  }
  return out;
}

// w blocked [N/4, K/16, 4, 16] (kernel.block).
at::Tensor linear_blocked(const at::Tensor& x, const at::Tensor& w,
                          const std::optional<at::Tensor>& scale) {
  TORCH_CHECK(w.dim() == 4 && w.size(2) == kRows && w.size(3) == kChunk && w.is_contiguous(),
              "linear_blocked: the weight is not blocked [N/4, K/16, 4, 16] (kernel.block); "
              "a plain [N, K] weight goes to linear_rows");
  return multiply<Blocked>("linear_blocked", x, w, w.size(0) * kRows, w.size(1) * kChunk,
                           scale);
}

// w plain row-major [N, K], N a multiple of 4 and K of 16 (kernel.fits).
at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& w,
                       const std::optional<at::Tensor>& scale) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(),
              "linear_rows: the weight is not a contiguous [N, K] matrix (got ", w.dim(),
              " dimensions", w.is_contiguous() ? "" : ", not contiguous",
              "); a blocked weight goes to linear_blocked");
  TORCH_CHECK(w.size(0) % kRows == 0 && w.size(1) % kChunk == 0, "linear_rows: a [",
              w.size(0), ", ", w.size(1), "] weight does not fit: N must be a multiple of ",
              kRows, " and K of ", kChunk, " (kernel.fits); use F.linear for this one");
  return multiply<Plain>("linear_rows", x, w, w.size(0), w.size(1), scale);
}
}  // namespace

// The schema is defined in Python (kernel.py) with its shape function, so graphs trace
// and export without this library; serving loads it before any graph.
TORCH_LIBRARY_IMPL(neuronctl, CPU, m) {
  m.impl("linear_blocked", linear_blocked);
  m.impl("linear_rows", linear_rows);
}
