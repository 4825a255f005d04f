// y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for few rows M (1 to 16) with W held in 8 or 4 bits: the
// shape of a quantized draft's passes and of a quantized target's decode steps, where a step is
// bound by reading W once. Each weight byte is read once per call; rows of x reuse it from L1.
//
// int8 (`linear_int8`): W = W8 * scale[n], per output channel, W8 in [-127, 127]. A lane vector of
// W8 is sign-extended and converted to float32 in registers and multiplied with float32 FMAs; the
// per-channel scale multiplies the finished sum.
//
// int4 (`linear_int4`): W = q * scale[n, g] + offset[n, g], q in [0, 15], per group g of G
// consecutive inputs of a row (asymmetric; scale and offset float16). With bfloat16 x on a CPU with
// AVX-512-BF16 a nibble or'ed into bfloat16 128.0 gives 128 + q exactly and the pair dot product
// does the multiplying; elsewhere q is converted to float32, rebuilt (q * scale + offset, one FMA)
// and multiplied with float32 FMAs.
//
// Both read tiles of 4 output rows in one sequential stream per thread; the layouts are made by
// cluster/quant/lowbit_pack.py (int8 [ceil(N / 4), K / 64, 4, 64]; int4 bytes [ceil(N / 4), K / G,
// 4, G / 2], where in each run of 64 inputs byte j holds input j in its low nibble and input 32 + j
// in its high one, and float16 (scale, offset) [ceil(N / 4), K / G, 4, 2]).
//
// Every row of x is computed by the same instructions in the same order whatever M is, so a row's
// result never depends on how many rows share the call (verification rows equal decode rows).
// Accumulation is float32; x and y share one dtype, float32 or bfloat16. Tiles are split over
// ATen's intra-op threads. build.py compiles this for the host CPU (AVX2 with FMA, or AVX-512).
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include "simd.h"

#include <algorithm>

namespace {

constexpr int kTileRows = 4;   // weight rows per tile
constexpr int kRowBlock = 4;   // rows of x per pass over a tile
constexpr int kLine = 64;      // int8 weights per row per packed line
constexpr int kRun = 64;       // int4 inputs per packed run: 32 bytes of a row
constexpr int64_t kMaxRows = 16;

// Sign-extend `kLanes` int8 at p to float32 lanes.
inline Vec load_int8(const int8_t* p) {
#if defined(__AVX512F__)
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#endif
}

// `kLanes` bytes at p, zero-extended to int32 lanes: the low nibbles are one lane vector of q, the
// high nibbles the next.
#if defined(__AVX512F__)
using IVec = __m512i;
inline IVec load_nibble_bytes(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline Vec low_nibbles(IVec v) { return _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15))); }
inline Vec high_nibbles(IVec v) { return _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)); }
#else
using IVec = __m256i;
inline IVec load_nibble_bytes(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline Vec low_nibbles(IVec v) { return _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15))); }
inline Vec high_nibbles(IVec v) { return _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)); }
#endif

// A tile's (scale, offset) pairs of one group, 4 rows of 2 float16, widened to float32 at once.
inline void group_params(const at::Half* params, float out[2 * kTileRows]) {
  _mm256_storeu_ps(out, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(params))));
}

