// The register tile our CPU GEMMs share (int8 weights: cpu_int8_gemm.cpp; float32 weights in
// panels: cpu_panel_linear.cpp): MR rows of x times one panel of 16 output columns, the panel
// stored k-major (its 16 weights at reduction step k at panel[k * 16 .. k * 16 + 15]). Each x
// value is broadcast and FMA'd into the 16 outputs at once; each output is one FMA chain over k,
// in order, so a row's result never depends on the other rows of the batch.
//
// A panel holds float32 weights, or bfloat16 ones (uint16_t bits) that the tile widens to float32
// as it loads them, so a bfloat16 model reads half the bytes on CPUs without bf16 arithmetic. A
// bfloat16 panel pairs its columns: at each k the 32-bit word j holds column j in its low half and
// column j + 8 in its high half (layers.py's `to_panels`), so an AVX2 tile widens its 16 weights with
// one shift (columns 0-7) and one mask (8-15) of a single load.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cpu_simd.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define PDSERVE_GEMM_ISA 512
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PDSERVE_GEMM_ISA 256
#else
#define PDSERVE_GEMM_ISA 0
#endif

namespace pdserve_gemm {

constexpr int64_t kPanel = 16;  // output columns per panel: one AVX-512 vector, two AVX2 ones

// Column j of a bfloat16 panel row sits at this index of the row's 16 (see the header comment).
constexpr int64_t bf16_slot(int64_t j) { return j < 8 ? 2 * j : 2 * (j - 8) + 1; }

// Which of `panels` panels row block `b` of `blocks` fetches ahead, as bits (bit j: panel j): the panels
// spread over the blocks, so that the requests for the next pass go out through the whole pass over
// the rows, each line once, rather than all during the first block (here and in the bf16 pair groups).
inline int ahead_share(int64_t b, int64_t blocks, int panels) {
  int mask = 0;
  for (int j = 0; j < panels; ++j)
    if (j * blocks / panels == b) mask |= 1 << j;
  return mask;
}

// Long inputs (prefill chunks) go through the GEMMs (float32 panels, bf16 pairs) in slices of
// kSliceRows rows or a few more, each slice through all of a thread's weights before the next, so
// that the slice of x stays in L2 while the weights pass (cpu_panel_linear.cpp has the measurements).
// The rows a slice takes of m, a whole number of `tile_rows` row blocks: all of m below
// 2 * kSliceRows, so no slice is shorter than kSliceRows.
constexpr int64_t kSliceRows = 256;
inline int64_t slice_rows(int64_t m, int64_t tile_rows) {
  const int64_t slices = std::max<int64_t>(1, m / kSliceRows);
  return ((m + slices - 1) / slices + tile_rows - 1) / tile_rows * tile_rows;
}

// Keeps a parameter out of template argument deduction (std::type_identity is C++20).
template <typename T>
struct same {
  using type = T;
};

// Whether step k of a panel begins a 64-byte line: every step for float32, every other for bfloat16,
// so the next panel is fetched once per line.
template <typename W>
constexpr bool starts_line(int64_t k) {
  return (k * kPanel * static_cast<int64_t>(sizeof(W))) % 64 == 0;
}

inline float weight_at(const float* row, int64_t j) { return row[j]; }
inline float weight_at(const uint16_t* row, int64_t j) {
  const uint32_t bits = static_cast<uint32_t>(row[bf16_slot(j)]) << 16;
  float f;
  __builtin_memcpy(&f, &bits, sizeof f);
  return f;
}

// k steps of a panel per 64-byte line: 1 for float32, 2 for bfloat16.
template <typename W>
constexpr int64_t kLineSteps = 64 / (kPanel * static_cast<int64_t>(sizeof(W)));

#if PDSERVE_GEMM_ISA != 0
// Line j of `prefetch` (j < fetch_count, all of the pass's lines by default) is fetched at step
// j * fetch_stride (by default the step that starts reading line j of this panel).
template <typename W>
struct LineFetch {
  static constexpr int64_t line_steps = kLineSteps<W>;
  const W* at;
  int64_t stride, count, next, done = 0;
  LineFetch(const W* lines, int64_t kc, int64_t fetch_stride, int64_t fetch_count)
      : at(lines),
        stride(fetch_stride > 0 ? fetch_stride : line_steps),
        count(fetch_count >= 0 ? fetch_count : (kc + line_steps - 1) / line_steps),
        next(lines != nullptr && count > 0 ? 0 : kc) {}
  // At step k of kc: the next line, if its step has come.
  void at_step(int64_t k, int64_t kc) {
    if (k != next) return;
    _mm_prefetch(reinterpret_cast<const char*>(at + done * line_steps * kPanel), _MM_HINT_T0);
    next = ++done < count ? k + stride : kc;
  }
};
#endif

// The tile adds x[0..MR) · panel over k in [0, kc) into out (or starts from zero when `first`),
// for the first `cols` of the panel's 16 columns, then scales column j by row_scale[j] if given.
// Where `prefetch` is set (`Fetch`), its lines are fetched as the steps go (LineFetch: by default the
// line at prefetch + k * 16 at step k): the next panel, so that its weights stream in from memory
// while this one is multiplied. Without it the loop carries no fetch test at all: LineFetch's test at
// every step, though never taken, ran int8_gemm's 2-8 row tiles 1.02-1.06x slower on the AVX-512 Xeon
// (a step's 48 matmuls, 2 threads, alternated processes).
//
// The loops over the tile's rows carry `#pragma GCC unroll`: without it GCC 12 kept the
// accumulators in registers but also stored them to the stack on every k step, and the tile ran
// at a third of the FMA peak.
#if PDSERVE_GEMM_ISA == 512
constexpr int kRowsMax = 12;  // 12 accumulators + the panel vector + broadcasts: within 32 registers

inline __m512 load_panel(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_panel(const uint16_t* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m512 paired = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15), paired);
}

