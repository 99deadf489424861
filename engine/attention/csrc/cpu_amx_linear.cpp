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
#include <type_traits>
#include <vector>

#include "cpu_amx.h"
#include "cpu_parallel.h"
#include "cpu_step_parts.h"

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
  pdserve_amx::load_tile_config(cfg);
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

// Tile [block / 4][kb][block % 4] of weights in the packed layout (bf16 or int8 elements).
template <typename T>
inline const T* tile_of(const T* w, int64_t k_blocks, int64_t block, int64_t kb) {
  return w + ((block / kGroup * k_blocks + kb) * kGroup + block % kGroup) * kTile;
}

// f(std::integral_constant<int, count>{}) for a count of 1 to 4: the tile routines take their
// number of accumulators as a template argument.
template <typename F>
inline void with_count(int64_t count, F&& f) {
  switch (count) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    default: f(std::integral_constant<int, 4>{}); break;
  }
}

// C[j] += the row block of x at a (row stride lda elements) · weight tile b[j], for j < NB: tile 4
// holds x, 5-7 the weight tiles in turn.
template <int NB>
inline void row_block_times(const uint16_t* a, int64_t lda, const uint16_t* const* b) {
  _tile_loadd(4, a, lda * 2);
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

// C[r] += row block r of x at a (16 rows each, row stride lda) · the weight tile b, for r < R: tile 5
// holds the weight, 4, 6 and 7 the row blocks in turn.
template <int R>
inline void weight_tile_times(const uint16_t* a, int64_t lda, const uint16_t* b) {
  const int64_t stride = lda * 2;
  _tile_loadd(5, b, 64);
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

// Up to 16 rows: C[j] = x · W_blockᵀ for NB output blocks starting at `block` (x's row stride lda
// elements), over every k-block; every line of the weight tiles kFewAhead k-blocks on is requested
// before this k-block's tiles are loaded (a tile load waits for its 16 lines one after another). On
// the 2-core AMX Xeon, whole bfloat16 decode steps of the bench model alternated in one process: 1.04-
// 1.05x at 1 and 16 rows against requesting this k-block's own lines just before their loads (one
// or three k-blocks on about the same, four 1.04x; into L2 instead of L1 1.02x; none at all level).
// Where the rest goes, measured later on that Xeon: a step's 49 matmuls run back to back with nothing
// between them read their weights at 0.66-0.70 of a 1 GiB sum's rate, where plain vector loads of the
// same halves read at 0.91, and perf puts 62% of the kernel's samples on these prefetches (each waits
// for a free line-fill buffer). Dropping them is 1.05-1.2x faster in that bare loop but level in
// whole steps (0.995-0.997x), as are B tiles rotated over three registers or x in two (0.95x bare).
constexpr int64_t kFewAhead = 2;

template <int NB>
void blocks_times(const uint16_t* x, int64_t lda, const uint16_t* w, int64_t k_blocks, int64_t block, float* c) {
  zero_accumulators<NB>();
  for (int64_t kb = 0; kb < k_blocks; ++kb) {
    for (int64_t ahead = kb == 0 ? 0 : kFewAhead; ahead <= kFewAhead && kb + ahead < k_blocks; ++ahead)
      for (int j = 0; j < NB; ++j) {
        const char* next = reinterpret_cast<const char*>(tile_of(w, k_blocks, block + j, kb + ahead));
        for (int64_t line = 0; line < kTile * 2; line += 64) _mm_prefetch(next + line, _MM_HINT_T0);
      }
    const uint16_t* b[NB];
    for (int j = 0; j < NB; ++j) b[j] = tile_of(w, k_blocks, block + j, kb);
    row_block_times<NB>(x + kb * kK, lda, b);
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
  for (int64_t kb = 0; kb < k_blocks; ++kb) {
    if (fetch) {
      for (int64_t ahead = kb == 0 ? 0 : kAhead; ahead <= kAhead && kb + ahead < k_blocks; ++ahead) {
        const char* next = reinterpret_cast<const char*>(tile_of(w, k_blocks, block, kb + ahead));
        for (int64_t line = 0; line < kTile * 2; line += 64) _mm_prefetch(next + line, _MM_HINT_T0);
      }
    }
    weight_tile_times<R>(x + kb * kK, lda, tile_of(w, k_blocks, block, kb));
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

// Where a kernel's outputs go: y is [m_size, n_size] bfloat16; `scale`, when not null, multiplies
// output column n before the rounding (int8 weights' row scales).
struct Output {
  uint16_t* y;
  int64_t n_size;
  const float* scale;
};

// Rows [m, m + rows) of output block `block` from c, row r of the block at c[r * 16], to bfloat16.
inline void store_rows(const float* c, int64_t rows, int64_t block, const Output& out, int64_t m) {
  const int64_t n0 = block * kBlock;
  const int64_t cols = std::min(kBlock, out.n_size - n0);
  const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);
  const __m512 scale = out.scale ? _mm512_maskz_loadu_ps(mask, out.scale + n0) : _mm512_set1_ps(1.0f);
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 v = out.scale ? _mm512_mul_ps(_mm512_load_ps(c + r * kBlock), scale) : _mm512_load_ps(c + r * kBlock);
    _mm256_mask_storeu_epi16(out.y + (m + r) * out.n_size + n0, mask, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
  }
}

// Up to 16 rows, output blocks [b0, b1), four per pass: `blocks(n, block, c)` multiplies the n
// blocks from `block` into c (n an integral_constant).
template <typename Blocks>
void few_rows(int64_t m_size, int64_t b0, int64_t b1, const Output& out, Blocks&& blocks) {
  alignas(64) float c[kGroup * kRows * kBlock];
  for (int64_t block = b0; block < b1; block += kGroup) {
    const int64_t nb = std::min<int64_t>(kGroup, b1 - block);
    with_count(nb, [&](auto n) { blocks(n, block, c); });
    for (int64_t j = 0; j < nb; ++j) store_rows(c + j * kRows * kBlock, m_size, block + j, out, 0);
  }
}

// Past 16 rows, output block `out_block` in chunks of up to four row blocks: `chunk(r, m, c)`
// multiplies the r row blocks from row m into c (r an integral_constant; m == 0 is the first pass).
template <typename Chunk>
void in_row_chunks(int64_t m_size, int64_t out_block, const Output& out, float* c, Chunk&& chunk) {
  constexpr int64_t kChunk = 4 * kRows;
  for (int64_t m = 0; m < m_size; m += kChunk) {
    const int64_t rows = std::min(kChunk, m_size - m);
    with_count((rows + kRows - 1) / kRows, [&](auto r) { chunk(r, m, c); });
    store_rows(c, rows, out_block, out, m);
  }
}

// Past 16 rows (x padded to whole row blocks), output blocks [b0, b1) of the tiles at w; output
// block `block` of w is block `block + first` of the output.
void many_rows(const uint16_t* x, int64_t lda, int64_t m_size, const uint16_t* w, int64_t k_blocks, int64_t b0,
               int64_t b1, int64_t first, const Output& out) {
  alignas(64) float c[kGroup * kRows * kBlock];
  int64_t block = b0;
  if (m_size >= kPairRows) {  // pairs of output blocks, two row blocks at a time
    for (; block + 1 < b1; block += 2) {
      for (int64_t m = 0; m < m_size; m += 2 * kRows) {
        const uint16_t* xr = x + m * lda;
        if (m + kRows < m_size) {  // x is padded to whole row blocks: both are there
          pairs_times(xr, lda, w, k_blocks, block, m == 0, c);
          for (int64_t r = 0; r < 2; ++r)
            for (int64_t j = 0; j < 2; ++j)
              store_rows(c + (2 * r + j) * kRows * kBlock, std::min(kRows, m_size - m - r * kRows), first + block + j,
                         out, m + r * kRows);
        } else {  // the last row block alone
          for (int64_t j = 0; j < 2; ++j) {
            rows_times<1>(xr, lda, w, k_blocks, block + j, false, c);
            store_rows(c, m_size - m, first + block + j, out, m);
          }
        }
      }
    }
  }
  // Up to four row blocks per pass over one output block; its tiles stay in cache after the first.
  for (; block < b1; ++block)
    in_row_chunks(m_size, first + block, out, c, [&](auto r, int64_t m, float* acc) {
      rows_times<decltype(r)::value>(x + m * lda, lda, w, k_blocks, block, m == 0, acc);
    });
}

// The output blocks are split among the threads in equal contiguous halves. On the 2-core AMX Xeon
// the two halves of a decode matmul (16 rows) ended 25-39 us apart on average, heavy-tailed: a
// quarter of the calls more than 30 us, 1.2-1.9 ms a step in all. Claiming groups one at a time
// instead (from one counter, or thread 0 from the front and thread 1 from the back) cut that to 0.6
// ms, yet whole bf16 decode steps were level (0.99-1.03x, alternated in one process): the thread
// left alone reads at most of the machine's rate, so the wait costs little of the stream.
void amx_times(const uint16_t* x, int64_t lda, int64_t m_size, const uint16_t* w, int64_t k_blocks,
               const Output& out) {
  const int64_t n_blocks = (out.n_size + kBlock - 1) / kBlock;
  pdserve_parallel::parallel_for(0, n_blocks, 1, [&](int64_t b0, int64_t b1) {
    configure_tiles(static_cast<int>(std::min(kRows, m_size)));
    if (m_size <= kRows) {
      few_rows(m_size, b0, b1, out, [&](auto n, int64_t block, float* c) {
        blocks_times<decltype(n)::value>(x, lda, w, k_blocks, block, c);
      });
    } else {
      many_rows(x, lda, m_size, w, k_blocks, b0, b1, 0, out);
    }
    _tile_release();
  });
}

// int8 weights in the same tile layout, one byte per element, one scale per output row. int8
// values are exact in bfloat16 (8 significant bits), so each weight tile is widened to bf16 in
// registers and multiplied as above; the sum of x times the int8 row, scaled once at the end, is
// the bf16 model's product with the dequantized weight up to float32 rounding. The weights stream
// in at half bf16's bytes.
//
// Widening, not the memory, sets the pace (about 100 cycles a tile with sign-extend, convert and
// pack), so the bytes are stored for a cheaper widening (quant.to_amx_int8_tiles): sign and
// magnitude (bit 7 the sign, bits 0-6 |v|), and within every 64 bytes in the order two byte
// interleaves put back in sequence (stored byte 16L + 8h + k holds element 32h + 8L + k). A byte
// permute looks up the high and the low byte of bf16(|v|) in 128-entry tables (it reads only the
// index's low 7 bits), the sign is or-ed into the high byte, and the interleaves give 64 bf16
// values in order: 30 against 18 ns a tile on the AMX Xeon, tiles in L1, bit-equal.

// Bytes of bf16(m) for m in 0..127: exact, m has at most 7 significant bits.
constexpr uint16_t bf16_of_small(int m) {
  int e = 0;
  while ((2 << e) <= m) ++e;
  return m == 0 ? 0 : static_cast<uint16_t>(((127 + e) << 7) | ((m << (7 - e)) & 0x7f));
}

struct WidenTables {
  __m512i high[2], low[2];  // entries 0-63 and 64-127
  WidenTables() {
    alignas(64) uint8_t hi[128], lo[128];
    for (int m = 0; m < 128; ++m) {
      hi[m] = static_cast<uint8_t>(bf16_of_small(m) >> 8);
      lo[m] = static_cast<uint8_t>(bf16_of_small(m) & 0xff);
    }
    high[0] = _mm512_load_si512(hi), high[1] = _mm512_load_si512(hi + 64);
    low[0] = _mm512_load_si512(lo), low[1] = _mm512_load_si512(lo + 64);
  }
};

// One tile of 16 x 32 stored bytes (above) to bfloat16, pair-interleaved as the bf16 tiles.
inline void widen_tile(const uint8_t* tile, uint16_t* out, const WidenTables& t) {
  const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
#pragma GCC unroll 8
  for (int64_t i = 0; i < kTile; i += 64) {
    const __m512i bytes = _mm512_loadu_si512(tile + i);
    // high | (bytes & sign): ternary-logic table 0xF8
    const __m512i high = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t.high[0], bytes, t.high[1]), bytes,
                                                   sign, 0xF8);
    const __m512i low = _mm512_permutex2var_epi8(t.low[0], bytes, t.low[1]);
    _mm512_store_si512(reinterpret_cast<__m512i*>(out + i), _mm512_unpacklo_epi8(low, high));
    _mm512_store_si512(reinterpret_cast<__m512i*>(out + i + 32), _mm512_unpackhi_epi8(low, high));
  }
}

// Up to 16 rows, NB output blocks from `block`: as blocks_times, the weight tiles widened one
// k-block ahead into a second buffer, so a tile load never waits on the stores just made to it.
template <int NB>
void int8_blocks_times(const uint16_t* x, int64_t lda, const uint8_t* w, int64_t k_blocks, int64_t block,
                       const WidenTables& tables, float* c) {
  alignas(64) uint16_t widened[2][kGroup][kTile];
  zero_accumulators<NB>();
  for (int j = 0; j < NB; ++j) widen_tile(tile_of(w, k_blocks, block + j, 0), widened[0][j], tables);
  for (int64_t kb = 0; kb < k_blocks; ++kb) {
    for (int64_t ahead = kb == 0 ? 1 : kAhead; ahead <= kAhead && kb + ahead < k_blocks; ++ahead)
      for (int j = 0; j < NB; ++j) {
        const char* next = reinterpret_cast<const char*>(tile_of(w, k_blocks, block + j, kb + ahead));
        for (int64_t line = 0; line < kTile; line += 64) _mm_prefetch(next + line, _MM_HINT_T0);
      }
    if (kb + 1 < k_blocks)
      for (int j = 0; j < NB; ++j)
        widen_tile(tile_of(w, k_blocks, block + j, kb + 1), widened[(kb + 1) & 1][j], tables);
    const uint16_t* b[NB];
    for (int j = 0; j < NB; ++j) b[j] = widened[kb & 1][j];
    row_block_times<NB>(x + kb * kK, lda, b);
  }
  store_accumulators<NB>(c);
}

// 17 to kPairRows - 1 rows: as rows_times on one output block, its tiles widened into `panel`
// ([k_blocks][16][32] bf16) in the pass of the first row blocks (`widen`), the widening overlapping
// the tile products; later row blocks read the panel. The int8 tiles are requested 4 * kAhead
// k-blocks ahead (one block's stream is a quarter of a group's).
template <int R>
void int8_rows_times(const uint16_t* x, int64_t lda, const uint8_t* w, int64_t k_blocks, int64_t block, bool widen,
                     uint16_t* panel, const WidenTables& tables, float* c) {
  zero_accumulators<R>();
  for (int64_t kb = 0; kb < k_blocks; ++kb) {
    uint16_t* b = panel + kb * kTile;
    if (widen) {
      for (int64_t ahead = kb == 0 ? 0 : 4 * kAhead; ahead <= 4 * kAhead && kb + ahead < k_blocks; ++ahead) {
        const char* next = reinterpret_cast<const char*>(tile_of(w, k_blocks, block, kb + ahead));
        for (int64_t line = 0; line < kTile; line += 64) _mm_prefetch(next + line, _MM_HINT_T0);
      }
      widen_tile(tile_of(w, k_blocks, block, kb), b, tables);
    }
    weight_tile_times<R>(x + kb * kK, lda, b);
  }
  store_accumulators<R>(c);
}

// Room for `tiles` bf16 tiles in `storage`, 64-byte aligned as tile loads and stores prefer.
uint16_t* aligned_buffer(std::vector<uint16_t>& storage, int64_t tiles) {
  storage.resize(tiles * kTile + 32);
  return reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~uintptr_t{63});
}

void int8_times(const uint16_t* x, int64_t lda, int64_t m_size, const uint8_t* w, int64_t k_blocks,
                const Output& out) {
  const int64_t n_blocks = (out.n_size + kBlock - 1) / kBlock;
  if (m_size <= kRows) {
    at::parallel_for(0, n_blocks, 1, [&](int64_t b0, int64_t b1) {
      configure_tiles(static_cast<int>(m_size));
      const WidenTables tables;
      few_rows(m_size, b0, b1, out, [&](auto n, int64_t block, float* c) {
        int8_blocks_times<decltype(n)::value>(x, lda, w, k_blocks, block, tables, c);
      });
      _tile_release();
    });
    return;
  }
  if (m_size < kPairRows) {
    at::parallel_for(0, n_blocks, 1, [&](int64_t b0, int64_t b1) {
      configure_tiles(kRows);
      const WidenTables tables;
      alignas(64) float c[kGroup * kRows * kBlock];
      std::vector<uint16_t> widened;
      uint16_t* panel = aligned_buffer(widened, k_blocks);
      for (int64_t block = b0; block < b1; ++block)
        in_row_chunks(m_size, block, out, c, [&](auto r, int64_t m, float* acc) {
          int8_rows_times<decltype(r)::value>(x + m * lda, lda, w, k_blocks, block, m == 0, panel, tables, acc);
        });
      _tile_release();
    });
    return;
  }
  // From kPairRows rows each weight tile meets many row blocks: a group's tiles (4 output blocks)
  // are widened once into a bf16 copy of the group, which the bf16 path multiplies from cache.
  const int64_t groups = (n_blocks + kGroup - 1) / kGroup;
  const int64_t group_tiles = k_blocks * kGroup;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    configure_tiles(kRows);
    const WidenTables tables;
    std::vector<uint16_t> widened;
    uint16_t* group = aligned_buffer(widened, group_tiles);
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* tiles = w + g * group_tiles * kTile;
      for (int64_t t = 0; t < group_tiles; ++t) widen_tile(tiles + t * kTile, group + t * kTile, tables);
      many_rows(x, lda, m_size, group, k_blocks, 0, std::min(kGroup, n_blocks - g * kGroup), g * kGroup, out);
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

// Checks what both ops share and returns x as the kernels read it: a tile reads up to 16 rows of 32
// inputs, so x is padded with zeros to whole tiles unless it already is whole tiles of contiguous
// rows (or one tile of fewer rows, the tiles' height then).
at::Tensor tiled_rows(const char* op, const at::Tensor& x, const at::Tensor& tiles, at::ScalarType element,
                      int64_t out_features) {
  TORCH_CHECK(amx_linear_available(), op, ": this build or CPU has no AMX (or the OS refused its state)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, op, ": x must be a 2-D bfloat16 tensor");
  const int64_t m_size = x.size(0), k_size = x.size(1);
  const pdserve_parts::Fit fit = pdserve_parts::amx_tiles_fit(tiles, element, k_size, out_features);
  TORCH_CHECK(fit.layout, op, ": the weight must be in AMX tiles, a contiguous ", element,
              " [groups, k_blocks, 4, 16, 32]");
  const int64_t groups = tiles.size(0), k_blocks = tiles.size(1);
  TORCH_CHECK(fit.inputs, op, ": x has ", k_size, " columns, the tiles hold ", k_blocks * kK);
  TORCH_CHECK(fit.outputs, op, ": ", groups, " groups of tiles cannot hold ", out_features, " output features");
  const int64_t rows_padded = m_size <= kRows ? m_size : (m_size + kRows - 1) / kRows * kRows;
  if (rows_padded == m_size && k_blocks * kK == k_size && x.stride(1) == 1) return x;
  at::Tensor xp = at::zeros({rows_padded, k_blocks * kK}, x.options());
  xp.narrow(0, 0, m_size).narrow(1, 0, k_size).copy_(x);
  return xp;
}

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& tiles, int64_t out_features) {
  const at::Tensor xp = tiled_rows("amx_linear", x, tiles, at::kBFloat16, out_features);
  at::Tensor y = at::empty({x.size(0), out_features}, x.options());
  if (x.size(0) == 0 || out_features == 0) return y;
#if PDSERVE_AMX
  amx_times(reinterpret_cast<const uint16_t*>(xp.data_ptr<at::BFloat16>()), xp.stride(0), x.size(0),
            reinterpret_cast<const uint16_t*>(tiles.data_ptr<at::BFloat16>()), tiles.size(1),
            Output{reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), out_features, nullptr});
#endif
  return y;
}

// x (bfloat16) times the weight q * scales[:, None] whose int8 values q are in AMX tiles
// (quant.to_amx_int8_tiles of quant.Int8Linear's rows): bfloat16 out, rounded once after the scaling.
at::Tensor amx_int8_linear(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scales) {
  TORCH_CHECK(scales.dim() == 1 && scales.scalar_type() == at::kFloat && scales.is_contiguous(),
              "amx_int8_linear: scales must be a contiguous 1-D float32 tensor, one per output feature");
  const int64_t out_features = scales.size(0);
  const at::Tensor xp = tiled_rows("amx_int8_linear", x, tiles, at::kByte, out_features);
  at::Tensor y = at::empty({x.size(0), out_features}, x.options());
  if (x.size(0) == 0 || out_features == 0) return y;
#if PDSERVE_AMX
  int8_times(reinterpret_cast<const uint16_t*>(xp.data_ptr<at::BFloat16>()), xp.stride(0), x.size(0),
             tiles.data_ptr<uint8_t>(), tiles.size(1),
             Output{reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), out_features, scales.data_ptr<float>()});
#endif
  return y;
}

}  // namespace

