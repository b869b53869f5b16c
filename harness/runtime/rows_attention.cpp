// Attention for CPU that computes each query row on its own over exactly the keys it sees, in slot order, so a row's
// result depends neither on the rows beside it nor on the masked keys after its own: a verify row sees more slots
// than the step that would have produced it, and a kernel that sums over the call's whole key range (torch's, in
// blocks sized by the call) rounds it differently. In fp32 that difference is an ulp that rarely flips a token; in
// bf16 the layer's output is rounded to bf16, so it reaches the logits, and drafts verified together would get other
// tokens than greedy AR's steps. Scores, their exponentials and the weighted values are fp32 sums in a fixed order;
// q, k and v are read as fp32 or widened from bf16.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "rows_load.h"

#include <cmath>
#include <limits>
#include <vector>

namespace {

using rows::load;
using rows::reduce;

// q (fp32, D values) against one key: two 8-lane partial sums over alternate blocks of eight, added in a fixed order.
template <typename T>
inline float dot(const float* q, const T* k, int64_t D) {
  __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    even = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load(k + d), even);
    odd = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), load(k + d + 8), odd);
  }
  if (d < D) even = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load(k + d), even);
  return reduce(_mm256_add_ps(even, odd));
}

struct Strides {
  int64_t b, h, s;
};

template <typename T>
void attend(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const bool* mask, float scale,
            at::Tensor& out) {
  const int64_t B = query.size(0), H = query.size(1), Tq = query.size(2), D = query.size(3);
  const int64_t Hkv = key.size(1), S = key.size(2), group = H / Hkv;
  const Strides qs{query.stride(0), query.stride(1), query.stride(2)};
  const Strides ks{key.stride(0), key.stride(1), key.stride(2)};
  const Strides vs{value.stride(0), value.stride(1), value.stride(2)};
  const T* qp = query.data_ptr<T>();
  const T* kp = key.data_ptr<T>();
  const T* vp = value.data_ptr<T>();
  float* op = out.data_ptr<float>();  // [B, Tq, H, D]
  at::parallel_for(0, B * H * Tq, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> q(D), scores(S);
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t b = task / (H * Tq), h = task / Tq % H, t = task % Tq;
      const T* qrow = qp + b * qs.b + h * qs.h + t * qs.s;
      for (int64_t d = 0; d < D; ++d) q[d] = static_cast<float>(qrow[d]);
      const T* keys = kp + b * ks.b + (h / group) * ks.h;
      const T* values = vp + b * vs.b + (h / group) * vs.h;
      const bool* seen = mask ? mask + t * S : nullptr;
      const int64_t last = S - Tq + t;  // without a mask a row sees the slots up to its own (the call's last ones)
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < S; ++j) {
        if (seen ? !seen[j] : j > last) continue;
        scores[j] = dot(q.data(), keys + j * ks.s, D) * scale;
        top = std::max(top, scores[j]);
      }
      float* o = op + ((b * Tq + t) * H + h) * D;
      for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
      float total = 0.f;
      for (int64_t j = 0; j < S; ++j) {
        if (seen ? !seen[j] : j > last) continue;
        const float e = std::exp(scores[j] - top);
        total += e;
        const __m256 ev = _mm256_set1_ps(e);
        const T* v = values + j * vs.s;
        for (int64_t d = 0; d < D; d += 8)
          _mm256_storeu_ps(o + d, _mm256_fmadd_ps(ev, load(v + d), _mm256_loadu_ps(o + d)));
      }
      const float inverse = total > 0.f ? 1.f / total : 0.f;  // a row that sees nothing gives zeros, not NaNs
      for (int64_t d = 0; d < D; ++d) o[d] *= inverse;
    }
  });
}

}  // namespace

// query [B, H, Tq, D], key and value [B, Hkv, S, D] (H a multiple of Hkv, D a positive multiple of 8), mask:
// boolean [Tq, S] (broadcast over batch and heads) or none (each row sees the slots up to its own, the call's rows
// being the last Tq slots, so S >= Tq), all on the CPU. Every size the loops read by is checked here, so a caller's
// mistake is one error, never a read past a buffer. Returns [B, Tq, H, D] in the query's dtype, as HF's attention
// functions do.
at::Tensor rows_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                          const c10::optional<at::Tensor>& mask, double scale) {
  const auto dtype = query.scalar_type();
  TORCH_CHECK(query.device().is_cpu() && key.device().is_cpu() && value.device().is_cpu() &&
                  (!mask.has_value() || mask->device().is_cpu()),
              "rows_attention runs on CPU tensors only");
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && key.scalar_type() == dtype &&
                  value.scalar_type() == dtype,
              "rows_attention takes fp32 or bf16 query, key and value of one dtype");
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4,
              "rows_attention: query [B, H, T, D], key and value [B, Hkv, S, D], got ", query.sizes(), ", ",
              key.sizes(), ", ", value.sizes());
  const int64_t B = query.size(0), H = query.size(1), Tq = query.size(2), D = query.size(3);
  TORCH_CHECK(D > 0 && D % 8 == 0, "rows_attention: the head dimension (", D, ") is not a positive multiple of 8");
  TORCH_CHECK(key.sizes() == value.sizes(), "rows_attention: key ", key.sizes(), " and value ", value.sizes(),
              " differ");
  TORCH_CHECK(key.size(0) == B && key.size(3) == D, "rows_attention: key and value ", key.sizes(),
              " do not match the query's batch ", B, " and head dimension ", D);
  TORCH_CHECK(key.size(1) > 0 && H % key.size(1) == 0, "rows_attention: ", H, " query heads are not a multiple of ",
              key.size(1), " key heads");
  const int64_t S = key.size(2);
  TORCH_CHECK(mask.has_value() || S >= Tq, "rows_attention: without a mask the ", Tq,
              " query rows are the last of the keys' slots, but there are only ", S);
  const at::Tensor q = query.stride(3) == 1 ? query : query.contiguous();
  const at::Tensor k = key.stride(3) == 1 ? key : key.contiguous();
  const at::Tensor v = value.stride(3) == 1 ? value : value.contiguous();
  at::Tensor seen;
  if (mask.has_value()) {
    TORCH_CHECK(mask->scalar_type() == at::kBool && mask->dim() >= 2 && mask->size(-2) == Tq &&
                    mask->size(-1) == S && mask->numel() == Tq * S,
                "rows_attention: the mask is boolean [Tq, S] = [", Tq, ", ", S, "], shared by batch and heads, got ",
                mask->scalar_type(), " ", mask->sizes());
    seen = mask->reshape({Tq, S}).contiguous();
  }
  at::Tensor out = at::empty({q.size(0), q.size(2), q.size(1), q.size(3)}, q.options().dtype(at::kFloat));
  const bool* mp = seen.defined() ? seen.data_ptr<bool>() : nullptr;
  if (dtype == at::kBFloat16)
    attend<at::BFloat16>(q, k, v, mp, static_cast<float>(scale), out);
  else
    attend<float>(q, k, v, mp, static_cast<float>(scale), out);
  return out.to(dtype);
}

TORCH_LIBRARY_FRAGMENT(spd_bench, m) {
  m.def("rows_attention(Tensor query, Tensor key, Tensor value, Tensor? mask, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(spd_bench, CPU, m) { m.impl("rows_attention", &rows_attention); }
