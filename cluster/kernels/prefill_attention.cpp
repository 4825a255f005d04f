// Prefill attention on the CPU: the rows of prompts (or of prompt chunks after a cached prefix)
// attend causally to their paged context, bfloat16 in, float32 inside, in one call per layer.
// The cache is bfloat16, or int8 with a float32 scale per (slot, KV head) (cluster/quant/kv_int8.py),
// widened as it is packed exactly as Int8LayerCache.gather widens it: value * scale in float32,
// rounded to bfloat16.
//
// torch's CPU flash kernel, which ran this before, spent most of its time outside its matrix
// products (softmax, conversions, blocks of padded rows): on a 2-core Zen 4 EPYC, SmolLM2-135M's
// shapes, 45-110 GFLOPS against the 420 its linear layers reach. Here both products are register
// tiles of bfloat16 pair products (AVX-512-BF16's vdpbf16ps: two bfloat16 products summed into a
// float32 lane; where the CPU lacks it, two float32 FMAs on the widened halves do the same sum):
//
// * The context of each (sequence, KV head) is first read through the slot table into two packed
//   copies: keys as blocks of 16 keys, [block][head_dim / 2][16 keys][2 dims], so one vector holds
//   one dim pair of 16 keys; values as key pairs, [key / 2][head_dim][2 keys], so one vector holds
//   16 dims of two keys. Both are zero past the context, up to a whole key block.
// * A task is one sequence, one KV head and kQueryPositions query positions: the query heads of
//   that KV head at those positions (GQA without repeating K/V), kRowTile of them per register
//   tile. It walks the keys in blocks of kKeyBlock up to its last position: scores for a tile are
//   kRowTile x kKeyBlock accumulators (each query dim pair broadcast, each key vector loaded once
//   per tile), scaled, hidden past each row's own position, then the online softmax (a running
//   maximum and sum per row, the row's output rescaled when the maximum grows), the
//   probabilities rounded to bfloat16 pairs and multiplied into the values the same way.
// * Tasks run heaviest first, each thread taking the next one when done (causal rows differ in
//   cost by up to the context's length).
//
// Each output row is its float32 sum divided by its softmax sum, rounded to bfloat16 once.
// Rows are computed the same way whatever else the call holds, except for the float32 rounding
// of the running maximum's steps (a row's key blocks are the same in any call, so that too).
// build.py compiles this for the host CPU; without AVX-512 the module's `available` is false.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "simd.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

namespace {

#if defined(__AVX512F__)
constexpr bool kAvailable = true;
constexpr int kKeyBlock = 64;        // keys per online-softmax step: 4 vectors of 16
constexpr int kKeyVectors = kKeyBlock / 16;
constexpr int kRowTile = 6;          // query rows per register tile: 6 x 4 accumulators
constexpr int64_t kQueryPositions = 32;  // query positions per task
constexpr int kDimChunk = 64;        // head dims per pass of the value product: 4 vectors

// acc + a.even * b.even + a.odd * b.odd, lane by lane, a and b holding bfloat16 pairs.
inline __m512 dot_pairs(__m512 acc, __m512i a, __m512i b) {
#if defined(__AVX512BF16__)
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(a), reinterpret_cast<__m512bh>(b));
#else
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(a, 16)), _mm512_castsi512_ps(_mm512_slli_epi32(b, 16)),
                        acc);
  return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(a, high)),
                         _mm512_castsi512_ps(_mm512_and_si512(b, high)), acc);
#endif
}

// float32 -> bfloat16 bits (nearest even, as c10 rounds), 16 lanes to 16 halves.
inline __m256i to_bf16(__m512 v) {
#if defined(__AVX512BF16__)
  return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
#else
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(vround_bf16(v)), 16));
#endif
}

struct Prefill {
  const uint16_t* q;  // [num_tokens, num_heads * head_dim] bfloat16 bits
  int64_t q_stride;
  const uint16_t *key_cache, *value_cache;  // [num_slots, num_kv_heads, head_dim] each (bfloat16 caches)
  const int8_t *key_int8, *value_int8;        // the same (int8 caches; null otherwise)
  const float *key_scales, *value_scales;     // [num_slots, num_kv_heads] (int8 caches)
  const int64_t *context_slots, *query_lens, *context_lens;
  std::vector<int64_t> query_start;  // [num_seqs]: the first token of each sequence's rows
  std::vector<int64_t> packed_start;  // [num_seqs]: each sequence's offset in the packed copies (keys)
  int64_t num_seqs, num_heads, num_kv_heads, head_dim, max_context;
  float scale;
};