bool pdserve_parts::amx_ready() { return amx_linear_available(); }

pdserve_parts::Fit pdserve_parts::amx_tiles_fit(const at::Tensor& tiles, at::ScalarType element, int64_t k_size,
                                                int64_t out_features) {
  Fit fit;
  fit.layout = tiles.dim() == 5 && tiles.scalar_type() == element && tiles.is_contiguous() &&
               tiles.size(2) == kGroup && tiles.size(3) == kRows && tiles.size(4) == kK;
  if (!fit.layout) return fit;
  const int64_t groups = tiles.size(0), k_blocks = tiles.size(1);
  fit.inputs = k_size <= k_blocks * kK && k_size > (k_blocks - 1) * kK;
  fit.outputs = out_features <= groups * kGroup * kBlock && out_features > (groups - 1) * kGroup * kBlock;
  return fit;
}

void pdserve_parts::amx_linear(const uint16_t* x, int64_t lda, int64_t rows, const uint16_t* tiles, int64_t k_blocks,
                               uint16_t* y, int64_t out_features) {
#if PDSERVE_AMX
  amx_times(x, lda, rows, tiles, k_blocks, Output{y, out_features, nullptr});
#else
  (void)x, (void)lda, (void)rows, (void)tiles, (void)k_blocks, (void)y, (void)out_features;
#endif
}

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("amx_linear_available() -> bool");
  m.def("amx_linear(Tensor x, Tensor tiles, int out_features) -> Tensor");
  m.def("amx_int8_linear(Tensor x, Tensor tiles, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CatchAll, m) { m.impl("amx_linear_available", &amx_linear_available); }

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) {
  m.impl("amx_linear", &amx_linear);
  m.impl("amx_int8_linear", &amx_int8_linear);
}
