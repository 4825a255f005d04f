// The decode step's small operations, one call each instead of a chain of torch ops:
//
// * rms_norm: y = (x * rsqrt(mean(x^2) + eps)).to(dtype) * weight, float32 inside (the
//   rounding order of Hugging Face's LlamaRMSNorm); add_rms_norm adds the residual first.
// * silu_and_mul: the gated MLP's silu(gate) * up on the fused gate|up projection's output.
// * rotary: rotary embeddings on Q and K of a longer query (a prompt's chunk), in torch's rounding.
// * paged_decode_attention, rotary_decode_attention: decode_attention.h's kernel, for float32,
//   bfloat16 or int8 caches.
//
// Tensors are float32 or bfloat16 on the CPU (the cache also int8); build.py compiles this for
// the host CPU.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "decode_attention.h"
#include "simd.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

// With residual: sum = (x + residual).to(dtype) is written, and normalized instead of x (the
// residual stream's add before a Llama norm, in torch's rounding). Vectors of kLanes, the rest of
// a row one value at a time.
template <typename T>
void rms_norm_rows(const T* x, const T* residual, const T* weight, T* sum, T* y, int64_t rows, int64_t hidden,
                   float eps) {
  const int64_t full = hidden / kLanes * kLanes;
  const T* tag = nullptr;
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * hidden;
      const T* rr = residual ? residual + r * hidden : nullptr;
      T* sr = residual ? sum + r * hidden : nullptr;
      Vec squares = vzero();
      for (int64_t i = 0; i < full; i += kLanes) {
        Vec v = vload(xr + i);
        if (rr) {
          v = vround_to(vadd(v, vload(rr + i)), tag);
          vstore_as(sr + i, v);
        }
        squares = vfma(v, v, squares);
      }
      float sum_sq = vsum(squares);
      for (int64_t i = full; i < hidden; ++i) {
        float v = to_float(xr[i]);
        if (rr) {
          sr[i] = static_cast<T>(v + to_float(rr[i]));
          v = to_float(sr[i]);
        }
        sum_sq += v * v;
      }
      if (rr) xr = sr;
      const float inv_rms = 1.f / std::sqrt(sum_sq / static_cast<float>(hidden) + eps);
      const Vec scale = vbroadcast(inv_rms);
      T* yr = y + r * hidden;
      for (int64_t i = 0; i < full; i += kLanes) {
        const Vec normed = vround_to(vmul(vload(xr + i), scale), tag);
        vstore_as(yr + i, vround_to(vmul(normed, vload(weight + i)), tag));
      }
      for (int64_t i = full; i < hidden; ++i) {
        const float normed = to_float(static_cast<T>(to_float(xr[i]) * inv_rms));
        yr[i] = static_cast<T>(normed * to_float(weight[i]));
      }
    }
  });
}

void check_norm(const torch::Tensor& x, const torch::Tensor& weight) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), "rms_norm: x must be a contiguous CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "rms_norm: float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous(),
              "rms_norm: weight must be contiguous and of x's dtype");
  TORCH_CHECK(weight.numel() == x.size(-1), "rms_norm: weight has ", weight.numel(), " values, x ", x.size(-1));
}

template <typename F>
void for_dtype(const torch::Tensor& x, F&& f) {
  if (x.scalar_type() == at::kFloat) f(static_cast<float*>(nullptr));
  else f(static_cast<at::BFloat16*>(nullptr));
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_norm(x, weight);
  const int64_t hidden = x.size(-1), rows = hidden ? x.numel() / hidden : 0;
  auto y = torch::empty_like(x);
  for_dtype(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rms_norm_rows<T>(x.data_ptr<T>(), nullptr, weight.data_ptr<T>(), nullptr, y.data_ptr<T>(), rows, hidden, eps);
  });
  return y;
}

std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  check_norm(x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() && residual.is_contiguous(),
              "add_rms_norm: residual must be contiguous, of x's shape and dtype");
  const int64_t hidden = x.size(-1), rows = hidden ? x.numel() / hidden : 0;
  auto sum = torch::empty_like(x), y = torch::empty_like(x);
  for_dtype(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rms_norm_rows<T>(x.data_ptr<T>(), residual.data_ptr<T>(), weight.data_ptr<T>(), sum.data_ptr<T>(),
                     y.data_ptr<T>(), rows, hidden, eps);
  });
  return {sum, y};
}