// D int8 values times their scale, in float32, rounded to bfloat16 (D a multiple of 16).
inline void widen_int8(const int8_t* x, float scale, int64_t D, uint16_t* out) {
  const __m512 s = _mm512_set1_ps(scale);
  for (int64_t d = 0; d < D; d += 16) {
    const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + d))));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + d), to_bf16(_mm512_mul_ps(f, s)));
  }
}

inline int64_t padded_keys(int64_t context) { return (context + kKeyBlock - 1) / kKeyBlock * kKeyBlock; }

// One (sequence, KV head)'s keys and values, packed (see the top of the file); 32-bit words,
// each a pair of bfloat16 values.
void pack_context(const Prefill& p, int64_t s, int64_t h, uint32_t* keys, uint32_t* values) {
  const int64_t D = p.head_dim, pairs = D / 2, kv_stride = p.num_kv_heads * D;
  const int64_t context = p.context_lens[s], padded = padded_keys(context);
  const int64_t* slots = p.context_slots + s * p.max_context;
  for (int64_t t = 0; t < padded; ++t) {
    const int64_t block = t / 16, lane = t % 16;
    uint32_t* key_out = keys + block * pairs * 16 + lane;
    uint16_t* value_out = reinterpret_cast<uint16_t*>(values + (t / 2) * D) + (t % 2);
    if (t < context) {
      uint32_t words[256];  // head_dim <= 512 (checked)
      alignas(64) uint16_t widened[512];
      const uint16_t* v;
      if (p.key_int8 == nullptr) {
        std::memcpy(words, p.key_cache + slots[t] * kv_stride + h * D, D * sizeof(uint16_t));
        v = p.value_cache + slots[t] * kv_stride + h * D;
      } else {
        const int64_t at = slots[t] * p.num_kv_heads + h;
        widen_int8(p.key_int8 + at * D, p.key_scales[at], D, reinterpret_cast<uint16_t*>(words));
        widen_int8(p.value_int8 + at * D, p.value_scales[at], D, widened);
        v = widened;
      }
      for (int64_t i = 0; i < pairs; ++i) key_out[i * 16] = words[i];
      for (int64_t d = 0; d < D; ++d) value_out[2 * d] = v[d];
    } else {
      for (int64_t i = 0; i < pairs; ++i) key_out[i * 16] = 0;
      for (int64_t d = 0; d < D; ++d) value_out[2 * d] = 0;
    }
  }
}

struct Task {
  int64_t seq, kv_head, first, end;  // query rows [first, end) of the sequence
  int64_t keys;  // how many keys its last row sees
};

