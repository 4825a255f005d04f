// y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for few rows M (1 to 64) with W held as a GGUF file holds it:
// each row of W a run of ggml blocks (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K; cluster/quant/gguf_blocks.py
// describes the bytes), never widened. Decode steps are bound by reading W, and these formats are 4.5-8.5
// bits a weight.
//
// x is quantized first, every row on its own: each run of 32 inputs to int8 codes with one float32 scale
// (max |x| / 127, codes rounded to nearest) and the codes' sum (and sums per 16 for Q6_K), as llama.cpp
// does for these formats. A 32-weight chunk of W then meets a row of x in integer arithmetic: unsigned
// codes times signed x bytes (`vpmaddubsw`, pairs summed into 16 bits, which cannot overflow for codes
// below 64 or int8 codes), the pairs summed into 8 int32 lanes; the chunk's float scale(s) multiply
// those lanes into a float32 accumulator per row, and the chunk's offset (Q4_0's -8, Q4_1's m, the
// K-quants' mins, Q6_K's -32) is added once per chunk through the sum of x's codes.
//
// A thread takes a contiguous range of W's rows and reads it as one stream; each weight row is decoded
// once per block of up to 4 rows of x, which reuse it from registers. Every row of x is computed by the
// same instructions in the same order whatever M is, so a row's result never depends on the rows beside
// it (a verification row equals a decode row). x and y share a dtype, float32 or bfloat16. 256-bit
// integer vectors (AVX2), which AVX-512 CPUs have too.
//
// With `residual`, what x's codes missed (x - scale * codes) is quantized the same way as a second
// internal row and the two rows' products added: about 15 bits of x instead of 8, twice the integer
// work. Q4_0, Q4_1 and Q8_0 run from tiles of 8 rows instead (below).
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kMaxRows = 64;
constexpr int kRowBlock = 4;
constexpr int kChunk = 32;  // inputs per x scale: every format's scales change at a multiple of it
constexpr int64_t kPrefetchBytes = 4096;  // how far ahead of its reads a thread asks for its stream

enum Format : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

struct FormatInfo {
  int block;  // weights per block
  int bytes;  // bytes per block
};

FormatInfo info_of(int64_t format) {
  switch (format) {
    case kQ4_0: return {32, 18};
    case kQ4_1: return {32, 20};
    case kQ8_0: return {32, 34};
    case kQ4_K: return {256, 144};
    case kQ5_K: return {256, 176};
    case kQ6_K: return {256, 210};
    default: return {0, 0};
  }
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
}

// x's rows quantized per chunk of 32: codes [R, K], scales and code sums [R, K / 32], sums per 16 [R, K / 16],
// where R = M rows of x, or 2M with the residual: row 2m is x's row m, row 2m + 1 what its codes missed
// (x - scale * codes, quantized the same way), so the two rows' products add up to x's with about 15 bits.
struct QuantizedX {
  std::vector<int8_t> codes;
  std::vector<float> scale;
  std::vector<int32_t> sum32, sum16;
  int64_t K;
  int per_row;  // internal rows per row of x: 1, or 2 with the residual
};

template <typename X>
inline void load_chunk(const X* x, float out[kChunk]) {
  for (int i = 0; i < kChunk; ++i) out[i] = static_cast<float>(x[i]);
}

// 32 values -> int8 codes rounded to nearest of max |v| / 127 (the scale returned) and their sums per 16.
inline float quantize_chunk(const float* vals, int8_t* codes, int32_t* sum16) {
  const __m256 sign_mask = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  __m256 v[4], amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(vals + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_mask, v[i]));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float max_abs = _mm_cvtss_f32(m4);
  const __m256 inv = _mm256_set1_ps(max_abs > 0.f ? 127.f / max_abs : 0.f);
  __m256i i32[4];
  for (int i = 0; i < 4; ++i)  // nearest, ties to even (the default rounding mode)
    i32[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
  // int32 -> int8 in order: the packs interleave 128-bit lanes, the permute puts them back
  const __m256i p16a = _mm256_packs_epi32(i32[0], i32[1]), p16b = _mm256_packs_epi32(i32[2], i32[3]);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes),
                      _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b), order));
  int32_t s0 = 0, s1 = 0;
  for (int i = 0; i < 16; ++i) s0 += codes[i];
  for (int i = 16; i < 32; ++i) s1 += codes[i];
  sum16[0] = s0;
  sum16[1] = s1;
  return max_abs / 127.f;
}