// M rows of x (float32, row stride K) against one int8 tile: raw sums out[r * M + m], unscaled.
template <int M>
inline void tile_int8(const float* x, const int8_t* tile, int64_t K, float* out) {
  Vec acc[kTileRows][M];
  for (int r = 0; r < kTileRows; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = vzero();
  for (int64_t k = 0; k < K; k += kLine, tile += kTileRows * kLine) {
    for (int r = 0; r < kTileRows; ++r) prefetch_ahead(tile + r * kLine);
    for (int s = 0; s < kLine; s += kLanes) {
      Vec xv[M];
      for (int m = 0; m < M; ++m) xv[m] = vload(x + m * K + k + s);
      for (int r = 0; r < kTileRows; ++r) {
        const Vec wv = load_int8(tile + r * kLine + s);
        for (int m = 0; m < M; ++m) acc[r][m] = vfma(wv, xv[m], acc[r][m]);
      }
    }
  }
  for (int r = 0; r < kTileRows; ++r)
    for (int m = 0; m < M; ++m) out[r * M + m] = vsum(acc[r][m]);
}

// M rows of x (float32) against one int4 tile (groups of G inputs): finished sums out[r * M + m].
// Each run of 64 inputs is 32 bytes a row: byte j holds input j (low nibble) and 32 + j (high).
template <int M>
inline void tile_int4_fma(const float* x, const uint8_t* tile, const at::Half* params, int64_t K, int64_t G,
                          float* out) {
  Vec acc[kTileRows][M];
  for (int r = 0; r < kTileRows; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = vzero();
  const int64_t group_bytes = G / 2;
  for (int64_t k0 = 0; k0 < K; k0 += G, tile += kTileRows * group_bytes, params += 2 * kTileRows) {
    float p[2 * kTileRows];
    group_params(params, p);
    for (int64_t b = 0; b < G; b += kRun) {
      for (int r = 0; r < kTileRows; ++r) prefetch_ahead(tile + r * group_bytes + b / 2);
      for (int o = 0; o < kRun / 2; o += kLanes) {
        Vec x_lo[M], x_hi[M];
        for (int m = 0; m < M; ++m) {
          x_lo[m] = vload(x + m * K + k0 + b + o);
          x_hi[m] = vload(x + m * K + k0 + b + kRun / 2 + o);
        }
        for (int r = 0; r < kTileRows; ++r) {
          const Vec scale = vbroadcast(p[2 * r]);
          const Vec offset = vbroadcast(p[2 * r + 1]);
          const IVec bytes = load_nibble_bytes(tile + r * group_bytes + b / 2 + o);
          const Vec w_lo = vfma(low_nibbles(bytes), scale, offset);
          const Vec w_hi = vfma(high_nibbles(bytes), scale, offset);
          for (int m = 0; m < M; ++m) acc[r][m] = vfma(w_hi, x_hi[m], vfma(w_lo, x_lo[m], acc[r][m]));
        }
      }
    }
  }
  for (int r = 0; r < kTileRows; ++r)
    for (int m = 0; m < M; ++m) out[r * M + m] = vsum(acc[r][m]);
}

#if defined(__AVX512BF16__)
constexpr bool kHasDpbf16 = true;

// The same with bfloat16 x, by the pair dot product: a nibble q or'ed into bfloat16 128.0 is
// exactly 128 + q, so a group's pair products sum to D = sum(x * q) + 128 * sum(x), and the group
// adds scale * D + (offset - 128 * scale) * sum(x). xsum: [M, K / G] float32 group sums of x.
template <int M>
inline void tile_int4_dpbf16(const at::BFloat16* x, const float* xsum, const uint8_t* tile, const at::Half* params,
                             int64_t K, int64_t G, float* out) {
  __m512 acc[kTileRows][M];
  float extra[kTileRows][M] = {};
  for (int r = 0; r < kTileRows; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  const int64_t group_bytes = G / 2, groups = K / G;
  const __m512i low_mask = _mm512_set1_epi16(0x000F), bf16_128 = _mm512_set1_epi16(0x4300);
  for (int64_t g = 0; g < groups; ++g, tile += kTileRows * group_bytes, params += 2 * kTileRows) {
    const int64_t k0 = g * G;
    float p[2 * kTileRows];
    group_params(params, p);
    __m512 scale[kTileRows];
    for (int r = 0; r < kTileRows; ++r) {
      scale[r] = _mm512_set1_ps(p[2 * r]);
      const float shift = p[2 * r + 1] - 128.f * p[2 * r];
      for (int m = 0; m < M; ++m) extra[r][m] += shift * xsum[m * groups + g];
    }
    for (int64_t b = 0; b < G; b += kRun) {  // scale * D of each run: the group's scale is the run's
      __m512bh x_lo[M], x_hi[M];
      for (int m = 0; m < M; ++m) {
        x_lo[m] = (__m512bh)_mm512_loadu_si512(x + m * K + k0 + b);
        x_hi[m] = (__m512bh)_mm512_loadu_si512(x + m * K + k0 + b + kRun / 2);
      }
      for (int r = 0; r < kTileRows; ++r) {
        prefetch_ahead(tile + r * group_bytes + b / 2);
        const __m512i bytes =
            _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + r * group_bytes + b / 2)));
        const __m512bh w_lo = (__m512bh)_mm512_or_si512(_mm512_and_si512(bytes, low_mask), bf16_128);
        const __m512bh w_hi = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(bytes, 4), bf16_128);
        for (int m = 0; m < M; ++m) {
          const __m512 dot = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), w_lo, x_lo[m]), w_hi, x_hi[m]);
          acc[r][m] = _mm512_fmadd_ps(dot, scale[r], acc[r][m]);
        }
      }
    }
  }
  for (int r = 0; r < kTileRows; ++r)
    for (int m = 0; m < M; ++m) out[r * M + m] = _mm512_reduce_add_ps(acc[r][m]) + extra[r][m];
}
#else
constexpr bool kHasDpbf16 = false;
#endif

