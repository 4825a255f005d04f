// The decode step's small operations, one call each instead of a chain of torch ops:
//
// * rms_norm: y = (x * rsqrt(mean(x^2) + eps)).to(dtype) * weight, float32 inside (the
//   rounding order of Hugging Face's LlamaRMSNorm); add_rms_norm adds the residual first.
// * silu_and_mul: the gated MLP's silu(gate) * up on the fused gate|up projection's output.
// * rotary: rotary embeddings on Q and K of a longer query (a prompt's chunk), in torch's rounding.
// * paged_decode_attention: writes each query row's new K/V at its slot, then attends the row's
//   query heads to its context straight through the slot table: no gather of the context,
//   scores and softmax in float32, GQA without repeating K/V. A row is a decoding sequence, or
//   one token of a short chunk (draft verification) with its own slots and context length; each
//   row is computed the same way whatever else the call holds. Optionally it first applies
//   rotary embeddings to Q and K (Llama's rotate-half form, the sign folded into sin), taking
//   Q, K and V as the fused projection's output.
//
// The attention is bound by reading K/V from memory at long contexts and by arithmetic at short
// ones. SmolLM2-135M's shapes (9 query heads on 3 KV heads, head_dim 64), bfloat16, 30 layers, 2
// threads of a 2-core Xeon with AMX (22 GB/s), ms before / after the chunked, register-tiled form
// below: batch 1 at context 2048 6.85 / 2.54, batch 8 at 128 2.46 / 1.59, batch 32 at 128 10.2 /
// 6.70, batch 8 at 2048 48.7 / 28.7 (13 GB/s of K/V); a whole batch-8 decode step at context 2048
// 72.5 / 56.2 ms (one run each).
//
// Tensors are float32 or bfloat16 on the CPU; build.py compiles this for the host CPU.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "simd.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) { return static_cast<float>(v); }

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

// One call's attention inputs, one query row each. Row s of Q, K and V starts at q + s * row_stride (and
// likewise for k, v): separate tensors or the column ranges of one fused QKV output.
template <typename T>
struct DecodeBatch {
  const T *q, *k, *v;
  int64_t row_stride_q, row_stride_k, row_stride_v;
  const T *cos, *sin_signed;  // [num_seqs, head_dim] each, or null: no rotary
  T *key_cache, *value_cache;  // [num_slots, num_kv_heads, head_dim] each
  const int64_t *slot_mapping, *context_slots, *context_lens;
  int64_t num_seqs, num_heads, num_kv_heads, head_dim, max_context;
  float scale;
};

// x * cos + rotate_half(x) * sin_signed for one head, in float32; rotate_half is a roll by half.
template <typename T>
inline float rotated(const T* x, const T* cos, const T* sin_signed, int64_t d, int64_t head_dim) {
  if (!cos) return to_float(x[d]);
  const int64_t partner = d < head_dim / 2 ? d + head_dim / 2 : d - head_dim / 2;
  return to_float(x[d]) * to_float(cos[d]) + to_float(x[partner]) * to_float(sin_signed[d]);
}

// A query row reads its context's K (then V) rows through the slot table: one slot's row (every
// KV head) is contiguous, but slots scatter over the cache. Asking for the rows a few slots ahead
// keeps several cache misses in flight instead of one. Only the first KV head's pass over a chunk
// reads memory; the later heads' passes find the rows in the cache, and so the second head's pass
// asks for the thread's next chunk meanwhile (SmolLM2-135M's shapes, bfloat16, 30 layers, 2-core
// Zen 4 EPYC, ms before / after: batch 15 at context 2,000 41.6 / 35.1, batch 8 at 2,000 21.6 /
// 17.4, batch 1 at 2,000 2.49 / 2.13, batch 32 at 256 11.5 / 9.8).
constexpr int64_t kPrefetchSlots = 16;

