// y = x Wᵀ for an int8 weight kept k-major in panels (quant.py's `to_int8_panels`: qpanels[p][k][j]
// = q[16p + j][k], zero past the last row; its scales likewise, spanels[p][g][j] for group g of a
// row, or spanels[p][j] for a scale per row). x is float32: the weight-only product, the same
// arithmetic as cpu_int8_gemm.cpp's.
//
// Why: int8_gemm reads the weight in rows and turns each 16 x 16 block k-major (a byte transpose)
// every time it builds a panel, which at decode rows costs more than the product. A Q8_0 LM head
// (SmolLM2's 49152 x 576) took 3.2 ms at one row and 3.9 ms at 16 through it on a Zen 5, where
// float32 panels of the same dequantized weight took 3.0 ms at 16 rows. Stored k-major, a pass's
// float32 slab is built with one widening load, one conversion and one multiply per 16 weights.
//
// Summation order: as in int8_gemm, each output is one FMA chain over k from 0 to K-1 of x times
// the dequantized weight (float(q) * scale, exact in float32 for GGUF's half-precision scales),
// row scales applied to the finished sum: the same bits as int8_gemm, and a row's result does not
// depend on the other rows of the batch nor on the number of threads.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_gemm_tile.h"

namespace {

using pdserve_gemm::kPanel;

#if PDSERVE_GEMM_ISA == 512
using pdserve_gemm::kGroupPanels, pdserve_gemm::kGroupRows, pdserve_gemm::kGroupSteps;
constexpr int64_t kBlockM = 256;  // x rows per block, as int8_gemm

// Rows [0, MR) of x times NP neighbouring panels over steps [k0, k1), added into out (or from zero
// when `first`), the last panel's first `cols` columns stored, each sum then scaled by row_scale[j]
// if given: pdserve_gemm::micro_group's tile, with each weight widened from int8 as it is loaded,
// float(q) times its group's scale (a memory operand: the scale vectors would not fit in registers
// beside 24 accumulators). No float32 copy of the weights is built: on a Zen 5 building one per
// pass (int8_gemm's way without the transpose) ran a 16-row LM head no faster than int8_gemm.
template <int MR, int NP>
inline void q8_tile(const float* x, int64_t ldx, const int8_t* q, int64_t panel_q, const float* s, int64_t panel_s,
                    int64_t group, int64_t k0, int64_t k1, float* out, int64_t ldo, int64_t cols, bool first,
                    const float* row_scale, const int8_t* ahead) {
  const __mmask16 last = static_cast<__mmask16>((1u << cols) - 1);
  __m512 acc[MR][NP];
  pdserve_gemm::load_sums<MR, NP>(acc, out, ldo, last, first);
  for (int64_t k = k0; k < k1;) {
    // One group's steps at a time (all of them with row scales): a division per step cost more than
    // the widening.
    const int64_t g = group > 0 ? k / group : 0;
    const int64_t end = group > 0 ? std::min(k1, (g + 1) * group) : k1;
    const float* sg = group > 0 ? s + g * kPanel : nullptr;
    for (; k < end; ++k) {
      if (ahead != nullptr && (k - k0) % 4 == 0) {  // a 64-byte line holds 4 steps of a panel
#pragma GCC unroll 4
        for (int j = 0; j < NP; ++j)
          _mm_prefetch(reinterpret_cast<const char*>(ahead + j * panel_q + (k - k0) * kPanel), _MM_HINT_T0);
      }
      __m512 wv[NP];
#pragma GCC unroll 4
      for (int j = 0; j < NP; ++j) {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + j * panel_q + k * kPanel));
        wv[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
        if (sg != nullptr) wv[j] = _mm512_mul_ps(wv[j], _mm512_loadu_ps(sg + j * panel_s));
      }
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const __m512 xv = _mm512_set1_ps(x[i * ldx + k]);
#pragma GCC unroll 4
        for (int j = 0; j < NP; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
      }
    }
  }
  if (row_scale != nullptr) pdserve_gemm::scale_sums<MR, NP>(acc, row_scale, last);  // [P, 16]: kPanel apart
  pdserve_gemm::store_sums<MR, NP>(acc, out, ldo, last);
}

// q8_tile<MR, NP> for the rows and panel count chosen at run time.
template <int NP, int MR = kGroupRows>
inline void q8_tile_rows(int rows, const float* x, int64_t ldx, const int8_t* q, int64_t panel_q, const float* s,
                         int64_t panel_s, int64_t group, int64_t k0, int64_t k1, float* out, int64_t ldo, int64_t cols,
                         bool first, const float* row_scale, const int8_t* ahead) {
  if constexpr (MR > 0) {
    if (rows == MR)
      return q8_tile<MR, NP>(x, ldx, q, panel_q, s, panel_s, group, k0, k1, out, ldo, cols, first, row_scale, ahead);
    q8_tile_rows<NP, MR - 1>(rows, x, ldx, q, panel_q, s, panel_s, group, k0, k1, out, ldo, cols, first, row_scale,
                             ahead);
  }
}