// One task: the group's query heads at rows [first, end), against the packed context.
void attend(const Prefill& p, const Task& task, const uint32_t* keys, const uint32_t* values, uint16_t* out,
            std::vector<float>& acc_buf) {
  const int64_t D = p.head_dim, pairs = D / 2, group = p.num_heads / p.num_kv_heads;
  const int64_t s = task.seq, rows = (task.end - task.first) * group;
  const int64_t offset = p.context_lens[s] - p.query_lens[s];  // row i sits at position offset + i
  acc_buf.assign(rows * (D + 2), 0.f);
  float* acc = acc_buf.data();  // [rows, D]: unnormalized outputs
  float* top = acc + rows * D;  // [rows]: running maximum of the scaled scores
  float* total = top + rows;    // [rows]: running sum of exp(score - top)
  std::fill(top, top + rows, -INFINITY);
  // Row r of the task: position first + r / group, query head kv_head * group + r % group.
  auto q_row = [&](int64_t r) {
    const int64_t i = task.first + r / group, qh = task.kv_head * group + r % group;
    return reinterpret_cast<const uint32_t*>(p.q + (p.query_start[s] + i) * p.q_stride + qh * D);
  };
  auto position = [&](int64_t r) { return offset + task.first + r / group; };
  alignas(64) uint16_t probs[kRowTile][kKeyBlock];
  float rescale[kRowTile];
  const __m512 scale = _mm512_set1_ps(p.scale);
  const __m512i lane_index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t k0 = 0; k0 < task.keys; k0 += kKeyBlock) {
    const uint32_t* key_block = keys + (k0 / 16) * pairs * 16;
    for (int64_t r0 = 0; r0 < rows; r0 += kRowTile) {
      const int n = static_cast<int>(std::min<int64_t>(kRowTile, rows - r0));
      if (position(r0 + n - 1) < k0) continue;  // the keys lie past every row of the tile
      const uint32_t* q[kRowTile];
      for (int r = 0; r < kRowTile; ++r) q[r] = q_row(r0 + std::min(r, n - 1));
      __m512 score[kRowTile][kKeyVectors];
      for (int r = 0; r < kRowTile; ++r)
        for (int c = 0; c < kKeyVectors; ++c) score[r][c] = _mm512_setzero_ps();
      for (int64_t i = 0; i < pairs; ++i) {
        __m512i k[kKeyVectors];
        for (int c = 0; c < kKeyVectors; ++c)
          k[c] = _mm512_loadu_si512(key_block + (c * pairs + i) * 16);
        for (int r = 0; r < kRowTile; ++r) {
          const __m512i a = _mm512_set1_epi32(static_cast<int>(q[r][i]));
          for (int c = 0; c < kKeyVectors; ++c) score[r][c] = dot_pairs(score[r][c], a, k[c]);
        }
      }
      for (int r = 0; r < n; ++r) {  // the online softmax, one row at a time
        const int64_t row = r0 + r, last_key = position(row);
        __m512 block_top = _mm512_set1_ps(-INFINITY);
        for (int c = 0; c < kKeyVectors; ++c) {
          score[r][c] = _mm512_mul_ps(score[r][c], scale);
          if (k0 + (c + 1) * 16 - 1 > last_key) {  // hide the keys past the row's position
            const __m512i key = _mm512_add_epi32(lane_index, _mm512_set1_epi32(static_cast<int>(k0 + c * 16)));
            const __mmask16 seen = _mm512_cmple_epi32_mask(key, _mm512_set1_epi32(static_cast<int>(last_key)));
            score[r][c] = _mm512_mask_blend_ps(seen, _mm512_set1_ps(-INFINITY), score[r][c]);
          }
          block_top = _mm512_max_ps(block_top, score[r][c]);
        }
        // Finite: every row saw key 0 in the first block (a row whose keys here all lie past it keeps its own).
        const float new_top = std::max(top[row], _mm512_reduce_max_ps(block_top));
        rescale[r] = std::exp(top[row] - new_top);
        top[row] = new_top;
        const __m512 shift = _mm512_set1_ps(new_top);
        __m512 sum = _mm512_setzero_ps();
        for (int c = 0; c < kKeyVectors; ++c) {
          const __m512 e = vexp(_mm512_sub_ps(score[r][c], shift));
          sum = _mm512_add_ps(sum, e);
          _mm256_store_si256(reinterpret_cast<__m256i*>(probs[r] + c * 16), to_bf16(e));
        }
        total[row] = total[row] * rescale[r] + _mm512_reduce_add_ps(sum);
      }
      for (int r = n; r < kRowTile; ++r) std::memset(probs[r], 0, sizeof(probs[r]));
      const uint32_t* prob_pairs[kRowTile];
      for (int r = 0; r < kRowTile; ++r) prob_pairs[r] = reinterpret_cast<const uint32_t*>(probs[r]);
      for (int64_t d0 = 0; d0 < D; d0 += kDimChunk) {
        __m512 o[kRowTile][kDimChunk / 16];
        for (int r = 0; r < kRowTile; ++r) {
          const __m512 factor = _mm512_set1_ps(r < n ? rescale[r] : 0.f);
          for (int c = 0; c < kDimChunk / 16; ++c)
            o[r][c] = r < n ? _mm512_mul_ps(_mm512_loadu_ps(acc + (r0 + r) * D + d0 + c * 16), factor)
                            : _mm512_setzero_ps();
        }
        const uint32_t* value_rows = values + (k0 / 2) * D + d0;
        for (int j = 0; j < kKeyBlock / 2; ++j) {
          __m512i v[kDimChunk / 16];
          for (int c = 0; c < kDimChunk / 16; ++c) v[c] = _mm512_loadu_si512(value_rows + j * D + c * 16);
          for (int r = 0; r < kRowTile; ++r) {
            const __m512i a = _mm512_set1_epi32(static_cast<int>(prob_pairs[r][j]));
            for (int c = 0; c < kDimChunk / 16; ++c) o[r][c] = dot_pairs(o[r][c], a, v[c]);
          }
        }
        for (int r = 0; r < n; ++r)
          for (int c = 0; c < kDimChunk / 16; ++c) _mm512_storeu_ps(acc + (r0 + r) * D + d0 + c * 16, o[r][c]);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = task.first + r / group, qh = task.kv_head * group + r % group;
    uint16_t* o = out + (p.query_start[s] + i) * p.num_heads * D + qh * D;
    const __m512 inv = _mm512_set1_ps(1.f / total[r]);
    for (int64_t d = 0; d < D; d += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + d),
                          to_bf16(_mm512_mul_ps(_mm512_loadu_ps(acc + r * D + d), inv)));
  }
}

