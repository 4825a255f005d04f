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
// 12 rows of x at a time (panel_gemm.h drives the panels and row blocks), each FMA taking its x
// value by an embedded broadcast.
// Every output is one float32 sum over k in order, rounded to bfloat16 once (nearest even).
// build.py compiles this for the host CPU; without AVX-512 the module's `available` is false.
#include <immintrin.h>
#include <torch/extension.h>

#include "panel_gemm.h"

namespace {

#if defined(__AVX512F__)
constexpr bool kAvailable = true;

// M rows of x (float32, row stride K) against one panel; y rows with stride N.
// Out of line: each block size its own function, so the 12-row loop keeps its registers (inlined
// into the panel driver with the others, it ran 3-4% slower at 256 rows).
template <int M, typename Y>
__attribute__((noinline)) void panel_rows(const float* x, const uint32_t* panel, int64_t K, const float* bias,
                                          int valid, Y* y, int64_t N) {
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

// The whole of x and y, for gemm_panels.
template <typename Y>
struct WideningRows {
  const float* x;
  int64_t K;
  Y* y;
  int64_t N;

  template <int M>
  void rows(const uint32_t* panel, int64_t m0, int64_t n0, const float* bias, int valid) const {
    panel_rows<M>(x + m0 * K, panel, K, bias, valid, y + m0 * N + n0, N);
  }
};
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
    gemm_panels(rows, w, K * 16, bias_ptr, N, WideningRows<float>{x_f32.data_ptr<float>(), K, y.data_ptr<float>(), N});
  else
    gemm_panels(rows, w, K * 16, bias_ptr, N,
                WideningRows<at::BFloat16>{x_f32.data_ptr<float>(), K, y.data_ptr<at::BFloat16>(), N});
#endif
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "lay a bfloat16 [out, in] weight out in the kernel's panels");
  m.def("linear", &linear, "y = x @ W.T (+ bias) in float32 arithmetic, W from pack(); y in x's dtype");
  m.attr("available") = kAvailable;
}