template <typename T>
inline void prefetch_row(const T* row, int64_t elements) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t offset = 0; offset < elements * static_cast<int64_t>(sizeof(T)); offset += 64)
    _mm_prefetch(p + offset, _MM_HINT_T2);
}

// A row's context is attended in chunks of kChunkSlots keys, each its own task with its own
// softmax maximum and sum, merged in chunk order afterwards: a long context spreads over the
// threads even at batch 1, and a chunk's scores stay in L1. A row's chunks depend only on its own
// context length, so its result never depends on what else the call holds.
constexpr int64_t kChunkSlots = 256;

// One chunk's unnormalized softmax state per query head: acc = sum_t e^(s_t - max) v_t.
struct ChunkState {
  float* max;  // [num_heads]
  float* sum;  // [num_heads]
  float* acc;  // [num_heads, head_dim]
};

// G query heads sharing KV head h (the first is qh0; rotated and scaled, in query) against slots
// [t0, t1) of a row's context, into their rows of state. The G heads' vectors stay in registers, CT
// vectors of a head at a time: each key or value vector read serves all G. Scores: each key's
// products are left as vectors and every kLanes keys summed across their lanes together (one
// transposing sum instead of one reduction per key). The first tile of a chunk (fetch) asks for
// whole slot rows (every KV head) a few slots ahead; later tiles find them in the cache.
// The slots of the chunk a thread attends next (none: count 0), whose K and V rows a later KV head's
// tile asks for while it works from the cache, one row per key it reads.
struct NextChunk {
  const int64_t* slots;
  int64_t count;
};

template <typename T, int G, int CT>
void attend_tile(const DecodeBatch<T>& b, const int64_t* slots, int64_t h, int64_t qh0, int64_t t0, int64_t t1,
                 const float* query, float* scores, float* partial, ChunkState state, bool fetch,
                 NextChunk next) {
  const int64_t D = b.head_dim, kv_stride = b.num_kv_heads * D, n = t1 - t0;
  const T* keys = b.key_cache + h * D;
  const T* values = b.value_cache + h * D;
  if (fetch)
    for (int64_t t = t0; t < std::min(t1, t0 + kPrefetchSlots); ++t)
      prefetch_row(b.key_cache + slots[t] * kv_stride, kv_stride);
  for (int64_t j0 = 0; j0 < n; j0 += kLanes) {
    const int64_t m = std::min<int64_t>(kLanes, n - j0);
    for (int64_t d0 = 0; d0 < D; d0 += CT * kLanes) {
      Vec q[G][CT];
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < CT; ++c) q[g][c] = vload(query + (qh0 + g) * D + d0 + c * kLanes);
      for (int64_t j = 0; j < m; ++j) {
        const int64_t t = t0 + j0 + j;
        if (fetch && d0 == 0 && t + kPrefetchSlots < t1)
          prefetch_row(b.key_cache + slots[t + kPrefetchSlots] * kv_stride, kv_stride);
        if (d0 == 0 && t - t0 < next.count) prefetch_row(b.key_cache + next.slots[t - t0] * kv_stride, kv_stride);
        const T* key = keys + slots[t] * kv_stride + d0;
        Vec k[CT];
        for (int c = 0; c < CT; ++c) k[c] = vload(key + c * kLanes);
        for (int g = 0; g < G; ++g) {
          float* products = partial + (g * kLanes + j) * kLanes;
          Vec dot = d0 ? vload(products) : vzero();
          for (int c = 0; c < CT; ++c) dot = vfma(q[g][c], k[c], dot);
          vstore(products, dot);
        }
      }
    }
    for (int g = 0; g < G; ++g) {
      Vec products[kLanes];
      for (int64_t j = 0; j < kLanes; ++j) products[j] = j < m ? vload(partial + (g * kLanes + j) * kLanes) : vzero();
      vstore(scores + g * kChunkSlots + j0, vsum_lanes(products));
    }
  }
  if (fetch)  // the values' first rows, during the softmax
    for (int64_t t = t0; t < std::min(t1, t0 + kPrefetchSlots); ++t)
      prefetch_row(b.value_cache + slots[t] * kv_stride, kv_stride);
  const int64_t full = n / kLanes * kLanes;
  for (int g = 0; g < G; ++g) {  // exp(score - max) and its sum, float32
    float* row = scores + g * kChunkSlots;
    float top = -INFINITY;
    if (full) {
      Vec vtop = vload(row);
      for (int64_t j = kLanes; j < full; j += kLanes) vtop = vmax(vtop, vload(row + j));
      top = vmax_lanes(vtop);
    }
    for (int64_t j = full; j < n; ++j) top = std::max(top, row[j]);
    const Vec shift = vbroadcast(top);
    Vec vtotal = vzero();
    for (int64_t j = 0; j < full; j += kLanes) {
      const Vec e = vexp(vsub(vload(row + j), shift));
      vstore(row + j, e);
      vtotal = vadd(vtotal, e);
    }
    float total = vsum(vtotal);
    if (full < n) {  // the tail: its lanes past n were never scores
      float tail[kLanes];
      vstore(tail, vexp(vsub(vload(row + full), shift)));
      for (int64_t j = full; j < n; ++j) total += (row[j] = tail[j - full]);
    }
    state.max[qh0 + g] = top;
    state.sum[qh0 + g] = total;
  }
  for (int64_t d0 = 0; d0 < D; d0 += CT * kLanes) {
    Vec acc[G][CT];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < CT; ++c) acc[g][c] = vzero();
    for (int64_t j = 0; j < n; ++j) {
      const int64_t t = t0 + j;
      if (fetch && d0 == 0 && t + kPrefetchSlots < t1)
        prefetch_row(b.value_cache + slots[t + kPrefetchSlots] * kv_stride, kv_stride);
      if (d0 == 0 && j < next.count) prefetch_row(b.value_cache + next.slots[j] * kv_stride, kv_stride);
      const T* value = values + slots[t] * kv_stride + d0;
      Vec v[CT];
      for (int c = 0; c < CT; ++c) v[c] = vload(value + c * kLanes);
      for (int g = 0; g < G; ++g) {
        const Vec p = vbroadcast(scores[g * kChunkSlots + j]);
        for (int c = 0; c < CT; ++c) acc[g][c] = vfma(p, v[c], acc[g][c]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < CT; ++c) vstore(state.acc + (qh0 + g) * D + d0 + c * kLanes, acc[g][c]);
  }
}

