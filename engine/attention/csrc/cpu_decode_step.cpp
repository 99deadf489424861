// Every decoder layer of a decode step in one call.
//
// A decode step computes one row per request. At one row (a lone stream) each layer is ten small
// ops, and from Python each op costs a module call, a few branch checks and a dispatcher trip:
// together about a quarter of the step on a 2-core CPU, time in which no weight is read. This loop
// runs the same ops in the same order on the same kernels (our ops found once through the
// dispatcher, torch's linear, oneDNN's packed linear), so its results are those of the
// layer-by-layer path to the bit; engine/model/decode_call.py decides when it applies and which
// matmul path each weight takes.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "cpu_parallel.h"
#include "cpu_step_parts.h"

namespace {

// How one weight is multiplied, numbered as decode_call.LINEAR_PATHS.
enum LinearPath : int64_t {
  kTorch = 0, kPacked = 1, kKernel = 2, kKernelSerial = 3, kInt8 = 4, kPanels = 5, kInt8A8 = 6, kAmx = 7, kInt8Gemm = 8,
  kAmxInt8 = 9, kPairs = 10
};

using FloatLinear = at::Tensor(const at::Tensor&, const at::Tensor&, bool);
using Int8Linear = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&);
using PanelLinear = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t);
using RmsNorm = void(const at::Tensor&, const at::Tensor&, double, at::Tensor&);
using AddRmsNorm = void(at::Tensor&, at::Tensor&, const at::Tensor&, double);
using SiluMul = void(const at::Tensor&, at::Tensor&);
using Rotary = void(const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t);
using WriteKV = void(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&);
using Attention = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                       double, at::Tensor&);

template <typename Sig>
c10::TypedOperatorHandle<Sig> typed_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

// Looked up on first use: the other files of this library register these ops when it loads.
struct Ops {
  c10::TypedOperatorHandle<FloatLinear> float_linear = typed_op<FloatLinear>("pdserve_cpu::float_linear");
  c10::TypedOperatorHandle<Int8Linear> int8_linear = typed_op<Int8Linear>("pdserve_cpu::int8_linear");
  c10::TypedOperatorHandle<Int8Linear> int8_linear_a8 = typed_op<Int8Linear>("pdserve_cpu::int8_linear_a8");
  c10::TypedOperatorHandle<Int8Linear> int8_gemm = typed_op<Int8Linear>("pdserve_cpu::int8_gemm");
  c10::TypedOperatorHandle<PanelLinear> panel_linear = typed_op<PanelLinear>("pdserve_cpu::panel_linear");
  c10::TypedOperatorHandle<PanelLinear> amx_linear = typed_op<PanelLinear>("pdserve_cpu::amx_linear");
  c10::TypedOperatorHandle<PanelLinear> pair_linear = typed_op<PanelLinear>("pdserve_cpu::pair_linear");
  c10::TypedOperatorHandle<Int8Linear> amx_int8_linear = typed_op<Int8Linear>("pdserve_cpu::amx_int8_linear");
  c10::TypedOperatorHandle<RmsNorm> rms_norm = typed_op<RmsNorm>("pdserve_cpu::rms_norm");
  c10::TypedOperatorHandle<AddRmsNorm> add_rms_norm = typed_op<AddRmsNorm>("pdserve_cpu::fused_add_rms_norm");
  c10::TypedOperatorHandle<SiluMul> silu_mul = typed_op<SiluMul>("pdserve_cpu::silu_and_mul");
  c10::TypedOperatorHandle<Rotary> rotary = typed_op<Rotary>("pdserve_cpu::rotary_embedding");
  c10::TypedOperatorHandle<WriteKV> write_kv = typed_op<WriteKV>("pdserve_cpu::write_kv");
  c10::TypedOperatorHandle<Attention> attention = typed_op<Attention>("pdserve_cpu::decode_attention");
  // oneDNN's op is called boxed: its C++ signature is torch's internal business, its schema is not.
  c10::OperatorHandle packed_linear = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
};

const Ops& ops() {
  static const Ops instance;
  return instance;
}

