// Paged decode attention (decode_ops.cpp's paged_decode_attention): writes each query row's new
// K/V at its slot, then attends the row's query heads to its context straight through the slot
// table: no gather of the context, scores and softmax in float32, GQA without repeating K/V. A
// row is a decoding sequence, or one token of a short chunk (draft verification) with its own
// slots and context length. Optionally it first applies rotary embeddings to Q and K (Llama's
// rotate-half form, the sign folded into sin). The cache holds float32, bfloat16 or int8 values
// (int8: one float32 scale per token and KV head, as cluster/quant/kv_int8.py writes them).
//
// Work is split into chunks of kChunkSlots keys, each with its own softmax maximum and sum,
// merged in chunk order afterwards: a long context spreads over the threads even at batch 1. A
// task is one chunk of a run of rows that read the same context (the k + 1 rows of a verified
// sequence): each key and value the task reads serves every row of the run from the cache, so a
// verify step reads its sequence's K/V about once instead of k + 1 times. Every row is still
// computed alone, with its own slots, chunks and order of operations, so its result never depends
// on what else the call holds: a verified draft gets bit for bit the logits plain decoding gives.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) { return static_cast<float>(v); }

// One call's attention inputs, one query row each. Row s of Q, K and V starts at q + s * row_stride
// (and likewise for k, v): separate tensors or the column ranges of one fused QKV output. C is the
// cache's element: T, or int8_t with scales.
template <typename T, typename C>
struct DecodeBatch {
  const T *q, *k, *v;
  int64_t row_stride_q, row_stride_k, row_stride_v;
  const T *cos, *sin_signed;  // [num_seqs, head_dim] each, or null: no rotary
  C *key_cache, *value_cache;  // [num_slots, num_kv_heads, head_dim] each
  float *key_scales, *value_scales;  // [num_slots, num_kv_heads] each for an int8 cache, else null
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

// One K or V vector (already rounded to the rows' dtype) into the cache.
inline void store_vector(float* dst, float*, const float* x, int64_t n) { std::copy(x, x + n, dst); }
inline void store_vector(at::BFloat16* dst, float*, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<at::BFloat16>(x[i]);
}
// int8: scale = max |x| / 127, values round(x / scale) (scale 0 for a zero vector), as
// cluster/quant/kv_int8.py's quantize_vectors computes them.
inline void store_vector(int8_t* dst, float* scale, const float* x, int64_t n) {
  float top = 0.f;
  for (int64_t i = 0; i < n; ++i) top = std::max(top, std::fabs(x[i]));
  const float s = top / 127.f, safe = s > 0.f ? s : 1.f;
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<int8_t>(std::clamp(std::nearbyint(x[i] / safe), -127.f, 127.f));
  *scale = s;
}

template <typename T, typename C>
void write_new_kv(const DecodeBatch<T, C>& b) {
  const int64_t D = b.head_dim, kv_stride = b.num_kv_heads * D;
  std::vector<float> row(kv_stride);
  for (int64_t s = 0; s < b.num_seqs; ++s) {
    const T* cos = b.cos ? b.cos + s * D : nullptr;
    const T* sin = b.sin_signed ? b.sin_signed + s * D : nullptr;
    const int64_t slot = b.slot_mapping[s];
    for (int64_t h = 0; h < b.num_kv_heads; ++h)
      for (int64_t d = 0; d < D; ++d)
        row[h * D + d] = to_float(static_cast<T>(rotated(b.k + s * b.row_stride_k + h * D, cos, sin, d, D)));
    for (int64_t h = 0; h < b.num_kv_heads; ++h)
      store_vector(b.key_cache + slot * kv_stride + h * D,
                   b.key_scales ? b.key_scales + slot * b.num_kv_heads + h : nullptr, &row[h * D], D);
    for (int64_t i = 0; i < kv_stride; ++i) row[i] = to_float(b.v[s * b.row_stride_v + i]);
    for (int64_t h = 0; h < b.num_kv_heads; ++h)
      store_vector(b.value_cache + slot * kv_stride + h * D,
                   b.value_scales ? b.value_scales + slot * b.num_kv_heads + h : nullptr, &row[h * D], D);
  }
}

// A row reads its context's K (then V) through the slot table: one slot's row (every KV head) is
// contiguous, but slots scatter over the cache. Asking for the rows a few slots ahead keeps several
// cache misses in flight instead of one. Only the first KV head's pass over a chunk reads memory;
// the second head's pass asks for the thread's next chunk meanwhile.
constexpr int64_t kPrefetchSlots = 16;

template <typename C>
inline void prefetch_row(const C* row, int64_t elements) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t offset = 0; offset < elements * static_cast<int64_t>(sizeof(C)); offset += 64)
    _mm_prefetch(p + offset, _MM_HINT_T2);
}

