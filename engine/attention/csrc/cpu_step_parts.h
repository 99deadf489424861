// A decoder layer's kernels by pointer, for the decode loop that runs a whole step in one OpenMP
// region (cpu_decode_step.cpp). They check nothing: that loop checks its inputs once, before the
// region, since an exception thrown inside one ends the process. Each splits its work with
// pdserve_parallel::parallel_for, so inside a team every member calls it and it ends at a barrier.
// The ops of the other files are these same functions behind their checks. What both check is
// one predicate each, declared here, so that the op and the region cannot come to disagree on
// what a packed weight or a table must be.

#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace pdserve_parts {

// How a packed weight fits a matmul of k_size inputs and out_features outputs, part by part so that an
// op can say which part failed. inputs and outputs are false where the layout is.
struct Fit {
  bool layout = false;   // the packing's rank, dtype, inner sizes and contiguity
  bool inputs = false;   // it holds k_size inputs (the last k-block or pair partly used)
  bool outputs = false;  // it holds out_features outputs (the last group or panel partly used)
  bool all() const { return layout && inputs && outputs; }
};

// tiles in AMX tiles of `element` (bfloat16, or uint8 for int8 weights): [groups, k_blocks, 4, 16, 32].
Fit amx_tiles_fit(const at::Tensor& tiles, at::ScalarType element, int64_t k_size, int64_t out_features);

// pairs in bfloat16 pair groups: [groups, ceil(k / 2), 48, 2].
Fit pair_groups_fit(const at::Tensor& pairs, int64_t k_size, int64_t out_features);

// panels in panels of 16 outputs: [panels, k, 16], of float32 or bfloat16.
Fit panels_fit(const at::Tensor& panels, int64_t k_size, int64_t out_features);

// How rotary tables fit heads of head_dim rotated over their first rotary_dim dims.
struct RotaryFit {
  bool dims = false;    // rotary_dim even and at most head_dim
  bool tables = false;  // cos and sin contiguous float32 [positions, rotary_dim]
  bool all() const { return dims && tables; }
};
RotaryFit rotary_fit(const at::Tensor& cos, const at::Tensor& sin, int64_t rotary_dim, int64_t head_dim);

// The slots of a KV cache whose last two dimensions are [heads, head_dim], or -1 where they are not.
int64_t cache_slots(const at::Tensor& cache, int64_t heads, int64_t head_dim);

// x <- weight * norm(x + residual), residual <- x + residual; without a residual (nullptr),
// out <- weight * norm(x). Row strides in elements.
template <typename T>
void rms_norm(T* x, int64_t x_row, T* residual, int64_t r_row, const T* weight, T* out, int64_t o_row, int64_t rows,
              int64_t hidden, float eps);

// out = SiLU(gate) * up for rows of [gate | up], each `inter` wide.
template <typename T>
void silu_mul(const T* gate_up, int64_t in_row, T* out, int64_t out_row, int64_t rows, int64_t inter);

// y += bias for `rows` rows of n (row stride y_row), each sum rounded to T once.
template <typename T>
void add_bias(T* y, int64_t y_row, const T* bias, int64_t rows, int64_t n);

// Rotary embedding of q and k in place (rotate-half), positions within the cos/sin tables.
template <typename T>
void rotary(const int64_t* positions, T* q, int64_t q_tok, int64_t q_head, int64_t q_heads, T* k, int64_t k_tok,
            int64_t k_head, int64_t k_heads, const float* cos, const float* sin, int64_t table_row, int64_t rotary_dim,
            int64_t tokens);

// Token t's key and value rows (heads rows of row_bytes, a head `*_head` bytes apart, a token
// `*_token` bytes apart) into slot slots[t] of the caches (token_bytes = heads * row_bytes a slot);
// a negative slot is skipped, and every other one is below the caches' slot count.
void write_kv(const char* k_src, int64_t k_token, int64_t k_head, const char* v_src, int64_t v_token, int64_t v_head,
              int64_t heads, int64_t row_bytes, char* k_dst, char* v_dst, const int64_t* slots, int64_t tokens);

// Whether amx_linear can run here (this build and CPU have AMX, the OS granted its state).
bool amx_ready();

// y = x Wᵀ, bfloat16, for x of `rows` rows (row stride lda, whole k-blocks of 32 inputs, at most 16
// rows or whole tiles of 16) and W in AMX tiles of k_blocks k-blocks; y is [rows, out_features].
void amx_linear(const uint16_t* x, int64_t lda, int64_t rows, const uint16_t* tiles, int64_t k_blocks, uint16_t* y,
                int64_t out_features);

// Whether pair_linear can run here (this build and CPU have AVX512-BF16).
bool pairs_ready();

// y = x Wᵀ, bfloat16, for x of `rows` rows (row stride ldx, an even number, and k_size inputs, an even
// number) and W in `groups` pair groups of 48 outputs (layers.to_pair_groups); y is [rows, out_features].
void pair_linear(const at::BFloat16* x, int64_t ldx, int64_t rows, const at::BFloat16* pairs, int64_t groups,
                 int64_t k_size, at::BFloat16* y, int64_t out_features);

// y = x Wᵀ, float32, for x of `rows` rows (row stride ldx, k_size inputs) and W in `count` panels of 16
// outputs (layers.to_panels); y is [rows, out_features].
void panel_linear(const float* x, int64_t ldx, int64_t rows, const float* panels, int64_t count, int64_t k_size,
                  float* y, int64_t out_features);

// pdserve_cpu::decode_attention's kernel, its inputs already checked.
template <typename T>
void decode_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                      const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, at::Tensor& out);

}  // namespace pdserve_parts
