// What the many-row GEMMs on packed bfloat16 weights share (widening_gemm.cpp, pair_gemm.cpp):
// W is packed as panels of 32 output rows; each panel is computed for up to 12 rows of x at a
// time (24 float32 accumulators: rows n0..n0+15 and n0+16..n0+31 of the panel per row of x); rows
// past 12 come in blocks of near-equal size that reuse the panel from L1/L2; panels are split over
// ATen's intra-op threads (gemm_panels says how). Only the inner product differs between the
// kernels: each passes a `Block` whose `rows<M>(panel, m0, n0, bias, valid)` computes rows
// m0..m0+M-1 of x against the panel of output rows n0..n0+31.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "simd.h"

constexpr int kPanel = 32;     // output rows (of W) per panel
constexpr int kRowBlock = 12;  // rows of x per pass over a panel

#if defined(__AVX512F__)
// One row of a panel's outputs: rows n0..n0+15 in lo, n0+16..n0+31 in hi, the first `valid` kept;
// `bias` (the panel's 32 values, zero past `valid`) added first.
inline void store_row(__m512 lo, __m512 hi, const float* bias, int valid, float* y) {
  if (bias) lo = _mm512_add_ps(lo, _mm512_load_ps(bias)), hi = _mm512_add_ps(hi, _mm512_load_ps(bias + 16));
  _mm512_mask_storeu_ps(y, first_lanes(valid), lo);
  if (valid > 16) _mm512_mask_storeu_ps(y + 16, first_lanes(valid - 16), hi);
}

// The same, each output rounded to bfloat16 once (nearest even).
inline void store_row(__m512 lo, __m512 hi, const float* bias, int valid, at::BFloat16* y) {
  if (bias) lo = _mm512_add_ps(lo, _mm512_load_ps(bias)), hi = _mm512_add_ps(hi, _mm512_load_ps(bias + 16));
  _mm256_mask_storeu_epi16(y, first_lanes(valid), _mm512_cvtepi32_epi16(round_to_bf16_bits(lo)));
  if (valid > 16)
    _mm256_mask_storeu_epi16(y + 16, first_lanes(valid - 16), _mm512_cvtepi32_epi16(round_to_bf16_bits(hi)));
}

// One thread's share of the panels, taken one at a time from `next`; a thread done with its own
// share goes on with the others'.
struct alignas(64) PanelShare {
  std::atomic<int64_t> next{0};
  int64_t end = 0;
};

// Panel p against every row of x (`bias_panel`: room for the panel's 32 bias values).
template <typename Block>
__attribute__((always_inline)) inline void gemm_panel(int64_t p, int64_t rows, const uint32_t* packed,
                                                      int64_t panel_elems, const float* bias, int64_t N,
                                                      const Block& block_rows, float* bias_panel) {
  const uint32_t* weights = packed + p * panel_elems;
  const int64_t n0 = p * kPanel;
  const int valid = static_cast<int>(std::min<int64_t>(kPanel, N - n0));
  const float* b = nullptr;
  if (bias) {
    std::memset(bias_panel, 0, sizeof(float) * kPanel);
    std::memcpy(bias_panel, bias + n0, sizeof(float) * valid);
    b = bias_panel;
  }
  const int64_t num_blocks = (rows + kRowBlock - 1) / kRowBlock;
  // rows in ceil(rows / kRowBlock) blocks of near-equal size (16 rows: 8 + 8, not 12 + 4)
  for (int64_t i = 0, m0 = 0; i < num_blocks; ++i) {
    const int64_t block = (rows - m0) / (num_blocks - i);
    switch (block) {
      case 12: block_rows.template rows<12>(weights, m0, n0, b, valid); break;
      case 11: block_rows.template rows<11>(weights, m0, n0, b, valid); break;
      case 10: block_rows.template rows<10>(weights, m0, n0, b, valid); break;
      case 9: block_rows.template rows<9>(weights, m0, n0, b, valid); break;
      case 8: block_rows.template rows<8>(weights, m0, n0, b, valid); break;
      case 7: block_rows.template rows<7>(weights, m0, n0, b, valid); break;
      case 6: block_rows.template rows<6>(weights, m0, n0, b, valid); break;
      case 5: block_rows.template rows<5>(weights, m0, n0, b, valid); break;
      case 4: block_rows.template rows<4>(weights, m0, n0, b, valid); break;
      case 3: block_rows.template rows<3>(weights, m0, n0, b, valid); break;
      case 2: block_rows.template rows<2>(weights, m0, n0, b, valid); break;
      default: block_rows.template rows<1>(weights, m0, n0, b, valid); break;
    }
    m0 += block;
  }
}

// Every panel of an [N, K] weight (`panel_elems` 32-bit words apart in `packed`) against `rows`
// rows of x (gemm_panel); `bias` is float32 [N] or null. Panels are split over ATen's threads in
// contiguous shares. Where the rows make a panel arithmetic-bound (more than kRowBlock), a thread
// done with its share takes the panels another has not started: on a machine shared with other
// processes, one of them preempting a thread then delays the call by the time it took, not by the
// preempted thread's whole share (SmolLM2-135M's linear layers at 128 rows, 2 threads of a 2-core Zen 4, beside a
// process busy 2 ms in every 5: 121.6 ms static, 106.3 ms shared; at 32 rows 32.8 and 30.2; alone
// 71.6 and 70.6). With fewer rows the weights' bandwidth bounds the call and the split stays static.
template <typename Block>
void gemm_panels(int64_t rows, const uint32_t* packed, int64_t panel_elems, const float* bias, int64_t N,
                 const Block& block_rows) {
  const int64_t num_panels = (N + kPanel - 1) / kPanel;
  if (rows <= kRowBlock) {
    at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
      alignas(64) float bias_panel[kPanel];
      for (int64_t p = begin; p < end; ++p)
        gemm_panel(p, rows, packed, panel_elems, bias, N, block_rows, bias_panel);
    });
    return;
  }
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_panels));
  std::vector<PanelShare> shares(threads);
  for (int64_t t = 0; t < threads; ++t) {
    shares[t].next = t * num_panels / threads;
    shares[t].end = (t + 1) * num_panels / threads;
  }
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    alignas(64) float bias_panel[kPanel];
    for (int64_t t = first; t < last; ++t)  // one thread each, unless called inside a parallel region
      for (int64_t i = 0; i < threads; ++i) {  // its own share first, then the others'
        PanelShare& share = shares[(t + i) % threads];
        for (int64_t p; (p = share.next.fetch_add(1, std::memory_order_relaxed)) < share.end;)
          gemm_panel(p, rows, packed, panel_elems, bias, N, block_rows, bias_panel);
      }
  });
}
#endif
