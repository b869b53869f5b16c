// Eight weights (or keys, values) as eight fp32 lanes, from fp32 or bf16, and eight lanes' sum in one fixed tree:
// what both row kernels read and add through.
#pragma once
#include <torch/extension.h>
#include <immintrin.h>

namespace rows {

inline __m256 load(const at::BFloat16* p) {  // 8 bf16 -> 8 fp32: the bf16 bits are an fp32's upper half
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline __m256 load(const float* p) { return _mm256_loadu_ps(p); }

inline float reduce(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehdup_ps(s));
  s = _mm_add_ss(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(s);
}

}  // namespace rows