// x Wᵀ (+ bias) by `path`, as layers.linear computes it for that path. On the int8 paths `weight`
// holds the int8 values and `packed` their scales (quant.Int8Linear's qweight and scales; on the
// AMX one the values are in AMX tiles); on the panels path `packed` holds the weight in panels
// (layers.to_panels), on the AMX path in AMX tiles (layers.to_amx_tiles), on the pairs path in pair
// groups (layers.to_pair_groups).
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& packed,
                  const std::optional<at::Tensor>& bias, int64_t path) {
  switch (path) {
    case kInt8:
    case kInt8A8:
    case kInt8Gemm: {
      TORCH_CHECK(packed.has_value(), "decode_layers: an int8 path without scales");
      const auto& op = path == kInt8 ? ops().int8_linear : path == kInt8A8 ? ops().int8_linear_a8 : ops().int8_gemm;
      at::Tensor y = op.call(x, weight, *packed);
      return bias.has_value() ? y.add_(*bias) : y;
    }
    case kAmxInt8: {
      TORCH_CHECK(packed.has_value(), "decode_layers: an int8 path without scales");
      at::Tensor y = ops().amx_int8_linear.call(x, weight, *packed);
      return bias.has_value() ? y.add_(*bias) : y;
    }
    case kKernel:
    case kKernelSerial: {
      at::Tensor y = ops().float_linear.call(x, weight, path == kKernelSerial);
      return bias.has_value() ? y + *bias : y;
    }
    case kPanels:
    case kAmx:
    case kPairs: {
      TORCH_CHECK(packed.has_value(), "decode_layers: a panels, AMX or pairs path without the weight in that layout");
      const auto& op = path == kPanels ? ops().panel_linear : path == kAmx ? ops().amx_linear : ops().pair_linear;
      at::Tensor y = op.call(x, *packed, weight.size(0));
      return bias.has_value() ? y.add_(*bias) : y;
    }
    case kPacked: {
      TORCH_CHECK(packed.has_value(), "decode_layers: a packed path without a packed weight");
      torch::jit::Stack stack{x.contiguous(), *packed, bias, std::string("none"),
                              c10::List<std::optional<at::Scalar>>(), std::string("")};
      ops().packed_linear.callBoxed(stack);
      return stack[0].toTensor();
    }
    case kTorch:
      return at::linear(x, weight, bias);
    default:
      TORCH_CHECK(false, "decode_layers: unknown linear path ", path);
  }
}

std::optional<at::Tensor> item(const c10::List<std::optional<at::Tensor>>& list, int64_t i) { return list.get(i); }

// ---- The step in one region ---------------------------------------------------------------------
//
// Op by op, every op of the loop below opens an OpenMP region of its own (about ten a layer), and
// between two of them the main thread alone goes through the dispatcher, the next op's checks, its
// output's allocation and the views of q, k and v, while the other threads spin. On a 2-core AMX
// Xeon that serial part was about 2 ms of a 14 ms bfloat16 decode step at 16 rows, time in which no
// weight is read. Where every matmul is one of our kernels on prepacked weights (bfloat16 in AMX
// tiles or pair groups, float32 in panels), the step instead runs in one region: the buffers are
// allocated and every input is checked once, before it, and each thread walks the layers calling
// the kernels by pointer, taking its share of each and meeting the others at a barrier. The kernels
// and their splits are the op path's, so the output is the same to the bit.

// Steps run in one region since the library loaded: what tests read to know which loop ran.
std::atomic<int64_t> region_steps{0};

int64_t decode_region_steps() { return region_steps.load(); }

struct Region {
  int64_t path;  // kAmx or kPairs (bfloat16), kPanels (float32): every matmul's
  int64_t rows, padded_rows, hidden, q_size, kv_size, inter, head_dim, num_heads, num_kv_heads, rotary_dim;
  std::vector<const void*> packed;  // 4 per layer: AMX tiles, pair groups or panels
  std::vector<int64_t> blocks;      // 4 per layer: the tiles' k-blocks, the groups' or the panels' count
  std::vector<const void*> biases;  // 4 per layer, null where none
  std::vector<const void*> norms;
  std::vector<at::Tensor> key_caches, value_caches;
};

// Whether packed weight t serves the region's matmul of in_features inputs and out_features outputs:
// as its op would take it, and with no padded copy of x, which the region does not make (whole
// k-blocks of 32 for AMX tiles, whole pairs for pair groups).
bool packed_fits(int64_t path, const at::Tensor& t, int64_t in_features, int64_t out_features) {
  switch (path) {
    case kAmx:
      return pdserve_parts::amx_tiles_fit(t, at::kBFloat16, in_features, out_features).all() &&
             t.size(1) * 32 == in_features;
    case kPairs:
      return pdserve_parts::pair_groups_fit(t, in_features, out_features).all() && in_features % 2 == 0;
    default:
      return t.scalar_type() == at::kFloat && pdserve_parts::panels_fit(t, in_features, out_features).all();
  }
}