// silu(gate).to(dtype) * up, rounded to dtype, for [rows, 2 * n] = [gate | up] (torch's rounding).
template <typename T>
void silu_and_mul_rows(const T* gate_up, T* out, int64_t rows, int64_t n) {
  const T* tag = nullptr;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = gate_up + r * 2 * n;
      const T* up = gate + n;
      T* o = out + r * n;
      int64_t i = 0;
      for (; i + kLanes <= n; i += kLanes)
        vstore_as(o + i, vround_to(vmul(vround_to(vsilu(vload(gate + i)), tag), vload(up + i)), tag));
      for (; i < n; ++i) {
        const float g = to_float(gate[i]);
        o[i] = static_cast<T>(to_float(static_cast<T>(g / (1.f + std::exp(-g)))) * to_float(up[i]));
      }
    }
  });
}

torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.is_contiguous() && gate_up.size(-1) % 2 == 0,
              "silu_and_mul: a contiguous CPU [..., 2 * n] tensor");
  TORCH_CHECK(gate_up.scalar_type() == at::kFloat || gate_up.scalar_type() == at::kBFloat16,
              "silu_and_mul: float32 or bfloat16, got ", gate_up.scalar_type());
  const int64_t n = gate_up.size(-1) / 2, rows = n ? gate_up.numel() / (2 * n) : 0;
  auto sizes = gate_up.sizes().vec();
  sizes.back() = n;
  auto out = torch::empty(sizes, gate_up.options());
  for_dtype(gate_up, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    silu_and_mul_rows<T>(gate_up.data_ptr<T>(), out.data_ptr<T>(), rows, n);
  });
  return out;
}

// Rotary embeddings on [rows, heads, head_dim] (heads contiguous in a row, rows `row_stride` apart):
// x * cos + roll(x, head_dim / 2) * sin_signed, each product and the sum rounded to T as torch's
// three ops round them (apply_rotary in cluster/models/layers/rotary.py), into a contiguous out. No
// contraction of a product and the sum into one FMA: float32 too keeps torch's two roundings.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
template <typename T>
void rotary_rows(const T* x, int64_t row_stride, const T* cos, const T* sin_signed, T* out, int64_t rows,
                 int64_t heads, int64_t head_dim) {
  const T* tag = nullptr;
  const int64_t half = head_dim / 2;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* c = cos + r * head_dim;
      const T* s = sin_signed + r * head_dim;
      for (int64_t h = 0; h < heads; ++h) {
        const T* xh = x + r * row_stride + h * head_dim;
        T* oh = out + (r * heads + h) * head_dim;
        int64_t d = 0;
        for (; d + kLanes <= half; d += kLanes) {
          const Vec lo = vload(xh + d), hi = vload(xh + half + d);
          const Vec lo_c = vround_to(vmul(lo, vload(c + d)), tag), hi_s = vround_to(vmul(hi, vload(s + d)), tag);
          vstore_as(oh + d, vround_to(vadd(lo_c, hi_s), tag));
          const Vec hi_c = vround_to(vmul(hi, vload(c + half + d)), tag);
          const Vec lo_s = vround_to(vmul(lo, vload(s + half + d)), tag);
          vstore_as(oh + half + d, vround_to(vadd(hi_c, lo_s), tag));
        }
        for (; d < half; ++d) {
          for (const int64_t i : {d, d + half}) {
            const int64_t partner = i < half ? i + half : i - half;
            const float a = to_float(static_cast<T>(to_float(xh[i]) * to_float(c[i])));
            const float b = to_float(static_cast<T>(to_float(xh[partner]) * to_float(s[i])));
            oh[i] = static_cast<T>(a + b);
          }
        }
      }
    }
  });
}
#pragma GCC pop_options

