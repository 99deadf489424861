// y = x Wᵀ for float32 (or bfloat16) weights stored in panels: W's output rows in groups of 16, each
// group k-major (engine/model/layers.py's `to_panels`: panels[p][k][j] = W[16p + j][k], zero past the
// last row; a bfloat16 group pairs rows j and j + 8, see cpu_gemm_tile.h). The multiply is
// cpu_gemm_tile.h's register tile, each panel streamed from memory once per call whatever the
// number of rows, while the next panel is prefetched. With AVX-512 the tile spans four panels
// (micro_group): on an AVX-512 Xeon, 16 rows of a decode step's weights from memory ran 1.3x faster
// than one panel at a time and 1.4-1.6x oneDNN's packed float32 matmul, level with it at 128-512.
//
// Why our own: on an AVX2 EPYC (Zen 3), with a decode step's weights coming from memory, oneDNN's
// packed float32 matmul ran 66-80 GFLOP/s at 16 rows, where it does 107 on weights in cache: it
// reads the weights, then computes, without overlapping the two. This tile, with the next panel
// prefetched, ran a decode step's matmuls 1.13x faster at one row, 1.3-1.5x at 2-16 rows, 1.08-1.15x
// at 32-64 and level at 128 (benchmarks/bench_kernels.py's `kernels_matmul` table measures it).
//
// Summation order: each output is one FMA chain over k from 0 to K-1, so a row's result does not
// depend on the other rows of the batch nor on the number of threads.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "cpu_gemm_tile.h"
#include "cpu_parallel.h"
#include "cpu_step_parts.h"

namespace {

using pdserve_gemm::kPanel;
using pdserve_gemm::kRowsMax;
using pdserve_gemm::micro_rows;

// out[m, n] = x[m] · W[n] for every row m, the panels split over threads.
template <typename W>
void panels_times(const float* xp, int64_t ldx, const W* wp, int64_t count, int64_t m_size, int64_t k_size,
                  int64_t n_size, float* op) {
  const int64_t panel_size = k_size * kPanel;
#if PDSERVE_GEMM_ISA == 512
  // Each thread's share of panels in groups of kGroupPanels (a narrower last group). A group is
  // multiplied kGroupSteps steps of k at a time, by all rows kGroupRows at a time, so the rows after
  // the first find the weights in L1 (1.03-1.05x one pass over all of k per row block).
  using pdserve_gemm::kGroupPanels, pdserve_gemm::kGroupRows, pdserve_gemm::kGroupSteps;
  // k in passes of equal length, at most kGroupSteps (an even number, so bfloat16 lines start each pass),
  // so that each pass fetches exactly what the next one reads. With passes of kGroupSteps and a
  // shorter last one (SmolLM2's 576 inputs: 4 x 128 + 64), a group's last pass fetched only part of
  // the next group's first pass: 64 of its steps came from memory unfetched.
  const int64_t passes = (k_size + kGroupSteps - 1) / kGroupSteps;
  const int64_t steps = ((k_size + passes - 1) / passes + 1) / 2 * 2;
  // With more than one row block, the weights are fetched a pass ahead while the blocks compute from
  // L1. On a Zen 5 (the bench model's 49 matmuls, 2 threads, alternated with oneDNN's), with the first
  // block fetching all four panels: 16 rows 0.99-1.0x oneDNN's speed where they were 0.92-0.94x, 32
  // rows 1.02x (0.99), 64 0.97x (0.95-0.96); two passes ahead did less. Each block fetching its share
  // of the panels instead (ahead_share; 16 rows: panels 0-1, 2, 3), so that the requests go out
  // through the whole pass rather than the first block's third of it: 1.21-1.26x at 16 rows,
  // 1.25-1.28x at 24 and 32, 1.11-1.13x at 64, 1.14x at 12, 1.02-1.04x at 8, 128 and 256, level at 512.
  // One row is left to the hardware: a fetch there only cost (1.07-1.13x oneDNN with it, 1.18-1.23x
  // without). On the AVX-512 Xeon the hardware's streams had kept pace.
  // Long inputs (prefill chunks) go through in slices (pdserve_gemm::slice_rows), each slice through
  // all of the thread's panels, so that a slice of x stays in L2 while the panels pass (a 576-wide
  // slice is 0.6 MiB); over all the rows at once, x came from L3 once per group of panels. On a
  // Zen 5 (2 threads, alternated in one process): SmolLM2's and the bench model's four matmul
  // shapes 1.04-1.12x at 1024 and 2048 rows (446-466 GFLOP/s of a 545 peak), level at 384 and 768;
  // slices of 128 rows or fewer ran 0.97-0.98x at 192-384 rows, re-reading the weights too often.
  const int64_t slice = pdserve_gemm::slice_rows(m_size, kGroupRows);
  pdserve_parallel::parallel_for(0, count, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t m0 = 0; m0 < m_size; m0 += slice) {
      const int64_t m1 = std::min(m_size, m0 + slice);
      const int64_t blocks = (m1 - m0 + kGroupRows - 1) / kGroupRows;
      for (int64_t p = p0; p < p1; p += kGroupPanels) {
        const int here = static_cast<int>(std::min<int64_t>(kGroupPanels, p1 - p));
        const int64_t n0 = p * kPanel, cols = std::min(kPanel, n_size - (p + here - 1) * kPanel);
        // Past this group's end the next pass reads the thread's next group or, after its last,
        // its first again for the next slice.
        const int64_t next = p + kGroupPanels < p1 ? p + kGroupPanels : (m1 < m_size ? p0 : -1);
        for (int64_t k0 = 0; k0 < k_size; k0 += steps) {
          const int64_t k1 = std::min(k_size, k0 + steps);
          // Where the next pass starts: this group's step k1, or the next group's first step.
          const W* ahead = nullptr;
          if (m1 - m0 > kGroupRows) {
            if (k1 < k_size) ahead = wp + p * panel_size + k1 * kPanel;
            else if (next >= 0) ahead = wp + next * panel_size;
          }
          for (int64_t m = m0, b = 0; m < m1; m += kGroupRows, ++b) {
            const int rows = static_cast<int>(std::min<int64_t>(kGroupRows, m1 - m));
            pdserve_gemm::micro_group_any(here, rows, xp + m * ldx, ldx, wp + p * panel_size, panel_size, k0, k1,
                                          op + m * n_size + n0, n_size, cols, k0 == 0, nullptr, ahead,
                                          pdserve_gemm::ahead_share(b, blocks, here));
          }
        }
      }
    }
  });