// The region's view of the inputs, or nothing where the step must go op by op (which then reports
// whatever is wrong with its inputs as the ops do).
std::optional<Region> region_for(const at::Tensor& hidden, const at::Tensor& positions, at::TensorList norms,
                                 at::TensorList weights, const c10::List<std::optional<at::Tensor>>& packed,
                                 const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef paths,
                                 at::TensorList kv_caches, const at::Tensor& slot_mapping,
                                 const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& cos,
                                 const at::Tensor& sin, int64_t rotary_dim, int64_t num_heads, int64_t num_kv_heads,
                                 int64_t head_dim) {
  const int64_t layers = static_cast<int64_t>(kv_caches.size());
  const int64_t rows = hidden.size(0), hidden_size = hidden.size(1);
  const at::ScalarType dtype = hidden.scalar_type();
  const int64_t path = dtype == at::kBFloat16 && (paths[0] == kAmx || paths[0] == kPairs) ? paths[0]
                       : dtype == at::kFloat                                              ? kPanels
                                                                                          : -1;
  if (rows < 1 || path < 0 || (path == kAmx && !pdserve_parts::amx_ready()) ||
      (path == kPairs && !pdserve_parts::pairs_ready()))
    return std::nullopt;
  if (num_kv_heads < 1 || num_heads % num_kv_heads != 0 || head_dim < 1 || weights[2].size(0) % 2 != 0)
    return std::nullopt;
  // AMX tiles read x 16 rows at a time: past 16 the inputs are padded to whole tiles with zero rows.
  const int64_t padded_rows = path == kAmx && rows > 16 ? (rows + 15) / 16 * 16 : rows;
  Region r{path, rows, padded_rows, hidden_size, num_heads * head_dim, num_kv_heads * head_dim, weights[2].size(0) / 2,
           head_dim, num_heads, num_kv_heads, rotary_dim, {}, {}, {}, {}, {}, {}};
  const int64_t ins[4] = {hidden_size, r.q_size, hidden_size, r.inter};
  const int64_t outs[4] = {r.q_size + 2 * r.kv_size, hidden_size, 2 * r.inter, hidden_size};
  for (int64_t i = 0; i < 4 * layers; ++i) {
    const std::optional<at::Tensor> t = packed.get(i);
    const std::optional<at::Tensor> bias = biases.get(i);
    if (paths[i] != path || !t.has_value() || weights[i].dim() != 2 || weights[i].size(0) != outs[i % 4])
      return std::nullopt;
    if (bias.has_value() && (bias->scalar_type() != dtype || !bias->is_contiguous() || bias->numel() != outs[i % 4]))
      return std::nullopt;
    r.biases.push_back(bias.has_value() ? bias->data_ptr() : nullptr);
    if (!packed_fits(path, *t, ins[i % 4], outs[i % 4])) return std::nullopt;
    r.packed.push_back(t->data_ptr());
    r.blocks.push_back(t->size(path == kAmx ? 1 : 0));
  }
  for (const at::Tensor& n : norms) {
    if (n.scalar_type() != dtype || !n.is_contiguous() || n.numel() != hidden_size) return std::nullopt;
    r.norms.push_back(n.data_ptr());
  }
  // What the rotary, KV-write and attention ops check, once for every layer.
  if (positions.dim() != 1 || positions.scalar_type() != at::kLong || !positions.is_contiguous() ||
      positions.size(0) != rows)
    return std::nullopt;
  if (!pdserve_parts::rotary_fit(cos, sin, rotary_dim, head_dim).all()) return std::nullopt;
  const int64_t* pos = positions.data_ptr<int64_t>();
  const auto [min_pos, max_pos] = std::minmax_element(pos, pos + rows);
  if (*min_pos < 0 || *max_pos >= cos.size(0)) return std::nullopt;
  const at::Tensor& c0 = kv_caches[0];
  if (c0.dim() != 5 || c0.size(0) != 2 || c0.size(3) != num_kv_heads || c0.size(4) != head_dim) return std::nullopt;
  for (const at::Tensor& c : kv_caches) {
    if (c.scalar_type() != dtype || !c.is_contiguous() || c.sizes() != c0.sizes()) return std::nullopt;
    r.key_caches.push_back(c.select(0, 0));
    r.value_caches.push_back(c.select(0, 1));
  }
  if (slot_mapping.dim() != 1 || slot_mapping.scalar_type() != at::kLong || !slot_mapping.is_contiguous() ||
      slot_mapping.size(0) != rows)
    return std::nullopt;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  if (*std::max_element(slots, slots + rows) >= pdserve_parts::cache_slots(r.key_caches[0], num_kv_heads, head_dim))
    return std::nullopt;
  if (block_tables.scalar_type() != at::kInt || seq_lens.scalar_type() != at::kInt || !block_tables.is_contiguous() ||
      !seq_lens.is_contiguous() || block_tables.dim() != 2 || block_tables.size(0) != rows || seq_lens.dim() != 1 ||
      seq_lens.size(0) != rows)
    return std::nullopt;
  return r;
}

