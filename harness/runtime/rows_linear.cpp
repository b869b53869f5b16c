// A Linear over fp32 or bf16 weights packed once into panels of eight output features ([N/8, K, 8]: a panel's K
// rows of eight weights lie one after another), read as one stream per panel. Each output is one fp32 sum, built by
// fused multiply-adds in input-feature order from zero whatever tile computes it, so a row's result never depends
// on how many rows share the call: drafts verified together get the logits steps of their own would. A bf16 panel
// is widened to fp32 as it is read, so a decode step reads half an fp32 model's bytes.
//
// Tiles: one token row against eight panels (a decode step: eight independent sums hide the multiply-add's latency,
// the weights stream once) or up to four token rows against three panels (a verify or a prompt: each weight read
// serves four rows; 12 sums, three weights and a broadcast fill AVX2's 16 registers).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "rows_load.h"

namespace {

using rows::load;

// ROWS token rows (x: [ROWS, K] at stride K) against PANELS consecutive panels; out at stride N.
template <int ROWS, int PANELS, typename W>
inline void tile(const float* x, const W* panels, int64_t K, const float* bias, float* out, int64_t N) {
  __m256 acc[ROWS][PANELS];
  #pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r)
    #pragma GCC unroll 8
    for (int p = 0; p < PANELS; ++p) acc[r][p] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m256 w[PANELS];
    #pragma GCC unroll 8
    for (int p = 0; p < PANELS; ++p) w[p] = load(panels + (p * K + k) * 8);
    #pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) {
      const __m256 xr = _mm256_broadcast_ss(x + r * K + k);
      #pragma GCC unroll 8
      for (int p = 0; p < PANELS; ++p) acc[r][p] = _mm256_fmadd_ps(w[p], xr, acc[r][p]);
    }
  }
  #pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r)
    #pragma GCC unroll 8
    for (int p = 0; p < PANELS; ++p) {
      __m256 sum = acc[r][p];
      if (bias) sum = _mm256_add_ps(sum, _mm256_loadu_ps(bias + 8 * p));
      _mm256_storeu_ps(out + r * N + 8 * p, sum);
    }
}

// Token rows in tiles of four (the last tile smaller) against the PANELS panels from `panels` on.
template <int PANELS, typename W>
inline void rows_tiles(const float* x, int64_t R, const W* panels, int64_t K, const float* bias, float* out,
                       int64_t N) {
  int64_t r = 0;
  for (; r + 4 <= R; r += 4) tile<4, PANELS>(x + r * K, panels, K, bias, out + r * N, N);
  if (R - r == 3) tile<3, PANELS>(x + r * K, panels, K, bias, out + r * N, N);
  if (R - r == 2) tile<2, PANELS>(x + r * K, panels, K, bias, out + r * N, N);
  if (R - r == 1) tile<1, PANELS>(x + r * K, panels, K, bias, out + r * N, N);
}

template <typename W>
void rows_times_panels(const float* x, const W* panels, const float* bias, float* out, int64_t R, int64_t K,
                       int64_t N) {
  const int64_t P = N / 8, group = R == 1 ? 8 : 3;  // panels a tile reads at once
  at::parallel_for(0, (P + group - 1) / group, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t g = lo; g < hi; ++g) {
      int64_t p = g * group;
      const int64_t end = std::min(P, p + group);
      auto at = [&](int64_t q) {  // panel q's weights, bias and first output
        return std::make_tuple(panels + q * K * 8, bias ? bias + 8 * q : nullptr, out + 8 * q);
      };
      if (end - p == 8) {
        auto [w, b, o] = at(p);
        tile<1, 8>(x, w, K, b, o, N);
        continue;
      }
      for (; p + 3 <= end; p += 3) {
        auto [w, b, o] = at(p);
        rows_tiles<3>(x, R, w, K, b, o, N);
      }
      for (; p < end; ++p) {
        auto [w, b, o] = at(p);
        rows_tiles<1>(x, R, w, K, b, o, N);
      }
    }
  });
}

}  // namespace

at::Tensor rows_linear(const at::Tensor& x, const at::Tensor& panels, const c10::optional<at::Tensor>& bias) {
  const bool bf16 = panels.scalar_type() == at::kBFloat16;
  TORCH_CHECK((bf16 || panels.scalar_type() == at::kFloat) && panels.dim() == 3 && panels.size(2) == 8 &&
                  panels.is_contiguous(),
              "rows_linear takes contiguous fp32 or bf16 panels [N/8, K, 8] (pack_rows)");
  const at::Tensor rows = x.reshape({-1, x.size(-1)}).to(at::kFloat).contiguous();
  const at::Tensor b = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const int64_t R = rows.size(0), K = rows.size(1), N = panels.size(0) * 8;
  TORCH_CHECK(K == panels.size(1), "rows_linear: input features ", K, " against the weight's ", panels.size(1));
  at::Tensor out = at::empty({R, N}, rows.options());
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  if (bf16)
    rows_times_panels(rows.data_ptr<float>(), panels.data_ptr<at::BFloat16>(), bp, out.data_ptr<float>(), R, K, N);
  else
    rows_times_panels(rows.data_ptr<float>(), panels.data_ptr<float>(), bp, out.data_ptr<float>(), R, K, N);
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = N;
  return out.to(x.scalar_type()).view(shape);
}

TORCH_LIBRARY(spd_bench, m) { m.def("rows_linear(Tensor x, Tensor panels, Tensor? bias) -> Tensor"); }
TORCH_LIBRARY_IMPL(spd_bench, CPU, m) { m.impl("rows_linear", &rows_linear); }