#else
  // Each block of rows fetches its share of the next panel of this task, a line every few steps, so
  // that the requests go out through the whole panel's pass rather than only during the first block
  // (the AVX-512 tile's ahead_share, for one panel). On a Zen 3 EPYC (2 threads, SmolLM2's 30 layers
  // of matmuls from memory, alternated in one process, outputs identical): 1.09-1.10x at 16 and 32
  // rows, 1.06x at 64, 1.02-1.03x at 4 and 8, level at 2 and at 256-2048; bfloat16 panels (half the
  // bytes, bound by the widening) level. Passes over k of 128 or 256 steps, so that a panel's pass and
  // the rows' x stay in L1 as on AVX-512, ran 0.88-1.03x of this, and slices of the rows level.
  constexpr int64_t line_steps = pdserve_gemm::kLineSteps<W>;
  const int64_t lines = (k_size + line_steps - 1) / line_steps;
  const int64_t blocks = (m_size + kRowsMax - 1) / kRowsMax;
  pdserve_parallel::parallel_for(0, count, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const W* panel = wp + p * panel_size;
      const int64_t n0 = p * kPanel, cols = std::min(kPanel, n_size - n0);
      const W* next = p + 1 < p1 ? panel + panel_size : nullptr;
      for (int64_t m = 0, b = 0; m < m_size; m += kRowsMax, ++b) {
        const int rows = static_cast<int>(std::min<int64_t>(kRowsMax, m_size - m));
        const int64_t l0 = lines * b / blocks, l1 = lines * (b + 1) / blocks;
        micro_rows(rows, xp + m * ldx, ldx, panel, k_size, op + m * n_size + n0, n_size, cols, true, nullptr,
                   next != nullptr ? next + l0 * line_steps * kPanel : nullptr,
                   l1 > l0 ? std::max<int64_t>(1, k_size / (l1 - l0)) : 1, l1 - l0);
      }
    }
  });
#endif
}

// float32 panels take float32 x; bfloat16 panels take bfloat16 x, widened to float32 here (exactly),
// multiplied in float32 and rounded back to bfloat16 once: what torch's bf16 matmul does on CPUs
// without bf16 arithmetic, with its sums in our order.
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t out_features) {
  const auto dtype = panels.scalar_type();
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == dtype && (dtype == at::kFloat || dtype == at::kBFloat16),
              "panel_linear: x must be a 2-D tensor of the panels' dtype (float32 or bfloat16)");
  const pdserve_parts::Fit fit = pdserve_parts::panels_fit(panels, x.size(1), out_features);
  TORCH_CHECK(fit.layout, "panel_linear: panels must be a contiguous tensor [panels, in_features, 16]");
  TORCH_CHECK(fit.inputs, "panel_linear: x has ", x.size(1), " columns, the weight ", panels.size(1));
  const int64_t count = panels.size(0);
  TORCH_CHECK(fit.outputs, "panel_linear: ", count, " panels cannot hold ", out_features, " output features");
  const int64_t m_size = x.size(0), k_size = x.size(1), n_size = out_features;
  // Rows of k-contiguous floats: .to keeps a transposed x transposed, so the widened copy is made contiguous.
  const at::Tensor xc =
      dtype == at::kBFloat16 ? x.to(at::kFloat).contiguous() : (x.stride(1) == 1 ? x : x.contiguous());
  at::Tensor out = at::empty({m_size, n_size}, xc.options());
  if (m_size == 0 || n_size == 0) return out.to(dtype);
  if (k_size == 0) return out.zero_().to(dtype);
  const float* xp = xc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  if (dtype == at::kFloat) {
    panels_times(xp, xc.stride(0), panels.data_ptr<float>(), count, m_size, k_size, n_size, op);
    return out;
  }
  const auto* bits = reinterpret_cast<const uint16_t*>(panels.data_ptr<at::BFloat16>());
  panels_times(xp, xc.stride(0), bits, count, m_size, k_size, n_size, op);
  return out.to(at::kBFloat16);  // round to nearest even
}

}  // namespace

pdserve_parts::Fit pdserve_parts::panels_fit(const at::Tensor& panels, int64_t k_size, int64_t out_features) {
  Fit fit;
  fit.layout = panels.dim() == 3 && panels.is_contiguous() && panels.size(2) == kPanel;
  if (!fit.layout) return fit;
  const int64_t count = panels.size(0);
  fit.inputs = k_size == panels.size(1);
  fit.outputs = out_features > (count - 1) * kPanel && out_features <= count * kPanel;
  return fit;
}

void pdserve_parts::panel_linear(const float* x, int64_t ldx, int64_t rows, const float* panels, int64_t count,
                                 int64_t k_size, float* y, int64_t out_features) {
  panels_times(x, ldx, panels, count, rows, k_size, out_features, y);
}

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("panel_linear(Tensor x, Tensor panels, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) { m.impl("panel_linear", &panel_linear); }