torch::Tensor rotary(torch::Tensor x, torch::Tensor cos, torch::Tensor sin_signed) {
  // x: [rows, heads, head_dim] with contiguous heads (a column range of the fused QKV output);
  // cos, sin_signed: [rows, 1, head_dim] (see cluster/models/layers/rotary.py).
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3, "rotary: x must be a CPU [rows, heads, head_dim] tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "rotary: float32 or bfloat16, got ", x.scalar_type());
  const int64_t rows = x.size(0), heads = x.size(1), head_dim = x.size(2);
  TORCH_CHECK(head_dim % 2 == 0, "rotary: head_dim must be even, got ", head_dim);
  TORCH_CHECK(rows <= 1 || x.stride(0) >= heads * head_dim, "rotary: rows of x overlap");
  TORCH_CHECK(x.stride(2) == 1 && (heads <= 1 || x.stride(1) == head_dim),
              "rotary: each row's heads must be contiguous");
  for (const auto& t : {cos, sin_signed})
    TORCH_CHECK(t.scalar_type() == x.scalar_type() && t.is_contiguous() && t.numel() == rows * head_dim,
                "rotary: cos and sin must be contiguous [rows, 1, head_dim] of x's dtype");
  auto out = torch::empty({rows, heads, head_dim}, x.options());
  if (rows == 0 || heads == 0) return out;
  for_dtype(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rotary_rows<T>(x.data_ptr<T>(), x.stride(0), cos.data_ptr<T>(), sin_signed.data_ptr<T>(), out.data_ptr<T>(),
                   rows, heads, head_dim);
  });
  return out;
}

// Checks shared by both entry points; returns num_seqs. An int8 cache comes with its scales.
int64_t check_paged(const torch::Tensor& kv_cache, const c10::optional<torch::Tensor>& kv_scales,
                    const torch::Tensor& slot_mapping, const torch::Tensor& context_slots,
                    const torch::Tensor& context_lens, int64_t num_heads) {
  TORCH_CHECK(kv_cache.device().is_cpu() && kv_cache.dim() == 4 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "paged_decode_attention: kv_cache must be a contiguous CPU [2, slots, kv_heads, head_dim]");
  const auto dtype = kv_cache.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kChar,
              "paged_decode_attention: a float32, bfloat16 or int8 cache, got ", dtype);
  const int64_t num_kv_heads = kv_cache.size(2), head_dim = kv_cache.size(3), num_slots = kv_cache.size(1);
  TORCH_CHECK((dtype == at::kChar) == kv_scales.has_value(),
              "paged_decode_attention: an int8 cache needs its scales, and only an int8 cache has them");
  if (kv_scales)
    TORCH_CHECK(kv_scales->scalar_type() == at::kFloat && kv_scales->is_contiguous() && kv_scales->dim() == 3 &&
                    kv_scales->size(0) == 2 && kv_scales->size(1) == num_slots && kv_scales->size(2) == num_kv_heads,
                "paged_decode_attention: kv_scales must be contiguous float32 [2, slots, kv_heads]");
  TORCH_CHECK(head_dim % kLanes == 0, "paged_decode_attention: head_dim must be a multiple of ", kLanes);
  TORCH_CHECK(num_heads % num_kv_heads == 0, "paged_decode_attention: num_heads must be a multiple of the KV heads");
  for (const auto& t : {slot_mapping, context_slots, context_lens})
    TORCH_CHECK(t.scalar_type() == at::kLong && t.is_contiguous(), "paged_decode_attention: int64 indices");
  const int64_t num_seqs = slot_mapping.numel();
  TORCH_CHECK(context_lens.numel() == num_seqs && context_slots.dim() == 2 && context_slots.size(0) == num_seqs,
              "paged_decode_attention: one slot, one context length and one slot row per query row");
  const int64_t max_context = context_slots.size(1);
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t* slots = context_slots.data_ptr<int64_t>();
  const int64_t* new_slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t s = 0; s < num_seqs; ++s) {
    TORCH_CHECK(lens[s] >= 1 && lens[s] <= max_context, "paged_decode_attention: context length out of range");
    TORCH_CHECK(new_slots[s] >= 0 && new_slots[s] < num_slots, "paged_decode_attention: slot out of range");
    for (int64_t t = 0; t < lens[s]; ++t)
      TORCH_CHECK(slots[s * max_context + t] >= 0 && slots[s * max_context + t] < num_slots,
                  "paged_decode_attention: context slot out of range");
  }
  return num_seqs;
}