// The rows of x in blocks of kRowBlock against every tile; `tile_fn(block, m0, t, sums)` fills sums
// for rows m0..m0+block-1 and tile t, `scale_of(n)` multiplies each finished sum (1 for int4).
template <typename X, typename TileFn, typename ScaleFn>
void run_tiles(int64_t rows, int64_t N, const float* bias, X* y, TileFn tile_fn,
               ScaleFn scale_of) {
  const int64_t num_tiles = (N + kTileRows - 1) / kTileRows;
  at::parallel_for(0, num_tiles, 16, [&](int64_t begin, int64_t end) {
    float sums[kTileRows * kRowBlock];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kTileRows;
      const int valid = static_cast<int>(std::min<int64_t>(kTileRows, N - n0));
      for (int64_t m0 = 0; m0 < rows; m0 += kRowBlock) {
        const int block = static_cast<int>(std::min<int64_t>(kRowBlock, rows - m0));
        tile_fn(block, m0, t, sums);
        for (int r = 0; r < valid; ++r)
          for (int m = 0; m < block; ++m)
            y[(m0 + m) * N + n0 + r] =
                static_cast<X>(sums[r * block + m] * scale_of(n0 + r) + (bias ? bias[n0 + r] : 0.f));
      }
    }
  });
}

struct Call {  // x as float32 (and, for int4 groups of G, its group sums), the bias, y: checked
  std::vector<float> x_f32, xsum, bias_f32;
  torch::Tensor y;
  int64_t rows, K;
};

Call prepare(const torch::Tensor& x, int64_t N, const std::optional<torch::Tensor>& bias, int64_t G,
             const char* name) {
  TORCH_CHECK(x.device().is_cpu(), name, " runs on the CPU");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), name, ": x must be a contiguous [rows, in_features]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, name,
              ": x must be float32 or bfloat16");
  const int64_t rows = x.size(0), K = x.size(1);
  TORCH_CHECK(rows >= 1 && rows <= kMaxRows, name, " takes 1 to ", kMaxRows, " rows, got ", rows);
  // Plain loops, not torch ops: at one row a torch op's dispatch costs as much as a small layer.
  Call call{std::vector<float>(rows * K), {}, {}, torch::empty({rows, N}, x.options()), rows, K};
  if (x.scalar_type() == at::kFloat) {
    std::copy_n(x.data_ptr<float>(), rows * K, call.x_f32.data());
  } else {
    const at::BFloat16* xb = x.data_ptr<at::BFloat16>();
    for (int64_t i = 0; i < rows * K; ++i) call.x_f32[i] = static_cast<float>(xb[i]);
  }
  if (G > 0) {  // sums of x over each group, in order
    call.xsum.assign(rows * (K / G), 0.f);
    for (int64_t i = 0; i < rows * K; ++i) call.xsum[i / G] += call.x_f32[i];
  }
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, name, ": bias has ", bias->numel(), " values, need ", N);
    const torch::Tensor b = bias->to(at::kFloat).contiguous();
    call.bias_f32.assign(b.data_ptr<float>(), b.data_ptr<float>() + N);
  }
  return call;
}

template <typename TileFn, typename ScaleFn>
torch::Tensor finish(Call& c, int64_t N, TileFn tile_fn, ScaleFn scale_of) {
  const float* bias = c.bias_f32.empty() ? nullptr : c.bias_f32.data();
  if (c.y.scalar_type() == at::kFloat)
    run_tiles(c.rows, N, bias, c.y.data_ptr<float>(), tile_fn, scale_of);
  else
    run_tiles(c.rows, N, bias, c.y.data_ptr<at::BFloat16>(), tile_fn, scale_of);
  return c.y;
}

torch::Tensor linear_int8(torch::Tensor x, torch::Tensor packed, torch::Tensor scale, int64_t out_features,
                          std::optional<torch::Tensor> bias) {
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kTileRows && packed.size(3) == kLine &&
                  packed.scalar_type() == at::kChar && packed.is_contiguous(),
              "lowbit_gemm.linear_int8: the weight must be packed by cluster.quant.lowbit_pack.pack_int8");
  const int64_t N = out_features;
  TORCH_CHECK(N > (packed.size(0) - 1) * kTileRows && N <= packed.size(0) * kTileRows,
              "lowbit_gemm.linear_int8: out_features ", N, " does not match the packed weight");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == N && scale.is_contiguous(),
              "lowbit_gemm.linear_int8: scale must be float32 with one value per output");
  Call c = prepare(x, N, bias, 0, "lowbit_gemm.linear_int8");
  TORCH_CHECK(packed.size(1) * kLine == c.K, "lowbit_gemm.linear_int8: x has ", c.K, " features, the weight ",
              packed.size(1) * kLine);
  const int8_t* w = packed.data_ptr<int8_t>();
  const float* s = scale.data_ptr<float>();
  const int64_t K = c.K;
  const float* x_f32 = c.x_f32.data();
  auto tile_fn = [&](int block, int64_t m0, int64_t t, float* sums) {
    const float* xb = x_f32 + m0 * K;
    const int8_t* tile = w + t * kTileRows * K;
    switch (block) {
      case 4: tile_int8<4>(xb, tile, K, sums); break;
      case 3: tile_int8<3>(xb, tile, K, sums); break;
      case 2: tile_int8<2>(xb, tile, K, sums); break;
      default: tile_int8<1>(xb, tile, K, sums); break;
    }
  };
  return finish(c, N, tile_fn, [&](int64_t n) { return s[n]; });
}

