// y = x Wᵀ for bfloat16 weights in AMX tiles, on CPUs with AMX (Intel Xeon since Sapphire Rapids).
//
// Why our own: a decode step reads every weight from memory once, so its matmuls run at the speed
// weights stream in. On a 2-core Xeon with AMX, oneDNN's packed bf16 matmul (AMX too) streamed a
// decode step's weights at 9-11 GB/s at 1 to 16 rows, where a plain sum reads 20-22 GB/s: each
// tile load waits for its 16 lines one after another. Here every line of a tile is requested
// before the tile is loaded, and past 16 rows each weight tile is multiplied by every row block as
// soon as it arrives. The step's matmuls ran 1.4-2.1x faster than oneDNN's from 1 to 16 rows (13-18
// GB/s at 16 rows), 2.0x at 32, 0.85-0.93x at 64-128 and level at 512; from 128 rows pairs of output
// blocks by pairs of row blocks (pairs_times) run 1.1-1.3x faster than one block at a time
// (benchmarks/bench_kernels.py's `kernels_matmul_bf16` table measures it).
//
// Layout (engine/model/layers.py's `to_amx_tiles`): [groups][k_blocks][4][16][32] bfloat16. Group g
// holds output rows 64g..64g+63, k-block b inputs 32b..32b+31; tile [g][b][j] is the B operand of
// output block 4g+j in AMX's pair-interleaved form: element [r][2c + h] = W[64g + 16j + c][32b + 2r + h].
// Rows past the weight's end and inputs past its width are zero.
//
// Arithmetic: bf16 products summed in float32 by the tile unit, in k-block order, then rounded to
// bfloat16 once (round to nearest even), as oneDNN's bf16 matmul does; the sums inside one k-block
// are in the hardware's order. A row's result does not depend on the other rows nor on the number
// of threads.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "cpu_amx.h"

