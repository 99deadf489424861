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
#include <torch/library.h>

#include <optional>
#include <string>

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

// Per layer l: norms[2l] (input), norms[2l+1] (post-attention), norms[2L] the final norm;
// weights, packed (or int8 scales), biases and paths [4l..4l+3] for qkv, o, gate_up, down. The column-parallel
// biases (qkv, gate_up) go into their matmul, the row-parallel ones (o, down) are added after it,
// as the modules do. Returns the final norm's output, one row per request.
at::Tensor decode_layers(const at::Tensor& hidden, const at::Tensor& positions, at::TensorList norms,
                         at::TensorList weights, const c10::List<std::optional<at::Tensor>>& packed,
                         const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef paths,
                         at::TensorList kv_caches, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                         const at::Tensor& seq_lens, const at::Tensor& cos, const at::Tensor& sin, int64_t rotary_dim,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale, double eps) {
  const int64_t layers = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(layers > 0, "decode_layers: no layers");
  TORCH_CHECK(hidden.dim() == 2 && hidden.stride(1) == 1, "decode_layers: hidden must be [rows, hidden_size]");
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == 2 * layers + 1, "decode_layers: 2 norms per layer and a final one");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == 4 * layers &&
                  static_cast<int64_t>(packed.size()) == 4 * layers &&
                  static_cast<int64_t>(biases.size()) == 4 * layers &&
                  static_cast<int64_t>(paths.size()) == 4 * layers,
              "decode_layers: 4 weights, packed weights, biases and paths per layer");
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
        "float scale, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) { m.impl("decode_layers", &decode_layers); }
// oneDNN-packed weights among the arguments make the dispatcher look for this backend.
TORCH_LIBRARY_IMPL(pdserve_cpu, MkldnnCPU, m) { m.impl("decode_layers", &decode_layers); }