void prefill(Prefill& p, uint16_t* out) {
  const int64_t D = p.head_dim, kv_heads = p.num_kv_heads;
  // The packed copies: per sequence, per KV head, padded_keys * D / 2 words of keys (and as many of values).
  int64_t words = 0;
  p.packed_start.resize(p.num_seqs);
  for (int64_t s = 0; s < p.num_seqs; ++s) {
    p.packed_start[s] = words;
    words += kv_heads * padded_keys(p.context_lens[s]) * D / 2;
  }
  // Left uninitialized: pack_context writes every word, the padding's zeros included.
  std::unique_ptr<uint32_t[]> packed_keys(new uint32_t[words]), packed_values(new uint32_t[words]);
  auto key_copy = [&](int64_t s, int64_t h) {
    return packed_keys.get() + p.packed_start[s] + h * padded_keys(p.context_lens[s]) * D / 2;
  };
  auto value_copy = [&](int64_t s, int64_t h) {
    return packed_values.get() + p.packed_start[s] + h * padded_keys(p.context_lens[s]) * D / 2;
  };
  at::parallel_for(0, p.num_seqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t job = begin; job < end; ++job) {
      const int64_t s = job / kv_heads, h = job % kv_heads;
      pack_context(p, s, h, key_copy(s, h), value_copy(s, h));
    }
  });
  std::vector<Task> tasks;
  for (int64_t s = 0; s < p.num_seqs; ++s) {
    const int64_t offset = p.context_lens[s] - p.query_lens[s];
    for (int64_t first = 0; first < p.query_lens[s]; first += kQueryPositions) {
      const int64_t end = std::min(p.query_lens[s], first + kQueryPositions);
      for (int64_t h = 0; h < kv_heads; ++h) tasks.push_back({s, h, first, end, offset + end});
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.keys > b.keys; });
  std::atomic<int64_t> next{0};
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> acc;
    for (int64_t t = next++; t < num_tasks; t = next++) {
      const Task& task = tasks[t];
      attend(p, task, key_copy(task.seq, task.kv_head), value_copy(task.seq, task.kv_head), out, acc);
    }
  });
}
#else
constexpr bool kAvailable = false;
#endif

