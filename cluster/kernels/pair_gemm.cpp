// y[M, N] = x[M, K] @ W[N, K]^T (+ bias) on bfloat16 x and W with the CPU's bfloat16 pair product
// (AVX-512-BF16 `vdpbf16ps`: two products of bfloat16 pairs added into a float32 sum), for the
// rows small_gemm does not take: big decode batches and prefill chunks, where a step is bound by
// arithmetic. On a CPU whose pair product issues as often as a float32 FMA (AMD Zen 4), it does
// twice a float32 FMA's work; oneDNN's bfloat16 GEMM gets there only for hundreds of rows.
//
// `pack` lays W out as panels of 32 output rows, [ceil(N / 32), K / 2, 32] pairs: at each pair
// step k the 32-bit lane j holds (W[n0 + j, 2k], W[n0 + j, 2k + 1]), rows n0..n0+15 in the first
// 64-byte line and n0+16..n0+31 in the second. `linear` computes a panel for up to 12 rows of x at
// a time (panel_gemm.h drives the panels and row blocks), each pair product taking its x pair by a
// 32-bit broadcast.
// Every output is one float32 sum over k in pair order (the instruction's rounding), plus the
// bias, rounded to bfloat16 once (nearest even).
// build.py compiles this for the host CPU; without AVX-512-BF16 the module's `available` is false.
#include <immintrin.h>
#include <torch/extension.h>

#include "panel_gemm.h"

namespace {

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
constexpr bool kAvailable = true;

// M rows of x (bfloat16 pairs, row stride K2 pairs) against one panel; y rows with stride N.
// Out of line: each block size its own function, so the 12-row loop keeps its registers (inlined
// into the panel driver with the others, it ran 3-4% slower at 256 rows).
template <int M>
__attribute__((noinline)) void panel_rows(const uint32_t* x, const uint32_t* panel, int64_t K2, const float* bias,
                                          int valid, at::BFloat16* y, int64_t N) {
  __m512 lo[M], hi[M];
  for (int m = 0; m < M; ++m) lo[m] = hi[m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K2; ++k) {
    const __m512bh w_lo = (__m512bh)_mm512_loadu_si512(panel + k * kPanel);
    const __m512bh w_hi = (__m512bh)_mm512_loadu_si512(panel + k * kPanel + 16);
    for (int m = 0; m < M; ++m) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[m * K2 + k]));
      lo[m] = _mm512_dpbf16_ps(lo[m], w_lo, xv);
      hi[m] = _mm512_dpbf16_ps(hi[m], w_hi, xv);
    }
  }
  for (int m = 0; m < M; ++m) store_row(lo[m], hi[m], bias, valid, y + m * N);
}

// The whole of x and y, for gemm_panels.
struct PairRows {
  const uint32_t* x;
  int64_t K2;
  at::BFloat16* y;
  int64_t N;

  template <int M>
  void rows(const uint32_t* panel, int64_t m0, int64_t n0, const float* bias, int valid) const {
    panel_rows<M>(x + m0 * K2, panel, K2, bias, valid, y + m0 * N + n0, N);
  }
};
#else
constexpr bool kAvailable = false;
#endif

// W [N, K] bfloat16, K even -> [ceil(N / 32), K / 2, 32] pairs: lane j of pair step k is (W[n0 + j, 2k], W[n0 + j, 2k + 1]).
torch::Tensor pack(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16,
              "pair_gemm.pack: weight must be a bfloat16 [out_features, in_features]");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(K % 2 == 0, "pair_gemm.pack: in_features must be even (pairs), got ", K);
  const int64_t num_panels = (N + kPanel - 1) / kPanel;
  auto padded = torch::zeros({num_panels * kPanel, K}, weight.options().device(at::kCPU));
  padded.narrow(0, 0, N).copy_(weight);
  // [P, 32, K/2, 2] -> [P, K/2, 32, 2]
  return padded.view({num_panels, kPanel, K / 2, 2}).permute({0, 2, 1, 3}).contiguous().view(
      {num_panels, K / 2, 2 * kPanel});
}

torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t out_features, std::optional<torch::Tensor> bias) {
  TORCH_CHECK(kAvailable, "pair_gemm needs AVX-512-BF16; this build has none");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "pair_gemm runs on the CPU");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "pair_gemm: x must be bfloat16 [rows, in_features]");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == 2 * kPanel && packed.is_contiguous() &&
              packed.scalar_type() == at::kBFloat16, "pair_gemm: the weight must come from pair_gemm.pack");
  const int64_t rows = x.size(0), K = x.size(1), N = out_features;
  TORCH_CHECK(packed.size(1) * 2 == K, "pair_gemm: x has ", K, " features, the weight ", packed.size(1) * 2);
  TORCH_CHECK(N > (packed.size(0) - 1) * kPanel && N <= packed.size(0) * kPanel,
              "pair_gemm: out_features ", N, " does not match the packed weight");
  auto y = torch::empty({rows, N}, x.options());
  if (rows == 0) return y;
  torch::Tensor bias_f32;
  const float* bias_ptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "pair_gemm: bias has ", bias->numel(), " values, need ", N);
    bias_f32 = bias->to(at::kFloat).contiguous();
    bias_ptr = bias_f32.data_ptr<float>();
  }
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  const auto xc = x.contiguous();
  gemm_panels(rows, reinterpret_cast<const uint32_t*>(packed.data_ptr<at::BFloat16>()), K / 2 * kPanel, bias_ptr, N,
              PairRows{reinterpret_cast<const uint32_t*>(xc.data_ptr<at::BFloat16>()), K / 2,
                       y.data_ptr<at::BFloat16>(), N});
#endif
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "lay a bfloat16 [out, in] weight out in the kernel's panels of pairs");
  m.def("linear", &linear, "y = x @ W.T (+ bias) with bfloat16 pair products, W from pack(); y bfloat16");
  m.attr("available") = kAvailable;
}