template <int MR, typename W = float, bool Fetch = false>
inline void micro(const float* x, int64_t ldx, const W* panel, int64_t kc, float* out, int64_t ldo, int64_t cols,
                  bool first, const float* row_scale, const W* prefetch, int64_t fetch_stride = 0,
                  int64_t fetch_count = -1) {
  const __mmask16 m = static_cast<__mmask16>((1u << cols) - 1);
  __m512 acc[MR];
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) acc[i] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m, out + i * ldo);
  LineFetch<W> fetch(prefetch, kc, fetch_stride, fetch_count);
  for (int64_t k = 0; k < kc; ++k) {
    if constexpr (Fetch) fetch.at_step(k, kc);
    const __m512 wv = load_panel(panel + k * kPanel);
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(x[i * ldx + k]), wv, acc[i]);
  }
  if (row_scale != nullptr) {
    const __m512 s = _mm512_maskz_loadu_ps(m, row_scale);
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) acc[i] = _mm512_mul_ps(acc[i], s);
  }
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) _mm512_mask_storeu_ps(out + i * ldo, m, acc[i]);
}

// The float32 sums of a tile of MR rows x NP panels (the wider tiles here and in cpu_int8_panels.cpp):
// read back from out, or zero when `first`; scaled by column (row_scale[j]); stored. Only the last
// panel's columns in `last` are read and written. A float32 store and reload is exact, so sums
// carried across passes over k stay the same FMA chains.
template <int MR, int NP>
__attribute__((always_inline)) inline void load_sums(__m512 (&acc)[MR][NP], const float* out, int64_t ldo,
                                                     __mmask16 last, bool first) {
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
    for (int j = 0; j + 1 < NP; ++j)
      acc[i][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(out + i * ldo + j * kPanel);
    acc[i][NP - 1] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(last, out + i * ldo + (NP - 1) * kPanel);
  }
}

