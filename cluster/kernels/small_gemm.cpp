// y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for few rows M: the decode and draft-verification
// shape, where a step is bound by reading W once from memory.
//
// `pack` lays W out as tiles of 4 output rows, [ceil(N / 4), K / C, 4, C] with C elements =
// one 64-byte cache line (rows past N are zero), so a thread reads its tiles as one
// sequential stream. `linear` computes each tile for every row of x, 4 rows of x per pass:
// the first pass brings the tile into L1/L2 and later passes reuse it, so reading W costs
// about the same for 1 row as for 4. Accumulation is float32. W is float32 or bfloat16; x
// and y share one dtype (float32 or bfloat16). bfloat16 weights use the AVX-512 BF16 pair
// dot product where the CPU has it and x is bfloat16; elsewhere they are widened to float32
// in registers (a 16-bit shift). Tiles are split over ATen's intra-op threads. build.py
// compiles this for the host CPU (-march=native); `capabilities()` says which paths it holds.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include "simd.h"

#include <algorithm>
#include <type_traits>
#include <vector>

namespace {

constexpr int kTileRows = 4;     // weight rows per tile
constexpr int kRowBlock = 4;     // rows of x per pass over a tile
constexpr int kLineBytes = 64;   // one packed chunk: a cache line of one weight row
constexpr int64_t kMaxRows = 64;


template <typename W>
constexpr int chunk_elems() { return kLineBytes / static_cast<int>(sizeof(W)); }

// M rows of x (float32) against one packed tile: out[r * M + m].
template <int M, typename W>
inline void tile_fma(const float* x, const W* tile, int64_t K, float* out) {
  constexpr int C = chunk_elems<W>();
  Vec acc[kTileRows][M];
  for (int r = 0; r < kTileRows; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = vzero();
  for (int64_t k = 0; k < K; k += C, tile += kTileRows * C) {
    for (int r = 0; r < kTileRows; ++r) prefetch_ahead(tile + r * C);
    for (int s = 0; s < C; s += kLanes) {
      Vec wv[kTileRows];
      for (int r = 0; r < kTileRows; ++r) wv[r] = vload(tile + r * C + s);
      for (int m = 0; m < M; ++m) {
        Vec xv = vload(x + m * K + k + s);
        for (int r = 0; r < kTileRows; ++r) acc[r][m] = vfma(wv[r], xv, acc[r][m]);
      }
    }
  }
  for (int r = 0; r < kTileRows; ++r)
    for (int m = 0; m < M; ++m) out[r * M + m] = vsum(acc[r][m]);
}

#if defined(__AVX512BF16__)
constexpr bool kHasDpbf16 = true;

// A vector's lane sum in one fixed order: the four 128-bit blocks first, (B0 + B2) + (B1 + B3)
// at each of the four positions, then the positions, (s0 + s2) + (s1 + s3). Written out here
// (not _mm512_reduce_add_ps, whose order is the compiler's) so lane_sums16 can match it.
inline float lane_sum(__m512 v) {
  const __m256 halves = _mm256_add_ps(_mm512_castps512_ps256(v),
                                      _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(halves), _mm256_extractf128_ps(halves, 1));
  const __m128 pairs = _mm_add_ps(s, _mm_movehl_ps(s, s));  // [s0 + s2, s1 + s3, ...]
  return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_movehdup_ps(pairs)));
}

// The lane sums of 16 vectors at once, each added in lane_sum's order (so a row's result
// is the same bits whether it was reduced alone or beside 15 others): blocks across pairs
// of vectors, then positions within blocks, by transposing shuffles. Vector i's sum lands
// in lane 4 * (i % 4) + i / 4.
inline __m512 lane_sums16(const __m512 v[16]) {
  __m512 w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i)  // [a.B0 + a.B2, a.B1 + a.B3, b.B0 + b.B2, b.B1 + b.B3]
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 4; ++i)  // block j: the four position sums s0..s3 of v[4i + j]
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int i = 0; i < 2; ++i)  // block j: [s0 + s2, s0 + s2, s1 + s3, s1 + s3] of two vectors
    y[i] = _mm512_add_ps(_mm512_unpacklo_ps(x[2 * i], x[2 * i + 1]), _mm512_unpackhi_ps(x[2 * i], x[2 * i + 1]));
  return _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(1, 0, 1, 0)),
                       _mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(3, 2, 3, 2)));
}