template <typename T>
at::Tensor run_region(const Region& r, const at::Tensor& hidden, const at::Tensor& positions,
                      const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                      const at::Tensor& cos, const at::Tensor& sin, double scale, double eps) {
  const int64_t rows = r.rows, hidden_size = r.hidden, qkv_size = r.q_size + 2 * r.kv_size;
  const int64_t layers = static_cast<int64_t>(r.key_caches.size());
  const auto options = hidden.options();
  // The matmuls' inputs (x, attended, act) have padded_rows rows; the pad rows are zeros no op writes.
  auto input = [&](int64_t width) {
    return r.padded_rows > rows ? at::zeros({r.padded_rows, width}, options) : at::empty({rows, width}, options);
  };
  at::Tensor x_all = input(hidden_size);
  at::Tensor attended_all = input(r.q_size);
  at::Tensor act = input(r.inter);
  at::Tensor qkv = at::empty({rows, qkv_size}, options);
  at::Tensor gate_up = at::empty({rows, 2 * r.inter}, options);
  const at::Tensor q = qkv.narrow(1, 0, r.q_size).view({rows, r.num_heads, r.head_dim});
  at::Tensor attended = attended_all.narrow(0, 0, rows).view({rows, r.num_heads, r.head_dim});
  // residual is the embedding itself, updated in place as the op path's first norm leaves it.
  T* res = const_cast<T*>(hidden.data_ptr<T>());
  const int64_t res_row = hidden.stride(0);
  T* xp = x_all.data_ptr<T>();
  T* qkvp = qkv.data_ptr<T>();
  T* attp = attended_all.data_ptr<T>();
  T* gup = gate_up.data_ptr<T>();
  T* actp = act.data_ptr<T>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const float* cosp = cos.data_ptr<float>();
  const float* sinp = sin.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  const int64_t elem = static_cast<int64_t>(sizeof(T)), row_bytes = r.head_dim * elem;
  const T* const* norms = reinterpret_cast<const T* const*>(r.norms.data());
  // x Wᵀ of weight w into out, then its bias (both ops of the op path add it after the matmul).
  auto matmul = [&](int64_t w, const T* in, int64_t k, T* out, int64_t n) {
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      if (r.path == kAmx)
        pdserve_parts::amx_linear(reinterpret_cast<const uint16_t*>(in), k, rows,
                                  static_cast<const uint16_t*>(r.packed[w]), r.blocks[w],
                                  reinterpret_cast<uint16_t*>(out), n);
      else
        pdserve_parts::pair_linear(in, k, rows, static_cast<const at::BFloat16*>(r.packed[w]), r.blocks[w], k, out, n);
    } else {
      pdserve_parts::panel_linear(in, k, rows, static_cast<const float*>(r.packed[w]), r.blocks[w], k, out, n);
    }
  };
  auto add_bias = [&](int64_t w, T* out, int64_t n) {
    pdserve_parts::add_bias<T>(out, n, static_cast<const T*>(r.biases[w]), rows, n);
  };
  const int threads = static_cast<int>(std::max(1, at::get_num_threads()));
  pdserve_parallel::TeamBarrier barrier;