template <typename T, int G, int CT>
void decode_attention(const DecodeBatch<T>& b, T* out) {
  const int64_t D = b.head_dim, kv_stride = b.num_kv_heads * D;  // kv_stride: one slot
  for (int64_t s = 0; s < b.num_seqs; ++s) {  // write the new K/V first: the query attends to itself
    const T* cos = b.cos ? b.cos + s * D : nullptr;
    const T* sin = b.sin_signed ? b.sin_signed + s * D : nullptr;
    T* key_slot = b.key_cache + b.slot_mapping[s] * kv_stride;
    const T* k_row = b.k + s * b.row_stride_k;
    for (int64_t h = 0; h < b.num_kv_heads; ++h)
      for (int64_t d = 0; d < D; ++d) key_slot[h * D + d] = static_cast<T>(rotated(k_row + h * D, cos, sin, d, D));
    std::copy(b.v + s * b.row_stride_v, b.v + s * b.row_stride_v + kv_stride,
              b.value_cache + b.slot_mapping[s] * kv_stride);
  }
  const int64_t heads = b.num_heads, group = heads / b.num_kv_heads;
  // The tasks: (row, chunk), and where each row's chunks start among them.
  std::vector<int64_t> first_chunk(b.num_seqs + 1, 0);
  for (int64_t s = 0; s < b.num_seqs; ++s)
    first_chunk[s + 1] = first_chunk[s] + (b.context_lens[s] + kChunkSlots - 1) / kChunkSlots;
  const int64_t chunks = first_chunk[b.num_seqs], state_floats = heads * (2 + D);
  std::vector<float> states(chunks * state_floats);
  auto state_of = [&](int64_t chunk) {
    float* base = states.data() + chunk * state_floats;
    return ChunkState{base, base + heads, base + 2 * heads};
  };
  // Fewer chunks than threads (batch 1 below kChunkSlots of context) of at least half a chunk's
  // keys: each chunk's KV heads are tasks of their own, so the threads share the call (the
  // arithmetic of every head is the same). Shorter, one thread is quicker than waking another.
  // SmolLM2-135M's shapes, float32, 2-core Zen 3, us a call before / after: context 200 32-40 /
  // 23-33, 255 39-48 / 29-31; context 64 alike.
  const int64_t longest = b.num_seqs ? *std::max_element(b.context_lens, b.context_lens + b.num_seqs) : 0;
  const int64_t parts = chunks < at::get_num_threads() && 2 * longest >= kChunkSlots ? b.num_kv_heads : 1;
  at::parallel_for(0, chunks * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> query(heads * D), scores(G * kChunkSlots);
    std::vector<float> partial(G * kLanes * kLanes);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t chunk = task / parts;
      const int64_t h_begin = parts == 1 ? 0 : task % parts, h_end = parts == 1 ? b.num_kv_heads : h_begin + 1;
      const int64_t s = std::upper_bound(first_chunk.begin(), first_chunk.end(), chunk) - first_chunk.begin() - 1;
      const int64_t t0 = (chunk - first_chunk[s]) * kChunkSlots, t1 = std::min(b.context_lens[s], t0 + kChunkSlots);
      const T* cos = b.cos ? b.cos + s * D : nullptr;
      const T* sin = b.sin_signed ? b.sin_signed + s * D : nullptr;
      const T* q_row = b.q + s * b.row_stride_q;
      for (int64_t qh = h_begin * group; qh < h_end * group; ++qh)
        for (int64_t d = 0; d < D; ++d) query[qh * D + d] = rotated(q_row + qh * D, cos, sin, d, D) * b.scale;
      const int64_t* slots = b.context_slots + s * b.max_context;
      NextChunk next{nullptr, 0};  // this thread's next chunk, while KV heads past the first work from the cache
      if (parts == 1 && chunk + 1 < end && b.num_kv_heads > 1) {
        const int64_t ns = s + (chunk + 1 == first_chunk[s + 1]);
        const int64_t n0 = (chunk + 1 - first_chunk[ns]) * kChunkSlots;
        next = {b.context_slots + ns * b.max_context + n0, std::min(b.context_lens[ns], n0 + kChunkSlots) - n0};
      }
      for (int64_t h = h_begin; h < h_end; ++h)
        for (int64_t qh0 = h * group; qh0 < (h + 1) * group; qh0 += G)
          attend_tile<T, G, CT>(b, slots, h, qh0, t0, t1, query.data(), scores.data(), partial.data(),
                                state_of(chunk), qh0 == h_begin * group,
                                qh0 == group ? next : NextChunk{nullptr, 0});
    }
  });
  // Merge each row's chunks in order: out = sum_i e^(max_i - M) acc_i / sum_i e^(max_i - M) sum_i.
  at::parallel_for(0, b.num_seqs * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / heads, qh = task % heads;
      float top = -INFINITY, total = 0.f;
      for (int64_t c = first_chunk[s]; c < first_chunk[s + 1]; ++c) top = std::max(top, state_of(c).max[qh]);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t c = first_chunk[s]; c < first_chunk[s + 1]; ++c) {
        const ChunkState part = state_of(c);
        const float weight = std::exp(part.max[qh] - top);
        total += weight * part.sum[qh];
        for (int64_t d = 0; d < D; ++d) acc[d] += weight * part.acc[qh * D + d];
      }
      const float inv = 1.f / total;
      T* o = out + s * heads * D + qh * D;
      for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(acc[d] * inv);
    }
  });
}