// bfloat16 x and W: one instruction multiplies 32 pairs into 16 float32 lanes.
template <int M>
inline void tile_dpbf16(const at::BFloat16* x, const at::BFloat16* tile, int64_t K, float* out) {
  static_assert(kTileRows * M <= 16, "lane_sums16 reduces at most 16 accumulators");
  constexpr int C = chunk_elems<at::BFloat16>();  // 32: one instruction's pairs
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += C, tile += kTileRows * C) {
    __m512bh wv[kTileRows];
    for (int r = 0; r < kTileRows; ++r) {
      prefetch_ahead(tile + r * C);
      wv[r] = (__m512bh)_mm512_loadu_si512(tile + r * C);
    }
    for (int m = 0; m < M; ++m) {
      __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * K + k);
      for (int r = 0; r < kTileRows; ++r) acc[r * M + m] = _mm512_dpbf16_ps(acc[r * M + m], wv[r], xv);
    }
  }
  if constexpr (M == 1) {  // 4 sums: one by one is cheaper than a 16-wide transpose
    for (int i = 0; i < kTileRows; ++i) out[i] = lane_sum(acc[i]);
  } else {
    alignas(64) float sums[16];
    _mm512_store_ps(sums, lane_sums16(acc));
    for (int i = 0; i < kTileRows * M; ++i) out[i] = sums[4 * (i % 4) + i / 4];
  }
}
#else
constexpr bool kHasDpbf16 = false;
#endif

template <int M, typename W, typename X>
inline void run_tile(const X* x_native, const float* x_f32, const W* tile, int64_t K, float* out) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<W, at::BFloat16> && std::is_same_v<X, at::BFloat16>) {
    tile_dpbf16<M>(x_native, tile, K, out);
    return;
  }
#endif
  tile_fma<M, W>(x_f32, tile, K, out);
}

template <typename W, typename X>
void gemm(int64_t rows, const X* x, const float* x_f32, const W* packed, const float* bias, X* y, int64_t N,
          int64_t K) {
  const int64_t num_tiles = (N + kTileRows - 1) / kTileRows;
  at::parallel_for(0, num_tiles, 16, [&](int64_t begin, int64_t end) {
    float sums[kTileRows * kRowBlock];
    for (int64_t t = begin; t < end; ++t) {
      const W* tile = packed + t * kTileRows * K;
      const int64_t n0 = t * kTileRows;
      const int valid = static_cast<int>(std::min<int64_t>(kTileRows, N - n0));
      for (int64_t m0 = 0; m0 < rows; m0 += kRowBlock) {
        const int block = static_cast<int>(std::min<int64_t>(kRowBlock, rows - m0));
        const X* xb = x + m0 * K;
        const float* xfb = x_f32 ? x_f32 + m0 * K : nullptr;
        switch (block) {
          case 4: run_tile<4, W, X>(xb, xfb, tile, K, sums); break;
          case 3: run_tile<3, W, X>(xb, xfb, tile, K, sums); break;
          case 2: run_tile<2, W, X>(xb, xfb, tile, K, sums); break;
          default: run_tile<1, W, X>(xb, xfb, tile, K, sums); break;
        }
        for (int r = 0; r < valid; ++r)
          for (int m = 0; m < block; ++m)
            y[(m0 + m) * N + n0 + r] = static_cast<X>(sums[r * block + m] + (bias ? bias[n0 + r] : 0.f));
      }
    }
  });
}

void check_dtype(at::ScalarType t, const char* what) {
  TORCH_CHECK(t == at::kFloat || t == at::kBFloat16, "small_gemm: ", what, " must be float32 or bfloat16");
}