QuantizedX quantize_x(const torch::Tensor& x, bool residual) {
  const int64_t M = x.size(0), K = x.size(1), chunks = K / kChunk;
  const int per_row = residual ? 2 : 1;
  const int64_t R = M * per_row;
  QuantizedX q{std::vector<int8_t>(R * K), std::vector<float>(R * chunks), std::vector<int32_t>(R * chunks),
               std::vector<int32_t>(R * K / 16), K, per_row};
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const float* xf = bf16 ? nullptr : x.data_ptr<float>();
  const at::BFloat16* xb = bf16 ? x.data_ptr<at::BFloat16>() : nullptr;
  alignas(32) float vals[kChunk];
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t at = m * K + c * kChunk;
      if (bf16) load_chunk(xb + at, vals); else load_chunk(xf + at, vals);
      for (int part = 0; part < per_row; ++part) {
        const int64_t row = m * per_row + part, index = row * chunks + c;
        int8_t* codes = q.codes.data() + row * K + c * kChunk;
        const float d = quantize_chunk(vals, codes, q.sum16.data() + 2 * index);
        q.scale[index] = d;
        q.sum32[index] = q.sum16[2 * index] + q.sum16[2 * index + 1];
        for (int i = 0; i < kChunk; ++i) vals[i] -= d * static_cast<float>(codes[i]);  // what the codes missed
      }
    }
  }
  return q;
}

// y[m, n] = the sum of x's row m's internal rows' products (+ bias), from sums [R, N].
template <typename Y>
void finish_rows(const QuantizedX& q, const std::vector<float>& sums, int64_t M, int64_t N, const float* bias, Y* y) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      float total = 0.f;
      for (int part = 0; part < q.per_row; ++part) total += sums[(m * q.per_row + part) * N + n];
      y[m * N + n] = static_cast<Y>(total + (bias ? bias[n] : 0.f));
    }
}

inline __m256i dot_u8s8(__m256i w_u8, __m256i x_s8) {  // 32 products summed into 8 int32 lanes
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w_u8, x_s8), _mm256_set1_epi16(1));
}

inline __m256i load32(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// 16 bytes -> 32 codes: the low nibbles (weights 0-15), then the high ones (16-31).
inline __m256i nibbles16(const uint8_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(15));
}
inline __m256i low4(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(15)); }
inline __m256i high4(__m256i v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15)); }

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Pointers of rows m0.. of quantized x, and the per-row accumulators of one weight row (or, for tiles,
// one group of 8 weight rows, a lane each).
template <int R>
struct RowState {
  const int8_t* codes[R];
  const float* scale[R];
  const int32_t* sum32[R];
  const int32_t* sum16[R];
  __m256 acc[R];
  float extra[R];

  RowState(const QuantizedX& q, int64_t m0) {
    const int64_t chunks = q.K / kChunk;
    for (int m = 0; m < R; ++m) {
      codes[m] = q.codes.data() + (m0 + m) * q.K;
      scale[m] = q.scale.data() + (m0 + m) * chunks;
      sum32[m] = q.sum32.data() + (m0 + m) * chunks;
      sum16[m] = q.sum16.data() + (m0 + m) * 2 * chunks;
      acc[m] = _mm256_setzero_ps();
      extra[m] = 0.f;
    }
  }
  // Chunk c of unsigned codes w with float scale `ws` and offset `wo` (w = ws * q + wo).
  inline void add_unsigned(int64_t c, __m256i w, float ws, float wo) {
    for (int m = 0; m < R; ++m) {
      const __m256i dot = dot_u8s8(w, load32(codes[m] + c * kChunk));
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(ws * scale[m][c]), acc[m]);
      extra[m] += wo * scale[m][c] * static_cast<float>(sum32[m][c]);
    }
  }
};

template <int R>
inline void row_q4_0(const uint8_t* w, int64_t chunks, RowState<R>& s) {
  for (int64_t c = 0; c < chunks; ++c, w += 18) {
    _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetchBytes, _MM_HINT_T0);
    const float d = half_at(w);
    s.add_unsigned(c, nibbles16(w + 2), d, -8.f * d);
  }
}