torch::Tensor linear_int4(torch::Tensor x, torch::Tensor weights, torch::Tensor params, int64_t out_features,
                          std::optional<torch::Tensor> bias) {
  TORCH_CHECK(weights.dim() == 4 && weights.size(2) == kTileRows && weights.scalar_type() == at::kByte &&
                  weights.is_contiguous() && params.dim() == 4 && params.scalar_type() == at::kHalf &&
                  params.is_contiguous() && params.size(0) == weights.size(0) && params.size(1) == weights.size(1),
              "lowbit_gemm.linear_int4: the weight must be packed by cluster.quant.lowbit_pack.pack_int4");
  const int64_t N = out_features;
  TORCH_CHECK(N > (weights.size(0) - 1) * kTileRows && N <= weights.size(0) * kTileRows,
              "lowbit_gemm.linear_int4: out_features ", N, " does not match the packed weight");
  const int64_t groups = weights.size(1), G = 2 * weights.size(3), K = x.size(-1);
  TORCH_CHECK(G % kRun == 0, "lowbit_gemm.linear_int4: groups of ", G, " inputs; the kernel takes multiples of ", kRun);
  TORCH_CHECK(groups * G == K, "lowbit_gemm.linear_int4: x has ", K, " features, the weight ", groups * G);
  Call c = prepare(x, N, bias, G, "lowbit_gemm.linear_int4");
  const uint8_t* w = weights.data_ptr<uint8_t>();
  const at::Half* p = params.data_ptr<at::Half>();
  const bool pair_path = kHasDpbf16 && x.scalar_type() == at::kBFloat16;
#if defined(__AVX512BF16__)
  if (pair_path) {
    const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
    const float* sp = c.xsum.data();  // [rows, groups]
    auto tile_fn = [&](int block, int64_t m0, int64_t t, float* sums) {
      const uint8_t* tile = w + t * kTileRows * (K / 2);
      const at::Half* tp = p + t * kTileRows * groups * 2;
      const at::BFloat16* xr = xp + m0 * K;
      const float* sr = sp + m0 * groups;
      switch (block) {
        case 4: tile_int4_dpbf16<4>(xr, sr, tile, tp, K, G, sums); break;
        case 3: tile_int4_dpbf16<3>(xr, sr, tile, tp, K, G, sums); break;
        case 2: tile_int4_dpbf16<2>(xr, sr, tile, tp, K, G, sums); break;
        default: tile_int4_dpbf16<1>(xr, sr, tile, tp, K, G, sums); break;
      }
    };
    return finish(c, N, tile_fn, [](int64_t) { return 1.f; });
  }
#endif
  (void)pair_path;
  const float* x_f32 = c.x_f32.data();
  auto tile_fn = [&](int block, int64_t m0, int64_t t, float* sums) {
    const float* xb = x_f32 + m0 * K;
    const uint8_t* tile = w + t * kTileRows * (K / 2);
    const at::Half* tp = p + t * kTileRows * groups * 2;
    switch (block) {
      case 4: tile_int4_fma<4>(xb, tile, tp, K, G, sums); break;
      case 3: tile_int4_fma<3>(xb, tile, tp, K, G, sums); break;
      case 2: tile_int4_fma<2>(xb, tile, tp, K, G, sums); break;
      default: tile_int4_fma<1>(xb, tile, tp, K, G, sums); break;
    }
  };
  return finish(c, N, tile_fn, [](int64_t) { return 1.f; });
}

std::vector<std::string> capabilities() {
  std::vector<std::string> caps = {kLanes == 16 ? "avx512-fma" : "avx2-fma"};
  if (kHasDpbf16) caps.push_back("avx512-bf16-pairs (int4, bfloat16 x)");
  return caps;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_int8", &linear_int8, "y = x @ (W8 * scale).T (+ bias) for 1 to max_rows rows");
  m.def("linear_int4", &linear_int4, "y = x @ (q * scale + offset).T (+ bias) for 1 to max_rows rows");
  m.def("capabilities", &capabilities, "the vector paths this build holds");
  m.attr("max_rows") = kMaxRows;
  m.attr("group_multiple") = kRun;
}