constexpr int64_t kChunkSlots = 256;

// One chunk's unnormalized softmax state per query head of one row: acc = sum_t e^(s_t - max) v_t.
struct ChunkState {
  float* max;  // [num_heads]
  float* sum;  // [num_heads]
  float* acc;  // [num_heads, head_dim]
};

// Register tiles: G query heads by CT vectors of a head (4, or 2 for G = 8: G * CT at most 24 of
// AVX-512's 32 registers; 1 where those do not divide the head), the query heads' vectors held
// while keys stream past, the values' sums held while values do.
template <int G>
constexpr int tile_vectors() {
  return G <= 4 ? 4 : 2;
}

// Scores of G query heads (query: [G, head_dim], rotated and scaled) against m <= kLanes keys of a
// row at `slots`, into scores[g * kChunkSlots + j]. Each key's products stay vectors (in
// `partial`), summed over the head CT vectors at a time, and kLanes keys are summed across their
// lanes together; each key's arithmetic is the same whichever lane it lands in.
template <typename C, int G, int CT>
inline void score_keys(const C* keys, const float* key_scales, const int64_t* slots, int64_t m, int64_t kv_stride,
                       int64_t scale_stride, int64_t D, const float* query, float* partial, float* scores) {
  for (int64_t d0 = 0; d0 < D; d0 += CT * kLanes) {
    Vec q[G][CT];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < CT; ++c) q[g][c] = vload(query + g * D + d0 + c * kLanes);
    for (int64_t j = 0; j < m; ++j) {
      const C* key = keys + slots[j] * kv_stride + d0;
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
  float key_scale[kLanes] = {};
  if (key_scales)
    for (int64_t j = 0; j < m; ++j) key_scale[j] = key_scales[slots[j] * scale_stride];
  for (int g = 0; g < G; ++g) {  // lanes past m hold stale products: their scores are never read
    Vec products[kLanes];
    for (int j = 0; j < kLanes; ++j) products[j] = vload(partial + (g * kLanes + j) * kLanes);
    const Vec sums = vsum_lanes(products);
    vstore(scores + g * kChunkSlots, key_scales ? vmul(sums, vload(key_scale)) : sums);
  }
}

// exp(score - max) over a row's n scores of one head, in place; its maximum and sum into `max`, `sum`.
inline void softmax_part(float* row, int64_t n, float* max, float* sum) {
  const int64_t full = n / kLanes * kLanes;
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
  *max = top;
  *sum = total;
}

// Which slot rows to ask for while a pass runs: `ahead` are the chunk's own (each key's row
// kPrefetchSlots keys ahead), `next` the thread's next chunk (one row per key).
struct Prefetch {
  const int64_t* ahead = nullptr;
  int64_t ahead_count = 0;
  const int64_t* next = nullptr;
  int64_t next_count = 0;
};

// acc[g] += sum_j probs[g][j] * value_j over n keys of a row at `slots` (acc from zero where
// `first`), CT vectors of a head at a time. A row's values are weighed a block of keys at a time,
// every row of a run in turn, so the block stays in L1 for all of them; each accumulator takes the
// same steps (one FMA per key, in key order) however the keys are blocked.
template <typename C, int G, int CT>
inline void weigh_values(const C* values, const C* value_rows, const int64_t* slots, int64_t n, int64_t kv_stride,
                         int64_t D, const float* probs, float* acc_out, bool first, Prefetch fetch) {
  for (int64_t d0 = 0; d0 < D; d0 += CT * kLanes) {
    Vec acc[G][CT];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < CT; ++c) acc[g][c] = first ? vzero() : vload(acc_out + g * D + d0 + c * kLanes);
    for (int64_t j = 0; j < n; ++j) {
      if (d0 == 0 && j + kPrefetchSlots < fetch.ahead_count)
        prefetch_row(value_rows + fetch.ahead[j + kPrefetchSlots] * kv_stride, kv_stride);
      if (d0 == 0 && j < fetch.next_count) prefetch_row(value_rows + fetch.next[j] * kv_stride, kv_stride);
      const C* value = values + slots[j] * kv_stride + d0;
      Vec v[CT];
      for (int c = 0; c < CT; ++c) v[c] = vload(value + c * kLanes);
      for (int g = 0; g < G; ++g) {
        const Vec p = vbroadcast(probs[g * kChunkSlots + j]);
        for (int c = 0; c < CT; ++c) acc[g][c] = vfma(p, v[c], acc[g][c]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < CT; ++c) vstore(acc_out + g * D + d0 + c * kLanes, acc[g][c]);
  }
}

constexpr int64_t kValueBlock = 16;  // keys whose V rows (one KV head) stay in L1 for a run's rows

// Whether row b reads row a's context and one token more (the next token of the same sequence):
// such rows form a run that shares its chunks. Only where rows run together depends on this; each
// row reads its own slots, so a wrong guess costs time, never a different result.
inline bool continues(const int64_t* lens, const int64_t* slots, int64_t max_context, int64_t a, int64_t b) {
  const int64_t* sa = slots + a * max_context;
  const int64_t* sb = slots + b * max_context;
  return lens[b] == lens[a] + 1 && sa[0] == sb[0] && sa[lens[a] - 1] == sb[lens[a] - 1];
}

template <typename T, typename C, int G, int CT>
void decode_attention(const DecodeBatch<T, C>& b, T* out) {
  write_new_kv(b);  // first: a query attends to itself
  const int64_t D = b.head_dim, kv_stride = b.num_kv_heads * D, heads = b.num_heads, group = heads / b.num_kv_heads;
  const int64_t* lens = b.context_lens;
  auto chunks_of = [&](int64_t s) { return (lens[s] + kChunkSlots - 1) / kChunkSlots; };
  // Each row's chunk states, where a row's chunks start among them.
  std::vector<int64_t> first_chunk(b.num_seqs + 1, 0);
  for (int64_t s = 0; s < b.num_seqs; ++s) first_chunk[s + 1] = first_chunk[s] + chunks_of(s);
  const int64_t state_floats = heads * (2 + D);
  std::vector<float> states(first_chunk[b.num_seqs] * state_floats);
  auto state_of = [&](int64_t s, int64_t c) {
    float* base = states.data() + (first_chunk[s] + c) * state_floats;
    return ChunkState{base, base + heads, base + 2 * heads};
  };
  // Runs of rows and their tasks (a run's chunks: its longest row's, the last). Fewer tasks than
  // threads: every row is a run of its own, so the threads share the rows.
  const int64_t threads = at::get_num_threads();
  std::vector<int64_t> run_first, task_first;
  auto plan = [&](bool together) {
    run_first = {0};
    task_first = {0};
    for (int64_t s = 1; s <= b.num_seqs; ++s) {
      if (s < b.num_seqs && together && continues(lens, b.context_slots, b.max_context, s - 1, s)) continue;
      task_first.push_back(task_first.back() + chunks_of(s - 1));
      run_first.push_back(s);
    }
  };
  plan(true);
  if (task_first.back() < threads) plan(false);
  const int64_t tasks = task_first.back();
  int64_t widest = 1;
  for (size_t r = 0; r + 1 < run_first.size(); ++r) widest = std::max(widest, run_first[r + 1] - run_first[r]);
  // Fewer tasks than threads (batch 1 below kChunkSlots of context) of at least half a chunk's
  // keys: each task's KV heads are tasks of their own, so the threads share the call (the
  // arithmetic of every head is the same). Shorter, one thread is quicker than waking another.
  const int64_t longest = b.num_seqs ? *std::max_element(lens, lens + b.num_seqs) : 0;
  const int64_t parts = tasks < threads && 2 * longest >= kChunkSlots ? b.num_kv_heads : 1;
  const int64_t scale_stride = b.num_kv_heads;
  at::parallel_for(0, tasks * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> query(widest * heads * D), scores(widest * G * kChunkSlots), partial(G * kLanes * kLanes);
    std::vector<int64_t> rows, counts;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t chunk = task / parts;
      const int64_t h_begin = parts == 1 ? 0 : task % parts, h_end = parts == 1 ? b.num_kv_heads : h_begin + 1;
      const int64_t run = std::upper_bound(task_first.begin(), task_first.end(), chunk) - task_first.begin() - 1;
      const int64_t c = chunk - task_first[run], t0 = c * kChunkSlots;
      rows.clear();
      counts.clear();  // each row's keys in this chunk
      for (int64_t s = run_first[run]; s < run_first[run + 1]; ++s)
        if (lens[s] > t0) rows.push_back(s), counts.push_back(std::min(lens[s], t0 + kChunkSlots) - t0);
      const int64_t last = rows.back(), n_last = counts.back();
      for (size_t i = 0; i < rows.size(); ++i) {
        const int64_t s = rows[i];
        const T* cos = b.cos ? b.cos + s * D : nullptr;
        const T* sin = b.sin_signed ? b.sin_signed + s * D : nullptr;
        for (int64_t qh = h_begin * group; qh < h_end * group; ++qh)
          for (int64_t d = 0; d < D; ++d)
            query[(i * heads + qh) * D + d] = rotated(b.q + s * b.row_stride_q + qh * D, cos, sin, d, D) * b.scale;
      }
      const int64_t* ahead = b.context_slots + last * b.max_context + t0;  // the run's every key of this chunk
      Prefetch next;  // this thread's next chunk, while KV heads past the first work from the cache
      if (parts == 1 && chunk + 1 < end && b.num_kv_heads > 1) {
        const int64_t next_run = run + (chunk + 1 == task_first[run + 1]);
        const int64_t next_last = run_first[next_run + 1] - 1;
        const int64_t n0 = (chunk + 1 - task_first[next_run]) * kChunkSlots;
        next.next = b.context_slots + next_last * b.max_context + n0;
        next.next_count = std::min(lens[next_last], n0 + kChunkSlots) - n0;
      }
      for (int64_t h = h_begin; h < h_end; ++h) {
        const C* keys = b.key_cache + h * D;
        const C* values = b.value_cache + h * D;
        const float* key_scales = b.key_scales ? b.key_scales + h : nullptr;
        const float* value_scales = b.value_scales ? b.value_scales + h : nullptr;
        for (int64_t qh0 = h * group; qh0 < (h + 1) * group; qh0 += G) {
          const bool reads = h == h_begin && qh0 == h * group, leads = qh0 == group;
          Prefetch fetch;  // what this pass asks for: its own keys ahead, or the next chunk
          if (reads) fetch.ahead = ahead, fetch.ahead_count = n_last;
          if (leads) fetch.next = next.next, fetch.next_count = next.next_count;
          if (reads)
            for (int64_t t = 0; t < std::min(n_last, kPrefetchSlots); ++t)
              prefetch_row(b.key_cache + ahead[t] * kv_stride, kv_stride);
          for (int64_t j0 = 0; j0 < n_last; j0 += kLanes) {
            for (int64_t j = j0; j < j0 + kLanes; ++j) {
              if (j + kPrefetchSlots < fetch.ahead_count)
                prefetch_row(b.key_cache + ahead[j + kPrefetchSlots] * kv_stride, kv_stride);
              if (j < fetch.next_count) prefetch_row(b.key_cache + fetch.next[j] * kv_stride, kv_stride);
            }
            for (size_t i = 0; i < rows.size(); ++i) {
              if (j0 < counts[i])
                score_keys<C, G, CT>(keys, key_scales, b.context_slots + rows[i] * b.max_context + t0 + j0,
                                     std::min<int64_t>(kLanes, counts[i] - j0), kv_stride, scale_stride, D,
                                     query.data() + (i * heads + qh0) * D, partial.data(),
                                     scores.data() + i * G * kChunkSlots + j0);
            }
          }
          if (reads)  // the values' first rows, during the softmax
            for (int64_t t = 0; t < std::min(n_last, kPrefetchSlots); ++t)
              prefetch_row(b.value_cache + ahead[t] * kv_stride, kv_stride);
          for (size_t i = 0; i < rows.size(); ++i) {
            const int64_t s = rows[i], n = counts[i];
            const int64_t* slots = b.context_slots + s * b.max_context + t0;
            const ChunkState state = state_of(s, c);
            float* probs = scores.data() + i * G * kChunkSlots;
            for (int g = 0; g < G; ++g) {
              softmax_part(probs + g * kChunkSlots, n, state.max + qh0 + g, state.sum + qh0 + g);
              if (value_scales)  // an int8 value's scale, into its weight
                for (int64_t j = 0; j < n; ++j) probs[g * kChunkSlots + j] *= value_scales[slots[j] * scale_stride];
            }
          }
          for (int64_t j0 = 0; j0 < n_last; j0 += kValueBlock) {
            Prefetch block;  // the first row asks for what the pass asks for, a block at a time
            if (reads) block.ahead = ahead + j0, block.ahead_count = n_last - j0;
            if (leads && j0 < next.next_count) block.next = next.next + j0, block.next_count = next.next_count - j0;
            block.next_count = std::min(block.next_count, kValueBlock);
            for (size_t i = 0; i < rows.size(); ++i) {
              const int64_t s = rows[i], n = counts[i];
              if (j0 >= n) continue;
              weigh_values<C, G, CT>(values, b.value_cache, b.context_slots + s * b.max_context + t0 + j0,
                                     std::min(kValueBlock, n - j0), kv_stride, D,
                                     scores.data() + i * G * kChunkSlots + j0, state_of(s, c).acc + qh0 * D,
                                     j0 == 0, i == 0 ? block : Prefetch{});
            }
          }
        }
      }
    }
  });
  // Merge each row's chunks in order: out = sum_i e^(max_i - M) acc_i / sum_i e^(max_i - M) sum_i.
  at::parallel_for(0, b.num_seqs * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / heads, qh = task % heads;
      float top = -INFINITY, total = 0.f;
      for (int64_t c = 0; c < chunks_of(s); ++c) top = std::max(top, state_of(s, c).max[qh]);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t c = 0; c < chunks_of(s); ++c) {
        const ChunkState part = state_of(s, c);
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

// decode_attention for the register tiles that fit: G query heads at a time (1, 2, 3, 4 or 8, the
// largest dividing the group: 1, 2, 3, 4, 6 and 8 cover the common models), CT vectors of a head
// (1 where CT does not divide the head). Few instantiations keep the first build short.
template <typename T, typename C, int G>
void decode_attention_tile(const DecodeBatch<T, C>& b, T* out) {
  constexpr int CT = tile_vectors<G>();
  if ((b.head_dim / kLanes) % CT == 0) return decode_attention<T, C, G, CT>(b, out);
  decode_attention<T, C, G, 1>(b, out);
}

template <typename T, typename C>
void decode_attention_any(const DecodeBatch<T, C>& b, T* out) {
  const int64_t group = b.num_heads / b.num_kv_heads;
  if (group % 8 == 0) return decode_attention_tile<T, C, 8>(b, out);
  if (group % 4 == 0) return decode_attention_tile<T, C, 4>(b, out);
  if (group % 3 == 0) return decode_attention_tile<T, C, 3>(b, out);
  if (group % 2 == 0) return decode_attention_tile<T, C, 2>(b, out);
  decode_attention_tile<T, C, 1>(b, out);
}

}  // namespace