template <int R>
inline void row_q4_1(const uint8_t* w, int64_t chunks, RowState<R>& s) {
  for (int64_t c = 0; c < chunks; ++c, w += 20) {
    _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetchBytes, _MM_HINT_T0);
    s.add_unsigned(c, nibbles16(w + 4), half_at(w), half_at(w + 2));
  }
}

template <int R>
inline void row_q8_0(const uint8_t* w, int64_t chunks, RowState<R>& s) {
  for (int64_t c = 0; c < chunks; ++c, w += 34) {
    _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetchBytes, _MM_HINT_T0);
    const float d = half_at(w);
    const __m256i q = load32(w + 2);
    const __m256i q_abs = _mm256_sign_epi8(q, q);
    for (int m = 0; m < R; ++m) {  // |w| * (x with w's sign): the unsigned-by-signed product
      const __m256i x = _mm256_sign_epi8(load32(s.codes[m] + c * kChunk), q);
      const __m256i dot = dot_u8s8(q_abs, x);
      s.acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * s.scale[m][c]), s.acc[m]);
    }
  }
}

// The eight 6-bit (scale, min) pairs of a Q4_K / Q5_K block.
inline void k_scales(const uint8_t* p, int sc[8], int mn[8]) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = p[j] & 63;
    mn[j] = p[j + 4] & 63;
    sc[j + 4] = (p[j + 8] & 15) | ((p[j] >> 6) << 4);
    mn[j + 4] = (p[j + 8] >> 4) | ((p[j + 4] >> 6) << 4);
  }
}

template <int R, bool kFifthBit>
inline void row_k(const uint8_t* w, int64_t chunks, RowState<R>& s) {
  constexpr int kBytes = kFifthBit ? 176 : 144;
  for (int64_t c0 = 0; c0 < chunks; c0 += 8, w += kBytes) {
    _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetchBytes, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetchBytes + 64, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetchBytes + 128, _MM_HINT_T0);
    const float d = half_at(w), dmin = half_at(w + 2);
    int sc[8], mn[8];
    k_scales(w + 4, sc, mn);
    const uint8_t* qs = w + (kFifthBit ? 48 : 16);
    const __m256i qh = kFifthBit ? load32(w + 16) : _mm256_setzero_si256();
    for (int g = 0; g < 4; ++g) {
      const __m256i bytes = load32(qs + 32 * g);
      for (int half = 0; half < 2; ++half) {
        const int j = 2 * g + half;
        __m256i q = half ? high4(bytes) : low4(bytes);
        if (kFifthBit) {
          const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << j));
          const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit);
          q = _mm256_or_si256(q, _mm256_and_si256(set, _mm256_set1_epi8(16)));
        }
        s.add_unsigned(c0 + j, q, d * static_cast<float>(sc[j]), -dmin * static_cast<float>(mn[j]));
      }
    }
  }
}

template <int R>
inline void row_q6_k(const uint8_t* w, int64_t chunks, RowState<R>& s) {
  for (int64_t c0 = 0; c0 < chunks; c0 += 8, w += 210) {
    for (int line = 0; line < 4; ++line) _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetchBytes + 64 * line, _MM_HINT_T0);
    const float d = half_at(w + 208);
    const int8_t* scales = reinterpret_cast<const int8_t*>(w + 192);
    for (int c = 0; c < 8; ++c) {
      const int h = c / 4, r = c % 4;
      const __m256i ql = load32(w + 64 * h + 32 * (r % 2));
      const __m256i qh = load32(w + 128 + 32 * h);
      const __m256i high = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * r), _mm256_set1_epi8(3));
      const __m256i q = _mm256_or_si256(r < 2 ? low4(ql) : high4(ql), _mm256_slli_epi16(high, 4));  // 0..63
      const int sa = scales[2 * c], sb = scales[2 * c + 1];
      const __m256i sv = _mm256_set_m128i(_mm_set1_epi16(static_cast<int16_t>(sb)),
                                          _mm_set1_epi16(static_cast<int16_t>(sa)));
      const int64_t chunk = c0 + c;
      for (int m = 0; m < R; ++m) {  // each 16-weight half's products times its scale, in integers
        const __m256i pairs = _mm256_maddubs_epi16(q, load32(s.codes[m] + chunk * kChunk));
        const __m256i dot = _mm256_madd_epi16(pairs, sv);
        const float dx = d * s.scale[m][chunk];
        s.acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(dx), s.acc[m]);
        s.extra[m] -= 32.f * dx *
                      static_cast<float>(sa * s.sum16[m][2 * chunk] + sb * s.sum16[m][2 * chunk + 1]);
      }
    }
  }
}

