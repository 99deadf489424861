"""A decode step's decoder layers in one C++ call (engine/attention/csrc/cpu_decode_step.cpp).

At one row per request a layer is ten small ops, and from Python each costs a module call, the
fused ops' checks and a dispatcher trip: about a quarter of a one-stream decode step on a 2-core
CPU. The C++ loop runs the same kernels in the same order, so its output is the layer-by-layer
path's to the bit; this module decides when that loop can stand in for the modules:

- a step of decodes only (one token per request), on the CPU, with our kernels built;
- the CPU attention backend and the fused KV write (what model_runner picks with the kernels);
- one tensor-parallel rank (the loop has no all-reduce), and, per weight, a matmul path the loop
  has (`linear_path`: not the widened bf16 one of AVX2 CPUs at 16+ rows, and int8 weights only
  through our register kernel or GEMM, not the slabs, in a float32 model, or in AMX tiles in a
  bfloat16 one).

Anything else runs the modules, as does every step with PDSERVE_DECODE_CALL=0.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pdserve.engine.attention.metadata import AttentionMetadata
from pdserve.engine.distributed import tp_size
from pdserve.engine.model import fused
from pdserve.engine.model import layers as model_layers
from pdserve.engine.model.quant import Int8Linear

# layers.linear's paths, numbered as the C++ loop's LinearPath.
LINEAR_PATHS = {"torch": 0, "packed": 1, "kernel": 2, "kernel_serial": 3, "int8": 4, "panels": 5, "int8_a8": 6,
                "amx": 7, "int8_gemm": 8, "amx_int8": 9, "pairs": 10}


def linear_path(module: nn.Module, rows: int) -> str | None:
    """The path layers.linear takes through `module` for `rows` rows of input, or None where it is
    one the C++ loop does not have (int8 weights past our GEMM's rows, widened bf16)."""
    if module.quantized is not None:
        q = module.quantized
        if not isinstance(q, Int8Linear):
            return None
        if q.tiles is not None:
            return "amx_int8"
        if q.kernel_takes(rows):
            return "int8_a8" if q.int8_activations else "int8"
        return "int8_gemm" if q.gemm_takes(rows) else None
    path = model_layers.linear_path(module.weight, module.packed_weight, module.one_row, rows)
    return None if path == "widened" else path


@dataclass
class DecodeCall:
    """What the loop reads of a model, gathered once; the matmul paths per row count."""

    norms: list[torch.Tensor]
    linears: list[nn.Module]  # qkv, o, gate_up, down of each layer, in order
    weights: list[torch.Tensor]
    packed: list[torch.Tensor | None]
    biases: list[torch.Tensor | None]
    cos: torch.Tensor
    sin: torch.Tensor
    rotary_dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    eps: float
    paths: dict[int, list[int] | None] = field(default_factory=dict)

    @classmethod
    def of(cls, model: nn.Module) -> "DecodeCall":
        """`model` is a LlamaModel (its layers, norms and rotary table)."""
        layers = list(model.layers)
        linears = [m for layer in layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                     layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        norms = [n.weight for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        attn = layers[0].self_attn
        # An int8 layer passes its int8 values (in rows or AMX tiles) as the weight, its scales where
        # a packed weight goes, and the bias it holds (column-parallel ones move into
        # quant.Int8Linear). A float weight's prepacked copy (oneDNN's, panels or AMX tiles) goes
        # there too; the weight still gives its shape.
        return cls(norms=norms + [model.norm.weight], linears=linears,
                   weights=[m.weight if m.quantized is None else _int8_values(m.quantized) for m in linears],
                   packed=[m.packed_weight if m.quantized is None else m.quantized.scales for m in linears],
                   biases=[m.bias if m.quantized is None or m.bias is not None else m.quantized.bias
                           for m in linears],
                   cos=attn.rotary.cos, sin=attn.rotary.sin, rotary_dim=attn.rotary.rotary_dim,
                   num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
                   scale=attn.scale, eps=model.norm.eps)

    def paths_for(self, rows: int) -> list[int] | None:
        if rows not in self.paths:
            named = [linear_path(m, rows) for m in self.linears]
            # Our int8 kernels take float32 rows (in a half model the modules convert around them),
            # the AMX one bfloat16 rows.
            if {"int8", "int8_a8", "int8_gemm"} & set(named) and self.norms[0].dtype != torch.float32:
                named.append(None)
            if "amx_int8" in named and self.norms[0].dtype != torch.bfloat16:
                named.append(None)
            self.paths[rows] = None if None in named else [LINEAR_PATHS[p] for p in named]
        return self.paths[rows]

    def run(self, hidden: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
            meta: AttentionMetadata, paths: list[int], one_region: bool | None = None) -> torch.Tensor:
        """The layers' output. `one_region`: whether the C++ loop may run the step in one OpenMP
        region where every matmul is one of our kernels on prepacked weights (bfloat16 AMX tiles or
        pair groups, float32 panels); its output is the op-by-op loop's to the bit. By default
        unless PDSERVE_DECODE_REGION=0."""
        if one_region is None:
            one_region = region_enabled()
        return torch.ops.pdserve_cpu.decode_layers(
            hidden, positions, self.norms, self.weights, self.packed, self.biases, paths, kv_caches,
            meta.slot_mapping, meta.block_tables, meta.seq_lens, self.cos, self.sin, self.rotary_dim,
            self.num_heads, self.num_kv_heads, self.head_dim, self.scale, self.eps, one_region)


def _int8_values(q: Int8Linear) -> torch.Tensor:
    return q.tiles if q.tiles is not None else q.qweight


def enabled() -> bool:
    return os.environ.get("PDSERVE_DECODE_CALL", "1") != "0"


def region_enabled() -> bool:
    return os.environ.get("PDSERVE_DECODE_REGION", "1") != "0"


def model_fits(model: nn.Module) -> bool:
    """Whether the loop can run this model at all (per-step conditions are checked in `call_for`)."""
    norm = model.norm.weight
    if norm.device.type != "cpu" or norm.dtype not in fused.KERNEL_DTYPES or tp_size() != 1:
        return False
    if not fused.cpu_kernels_ready() or not hasattr(torch.ops.pdserve_cpu, "decode_layers"):
        return False
    return all(p.dtype == norm.dtype for p in model.parameters())


def call_for(model: nn.Module, meta: AttentionMetadata, positions: torch.Tensor, attend: Any,
             write_kv: Any) -> tuple[DecodeCall, list[int]] | None:
    """The loop and its matmul paths for this step, or None when the modules must run it."""
    if not enabled() or meta.num_decodes != meta.num_tokens or meta.num_tokens == 0 or fused.reference_only():
        return None
    from pdserve.engine.attention import cpu_attention, torch_paged

    # Through the step profiler's labels (and nothing else that wraps them): it must time the path
    # that really runs.
    attend, write_kv = _unlabelled(attend), _unlabelled(write_kv)
    if attend is not cpu_attention.paged_attention or write_kv not in (torch_paged.write_kv, fused.write_kv):
        return None
    if positions.dtype != torch.int64 or meta.slot_mapping.dtype != torch.int64:
        return None
    plan = getattr(model, "_decode_call", None)
    if plan is None:
        plan = DecodeCall.of(model) if model_fits(model) else False
        model._decode_call = plan
    if plan is False:
        return None
    paths = plan.paths_for(meta.num_tokens)
    return None if paths is None else (plan, paths)


def _unlabelled(fn: Any) -> Any:
    return fn.__wrapped__ if getattr(fn, "only_labels", False) else fn


def forget(model: nn.Module) -> None:
    """Drop what was gathered (weights repacked, matmul paths re-tuned): the next step gathers again."""
    for module in model.modules():
        if hasattr(module, "_decode_call"):
            del module._decode_call