void q8_tile_any(int here, int rows, const float* x, int64_t ldx, const int8_t* q, int64_t panel_q, const float* s,
                 int64_t panel_s, int64_t group, int64_t k0, int64_t k1, float* out, int64_t ldo, int64_t cols,
                 bool first, const float* row_scale, const int8_t* ahead) {
  switch (here) {
    case 4:
      return q8_tile_rows<4>(rows, x, ldx, q, panel_q, s, panel_s, group, k0, k1, out, ldo, cols, first, row_scale,
                             ahead);
    case 3:
      return q8_tile_rows<3>(rows, x, ldx, q, panel_q, s, panel_s, group, k0, k1, out, ldo, cols, first, row_scale,
                             ahead);
    case 2:
      return q8_tile_rows<2>(rows, x, ldx, q, panel_q, s, panel_s, group, k0, k1, out, ldo, cols, first, row_scale,
                             ahead);
    default:
      return q8_tile_rows<1>(rows, x, ldx, q, panel_q, s, panel_s, group, k0, k1, out, ldo, cols, first, row_scale,
                             ahead);
  }
}

void panels_times(const float* xp, int64_t ldx, const int8_t* qp, const float* sp, int64_t group, int64_t count,
                  int64_t m_size, int64_t k_size, int64_t n_size, float* op) {
  const int64_t groups = group > 0 ? k_size / group : 0;
  const int64_t panel_q = k_size * kPanel, panel_s = group > 0 ? groups * kPanel : kPanel;
  at::parallel_for(0, count, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t m0 = 0; m0 < m_size; m0 += kBlockM) {
      const int64_t mb = std::min(kBlockM, m_size - m0);
      for (int64_t p = p0; p < p1; p += kGroupPanels) {
        const int here = static_cast<int>(std::min<int64_t>(kGroupPanels, p1 - p));
        const int64_t n0 = p * kPanel, cols = std::min(kPanel, n_size - (p + here - 1) * kPanel);
        for (int64_t k0 = 0; k0 < k_size; k0 += kGroupSteps) {
          const int64_t k1 = std::min(k_size, k0 + kGroupSteps);
          // The first row block fetches what the next pass reads: this group's next steps, or the
          // next group's first ones.
          const int8_t* ahead = k1 < k_size ? qp + p * panel_q + k1 * kPanel
                                            : (p + kGroupPanels < p1 ? qp + (p + kGroupPanels) * panel_q : nullptr);
          const float* row_scale = group == 0 && k1 == k_size ? sp + p * panel_s : nullptr;
          for (int64_t m = 0; m < mb; m += kGroupRows) {
            const int rows = static_cast<int>(std::min<int64_t>(kGroupRows, mb - m));
            q8_tile_any(here, rows, xp + (m0 + m) * ldx, ldx, qp + p * panel_q, panel_q, sp + p * panel_s, panel_s,
                        group, k0, k1, op + (m0 + m) * n_size + n0, n_size, cols, k0 == 0, row_scale,
                        m == 0 ? ahead : nullptr);
          }
        }
      }
    }
  });
}
#endif

at::Tensor int8_panel_gemm(const at::Tensor& x, const at::Tensor& qpanels, const at::Tensor& spanels, int64_t group,
                           int64_t out_features) {
  TORCH_CHECK(PDSERVE_GEMM_ISA == 512, "int8_panel_gemm: built without AVX-512");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "int8_panel_gemm: x must be a 2-D float32 tensor");
  TORCH_CHECK(qpanels.dim() == 3 && qpanels.scalar_type() == at::kChar && qpanels.is_contiguous() &&
                  qpanels.size(2) == kPanel,
              "int8_panel_gemm: the weight must be contiguous int8 panels [panels, in_features, 16]");
  const int64_t count = qpanels.size(0), k_size = qpanels.size(1), m_size = x.size(0);
  TORCH_CHECK(x.size(1) == k_size, "int8_panel_gemm: x has ", x.size(1), " columns, the weight ", k_size);
  TORCH_CHECK(out_features > (count - 1) * kPanel && out_features <= count * kPanel, "int8_panel_gemm: ", count,
              " panels cannot hold ", out_features, " output features");
  TORCH_CHECK(group >= 0 && (group == 0 || (group % 8 == 0 && k_size % group == 0)),
              "int8_panel_gemm: groups of ", group, " do not split rows of ", k_size);
  const std::vector<int64_t> scale_shape =
      group > 0 ? std::vector<int64_t>{count, k_size / group, kPanel} : std::vector<int64_t>{count, kPanel};
  TORCH_CHECK(spanels.scalar_type() == at::kFloat && spanels.is_contiguous() && spanels.sizes() == scale_shape,
              "int8_panel_gemm: the scales must be contiguous float32 ", at::IntArrayRef(scale_shape));
  at::Tensor out = at::empty({m_size, out_features}, x.options());
  if (m_size == 0) return out;
  if (k_size == 0) return out.zero_();
#if PDSERVE_GEMM_ISA == 512
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  panels_times(xc.data_ptr<float>(), xc.stride(0), qpanels.data_ptr<int8_t>(), spanels.data_ptr<float>(), group,
               count, m_size, k_size, out_features, out.data_ptr<float>());
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("int8_panel_gemm(Tensor x, Tensor qpanels, Tensor spanels, int group, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) { m.impl("int8_panel_gemm", &int8_panel_gemm); }