template <int R>
inline void weight_row(int64_t format, const uint8_t* w, int64_t chunks, RowState<R>& s) {
  switch (format) {
    case kQ4_0: row_q4_0(w, chunks, s); break;
    case kQ4_1: row_q4_1(w, chunks, s); break;
    case kQ8_0: row_q8_0(w, chunks, s); break;
    case kQ4_K: row_k<R, false>(w, chunks, s); break;
    case kQ5_K: row_k<R, true>(w, chunks, s); break;
    default: row_q6_k(w, chunks, s); break;
  }
}

template <int R>
inline void rows_against(int64_t format, const uint8_t* w, const QuantizedX& q, int64_t m0, int64_t n, int64_t N,
                         float* y) {
  RowState<R> s(q, m0);
  weight_row<R>(format, w, q.K / kChunk, s);
  for (int m = 0; m < R; ++m) y[(m0 + m) * N + n] = hsum(s.acc[m]) + s.extra[m];
}

// sums [M, N] of M internal rows of q against every weight row.
void run(int64_t format, const uint8_t* w, int64_t row_bytes, const QuantizedX& q, int64_t M, int64_t N, float* y) {
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* row = w + n * row_bytes;
      for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
        switch (std::min<int64_t>(kRowBlock, M - m0)) {
          case 4: rows_against<4>(format, row, q, m0, n, N, y); break;
          case 3: rows_against<3>(format, row, q, m0, n, N, y); break;
          case 2: rows_against<2>(format, row, q, m0, n, N, y); break;
          default: rows_against<1>(format, row, q, m0, n, N, y); break;
        }
      }
    }
  });
}

// --- Tiles of 8 weight rows (cluster/quant/gguf_tiles.py lays them out) ------------------------------
//
// Q4_0, Q4_1 and Q8_0 rows repacked, values unchanged, so that one 256-bit vector holds 4 consecutive codes
// of each of 8 rows (row r in 32-bit lane r): a broadcast of 4 of x's bytes against it gives, through
// `vpmaddubsw` and `vpmaddwd`, each row's partial dot product in its own lane, and a chunk's 8 rows come
// out as one vector with no horizontal sums. A tile is one chunk of 32 inputs of 8 rows:
//   affine4 (Q4_0, Q4_1): 128 bytes of codes (vector v: step v in the low nibbles, step v + 4 in the high
//     ones; step s = inputs 4s..4s+3), then float16 scale[8] and offset[8] (w = scale * q + offset;
//     Q4_0's offset is -8 * d, exact in float16);
//   int8 (Q8_0): 256 bytes of codes (vector s = step s), then float16 scale[8].
// A group of 8 rows is its K / 32 tiles in order: one stream.

constexpr int kTileRows = 8;
constexpr int kAffine4Bytes = 128 + 32;
constexpr int kInt8Bytes = 256 + 16;

inline __m256 load_halves8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

template <int R>
inline void group_affine4(const uint8_t* tile, int64_t chunks, RowState<R>& t) {
  const __m256i low_mask = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  for (int64_t c = 0; c < chunks; ++c, tile += kAffine4Bytes) {
    _mm_prefetch(reinterpret_cast<const char*>(tile) + kPrefetchBytes, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(tile) + kPrefetchBytes + 64, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(tile) + kPrefetchBytes + 128, _MM_HINT_T0);
    __m256i q[8];
    for (int v = 0; v < 4; ++v) {
      const __m256i bytes = load32(tile + 32 * v);
      q[v] = _mm256_and_si256(bytes, low_mask);
      q[v + 4] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low_mask);
    }
    const __m256 scale = load_halves8(tile + 128), offset = load_halves8(tile + 144);
    for (int m = 0; m < R; ++m) {
      const int8_t* x = t.codes[m] + c * kChunk;
      // 4-bit codes: 8 steps of pair sums stay below 8 * 2 * 15 * 127 < 2^15 in 16 bits
      __m256i pairs = _mm256_maddubs_epi16(q[0], broadcast4(x));
      for (int s = 1; s < 8; ++s) pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(q[s], broadcast4(x + 4 * s)));
      const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
      const float dx = t.scale[m][c];
      t.acc[m] = _mm256_fmadd_ps(dot, _mm256_mul_ps(scale, _mm256_set1_ps(dx)), t.acc[m]);
      t.acc[m] = _mm256_fmadd_ps(offset, _mm256_set1_ps(dx * static_cast<float>(t.sum32[m][c])), t.acc[m]);
    }
  }
}

