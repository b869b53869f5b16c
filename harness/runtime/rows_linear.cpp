// A Linear over bf16 weights for CPUs whose oneDNN has no bf16 path (AVX2 without bf16 units): each weight row is
// widened to fp32 as it is read and multiplied into fp32 sums, so a decode step reads half the bytes of an fp32
// model. Every output is summed the same way whatever the call's row count (four 8-lane partial sums over 32-element
// steps, added in a fixed order, then the tail in order), so a row's result never depends on the rows beside it:
// drafts verified together get the logits steps of their own would.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

inline float reduce(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehdup_ps(s));
  s = _mm_add_ss(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(s);
}

inline __m256 widen(const at::BFloat16* p) {  // 8 bf16 -> 8 fp32: the bf16 bits are an fp32's upper half
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// One weight row against ROWS token rows (three at most: four sums each, plus the weight, fit AVX2's 16 registers).
template <int ROWS>
inline void dot(const at::BFloat16* w, const float* x, int64_t K, float* out, int64_t N, const float* bias) {
  __m256 acc[ROWS][4];
  for (int r = 0; r < ROWS; ++r)
    for (int u = 0; u < 4; ++u) acc[r][u] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32)
    for (int u = 0; u < 4; ++u) {
      const __m256 wu = widen(w + k + 8 * u);
      for (int r = 0; r < ROWS; ++r)
        acc[r][u] = _mm256_fmadd_ps(wu, _mm256_loadu_ps(x + r * K + k + 8 * u), acc[r][u]);
    }
  for (int r = 0; r < ROWS; ++r) {
    float s = reduce(_mm256_add_ps(_mm256_add_ps(acc[r][0], acc[r][1]), _mm256_add_ps(acc[r][2], acc[r][3])));
    for (int64_t t = k; t < K; ++t) s += static_cast<float>(w[t]) * x[r * K + t];
    out[r * N] = bias ? s + *bias : s;
  }
}

}  // namespace

at::Tensor rows_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.dim() == 2 && weight.is_contiguous(),
              "rows_linear takes a contiguous 2-D bf16 weight");
  const at::Tensor rows = x.reshape({-1, x.size(-1)}).to(at::kFloat).contiguous();
  const at::Tensor b = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const int64_t R = rows.size(0), K = rows.size(1), N = weight.size(0);
  TORCH_CHECK(K == weight.size(1), "rows_linear: input features ", K, " against the weight's ", weight.size(1));
  at::Tensor out = at::empty({R, N}, rows.options());
  const at::BFloat16* wp = weight.data_ptr<at::BFloat16>();
  const float* xp = rows.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t j = lo; j < hi; ++j) {
      const at::BFloat16* w = wp + j * K;
      const float* bj = bp ? bp + j : nullptr;
      int64_t r = 0;
      for (; r + 3 <= R; r += 3) dot<3>(w, xp + r * K, K, op + r * N + j, N, bj);
      if (R - r == 2) dot<2>(w, xp + r * K, K, op + r * N + j, N, bj);
      if (R - r == 1) dot<1>(w, xp + r * K, K, op + r * N + j, N, bj);
    }
  });
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = N;
  return out.to(x.scalar_type()).view(shape);
}

TORCH_LIBRARY(spd_bench, m) { m.def("rows_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor"); }
TORCH_LIBRARY_IMPL(spd_bench, CPU, m) { m.impl("rows_linear", &rows_linear); }
