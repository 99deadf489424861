// Storing one step's keys and values in the paged KV cache, both in one pass.
//
// The eager path is two index_copy_ calls per layer (keys, then values), each a dispatch, a
// bounds check over the index tensor and a strided copy. Here each token's key and value rows
// are copied together, one memcpy per row of heads when a token's heads are contiguous (they
// are: k and v are views of the fused qkv projection), split over threads by token.
//
// A negative slot means "not stored" (as in the Triton kernel the GPU uses); a slot past the
// cache is an error, checked before anything is written.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu_parallel.h"
#include "cpu_step_parts.h"

namespace {

// Copies one token's [heads, head_dim] rows from src (a head head_bytes apart) into a contiguous
// destination row.
void copy_token(const char* src, int64_t head_bytes, int64_t heads, int64_t row_bytes, char* dst) {
  if (head_bytes == row_bytes) {
    std::memcpy(dst, src, heads * row_bytes);
    return;
  }
  for (int64_t h = 0; h < heads; ++h) std::memcpy(dst + h * row_bytes, src + h * head_bytes, row_bytes);
}

}  // namespace

void pdserve_parts::write_kv(const char* k_src, int64_t k_token, int64_t k_head, const char* v_src, int64_t v_token,
                             int64_t v_head, int64_t heads, int64_t row_bytes, char* k_dst, char* v_dst,
                             const int64_t* slots, int64_t tokens) {
  const int64_t token_bytes = heads * row_bytes;
  // A decode step's few tokens are not worth waking threads for: a token is a few KiB.
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(1, 2 * token_bytes));
  pdserve_parallel::parallel_for(0, tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;
      copy_token(k_src + t * k_token, k_head, heads, row_bytes, k_dst + slot * token_bytes);
      copy_token(v_src + t * v_token, v_head, heads, row_bytes, v_dst + slot * token_bytes);
    }
  });
}

namespace {

void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache, at::Tensor& value_cache,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(), "key and value must be [tokens, kv_heads, head_dim]");
  TORCH_CHECK(key.scalar_type() == value.scalar_type() && key_cache.scalar_type() == key.scalar_type() &&
                  value_cache.scalar_type() == key.scalar_type(),
              "key, value and the caches must share one dtype");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1, "key and value rows (head_dim) must be contiguous");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() && key_cache.sizes() == value_cache.sizes(),
              "the caches must be contiguous and of one shape");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.size(0) == key.size(0),
              "slot_mapping must be a contiguous int64 tensor with one slot per token");
  const int64_t tokens = key.size(0), heads = key.size(1), head_dim = key.size(2);
  if (tokens == 0) return;
  const int64_t elem = key.element_size();
  const int64_t row_bytes = head_dim * elem;
  const int64_t num_slots = pdserve_parts::cache_slots(key_cache, heads, head_dim);
  TORCH_CHECK(num_slots >= 0, "the caches' last two dimensions must be [kv_heads, head_dim] of the keys");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t last = *std::max_element(slots, slots + tokens);
  TORCH_CHECK(last < num_slots, "slot ", last, " is outside the KV cache of ", num_slots, " slots");

  pdserve_parts::write_kv(static_cast<const char*>(key.data_ptr()), key.stride(0) * elem, key.stride(1) * elem,
                          static_cast<const char*>(value.data_ptr()), value.stride(0) * elem, value.stride(1) * elem,
                          heads, row_bytes, static_cast<char*>(key_cache.data_ptr()),
                          static_cast<char*>(value_cache.data_ptr()), slots, tokens);
}

}  // namespace

int64_t pdserve_parts::cache_slots(const at::Tensor& cache, int64_t heads, int64_t head_dim) {
  const int64_t row = heads * head_dim;
  if (cache.dim() < 2 || row <= 0 || cache.size(cache.dim() - 1) * cache.size(cache.dim() - 2) != row) return -1;
  return cache.numel() / row;
}

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("write_kv(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) { m.impl("write_kv", &write_kv); }