// decode_attention for the register tile that fits: G query heads (1, 2, 3, 4 or 8, the largest
// dividing the group: 1, 2, 3, 4, 6 and 8 cover the common models) by CT vectors of a head (4, or 2
// for G = 8: G * CT at most 24 of AVX-512's 32 registers; 1 where those do not divide the head).
// Fewer instantiations keep the first build short (about 30 s). Only AVX-512 was timed.
template <typename T, int G>
void decode_attention_tile(const DecodeBatch<T>& b, T* out) {
  constexpr int kWidest = G <= 4 ? 4 : 2;
  if ((b.head_dim / kLanes) % kWidest == 0) return decode_attention<T, G, kWidest>(b, out);
  decode_attention<T, G, 1>(b, out);
}

template <typename T>
void decode_attention_any(const DecodeBatch<T>& b, T* out) {
  const int64_t group = b.num_heads / b.num_kv_heads;
  if (group % 8 == 0) return decode_attention_tile<T, 8>(b, out);
  if (group % 4 == 0) return decode_attention_tile<T, 4>(b, out);
  if (group % 3 == 0) return decode_attention_tile<T, 3>(b, out);
  if (group % 2 == 0) return decode_attention_tile<T, 2>(b, out);
  decode_attention_tile<T, 1>(b, out);
}

