// AVX2 helpers shared by neuronctl's CPU ops (gemv.cpp, attention.cpp). Part of the kernel
// digest (backends/torch/versions.py), like the two sources.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <type_traits>

namespace neuronctl_simd {

// The sum of a vector's 8 lanes.
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Half h (0 or 1) of a 16-value chunk as 8 floats: float32 as it is (values h*8 .. h*8+7),
// bf16 (uint16_t) as its even (h = 0) or odd (h = 1) elements. A bf16 is the top half of a
// float: even elements shifted up, odd ones masked, no lane crossing. Whatever multiplies
// the result must be in the same order (each 16-chunk as its 8 even then its 8 odd values).
template <typename T>
inline __m256 half8(const T* p, int h) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, uint16_t>);
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(p + h * 8);
  } else {
    __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return h ? _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF0000)))
             : _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  }
}

}  // namespace neuronctl_simd