// The rows' dtype: the cache's, or for an int8 cache the queries'.
void check_rows(const torch::Tensor& t, at::ScalarType dtype, int64_t num_seqs, int64_t features, const char* what) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "paged_decode_attention: float32 or bfloat16 rows, got ",
              dtype);
  TORCH_CHECK(t.scalar_type() == dtype && t.dim() == 2 && t.size(0) == num_seqs && t.size(1) == features &&
                  t.stride(1) == 1,
              "paged_decode_attention: ", what, " must be [num_seqs, ", features, "] rows of the cache's dtype");
}

at::ScalarType rows_dtype(const torch::Tensor& kv_cache, const torch::Tensor& first_rows) {
  return kv_cache.scalar_type() == at::kChar ? first_rows.scalar_type() : kv_cache.scalar_type();
}

// Fills the cache's fields of b and runs the kernel for rows of T over a cache of C.
template <typename T, typename C>
torch::Tensor run(DecodeBatch<T, C> b, const torch::Tensor& kv_cache, const c10::optional<torch::Tensor>& kv_scales,
                  const torch::Tensor& slot_mapping, const torch::Tensor& context_slots,
                  const torch::Tensor& context_lens, torch::Tensor out) {
  b.key_cache = kv_cache[0].data_ptr<C>();
  b.value_cache = kv_cache[1].data_ptr<C>();
  b.key_scales = kv_scales ? (*kv_scales)[0].data_ptr<float>() : nullptr;
  b.value_scales = kv_scales ? (*kv_scales)[1].data_ptr<float>() : nullptr;
  b.slot_mapping = slot_mapping.data_ptr<int64_t>();
  b.context_slots = context_slots.data_ptr<int64_t>();
  b.context_lens = context_lens.data_ptr<int64_t>();
  b.num_kv_heads = kv_cache.size(2);
  b.head_dim = kv_cache.size(3);
  b.max_context = context_slots.size(1);
  decode_attention_any<T, C>(b, out.data_ptr<T>());
  return out;
}

// f(T*, C*) for the rows' dtype T and the cache's element C.
template <typename F>
torch::Tensor for_types(at::ScalarType rows, at::ScalarType cache, F&& f) {
  if (cache == at::kChar)
    return rows == at::kFloat ? f(static_cast<float*>(nullptr), static_cast<int8_t*>(nullptr))
                              : f(static_cast<at::BFloat16*>(nullptr), static_cast<int8_t*>(nullptr));
  return rows == at::kFloat ? f(static_cast<float*>(nullptr), static_cast<float*>(nullptr))
                            : f(static_cast<at::BFloat16*>(nullptr), static_cast<at::BFloat16*>(nullptr));
}

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor kv_cache,
                                     torch::Tensor slot_mapping, torch::Tensor context_slots,
                                     torch::Tensor context_lens, int64_t num_heads, double scale,
                                     c10::optional<torch::Tensor> kv_scales) {
  // q: [num_seqs, num_heads * head_dim]; k, v: [num_seqs, num_kv_heads * head_dim];
  // kv_cache: [2, num_slots, num_kv_heads, head_dim] (kv_scales [2, num_slots, num_kv_heads] for int8);
  // context_slots: [num_seqs, max_context] int64; slot_mapping, context_lens: [num_seqs] int64.
  const int64_t num_seqs = check_paged(kv_cache, kv_scales, slot_mapping, context_slots, context_lens, num_heads);
  const int64_t kv_features = kv_cache.size(2) * kv_cache.size(3);
  const auto dtype = rows_dtype(kv_cache, q);
  check_rows(q, dtype, num_seqs, num_heads * kv_cache.size(3), "q");
  check_rows(k, dtype, num_seqs, kv_features, "k");
  check_rows(v, dtype, num_seqs, kv_features, "v");
  auto out = torch::empty({num_seqs, num_heads * kv_cache.size(3)}, q.options());
  return for_types(dtype, kv_cache.scalar_type(), [&](auto* row_tag, auto* cache_tag) {
    using T = std::remove_pointer_t<decltype(row_tag)>;
    using C = std::remove_pointer_t<decltype(cache_tag)>;
    DecodeBatch<T, C> b{};
    b.q = q.data_ptr<T>(), b.k = k.data_ptr<T>(), b.v = v.data_ptr<T>();
    b.row_stride_q = q.stride(0), b.row_stride_k = k.stride(0), b.row_stride_v = v.stride(0);
    b.num_seqs = num_seqs, b.num_heads = num_heads, b.scale = static_cast<float>(scale);
    return run<T, C>(b, kv_cache, kv_scales, slot_mapping, context_slots, context_lens, out);
  });
}

