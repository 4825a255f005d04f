// y[M, N] = x[M, K] @ W[N, K]^T (+ bias) in float32 arithmetic on bfloat16 weights, for many rows M:
// the shape of big decode batches and prefill chunks, where a step is bound by arithmetic.
//
// Where the CPU's bfloat16 pair product (AVX-512-BF16) is slow (on a 2-core Xeon without AMX it
// issued a quarter as often as a float32 FMA and did twice the work each: half the speed), float32 FMAs
// are the fastest arithmetic, but a float32 copy of W doubles the bytes a step reads. So W stays
// bfloat16 in memory and is widened in registers: bfloat16 is the top half of a float32, so a
// shift or a mask does it.
//
// `pack` lays W out as panels of 32 output rows, [ceil(N / 32), K, 32] bfloat16, where at each k
// the 32-bit lane j holds W[n0 + j, k] in its low half and W[n0 + 16 + j, k] in its high half
// (one 64-byte line per k). Widening a line is then two instructions: a shift by 16 gives rows
// n0..n0+15, a mask of the low half gives rows n0+16..n0+31. `linear` computes a panel for up to
// 12 rows of x at a time, 24 accumulators, each FMA taking its x value by an embedded broadcast;
// rows past 12 come in blocks of near-equal size that reuse the panel from L1/L2. Panels are split
// over ATen's intra-op threads.
// Every output is one float32 sum over k in order, rounded to bfloat16 once (nearest even).
// build.py compiles this for the host CPU; without AVX-512 the module's `available` is false.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstring>

#include "simd.h"

namespace {

constexpr int kPanel = 32;     // output rows (of W) per panel
constexpr int kRowBlock = 12;  // rows of x per pass over a panel

#if defined(__AVX512F__)
constexpr bool kAvailable = true;

// One row of a panel's outputs: rows n0..n0+15 in lo, n0+16..n0+31 in hi, the first `valid` kept.
inline void store_row(__m512 lo, __m512 hi, const float* bias, int valid, float* y) {
  if (bias) lo = _mm512_add_ps(lo, _mm512_load_ps(bias)), hi = _mm512_add_ps(hi, _mm512_load_ps(bias + 16));
  _mm512_mask_storeu_ps(y, first_lanes(valid), lo);
  if (valid > 16) _mm512_mask_storeu_ps(y + 16, first_lanes(valid - 16), hi);
}

inline void store_row(__m512 lo, __m512 hi, const float* bias, int valid, at::BFloat16* y) {
  if (bias) lo = _mm512_add_ps(lo, _mm512_load_ps(bias)), hi = _mm512_add_ps(hi, _mm512_load_ps(bias + 16));
  _mm256_mask_storeu_epi16(y, first_lanes(valid), _mm512_cvtepi32_epi16(round_to_bf16_bits(lo)));
  if (valid > 16)
    _mm256_mask_storeu_epi16(y + 16, first_lanes(valid - 16), _mm512_cvtepi32_epi16(round_to_bf16_bits(hi)));
}

// M rows of x (float32, row stride K) against one panel; y rows with stride N.
template <int M, typename Y>
inline void panel_rows(const float* x, const uint32_t* panel, int64_t K, const float* bias, int valid, Y* y,
                       int64_t N) {
  __m512 lo[M], hi[M];
  for (int m = 0; m < M; ++m) lo[m] = hi[m] = _mm512_setzero_ps();
  const __m512i high_half = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t k = 0; k < K; ++k) {
    const __m512i line = _mm512_loadu_si512(panel + k * 16);
    const __m512 w_lo = _mm512_castsi512_ps(_mm512_slli_epi32(line, 16));
    const __m512 w_hi = _mm512_castsi512_ps(_mm512_and_si512(line, high_half));
    for (int m = 0; m < M; ++m) {
      const __m512 xv = _mm512_set1_ps(x[m * K + k]);
      lo[m] = _mm512_fmadd_ps(w_lo, xv, lo[m]);
      hi[m] = _mm512_fmadd_ps(w_hi, xv, hi[m]);
    }
  }
  for (int m = 0; m < M; ++m) store_row(lo[m], hi[m], bias, valid, y + m * N);
}