template <int R>
inline void group_int8(const uint8_t* tile, int64_t chunks, RowState<R>& t) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t c = 0; c < chunks; ++c, tile += kInt8Bytes) {
    for (int line = 0; line < 5; ++line) _mm_prefetch(reinterpret_cast<const char*>(tile) + kPrefetchBytes + 64 * line, _MM_HINT_T0);
    __m256i q[8], q_abs[8];
    for (int s = 0; s < 8; ++s) {
      q[s] = load32(tile + 32 * s);
      q_abs[s] = _mm256_sign_epi8(q[s], q[s]);
    }
    const __m256 scale = load_halves8(tile + 256);
    for (int m = 0; m < R; ++m) {
      const int8_t* x = t.codes[m] + c * kChunk;
      __m256i dot = _mm256_setzero_si256();
      for (int s = 0; s < 8; ++s) {  // |w| * (x with w's sign); pair sums up to 2 * 128 * 127 fit 16 bits once
        const __m256i xs = _mm256_sign_epi8(broadcast4(x + 4 * s), q[s]);
        dot = _mm256_add_epi32(dot, _mm256_madd_epi16(_mm256_maddubs_epi16(q_abs[s], xs), ones));
      }
      t.acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(scale, _mm256_set1_ps(t.scale[m][c])), t.acc[m]);
    }
  }
}

template <int R>
inline void tile_rows_against(bool affine4, const uint8_t* group, const QuantizedX& q, int64_t m0, int64_t n0,
                              int64_t N, float* y) {
  RowState<R> t(q, m0);
  const int64_t chunks = q.K / kChunk;
  if (affine4) group_affine4<R>(group, chunks, t); else group_int8<R>(group, chunks, t);
  const int valid = static_cast<int>(std::min<int64_t>(kTileRows, N - n0));
  for (int m = 0; m < R; ++m) {
    alignas(32) float out[kTileRows];
    _mm256_store_ps(out, t.acc[m]);
    for (int r = 0; r < valid; ++r) y[(m0 + m) * N + n0 + r] = out[r];
  }
}

void run_tiles(bool affine4, const uint8_t* tiles, int64_t group_bytes, const QuantizedX& q, int64_t M, int64_t N,
               float* y) {
  const int64_t groups = (N + kTileRows - 1) / kTileRows;
  at::parallel_for(0, groups, 4, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const uint8_t* group = tiles + g * group_bytes;
      for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
        switch (std::min<int64_t>(kRowBlock, M - m0)) {
          case 4: tile_rows_against<4>(affine4, group, q, m0, g * kTileRows, N, y); break;
          case 3: tile_rows_against<3>(affine4, group, q, m0, g * kTileRows, N, y); break;
          case 2: tile_rows_against<2>(affine4, group, q, m0, g * kTileRows, N, y); break;
          default: tile_rows_against<1>(affine4, group, q, m0, g * kTileRows, N, y); break;
        }
      }
    }
  });
}

torch::Tensor finish(const QuantizedX& q, const std::vector<float>& sums, const std::vector<float>& bias,
                     const torch::Tensor& x, int64_t N) {
  const int64_t M = x.size(0);
  torch::Tensor y = torch::empty({M, N}, x.options());
  const float* b = bias.empty() ? nullptr : bias.data();
  if (y.scalar_type() == at::kFloat)
    finish_rows(q, sums, M, N, b, y.data_ptr<float>());
  else
    finish_rows(q, sums, M, N, b, y.data_ptr<at::BFloat16>());
  return y;
}

std::vector<float> checked_bias(const std::optional<torch::Tensor>& bias, int64_t N, const char* name) {
  std::vector<float> out;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, name, ": bias has ", bias->numel(), " values, need ", N);
    const torch::Tensor b = bias->to(at::kFloat).contiguous();
    out.assign(b.data_ptr<float>(), b.data_ptr<float>() + N);
  }
  return out;
}

void check_x(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu(), name, " runs on the CPU");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), name, ": x must be a contiguous [rows, in_features]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, name,
              ": x must be float32 or bfloat16");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, name, " takes 1 to ", kMaxRows, " rows, got ", x.size(0));
  TORCH_CHECK(x.size(1) % kChunk == 0, name, ": in_features ", x.size(1), " is not a multiple of ", kChunk);
}