torch::Tensor rotary_decode_attention(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin_signed,
                                      torch::Tensor kv_cache, torch::Tensor slot_mapping,
                                      torch::Tensor context_slots, torch::Tensor context_lens, int64_t num_heads,
                                      double scale, c10::optional<torch::Tensor> kv_scales) {
  // qkv: [num_seqs, (num_heads + 2 * num_kv_heads) * head_dim], the fused projection's output;
  // cos, sin_signed: [num_seqs, 1, head_dim] (see cluster/models/layers/rotary.py).
  const int64_t num_seqs = check_paged(kv_cache, kv_scales, slot_mapping, context_slots, context_lens, num_heads);
  const int64_t head_dim = kv_cache.size(3), kv_features = kv_cache.size(2) * head_dim;
  const auto dtype = rows_dtype(kv_cache, qkv);
  check_rows(qkv, dtype, num_seqs, num_heads * head_dim + 2 * kv_features, "qkv");
  for (const auto& t : {cos, sin_signed})
    TORCH_CHECK(t.scalar_type() == dtype && t.is_contiguous() && t.numel() == num_seqs * head_dim,
                "paged_decode_attention: cos and sin must be [num_seqs, 1, head_dim] of the rows' dtype");
  auto out = torch::empty({num_seqs, num_heads * head_dim}, qkv.options());
  return for_types(dtype, kv_cache.scalar_type(), [&](auto* row_tag, auto* cache_tag) {
    using T = std::remove_pointer_t<decltype(row_tag)>;
    using C = std::remove_pointer_t<decltype(cache_tag)>;
    DecodeBatch<T, C> b{};
    const T* row = qkv.data_ptr<T>();
    b.q = row, b.k = row + num_heads * head_dim, b.v = row + num_heads * head_dim + kv_features;
    b.row_stride_q = b.row_stride_k = b.row_stride_v = qkv.stride(0);
    b.cos = cos.data_ptr<T>(), b.sin_signed = sin_signed.data_ptr<T>();
    b.num_seqs = num_seqs, b.num_heads = num_heads, b.scale = static_cast<float>(scale);
    return run<T, C>(b, kv_cache, kv_scales, slot_mapping, context_slots, context_lens, out);
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "Llama RMSNorm over the last dimension, float32 inside");
  m.def("add_rms_norm", &add_rms_norm, "(x + residual, rms_norm(x + residual)): the residual add and the next norm");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up for a [..., 2 * n] gate|up tensor");
  m.def("rotary", &rotary, "x * cos + rotate_half(x) * sin for [rows, heads, head_dim], in torch's rounding");
  m.attr("head_dim_multiple") = kLanes;
  m.def("paged_decode_attention", &paged_decode_attention,
        "write each query row's K/V and attend it to its paged context", py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("kv_cache"), py::arg("slot_mapping"), py::arg("context_slots"), py::arg("context_lens"),
        py::arg("num_heads"), py::arg("scale"), py::arg("kv_scales") = py::none());
  m.def("rotary_decode_attention", &rotary_decode_attention,
        "paged_decode_attention on a fused QKV output, with rotary embeddings applied to Q and K first",
        py::arg("qkv"), py::arg("cos"), py::arg("sin_signed"), py::arg("kv_cache"), py::arg("slot_mapping"),
        py::arg("context_slots"), py::arg("context_lens"), py::arg("num_heads"), py::arg("scale"),
        py::arg("kv_scales") = py::none());
}