// Checks shared by both entry points; returns num_seqs.
int64_t check_paged(const torch::Tensor& kv_cache, const torch::Tensor& slot_mapping,
                    const torch::Tensor& context_slots, const torch::Tensor& context_lens, int64_t num_heads) {
  TORCH_CHECK(kv_cache.device().is_cpu() && kv_cache.dim() == 4 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "paged_decode_attention: kv_cache must be a contiguous CPU [2, slots, kv_heads, head_dim]");
  TORCH_CHECK(kv_cache.scalar_type() == at::kFloat || kv_cache.scalar_type() == at::kBFloat16,
              "paged_decode_attention: float32 or bfloat16, got ", kv_cache.scalar_type());
  const int64_t num_kv_heads = kv_cache.size(2), head_dim = kv_cache.size(3), num_slots = kv_cache.size(1);
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

void check_rows(const torch::Tensor& t, const torch::Tensor& kv_cache, int64_t num_seqs, int64_t features,
                const char* what) {
  TORCH_CHECK(t.scalar_type() == kv_cache.scalar_type() && t.dim() == 2 && t.size(0) == num_seqs &&
                  t.size(1) == features && t.stride(1) == 1,
              "paged_decode_attention: ", what, " must be [num_seqs, ", features, "] rows of the cache's dtype");
}

template <typename T>
torch::Tensor run(DecodeBatch<T> b, const torch::Tensor& kv_cache, const torch::Tensor& slot_mapping,
                  const torch::Tensor& context_slots, const torch::Tensor& context_lens, torch::Tensor out) {
  b.key_cache = kv_cache[0].data_ptr<T>();
  b.value_cache = kv_cache[1].data_ptr<T>();
  b.slot_mapping = slot_mapping.data_ptr<int64_t>();
  b.context_slots = context_slots.data_ptr<int64_t>();
  b.context_lens = context_lens.data_ptr<int64_t>();
  b.num_kv_heads = kv_cache.size(2);
  b.head_dim = kv_cache.size(3);
  b.max_context = context_slots.size(1);
  decode_attention_any<T>(b, out.data_ptr<T>());
  return out;
}

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor kv_cache,
                                     torch::Tensor slot_mapping, torch::Tensor context_slots,
                                     torch::Tensor context_lens, int64_t num_heads, double scale) {
  // q: [num_seqs, num_heads * head_dim]; k, v: [num_seqs, num_kv_heads * head_dim];
  // kv_cache: [2, num_slots, num_kv_heads, head_dim]; context_slots: [num_seqs, max_context] int64;
  // slot_mapping, context_lens: [num_seqs] int64.
  const int64_t num_seqs = check_paged(kv_cache, slot_mapping, context_slots, context_lens, num_heads);
  const int64_t kv_features = kv_cache.size(2) * kv_cache.size(3);
  check_rows(q, kv_cache, num_seqs, num_heads * kv_cache.size(3), "q");
  check_rows(k, kv_cache, num_seqs, kv_features, "k");
  check_rows(v, kv_cache, num_seqs, kv_features, "v");
  auto out = torch::empty({num_seqs, num_heads * kv_cache.size(3)}, q.options());
  auto fill = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    DecodeBatch<T> b{};
    b.q = q.data_ptr<T>(), b.k = k.data_ptr<T>(), b.v = v.data_ptr<T>();
    b.row_stride_q = q.stride(0), b.row_stride_k = k.stride(0), b.row_stride_v = v.stride(0);
    b.num_seqs = num_seqs, b.num_heads = num_heads, b.scale = static_cast<float>(scale);
    return run<T>(b, kv_cache, slot_mapping, context_slots, context_lens, out);
  };
  return kv_cache.scalar_type() == at::kFloat ? fill(static_cast<float*>(nullptr))
                                              : fill(static_cast<at::BFloat16*>(nullptr));
}

