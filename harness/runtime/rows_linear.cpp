// A Linear over fp32 or bf16 weights packed once into panels of eight output features ([N/8, K, 8]: a panel's K
// rows of eight weights lie one after another), read as one stream per panel. Each output is one fp32 sum, built by
// fused multiply-adds in input-feature order from zero whatever tile computes it, so a row's result never depends
// on how many rows share the call: drafts verified together get the logits steps of their own would. A bf16 panel
// is widened to fp32 as it is read, so a decode step reads half an fp32 model's bytes.
//
// Tiles: one token row against eight panels (a decode step: eight independent sums hide the multiply-add's latency,
// the weights stream once) or up to four token rows against three panels (a verify or a prompt: each weight read
// serves four rows; 12 sums, three weights and a broadcast fill AVX2's 16 registers). Where the CPU has AVX-512,
// several rows take a wider tile instead: up to eight rows against two pairs of panels, a pair's sixteen weights in
// one 512-bit register (32 registers hold its 16 sums). Every lane still sums its output alone in the same order, so
// both tiles give the same bits and a machine with AVX-512 decodes the tokens one without decodes.
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

// The AVX-512 tile: ROWS token rows against PAIRS pairs of consecutive panels (a pair's two eight-weight rows at k
// in one register's low and high halves), out at stride N.
inline __attribute__((target("avx512f"))) __m512 load_pair(const float* a, const float* b) {
  const __m512d low = _mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(a)));
  return _mm512_castpd_ps(_mm512_insertf64x4(low, _mm256_castps_pd(_mm256_loadu_ps(b)), 1));
}

inline __attribute__((target("avx512f"))) __m512 load_pair(const at::BFloat16* a, const at::BFloat16* b) {
  const __m256i h = _mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

template <int ROWS, int PAIRS, typename W>
__attribute__((target("avx512f"))) void tile512(const float* x, const W* panels, int64_t K, const float* bias,
                                                float* out, int64_t N) {
  __m512 acc[ROWS][PAIRS];
  #pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r)
    #pragma GCC unroll 8
    for (int p = 0; p < PAIRS; ++p) acc[r][p] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 w[PAIRS];
    #pragma GCC unroll 8
    for (int p = 0; p < PAIRS; ++p)
      w[p] = load_pair(panels + (2 * p * K + k) * 8, panels + ((2 * p + 1) * K + k) * 8);
    #pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) {
      const __m512 xr = _mm512_set1_ps(x[r * K + k]);
      #pragma GCC unroll 8
      for (int p = 0; p < PAIRS; ++p) acc[r][p] = _mm512_fmadd_ps(w[p], xr, acc[r][p]);
    }
  }
  #pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r)
    #pragma GCC unroll 8
    for (int p = 0; p < PAIRS; ++p) {
      __m512 sum = acc[r][p];
      if (bias) sum = _mm512_add_ps(sum, _mm512_loadu_ps(bias + 16 * p));
      _mm512_storeu_ps(out + r * N + 16 * p, sum);
    }
}

// Token rows in tiles of eight (the last tile smaller) against two pairs of panels from `panels` on.
template <typename W>
void rows_tiles512(const float* x, int64_t R, const W* panels, int64_t K, const float* bias, float* out, int64_t N) {
  int64_t r = 0;
  for (; r + 8 <= R; r += 8) tile512<8, 2>(x + r * K, panels, K, bias, out + r * N, N);
  const float* xr = x + r * K;
  float* o = out + r * N;
  switch (R - r) {
    case 7: tile512<7, 2>(xr, panels, K, bias, o, N); break;
    case 6: tile512<6, 2>(xr, panels, K, bias, o, N); break;
    case 5: tile512<5, 2>(xr, panels, K, bias, o, N); break;
    case 4: tile512<4, 2>(xr, panels, K, bias, o, N); break;
    case 3: tile512<3, 2>(xr, panels, K, bias, o, N); break;
    case 2: tile512<2, 2>(xr, panels, K, bias, o, N); break;
    case 1: tile512<1, 2>(xr, panels, K, bias, o, N); break;
  }
}

bool has_avx512() {
  static const bool yes = (__builtin_cpu_init(), __builtin_cpu_supports("avx512f"));
  return yes;
}

template <typename W>
void rows_times_panels(const float* x, const W* panels, const float* bias, float* out, int64_t R, int64_t K,
                       int64_t N) {
  const bool wide = R > 1 && has_avx512();
  const int64_t P = N / 8, group = R == 1 ? 8 : wide ? 4 : 3;  // panels a tile reads at once
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
      if (wide && end - p == 4) {
        auto [w, b, o] = at(p);
        rows_tiles512(x, R, w, K, b, o, N);
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

// x [..., K] of the panels' dtype (fp32 or bf16), panels [N/8, K, 8] (pack_rows; contiguous, K > 0), bias [N] of
// that dtype or none, all on the CPU: every size the tiles read by is checked here, so a caller's mistake is one
// error, never a read past a buffer. The sums are fp32; `float_out` returns them so (an LM head's logits: rounding
// them to bf16 would make ties the fp32 sums do not have), else in the panels' dtype.
at::Tensor rows_linear(const at::Tensor& x, const at::Tensor& panels, const c10::optional<at::Tensor>& bias,
                       bool float_out) {
  const auto dtype = panels.scalar_type();
  TORCH_CHECK(x.device().is_cpu() && panels.device().is_cpu() && (!bias.has_value() || bias->device().is_cpu()),
              "rows_linear runs on CPU tensors only");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "rows_linear takes fp32 or bf16 panels, got ", dtype);
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == 8 && panels.size(1) > 0 && panels.is_contiguous(),
              "rows_linear takes contiguous panels [N/8, K, 8] with K > 0 (pack_rows), got ", panels.sizes());
  const int64_t K = panels.size(1), N = panels.size(0) * 8;
  TORCH_CHECK(x.scalar_type() == dtype, "rows_linear: x is ", x.scalar_type(), ", the panels ", dtype);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, "rows_linear: x ", x.sizes(), " against panels of ", K,
              " input features");
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == dtype && bias->dim() == 1 && bias->size(0) == N, "rows_linear: the bias ",
                bias->sizes(), " (", bias->scalar_type(), ") is not [", N, "] of the panels' dtype");
  const at::Tensor rows = x.reshape({-1, K}).to(at::kFloat).contiguous();
  const at::Tensor b = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const int64_t R = rows.size(0);
  at::Tensor out = at::empty({R, N}, rows.options());
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  if (dtype == at::kBFloat16)
    rows_times_panels(rows.data_ptr<float>(), panels.data_ptr<at::BFloat16>(), bp, out.data_ptr<float>(), R, K, N);
  else
    rows_times_panels(rows.data_ptr<float>(), panels.data_ptr<float>(), bp, out.data_ptr<float>(), R, K, N);
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = N;
  return (float_out ? out : out.to(dtype)).view(shape);
}

TORCH_LIBRARY(spd_bench, m) {
  m.def("rows_linear(Tensor x, Tensor panels, Tensor? bias, bool float_out=False) -> Tensor");
}
TORCH_LIBRARY_IMPL(spd_bench, CPU, m) { m.impl("rows_linear", &rows_linear); }