// W [N, K] -> [ceil(N / 4), K / C, 4, C], zero rows past N.
torch::Tensor pack(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2, "small_gemm.pack: weight must be [out_features, in_features]");
  check_dtype(weight.scalar_type(), "weight");
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t C = kLineBytes / weight.element_size();
  TORCH_CHECK(K % C == 0, "small_gemm.pack: in_features must be a multiple of ", C, ", got ", K);
  const int64_t num_tiles = (N + kTileRows - 1) / kTileRows;
  auto padded = torch::zeros({num_tiles * kTileRows, K}, weight.options().device(at::kCPU));
  padded.narrow(0, 0, N).copy_(weight);
  return padded.view({num_tiles, kTileRows, K / C, C}).transpose(1, 2).contiguous();
}

torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t out_features,
                     std::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "small_gemm runs on the CPU");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "small_gemm: x must be a contiguous [rows, in_features]");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kTileRows && packed.is_contiguous(),
              "small_gemm: the weight must come from small_gemm.pack");
  check_dtype(x.scalar_type(), "x");
  check_dtype(packed.scalar_type(), "weight");
  const int64_t rows = x.size(0), K = x.size(1), N = out_features;
  TORCH_CHECK(packed.size(1) * packed.size(3) == K, "small_gemm: x has ", K, " features, the weight ",
              packed.size(1) * packed.size(3));
  TORCH_CHECK(N > (packed.size(0) - 1) * kTileRows && N <= packed.size(0) * kTileRows,
              "small_gemm: out_features ", N, " does not match the packed weight");
  TORCH_CHECK(rows >= 1 && rows <= kMaxRows, "small_gemm takes 1 to ", kMaxRows, " rows, got ", rows);
  torch::Tensor bias_f32;
  const float* bias_ptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "small_gemm: bias has ", bias->numel(), " values, need ", N);
    bias_f32 = bias->to(at::kFloat).contiguous();
    bias_ptr = bias_f32.data_ptr<float>();
  }
  const auto xt = x.scalar_type(), wt = packed.scalar_type();
  auto y = torch::empty({rows, N}, x.options());
  // The FMA path reads x as float32; the bfloat16 pair path reads x in bfloat16 itself.
  const bool pair_path = kHasDpbf16 && xt == at::kBFloat16 && wt == at::kBFloat16;
  torch::Tensor x_f32 = (xt == at::kFloat || pair_path) ? x : x.to(at::kFloat);
  const float* xf = pair_path ? nullptr : x_f32.data_ptr<float>();
  if (xt == at::kFloat && wt == at::kFloat)
    gemm<float, float>(rows, x.data_ptr<float>(), xf, packed.data_ptr<float>(), bias_ptr, y.data_ptr<float>(), N, K);
  else if (xt == at::kFloat)
    gemm<at::BFloat16, float>(rows, x.data_ptr<float>(), xf, packed.data_ptr<at::BFloat16>(), bias_ptr,
                              y.data_ptr<float>(), N, K);
  else if (wt == at::kBFloat16)
    gemm<at::BFloat16, at::BFloat16>(rows, x.data_ptr<at::BFloat16>(), xf, packed.data_ptr<at::BFloat16>(),
                                     bias_ptr, y.data_ptr<at::BFloat16>(), N, K);
  else
    gemm<float, at::BFloat16>(rows, x.data_ptr<at::BFloat16>(), xf, packed.data_ptr<float>(), bias_ptr,
                              y.data_ptr<at::BFloat16>(), N, K);
  return y;
}

std::vector<std::string> capabilities() {
  std::vector<std::string> caps = {kLanes == 16 ? "avx512-fma" : "avx2-fma"};
  if (kHasDpbf16) caps.push_back("avx512-bf16-pairs");
  return caps;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "lay a [out, in] weight out in the kernel's tiles");
  m.def("linear", &linear, "y = x @ W.T (+ bias) for 1 to max_rows rows, W from pack()");
  m.def("capabilities", &capabilities, "the vector paths this build holds");
  m.attr("max_rows") = kMaxRows;
}