torch::Tensor rotary_decode_attention(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin_signed,
                                      torch::Tensor kv_cache, torch::Tensor slot_mapping,
                                      torch::Tensor context_slots, torch::Tensor context_lens, int64_t num_heads,
                                      double scale) {
  // qkv: [num_seqs, (num_heads + 2 * num_kv_heads) * head_dim], the fused projection's output;
  // cos, sin_signed: [num_seqs, 1, head_dim] (see cluster/models/layers/rotary.py).
  const int64_t num_seqs = check_paged(kv_cache, slot_mapping, context_slots, context_lens, num_heads);
  const int64_t head_dim = kv_cache.size(3), kv_features = kv_cache.size(2) * head_dim;
  check_rows(qkv, kv_cache, num_seqs, num_heads * head_dim + 2 * kv_features, "qkv");
  for (const auto& t : {cos, sin_signed})
    TORCH_CHECK(t.scalar_type() == kv_cache.scalar_type() && t.is_contiguous() && t.numel() == num_seqs * head_dim,
                "paged_decode_attention: cos and sin must be [num_seqs, 1, head_dim] of the cache's dtype");
  auto out = torch::empty({num_seqs, num_heads * head_dim}, qkv.options());
  auto fill = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    DecodeBatch<T> b{};
    const T* row = qkv.data_ptr<T>();
    b.q = row, b.k = row + num_heads * head_dim, b.v = row + num_heads * head_dim + kv_features;
    b.row_stride_q = b.row_stride_k = b.row_stride_v = qkv.stride(0);
    b.cos = cos.data_ptr<T>(), b.sin_signed = sin_signed.data_ptr<T>();
    b.num_seqs = num_seqs, b.num_heads = num_heads, b.scale = static_cast<float>(scale);
    return run<T>(b, kv_cache, slot_mapping, context_slots, context_lens, out);
  };
  return kv_cache.scalar_type() == at::kFloat ? fill(static_cast<float*>(nullptr))
                                              : fill(static_cast<at::BFloat16*>(nullptr));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "Llama RMSNorm over the last dimension, float32 inside");
  m.def("add_rms_norm", &add_rms_norm, "(x + residual, rms_norm(x + residual)): the residual add and the next norm");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up for a [..., 2 * n] gate|up tensor");
  m.def("rotary", &rotary, "x * cos + rotate_half(x) * sin for [rows, heads, head_dim], in torch's rounding");
  m.attr("head_dim_multiple") = kLanes;
  m.def("paged_decode_attention", &paged_decode_attention,
        "write each query row's K/V and attend it to its paged context");
  m.def("rotary_decode_attention", &rotary_decode_attention,
        "paged_decode_attention on a fused QKV output, with rotary embeddings applied to Q and K first");
}