#pragma omp parallel num_threads(threads)
  {
    pdserve_parallel::TeamMember member(&barrier);
    // The step profiler (pdserve/bench/step_profile.py) sees no op inside the region: the calling
    // thread records each kernel, barrier included, under its op's name.
    const bool records = omp_get_thread_num() == 0;
    auto op = [records](const char* name, auto&& run) {
      if (records) {
        RECORD_FUNCTION(name, std::vector<c10::IValue>());
        run();
      } else {
        run();
      }
    };
    const char* linear = r.path == kAmx ? "pdserve_cpu::amx_linear"
                         : r.path == kPairs ? "pdserve_cpu::pair_linear"
                                            : "pdserve_cpu::panel_linear";
    for (int64_t l = 0; l < layers; ++l) {
      const int64_t w = 4 * l;
      op("pdserve_cpu::fused_add_rms_norm", [&] {
        if (l == 0)
          pdserve_parts::rms_norm<T>(res, res_row, nullptr, 0, norms[0], xp, hidden_size, rows, hidden_size, feps);
        else
          pdserve_parts::rms_norm<T>(xp, hidden_size, res, res_row, norms[2 * l], nullptr, 0, rows, hidden_size, feps);
      });
      op(linear, [&] { matmul(w, xp, hidden_size, qkvp, qkv_size); });
      if (r.biases[w] != nullptr) op("pdserve_cpu::linear_bias", [&] { add_bias(w, qkvp, qkv_size); });
      op("pdserve_cpu::rotary_embedding", [&] {
        pdserve_parts::rotary<T>(pos, qkvp, qkv_size, r.head_dim, r.num_heads, qkvp + r.q_size, qkv_size, r.head_dim,
                                 r.num_kv_heads, cosp, sinp, cos.size(1), r.rotary_dim, rows);
      });
      op("pdserve_cpu::write_kv", [&] {
        pdserve_parts::write_kv(reinterpret_cast<const char*>(qkvp + r.q_size), qkv_size * elem, row_bytes,
                                reinterpret_cast<const char*>(qkvp + r.q_size + r.kv_size), qkv_size * elem,
                                row_bytes, r.num_kv_heads, row_bytes, static_cast<char*>(r.key_caches[l].data_ptr()),
                                static_cast<char*>(r.value_caches[l].data_ptr()), slots, rows);
      });
      op("pdserve_cpu::decode_attention", [&] {
        pdserve_parts::decode_attention<T>(q, r.key_caches[l], r.value_caches[l], block_tables, seq_lens, scale,
                                           attended);
      });
      op(linear, [&] { matmul(w + 1, attp, r.q_size, xp, hidden_size); });
      if (r.biases[w + 1] != nullptr) op("pdserve_cpu::linear_bias", [&] { add_bias(w + 1, xp, hidden_size); });
      op("pdserve_cpu::fused_add_rms_norm", [&] {
        pdserve_parts::rms_norm<T>(xp, hidden_size, res, res_row, norms[2 * l + 1], nullptr, 0, rows, hidden_size,
                                   feps);
      });
      op(linear, [&] { matmul(w + 2, xp, hidden_size, gup, 2 * r.inter); });
      if (r.biases[w + 2] != nullptr) op("pdserve_cpu::linear_bias", [&] { add_bias(w + 2, gup, 2 * r.inter); });
      op("pdserve_cpu::silu_and_mul",
         [&] { pdserve_parts::silu_mul<T>(gup, 2 * r.inter, actp, r.inter, rows, r.inter); });
      op(linear, [&] { matmul(w + 3, actp, r.inter, xp, hidden_size); });
      if (r.biases[w + 3] != nullptr) op("pdserve_cpu::linear_bias", [&] { add_bias(w + 3, xp, hidden_size); });
    }
    op("pdserve_cpu::fused_add_rms_norm", [&] {
      pdserve_parts::rms_norm<T>(xp, hidden_size, res, res_row, norms[2 * layers], nullptr, 0, rows, hidden_size,
                                 feps);
    });
  }
  return r.padded_rows > rows ? x_all.narrow(0, 0, rows) : x_all;
}