template <int MR, int NP>
__attribute__((always_inline)) inline void scale_sums(__m512 (&acc)[MR][NP], const float* row_scale,
                                                      __mmask16 last) {
#pragma GCC unroll 4
  for (int j = 0; j < NP; ++j) {
    const __m512 sv = j + 1 < NP ? _mm512_loadu_ps(row_scale + j * kPanel)
                                 : _mm512_maskz_loadu_ps(last, row_scale + j * kPanel);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) acc[i][j] = _mm512_mul_ps(acc[i][j], sv);
  }
}

template <int MR, int NP>
__attribute__((always_inline)) inline void store_sums(const __m512 (&acc)[MR][NP], float* out, int64_t ldo,
                                                      __mmask16 last) {
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
    for (int j = 0; j + 1 < NP; ++j) _mm512_storeu_ps(out + i * ldo + j * kPanel, acc[i][j]);
    _mm512_mask_storeu_ps(out + i * ldo + (NP - 1) * kPanel, last, acc[i][NP - 1]);
  }
}

// The wider tile panel_linear and int8_gemm use here: MR rows times NP neighbouring panels (NP * 16
// columns) over reduction steps [k0, k1), added into out (or starting from zero when `first`; a
// float32 store and reload is exact, so the sums are the same FMA chains as in one pass), then column
// j scaled by row_scale[j] if given, the last panel's first `cols` columns stored. Each x broadcast
// feeds NP FMAs instead of one: with weights streaming from memory, 16 rows in tiles of 6 x 4 read
// them 1.3x faster than tiles of 12 x 1, which are bound by their loads (one broadcast per FMA); on
// weights in L1 the 6 x 4 tile runs 110-150 GFLOP/s a core, against 80-125 for 12 x 1 (FMA peak 172).
constexpr int kGroupRows = 6;    // 6 x 4 accumulators + 4 panel vectors: 28 of 32 registers
constexpr int kGroupPanels = 4;
constexpr int64_t kGroupSteps = 128;  // k steps per pass over the rows: 4 panels' 32 KiB stay in L1