namespace {

constexpr int64_t kRows = 16;    // rows of x per A tile; k pairs per B tile
constexpr int64_t kK = 32;       // bf16 inputs per tile row
constexpr int64_t kBlock = 16;   // outputs per B tile
constexpr int64_t kGroup = 4;    // output blocks per packed group (and per pass: 4 C tiles)
constexpr int64_t kTile = kRows * kK;  // bf16 elements per tile

#if PDSERVE_AMX

using pdserve_amx::permitted;
using pdserve_amx::TileConfig;

// Tiles 0-3 accumulate four output blocks, 4 holds `rows` rows of x, 5-7 the weight tiles in turn.
// Fewer than 16 rows only for an x of fewer rows: a taller one is padded to whole tiles by the caller.
void configure_tiles(int rows) {
  TileConfig cfg{};
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = t < 5 ? rows : kRows;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// Accumulator tiles 0..N-1: zeroed before a pass, stored after it to c, 256 floats (16 x 16) apart.
template <int N>
inline void zero_accumulators() {
  _tile_zero(0);
  if (N > 1) _tile_zero(1);
  if (N > 2) _tile_zero(2);
  if (N > 3) _tile_zero(3);
}

template <int N>
inline void store_accumulators(float* c) {
  _tile_stored(0, c, 64);
  if (N > 1) _tile_stored(1, c + 256, 64);
  if (N > 2) _tile_stored(2, c + 512, 64);
  if (N > 3) _tile_stored(3, c + 768, 64);
}

inline const uint16_t* tile_of(const uint16_t* w, int64_t k_blocks, int64_t block, int64_t kb) {
  return w + ((block / kGroup * k_blocks + kb) * kGroup + block % kGroup) * kTile;
}

// Up to 16 rows: C[j] = x · W_blockᵀ for NB output blocks starting at `block` (x's row stride lda
// elements), over every k-block; each weight tile's lines are all requested before it is loaded.
template <int NB>
void blocks_times(const uint16_t* x, int64_t lda, const uint16_t* w, int64_t k_blocks, int64_t block, float* c) {
  zero_accumulators<NB>();
  for (int64_t kb = 0; kb < k_blocks; ++kb) {
    const uint16_t* b[NB];
    for (int j = 0; j < NB; ++j) b[j] = tile_of(w, k_blocks, block + j, kb);
    for (int j = 0; j < NB; ++j)
      for (int64_t line = 0; line < kTile * 2; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(b[j]) + line, _MM_HINT_T0);
    _tile_loadd(4, x + kb * kK, lda * 2);
    _tile_loadd(5, b[0], 64);
    _tile_dpbf16ps(0, 4, 5);
    if (NB > 1) {
      _tile_loadd(6, b[1], 64);
      _tile_dpbf16ps(1, 4, 6);
    }
    if (NB > 2) {
      _tile_loadd(7, b[2], 64);
      _tile_dpbf16ps(2, 4, 7);
    }
    if (NB > 3) {
      _tile_loadd(5, b[3], 64);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  store_accumulators<NB>(c);
}

// Past 16 rows: C[r] = rows 16r..16r+15 of x · W_blockᵀ for R row blocks of one output block, each
// weight tile multiplied by every row block as soon as it is loaded. A pass per row block would
// read the tiles from memory in the first pass and only compute on them, from cache, in the others;
// interleaved, the weight stream and the arithmetic overlap (the next tiles are requested kAhead
// k-blocks early; `fetch` only in the first chunk of rows, later ones find the tiles in cache).
// Tile 5 holds the weight tile, 4, 6 and 7 the row blocks of x in turn.
constexpr int64_t kAhead = 4;

template <int R>
void rows_times(const uint16_t* x, int64_t lda, const uint16_t* w, int64_t k_blocks, int64_t block, bool fetch,
                float* c) {
  zero_accumulators<R>();
  const int64_t stride = lda * 2;
  for (int64_t kb = 0; kb < k_blocks; ++kb) {
    if (fetch) {
      for (int64_t ahead = kb == 0 ? 0 : kAhead; ahead <= kAhead && kb + ahead < k_blocks; ++ahead) {
        const char* next = reinterpret_cast<const char*>(tile_of(w, k_blocks, block, kb + ahead));
        for (int64_t line = 0; line < kTile * 2; line += 64) _mm_prefetch(next + line, _MM_HINT_T0);
      }
    }
    const uint16_t* a = x + kb * kK;
    _tile_loadd(5, tile_of(w, k_blocks, block, kb), 64);
    _tile_loadd(4, a, stride);
    _tile_dpbf16ps(0, 4, 5);
    if (R > 1) {
      _tile_loadd(6, a + kRows * lda, stride);
      _tile_dpbf16ps(1, 6, 5);
    }
    if (R > 2) {
      _tile_loadd(7, a + 2 * kRows * lda, stride);
      _tile_dpbf16ps(2, 7, 5);
    }
    if (R > 3) {
      _tile_loadd(4, a + 3 * kRows * lda, stride);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  store_accumulators<R>(c);
}

// From kPairRows rows: C = rows 16r..16r+31 of x · (output blocks `block`, `block` + 1)ᵀ, a 2 x 2 of
// accumulators ([row block][output block] at c + 256 * (2 * r + j)): per k-block two tiles of x and two
// of weights feed four products, where rows_times loads a tile of x per product. On the AMX Xeon (2
// threads, a decode step's 49 matmuls, weights from memory, medians of paired ratios) 1.13-1.30x
// rows_times at 128 rows, 1.16-1.23x at 256, 0.81x at 32 and level at 64: rows_times keeps those.
// Tiles 4 and 5 hold x, 6 and 7 the weights; the next tiles of both blocks are requested kAhead
// k-blocks early when `fetch` (the first rows).
constexpr int64_t kPairRows = 128;

void pairs_times(const uint16_t* x, int64_t lda, const uint16_t* w, int64_t k_blocks, int64_t block, bool fetch,
                 float* c) {
  zero_accumulators<4>();
  const int64_t stride = lda * 2;
  for (int64_t kb = 0; kb < k_blocks; ++kb) {
    if (fetch) {
      for (int64_t ahead = kb == 0 ? 0 : kAhead; ahead <= kAhead && kb + ahead < k_blocks; ++ahead)
        for (int64_t j = 0; j < 2; ++j) {
          const char* next = reinterpret_cast<const char*>(tile_of(w, k_blocks, block + j, kb + ahead));
          for (int64_t line = 0; line < kTile * 2; line += 64) _mm_prefetch(next + line, _MM_HINT_T0);
        }
    }
    const uint16_t* a = x + kb * kK;
    _tile_loadd(4, a, stride);
    _tile_loadd(6, tile_of(w, k_blocks, block, kb), 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, tile_of(w, k_blocks, block + 1, kb), 64);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, a + kRows * lda, stride);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  store_accumulators<4>(c);
}

// Rows [m, m + rows) of output block `block` from c, row r of the block at c[r * 16], to bfloat16.
inline void store_rows(const float* c, int64_t rows, int64_t block, int64_t n_size, int64_t m, uint16_t* y) {
  const int64_t n0 = block * kBlock;
  const int64_t cols = std::min(kBlock, n_size - n0);
  const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);
  for (int64_t r = 0; r < rows; ++r) {
    const __m256i v = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_load_ps(c + r * kBlock)));
    _mm256_mask_storeu_epi16(y + (m + r) * n_size + n0, mask, v);
  }
}

void amx_times(const uint16_t* x, int64_t lda, int64_t m_size, const uint16_t* w, int64_t k_blocks,
               int64_t n_size, uint16_t* y) {
  const int64_t n_blocks = (n_size + kBlock - 1) / kBlock;
  at::parallel_for(0, n_blocks, 1, [&](int64_t b0, int64_t b1) {
    configure_tiles(static_cast<int>(std::min(kRows, m_size)));
    alignas(64) float c[kGroup * kRows * kBlock];
    if (m_size <= kRows) {  // one row block: four output blocks per pass
      for (int64_t block = b0; block < b1; block += kGroup) {
        const int nb = static_cast<int>(std::min<int64_t>(kGroup, b1 - block));
        switch (nb) {
          case 1: blocks_times<1>(x, lda, w, k_blocks, block, c); break;
          case 2: blocks_times<2>(x, lda, w, k_blocks, block, c); break;
          case 3: blocks_times<3>(x, lda, w, k_blocks, block, c); break;
          default: blocks_times<4>(x, lda, w, k_blocks, block, c); break;
        }
        for (int j = 0; j < nb; ++j) store_rows(c + j * kRows * kBlock, m_size, block + j, n_size, 0, y);
      }
    } else {
      int64_t block = b0;
      if (m_size >= kPairRows) {  // pairs of output blocks, two row blocks at a time
        for (; block + 1 < b1; block += 2) {
          for (int64_t m = 0; m < m_size; m += 2 * kRows) {
            const uint16_t* xr = x + m * lda;
            if (m + kRows < m_size) {  // x is padded to whole row blocks: both are there
              pairs_times(xr, lda, w, k_blocks, block, m == 0, c);
              for (int64_t r = 0; r < 2; ++r)
                for (int64_t j = 0; j < 2; ++j)
                  store_rows(c + (2 * r + j) * kRows * kBlock, std::min(kRows, m_size - m - r * kRows), block + j,
                             n_size, m + r * kRows, y);
            } else {  // the last row block alone
              for (int64_t j = 0; j < 2; ++j) {
                rows_times<1>(xr, lda, w, k_blocks, block + j, false, c);
                store_rows(c, m_size - m, block + j, n_size, m, y);
              }
            }
          }
        }
      }
      // Up to four row blocks per pass over one output block; its tiles stay in cache after the first.
      constexpr int64_t kChunk = 4 * kRows;
      for (; block < b1; ++block) {
        for (int64_t m = 0; m < m_size; m += kChunk) {
          const uint16_t* xr = x + m * lda;
          const bool fetch = m == 0;
          const int64_t rows = std::min(kChunk, m_size - m);
          switch ((rows + kRows - 1) / kRows) {
            case 1: rows_times<1>(xr, lda, w, k_blocks, block, fetch, c); break;
            case 2: rows_times<2>(xr, lda, w, k_blocks, block, fetch, c); break;
            case 3: rows_times<3>(xr, lda, w, k_blocks, block, fetch, c); break;
            default: rows_times<4>(xr, lda, w, k_blocks, block, fetch, c); break;
          }
          store_rows(c, rows, block, n_size, m, y);
        }
      }
    }
    _tile_release();
  });
}

#endif  // PDSERVE_AMX

bool amx_linear_available() {
#if PDSERVE_AMX
  return permitted();
#else
  return false;
#endif
}

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& tiles, int64_t out_features) {
  TORCH_CHECK(amx_linear_available(), "amx_linear: this build or CPU has no AMX (or the OS refused its state)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "amx_linear: x must be a 2-D bfloat16 tensor");
  TORCH_CHECK(tiles.dim() == 5 && tiles.scalar_type() == at::kBFloat16 && tiles.is_contiguous() &&
                  tiles.size(2) == kGroup && tiles.size(3) == kRows && tiles.size(4) == kK,
              "amx_linear: the weight must be in AMX tiles, a contiguous bfloat16 [groups, k_blocks, 4, 16, 32]");
  const int64_t groups = tiles.size(0), k_blocks = tiles.size(1);
  const int64_t m_size = x.size(0), k_size = x.size(1), n_size = out_features;
  TORCH_CHECK(k_size <= k_blocks * kK && k_size > (k_blocks - 1) * kK, "amx_linear: x has ", k_size,
              " columns, the tiles hold ", k_blocks * kK);
  TORCH_CHECK(n_size <= groups * kGroup * kBlock && n_size > (groups - 1) * kGroup * kBlock, "amx_linear: ", groups,
              " groups of tiles cannot hold ", n_size, " output features");
  at::Tensor y = at::empty({m_size, n_size}, x.options());
  if (m_size == 0 || n_size == 0) return y;
#if PDSERVE_AMX
  // A tile reads up to 16 rows of 32 inputs: x is padded with zeros to whole tiles unless it already
  // is whole tiles of contiguous rows (or one tile of fewer rows, the tiles' height then).
  const int64_t rows_padded = m_size <= kRows ? m_size : (m_size + kRows - 1) / kRows * kRows;
  at::Tensor xp = x;
  if (rows_padded != m_size || k_blocks * kK != k_size || x.stride(1) != 1) {
    xp = at::zeros({rows_padded, k_blocks * kK}, x.options());
    xp.narrow(0, 0, m_size).narrow(1, 0, k_size).copy_(x);
  }
  amx_times(reinterpret_cast<const uint16_t*>(xp.data_ptr<at::BFloat16>()), xp.stride(0), m_size,
            reinterpret_cast<const uint16_t*>(tiles.data_ptr<at::BFloat16>()), k_blocks, n_size,
            reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()));
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("amx_linear_available() -> bool");
  m.def("amx_linear(Tensor x, Tensor tiles, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CatchAll, m) { m.impl("amx_linear_available", &amx_linear_available); }

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) { m.impl("amx_linear", &amx_linear); }