// Per layer l: norms[2l] (input), norms[2l+1] (post-attention), norms[2L] the final norm;
// weights, packed (or int8 scales), biases and paths [4l..4l+3] for qkv, o, gate_up, down. The column-parallel
// biases (qkv, gate_up) go into their matmul, the row-parallel ones (o, down) are added after it,
// as the modules do. Returns the final norm's output, one row per request.
at::Tensor decode_layers(const at::Tensor& hidden, const at::Tensor& positions, at::TensorList norms,
                         at::TensorList weights, const c10::List<std::optional<at::Tensor>>& packed,
                         const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef paths,
                         at::TensorList kv_caches, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                         const at::Tensor& seq_lens, const at::Tensor& cos, const at::Tensor& sin, int64_t rotary_dim,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale, double eps,
                         bool one_region) {
  const int64_t layers = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(layers > 0, "decode_layers: no layers");
  TORCH_CHECK(hidden.dim() == 2 && hidden.stride(1) == 1, "decode_layers: hidden must be [rows, hidden_size]");
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == 2 * layers + 1, "decode_layers: 2 norms per layer and a final one");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == 4 * layers &&
                  static_cast<int64_t>(packed.size()) == 4 * layers &&
                  static_cast<int64_t>(biases.size()) == 4 * layers &&
                  static_cast<int64_t>(paths.size()) == 4 * layers,
              "decode_layers: 4 weights, packed weights, biases and paths per layer");
  if (one_region) {
    const std::optional<Region> region =
        region_for(hidden, positions, norms, weights, packed, biases, paths, kv_caches, slot_mapping, block_tables,
                   seq_lens, cos, sin, rotary_dim, num_heads, num_kv_heads, head_dim);
    if (region.has_value()) {
      region_steps.fetch_add(1);
      return region->path != kPanels
                 ? run_region<at::BFloat16>(*region, hidden, positions, slot_mapping, block_tables, seq_lens, cos, sin,
                                            scale, eps)
                 : run_region<float>(*region, hidden, positions, slot_mapping, block_tables, seq_lens, cos, sin,
                                     scale, eps);
    }
  }
  const Ops& o = ops();
  const int64_t rows = hidden.size(0);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  at::Tensor x = hidden, residual;
  for (int64_t l = 0; l < layers; ++l) {
    const int64_t w = 4 * l;
    if (l == 0) {  // no residual yet: the embedding is it, its norm goes to a new tensor
      residual = x;
      x = at::empty_like(residual);
      o.rms_norm.call(residual, norms[0], eps, x);
    } else {
      o.add_rms_norm.call(x, residual, norms[2 * l], eps);
    }
    at::Tensor qkv = linear(x, weights[w], item(packed, w), item(biases, w), paths[w]);
    at::Tensor q = qkv.narrow(1, 0, q_size).view({rows, num_heads, head_dim});
    at::Tensor k = qkv.narrow(1, q_size, kv_size).view({rows, num_kv_heads, head_dim});
    at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).reshape({rows, num_kv_heads, head_dim});
    o.rotary.call(positions, q, k, cos, sin, rotary_dim);
    at::Tensor key_cache = kv_caches[l].select(0, 0), value_cache = kv_caches[l].select(0, 1);
    o.write_kv.call(k, v, key_cache, value_cache, slot_mapping);
    at::Tensor attended = at::empty_like(q);
    o.attention.call(q, key_cache, value_cache, block_tables, seq_lens, scale, attended);
    x = linear(attended.reshape({rows, q_size}), weights[w + 1], item(packed, w + 1), std::nullopt, paths[w + 1]);
    if (auto bias = item(biases, w + 1)) x = x + *bias;
    o.add_rms_norm.call(x, residual, norms[2 * l + 1], eps);
    at::Tensor gate_up = linear(x, weights[w + 2], item(packed, w + 2), item(biases, w + 2), paths[w + 2]);
    at::Tensor act = at::empty({rows, gate_up.size(1) / 2}, gate_up.options());
    o.silu_mul.call(gate_up, act);
    x = linear(act, weights[w + 3], item(packed, w + 3), std::nullopt, paths[w + 3]);
    if (auto bias = item(biases, w + 3)) x = x + *bias;
  }
  o.add_rms_norm.call(x, residual, norms[2 * layers], eps);
  return x;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("decode_layers(Tensor hidden, Tensor positions, Tensor[] norms, Tensor[] weights, Tensor?[] packed, "
        "Tensor?[] biases, int[] paths, Tensor[] kv_caches, Tensor slot_mapping, Tensor block_tables, "
        "Tensor seq_lens, Tensor cos, Tensor sin, int rotary_dim, int num_heads, int num_kv_heads, int head_dim, "
        "float scale, float eps, bool one_region=True) -> Tensor");
  m.def("decode_region_steps() -> int");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) { m.impl("decode_layers", &decode_layers); }
TORCH_LIBRARY_IMPL(pdserve_cpu, CatchAll, m) { m.impl("decode_region_steps", &decode_region_steps); }
// oneDNN-packed weights among the arguments make the dispatcher look for this backend.
TORCH_LIBRARY_IMPL(pdserve_cpu, MkldnnCPU, m) { m.impl("decode_layers", &decode_layers); }