// kind: 0 affine4 (Q4_0, Q4_1), 1 int8 (Q8_0); tiles: uint8 [ceil(N / 8), K / 32 * tile bytes].
torch::Tensor linear_tiles(torch::Tensor x, torch::Tensor tiles, int64_t kind, int64_t out_features,
                           std::optional<torch::Tensor> bias, bool residual) {
  const char* name = "gguf_gemm.linear_tiles";
  check_x(x, name);
  TORCH_CHECK(kind == 0 || kind == 1, name, ": kind is 0 (affine4) or 1 (int8), got ", kind);
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  const int64_t tile_bytes = kind == 0 ? kAffine4Bytes : kInt8Bytes;
  TORCH_CHECK(tiles.dim() == 2 && tiles.scalar_type() == at::kByte && tiles.is_contiguous() &&
                  tiles.size(0) == (N + kTileRows - 1) / kTileRows && tiles.size(1) == K / kChunk * tile_bytes,
              name, ": the tiles must be laid out by cluster.quant.gguf_tiles for ", N, " rows of ", K, " inputs");
  const std::vector<float> bias_f32 = checked_bias(bias, N, name);
  const QuantizedX q = quantize_x(x, residual);
  std::vector<float> sums(M * q.per_row * N);
  run_tiles(kind == 0, tiles.data_ptr<uint8_t>(), tiles.size(1), q, M * q.per_row, N, sums.data());
  return finish(q, sums, bias_f32, x, N);
}

torch::Tensor linear(torch::Tensor x, torch::Tensor weight, int64_t format, std::optional<torch::Tensor> bias,
                     bool residual) {
  const FormatInfo fi = info_of(format);
  TORCH_CHECK(fi.block > 0, "gguf_gemm.linear: ggml type ", format,
              " is not served; served: Q4_0 (2), Q4_1 (3), Q8_0 (8), Q4_K (12), Q5_K (13), Q6_K (14)");
  check_x(x, "gguf_gemm.linear");
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 && weight.scalar_type() == at::kByte && weight.is_contiguous(),
              "gguf_gemm.linear: the weight must be a contiguous CPU uint8 [out_features, row_bytes]");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(K % fi.block == 0 && weight.size(1) == K / fi.block * fi.bytes, "gguf_gemm.linear: x has ", K,
              " features, the weight's rows ", weight.size(1), " bytes of ", fi.bytes, "-byte blocks of ", fi.block);
  const std::vector<float> bias_f32 = checked_bias(bias, N, "gguf_gemm.linear");
  const QuantizedX q = quantize_x(x, residual);
  std::vector<float> sums(M * q.per_row * N);
  run(format, weight.data_ptr<uint8_t>(), weight.size(1), q, M * q.per_row, N, sums.data());
  return finish(q, sums, bias_f32, x, N);
}

// The int8 codes, scales and sums x is quantized to (for tests: the reference computes from them).
std::vector<torch::Tensor> quantize_activations(torch::Tensor x, bool residual) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % kChunk == 0 &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "gguf_gemm.quantize_activations: a contiguous float32 or bfloat16 [rows, K], K a multiple of 32");
  const QuantizedX q = quantize_x(x, residual);
  const int64_t R = x.size(0) * q.per_row, chunks = x.size(1) / kChunk;
  torch::Tensor codes = torch::empty({R, x.size(1)}, torch::kChar), scale = torch::empty({R, chunks}, torch::kFloat);
  std::copy(q.codes.begin(), q.codes.end(), codes.data_ptr<int8_t>());
  std::copy(q.scale.begin(), q.scale.end(), scale.data_ptr<float>());
  return {codes, scale};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, "y = x @ W.T (+ bias) for 1 to max_rows rows, W as ggml blocks of the given type; "
        "residual: x's codes and what they missed (about 15 bits) instead of its codes alone (8)");
  m.def("linear_tiles", &linear_tiles, "the same on Q4_0 / Q4_1 (kind 0) or Q8_0 (kind 1) rows in tiles of 8");
  m.def("quantize_activations", &quantize_activations,
        "x's int8 codes and scales per 32 inputs (with the residual: rows 2m and 2m + 1 for x's row m)");
  m.attr("max_rows") = kMaxRows;
}