template <int MR, int NP, typename W>
inline void micro_group(const float* x, int64_t ldx, const W* panels, int64_t panel_size, int64_t k0, int64_t k1,
                        float* out, int64_t ldo, int64_t cols, bool first, const float* row_scale,
                        const W* ahead = nullptr, int ahead_panels = ~0) {
  const __mmask16 last = static_cast<__mmask16>((1u << cols) - 1);
  __m512 acc[MR][NP];
  load_sums<MR, NP>(acc, out, ldo, last, first);
  const bool into_l2 = pdserve_simd::fetch_into_l2();
  for (int64_t k = k0; k < k1; ++k) {
    if (ahead != nullptr && starts_line<W>(k - k0)) {
#pragma GCC unroll 4
      for (int j = 0; j < NP; ++j)
        if (ahead_panels & (1 << j)) pdserve_simd::fetch_line(ahead + j * panel_size + (k - k0) * kPanel, into_l2);
    }
    __m512 wv[NP];
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j) wv[j] = load_panel(panels + j * panel_size + k * kPanel);
    // Kept in registers: for tiles of 2-4 rows GCC 12 folded each panel vector into every row's FMA as
    // a memory operand (a load per FMA), and on a Zen 5 those tiles ran at 0.44-0.55 of the 6-row
    // tile's rate with the weights in L1 (float32, 4 panels: 4 rows 119 -> 267 GFLOP/s a core, 3 rows
    // 118 -> 266, 2 rows 118 -> 210). A 16-row decode batch is 6 + 6 + 4 rows.
    pdserve_simd::keep_in_registers(wv);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512 xv = _mm512_set1_ps(x[i * ldx + k]);
#pragma GCC unroll 4
      for (int j = 0; j < NP; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  if (row_scale != nullptr) scale_sums<MR, NP>(acc, row_scale, last);
  store_sums<MR, NP>(acc, out, ldo, last);
}

// `micro_group<MR, NP>` for the rows and panel count chosen at run time.
template <int NP, int MR = kGroupRows, typename W>
inline void micro_group_rows(int rows, const float* x, int64_t ldx, const W* panels, int64_t panel_size, int64_t k0,
                             int64_t k1, float* out, int64_t ldo, int64_t cols, bool first, const float* row_scale,
                             const W* ahead, int ahead_panels) {
  if constexpr (MR > 0) {
    if (rows == MR)
      return micro_group<MR, NP>(x, ldx, panels, panel_size, k0, k1, out, ldo, cols, first, row_scale, ahead,
                                 ahead_panels);
    micro_group_rows<NP, MR - 1>(rows, x, ldx, panels, panel_size, k0, k1, out, ldo, cols, first, row_scale, ahead,
                                 ahead_panels);
  }
}

// `ahead`, where given, is fetched line by line as the tile reads `panels`: at step k the line at
// ahead + j * panel_size + (k - k0) * kPanel, for the panels j whose bit is set in `ahead_panels`; so
// `ahead` is where the next pass starts, as many steps long as this one.
template <typename W>
inline void micro_group_any(int panels_here, int rows, const float* x, int64_t ldx, const W* panels,
                            int64_t panel_size, int64_t k0, int64_t k1, float* out, int64_t ldo, int64_t cols,
                            bool first, const float* row_scale = nullptr, const W* ahead = nullptr,
                            int ahead_panels = ~0) {
  switch (panels_here) {
    case 4:
      return micro_group_rows<4>(rows, x, ldx, panels, panel_size, k0, k1, out, ldo, cols, first, row_scale, ahead,
                                 ahead_panels);
    case 3:
      return micro_group_rows<3>(rows, x, ldx, panels, panel_size, k0, k1, out, ldo, cols, first, row_scale, ahead,
                                 ahead_panels);
    case 2:
      return micro_group_rows<2>(rows, x, ldx, panels, panel_size, k0, k1, out, ldo, cols, first, row_scale, ahead,
                                 ahead_panels);
    default:
      return micro_group_rows<1>(rows, x, ldx, panels, panel_size, k0, k1, out, ldo, cols, first, row_scale, ahead,
                                 ahead_panels);
  }
}
#elif PDSERVE_GEMM_ISA == 256
constexpr int kRowsMax = 6;  // 6 x 2 accumulators + 2 panel vectors + a broadcast: 15 of 16 registers

inline __m256i lanes_below(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

inline void load_panel(const float* p, __m256& w0, __m256& w1) {
  w0 = _mm256_loadu_ps(p);
  w1 = _mm256_loadu_ps(p + 8);
}
inline void load_panel(const uint16_t* p, __m256& w0, __m256& w1) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  w0 = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
  w1 = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

template <int MR, typename W = float, bool Fetch = false>
inline void micro(const float* x, int64_t ldx, const W* panel, int64_t kc, float* out, int64_t ldo, int64_t cols,
                  bool first, const float* row_scale, const W* prefetch, int64_t fetch_stride = 0,
                  int64_t fetch_count = -1) {
  const __m256i m0 = lanes_below(cols), m1 = lanes_below(cols - 8);
  LineFetch<W> fetch(prefetch, kc, fetch_stride, fetch_count);
  __m256 acc[MR][2];
  // A whole panel's sums are read back and stored with plain loads and stores: vmaskmovps is slow on
  // AMD's Zen 3. Measured there (2 threads, alternated): plain stores ran 16-row panel matmuls
  // 1.08-1.10x faster (64-256 rows 1.04x, float32 and bfloat16 alike), and plain loads too ran
  // int8_gemm's reduction slices 1.05-1.08x faster at 64-512 rows.
  const bool whole = cols == kPanel;
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) {
    if (first) {
      acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    } else {
      acc[i][0] = whole ? _mm256_loadu_ps(out + i * ldo) : _mm256_maskload_ps(out + i * ldo, m0);
      acc[i][1] = whole ? _mm256_loadu_ps(out + i * ldo + 8) : _mm256_maskload_ps(out + i * ldo + 8, m1);
    }
  }
  for (int64_t k = 0; k < kc; ++k) {
    if constexpr (Fetch) fetch.at_step(k, kc);
    __m256 w0, w1;
    load_panel(panel + k * kPanel, w0, w1);
    // Kept in registers: for tiles of 4 rows or fewer GCC 12 otherwise loaded each panel vector once
    // per row (8 loads a step instead of 2), and the 4-row tile, the last block of a 16-row decode
    // batch, ran at half the 6-row tile's rate on a Zen 3; with this, 16-row panel matmuls from memory
    // ran 1.05x faster (30 alternated pairs, quartiles 1.02-1.10), and 2-8 and 64 rows level.
    pdserve_simd::keep_in_register(w0);
    pdserve_simd::keep_in_register(w1);
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      const __m256 xv = _mm256_broadcast_ss(x + i * ldx + k);
      acc[i][0] = _mm256_fmadd_ps(xv, w0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(xv, w1, acc[i][1]);
    }
  }
  if (row_scale != nullptr) {
    const __m256 s0 = _mm256_maskload_ps(row_scale, m0), s1 = _mm256_maskload_ps(row_scale + 8, m1);
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      acc[i][0] = _mm256_mul_ps(acc[i][0], s0);
      acc[i][1] = _mm256_mul_ps(acc[i][1], s1);
    }
  }
  if (whole) {
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      _mm256_storeu_ps(out + i * ldo, acc[i][0]);
      _mm256_storeu_ps(out + i * ldo + 8, acc[i][1]);
    }
    return;
  }
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) {
    _mm256_maskstore_ps(out + i * ldo, m0, acc[i][0]);
    _mm256_maskstore_ps(out + i * ldo + 8, m1, acc[i][1]);
  }
}
#else
constexpr int kRowsMax = 4;

