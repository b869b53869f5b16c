// Eight weights (or keys, values) as eight fp32 lanes, from fp32 or bf16: what both row kernels read through.
#pragma once
#include <torch/extension.h>
#include <immintrin.h>

namespace rows {

inline __m256 load(const at::BFloat16* p) {  // 8 bf16 -> 8 fp32: the bf16 bits are an fp32's upper half
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline __m256 load(const float* p) { return _mm256_loadu_ps(p); }

}  // namespace rows