template <typename Y>
void gemm(int64_t rows, const float* x, const uint32_t* packed, const float* bias, Y* y, int64_t N, int64_t K) {
  const int64_t num_panels = (N + kPanel - 1) / kPanel;
  at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float bias_panel[kPanel];
    for (int64_t p = begin; p < end; ++p) {
      const uint32_t* panel = packed + p * K * 16;
      const int64_t n0 = p * kPanel;
      const int valid = static_cast<int>(std::min<int64_t>(kPanel, N - n0));
      const float* b = nullptr;
      if (bias) {
        std::memset(bias_panel, 0, sizeof(bias_panel));
        std::memcpy(bias_panel, bias + n0, sizeof(float) * valid);
        b = bias_panel;
      }
      // rows in ceil(rows / kRowBlock) blocks of near-equal size (16 rows: 8 + 8, not 12 + 4)
      const int64_t num_blocks = (rows + kRowBlock - 1) / kRowBlock;
      for (int64_t i = 0, m0 = 0; i < num_blocks; ++i) {
        const int64_t block = (rows - m0) / (num_blocks - i);
        const float* xb = x + m0 * K;
        Y* yb = y + m0 * N + n0;
        m0 += block;
        switch (block) {
          case 12: panel_rows<12>(xb, panel, K, b, valid, yb, N); break;
          case 11: panel_rows<11>(xb, panel, K, b, valid, yb, N); break;
          case 10: panel_rows<10>(xb, panel, K, b, valid, yb, N); break;
          case 9: panel_rows<9>(xb, panel, K, b, valid, yb, N); break;
          case 8: panel_rows<8>(xb, panel, K, b, valid, yb, N); break;
          case 7: panel_rows<7>(xb, panel, K, b, valid, yb, N); break;
          case 6: panel_rows<6>(xb, panel, K, b, valid, yb, N); break;
          case 5: panel_rows<5>(xb, panel, K, b, valid, yb, N); break;
          case 4: panel_rows<4>(xb, panel, K, b, valid, yb, N); break;
          case 3: panel_rows<3>(xb, panel, K, b, valid, yb, N); break;
          case 2: panel_rows<2>(xb, panel, K, b, valid, yb, N); break;
          default: panel_rows<1>(xb, panel, K, b, valid, yb, N); break;
        }
      }
    }
  });
}
#else
constexpr bool kAvailable = false;
#endif

// W [N, K] bfloat16 -> [ceil(N / 32), K, 32]: at each k, rows n0..n0+15 and n0+16..n0+31 interleaved.
torch::Tensor pack(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16,
              "widening_gemm.pack: weight must be a bfloat16 [out_features, in_features]");
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t num_panels = (N + kPanel - 1) / kPanel;
  auto padded = torch::zeros({num_panels * kPanel, K}, weight.options().device(at::kCPU));
  padded.narrow(0, 0, N).copy_(weight);
  // [P, 2, 16, K] -> [P, K, 16, 2]: lane j's pair is (row j, row 16 + j)
  return padded.view({num_panels, 2, 16, K}).permute({0, 3, 2, 1}).contiguous().view({num_panels, K, kPanel});
}

torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t out_features, std::optional<torch::Tensor> bias) {
  TORCH_CHECK(kAvailable, "widening_gemm needs AVX-512; this build has none");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "widening_gemm runs on the CPU");
  TORCH_CHECK(x.dim() == 2, "widening_gemm: x must be [rows, in_features]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "widening_gemm: x must be bfloat16 or float32");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous() &&
              packed.scalar_type() == at::kBFloat16, "widening_gemm: the weight must come from widening_gemm.pack");
  const int64_t rows = x.size(0), K = x.size(1), N = out_features;
  TORCH_CHECK(packed.size(1) == K, "widening_gemm: x has ", K, " features, the weight ", packed.size(1));
  TORCH_CHECK(N > (packed.size(0) - 1) * kPanel && N <= packed.size(0) * kPanel,
              "widening_gemm: out_features ", N, " does not match the packed weight");
  auto y = torch::empty({rows, N}, x.options());
  if (rows == 0) return y;
  torch::Tensor bias_f32;
  const float* bias_ptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "widening_gemm: bias has ", bias->numel(), " values, need ", N);
    bias_f32 = bias->to(at::kFloat).contiguous();
    bias_ptr = bias_f32.data_ptr<float>();
  }
#if defined(__AVX512F__)
  const auto x_f32 = x.to(at::kFloat).contiguous();
  const auto* w = reinterpret_cast<const uint32_t*>(packed.data_ptr<at::BFloat16>());
  if (x.scalar_type() == at::kFloat)
    gemm<float>(rows, x_f32.data_ptr<float>(), w, bias_ptr, y.data_ptr<float>(), N, K);
  else
    gemm<at::BFloat16>(rows, x_f32.data_ptr<float>(), w, bias_ptr, y.data_ptr<at::BFloat16>(), N, K);
#endif
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "lay a bfloat16 [out, in] weight out in the kernel's panels");
  m.def("linear", &linear, "y = x @ W.T (+ bias) in float32 arithmetic, W from pack(); y in x's dtype");
  m.attr("available") = kAvailable;
}