template <int MR, typename W = float, bool Fetch = false>
inline void micro(const float* x, int64_t ldx, const W* panel, int64_t kc, float* out, int64_t ldo, int64_t cols,
                  bool first, const float* row_scale, const W* /*prefetch*/, int64_t /*fetch_stride*/ = 0,
                  int64_t /*fetch_count*/ = -1) {
  for (int i = 0; i < MR; ++i)
    for (int64_t j = 0; j < cols; ++j) {
      float acc = first ? 0.f : out[i * ldo + j];
      for (int64_t k = 0; k < kc; ++k) acc = std::fma(x[i * ldx + k], weight_at(panel + k * kPanel, j), acc);
      out[i * ldo + j] = row_scale != nullptr ? acc * row_scale[j] : acc;
    }
}
#endif

// `micro<MR>` for MR chosen at run time (the last rows of a block).
template <int MR = kRowsMax, typename W = float>
inline void micro_rows(int rows, const float* x, int64_t ldx, const W* panel, int64_t kc, float* out, int64_t ldo,
                       int64_t cols, bool first, const float* row_scale,
                       const typename same<W>::type* prefetch = nullptr, int64_t fetch_stride = 0,
                       int64_t fetch_count = -1) {
  if constexpr (MR > 0) {
    if (rows == MR) {
      if (prefetch == nullptr) return micro<MR, W, false>(x, ldx, panel, kc, out, ldo, cols, first, row_scale, nullptr);
      return micro<MR, W, true>(x, ldx, panel, kc, out, ldo, cols, first, row_scale, prefetch, fetch_stride,
                                fetch_count);
    }
    micro_rows<MR - 1, W>(rows, x, ldx, panel, kc, out, ldo, cols, first, row_scale, prefetch, fetch_stride,
                          fetch_count);
  }
}

}  // namespace pdserve_gemm