torch::Tensor paged_prefill_attention(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor context_slots,
                                      torch::Tensor query_lens, torch::Tensor context_lens, int64_t num_heads,
                                      double scale, c10::optional<torch::Tensor> kv_scales) {
  // q: [num_tokens, num_heads * head_dim], the sequences' query rows one after another;
  // kv_cache: [2, num_slots, num_kv_heads, head_dim], holding every context token's K/V already,
  // bfloat16, or int8 with kv_scales [2, num_slots, num_kv_heads] float32;
  // context_slots: [num_seqs, max_context] int64; query_lens, context_lens: [num_seqs] int64. Row i
  // of sequence s sits at position context_lens[s] - query_lens[s] + i and sees the keys up to it.
  TORCH_CHECK(kAvailable, "paged_prefill_attention: this build has no AVX-512");
  const bool int8 = kv_cache.scalar_type() == at::kChar;
  TORCH_CHECK(kv_cache.device().is_cpu() && kv_cache.dim() == 4 && kv_cache.size(0) == 2 && kv_cache.is_contiguous() &&
                  (int8 || kv_cache.scalar_type() == at::kBFloat16),
              "paged_prefill_attention: kv_cache must be a contiguous bfloat16 or int8 CPU [2, slots, kv_heads, head_dim]");
  const int64_t num_kv_heads = kv_cache.size(2), head_dim = kv_cache.size(3), num_slots = kv_cache.size(1);
  TORCH_CHECK(int8 == kv_scales.has_value(), "paged_prefill_attention: kv_scales go with an int8 kv_cache, and only there");
  if (int8)
    TORCH_CHECK(kv_scales->scalar_type() == at::kFloat && kv_scales->is_contiguous() && kv_scales->device().is_cpu() &&
                    kv_scales->dim() == 3 && kv_scales->size(0) == 2 && kv_scales->size(1) == num_slots &&
                    kv_scales->size(2) == num_kv_heads,
                "paged_prefill_attention: kv_scales must be contiguous float32 CPU [2, slots, kv_heads]");
  TORCH_CHECK(head_dim % 64 == 0 && head_dim <= 512, "paged_prefill_attention: head_dim must be a multiple of 64, "
              "at most 512, got ", head_dim);
  TORCH_CHECK(num_heads > 0 && num_heads % num_kv_heads == 0,
              "paged_prefill_attention: num_heads must be a multiple of the KV heads");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && q.dim() == 2 && q.size(1) == num_heads * head_dim && q.stride(1) == 1,
              "paged_prefill_attention: q must be bfloat16 [num_tokens, num_heads * head_dim] rows");
  for (const auto& t : {context_slots, query_lens, context_lens})
    TORCH_CHECK(t.scalar_type() == at::kLong && t.is_contiguous() && t.device().is_cpu(),
                "paged_prefill_attention: int64 CPU indices");
  const int64_t num_seqs = query_lens.numel();
  TORCH_CHECK(context_lens.numel() == num_seqs && context_slots.dim() == 2 && context_slots.size(0) == num_seqs,
              "paged_prefill_attention: one query length, context length and slot row per sequence");
  const int64_t max_context = context_slots.size(1);
  const int64_t *qlens = query_lens.data_ptr<int64_t>(), *clens = context_lens.data_ptr<int64_t>();
  const int64_t* slots = context_slots.data_ptr<int64_t>();
  int64_t tokens = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    TORCH_CHECK(qlens[s] >= 1 && qlens[s] <= clens[s] && clens[s] <= max_context,
                "paged_prefill_attention: need 1 <= query length <= context length <= the slot rows' length");
    for (int64_t t = 0; t < clens[s]; ++t)
      TORCH_CHECK(slots[s * max_context + t] >= 0 && slots[s * max_context + t] < num_slots,
                  "paged_prefill_attention: context slot out of range");
    tokens += qlens[s];
  }
  TORCH_CHECK(q.size(0) == tokens, "paged_prefill_attention: q has ", q.size(0), " rows, the query lengths sum to ",
              tokens);
  auto out = torch::empty({tokens, num_heads * head_dim}, q.options());
#if defined(__AVX512F__)
  Prefill p{};
  p.q = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  p.q_stride = q.stride(0);
  if (int8) {
    p.key_int8 = kv_cache[0].data_ptr<int8_t>(), p.value_int8 = kv_cache[1].data_ptr<int8_t>();
    p.key_scales = (*kv_scales)[0].data_ptr<float>(), p.value_scales = (*kv_scales)[1].data_ptr<float>();
  } else {
    p.key_cache = reinterpret_cast<const uint16_t*>(kv_cache[0].data_ptr<at::BFloat16>());
    p.value_cache = reinterpret_cast<const uint16_t*>(kv_cache[1].data_ptr<at::BFloat16>());
  }
  p.context_slots = slots, p.query_lens = qlens, p.context_lens = clens;
  p.query_start.resize(num_seqs);
  for (int64_t s = 0, start = 0; s < num_seqs; start += qlens[s], ++s) p.query_start[s] = start;
  p.num_seqs = num_seqs, p.num_heads = num_heads, p.num_kv_heads = num_kv_heads, p.head_dim = head_dim;
  p.max_context = max_context, p.scale = static_cast<float>(scale);
  prefill(p, reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()));
#endif
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("available") = kAvailable;
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "causal attention of prompt rows to their paged context (K/V already written), bfloat16 or int8 K/V",
        py::arg("q"), py::arg("kv_cache"), py::arg("context_slots"), py::arg("query_lens"), py::arg("context_lens"),
        py::arg("num_heads"), py::arg("scale"), py::arg("kv_scales") = py::none());
}
