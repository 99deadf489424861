"""Tensor-parallel building blocks: each rank holds and loads only its slice of a weight.

Weight loaders receive a safetensors slice (anything sliceable with a `get_shape()`), so a rank
reads only its own rows or columns from disk.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine import cpu_info
from pdserve.engine.config import cpu_has_native_bf16
from pdserve.engine.distributed import all_gather_last_dim, all_reduce, tp_rank, tp_size
from pdserve.engine.model import fused


def _shape(loaded: Any) -> list[int]:
    return list(loaded.get_shape()) if hasattr(loaded, "get_shape") else list(loaded.shape)


def _rows(loaded: Any, start: int, size: int) -> torch.Tensor:
    return loaded[start:start + size]


def _cols(loaded: Any, start: int, size: int) -> torch.Tensor:
    return loaded[:, start:start + size]


# Batch sizes (rows of x) at which oneDNN's prepacked weights beat plain F.linear, measured on
# AVX-512 CPUs: fp32 gains 1.4-2.5x for small batches and loses on one row and on big prefills;
# bf16 gains nearly everywhere.
PACKED_ROWS = {torch.float32: (2, 384), torch.bfloat16: (1, 1 << 30)}


@functools.cache
def packing_supported(dtype: torch.dtype) -> bool:
    """Whether oneDNN can prepack `dtype` weights on this CPU.

    Asked by doing it once on a tiny matrix: the bf16 path needs AVX-512 (or AVX-NE-CONVERT) and
    raises on plain AVX2 CPUs, and no flag torch exposes names exactly that requirement.
    """
    if not (dtype in PACKED_ROWS and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise") and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), 64)
    except RuntimeError:
        return False
    return True


# Float32 weights go in panels (to_panels, multiplied by csrc/cpu_panel_linear.cpp) instead of
# oneDNN's packed layout. Measured on a Zen 3 EPYC (AVX2) with a decode step's weights coming from
# memory (benchmarks/bench_kernels.py's matmul rows): panels 1.1-1.5x oneDNN's throughput from 1 to
# 64 rows and level at 128; 1.3-4.5x F.linear's up to 128 rows, level with it at 512, 0.96x at 1024
# and 0.95x at 2048. On an AVX-512 Xeon, with the tile spanning four panels: 1.4-1.6x oneDNN from 1
# to 16 rows, 1.1x at 64, level at 128-512; whole decode steps 1.22-1.30x at batch 16 (paired, in
# one process), 1.13-1.14x at 32, 1.05-1.07x at 64, 1.05-1.17x at 1, but prefills of 512 tokens
# 0.93x F.linear's (README). Past panel_max_rows() F.linear takes over. PDSERVE_FLOAT_PACKING=panels or =onednn
# overrides the rule.
FLOAT_PACKINGS = ("panels", "onednn")


@functools.cache
def float_packing() -> str:
    """How float32 weights are prepacked on this machine: "panels" or "onednn"."""
    chosen = os.environ.get("PDSERVE_FLOAT_PACKING", "")
    if chosen and chosen not in FLOAT_PACKINGS:
        raise ValueError(f"PDSERVE_FLOAT_PACKING={chosen!r}: expected one of {', '.join(FLOAT_PACKINGS)}")
    return "onednn" if chosen == "onednn" or not panels_supported() else "panels"


@functools.cache
def panel_max_rows() -> int:
    """The most rows panels multiply before F.linear (MKL) takes over: 512 with the AVX2 tile (on a
    Zen 3 panels ran level with MKL at 512 rows, 0.95x at 2048); with the AVX-512 one 256 on Intel (a
    512-token prefill ran 0.93x F.linear's there, 256 tokens 1.02x) and every row count on AMD, where
    MKL's float32 GEMM runs its AVX2 code: on a Zen 5 it ran 190 GFLOP/s at 256 to 4096 rows where
    panels ran 455 to 316 (2.4x to 1.6x; bench_kernels' float32 matmul rows)."""
    if not (panels_supported() and torch.ops.pdserve_cpu.gemm_tile_isa() == 512):
        return 512
    return sys.maxsize if cpu_info.vendor() == "AuthenticAMD" else 256


@functools.cache
def panels_supported() -> bool:
    """Whether our panel kernel is built here, with vector code (else it would be a slow scalar loop)."""
    return fused.cpu_kernels_ready() and bool(torch.ops.pdserve_cpu.gemm_tile_isa())


def to_panels(weight: torch.Tensor) -> torch.Tensor:
    """A [out, in] weight as [ceil(out / 16), in, 16]: each group of 16 output rows k-major, so
    one 64-byte line holds the group's 16 weights at one k; rows past `out` are zero. A bfloat16
    group interleaves its halves (rows 0, 8, 1, 9, ... 7, 15): csrc/cpu_gemm_tile.h widens each
    32-bit pair into rows j and j + 8 with one shift and one mask."""
    out_features, in_features = weight.shape
    count = -(-out_features // 16)
    padded = weight.new_zeros(count * 16, in_features)
    padded[:out_features] = weight
    panels = padded.view(count, 16, in_features).transpose(1, 2)
    if weight.dtype == torch.bfloat16:
        panels = torch.stack((panels[..., :8], panels[..., 8:]), dim=-1).reshape(count, in_features, 16)
    return panels.contiguous()


def is_panels(packed: torch.Tensor) -> bool:
    """A prepacked weight in panels (a plain 3-D tensor), not oneDNN's (an opaque mkldnn one) nor AMX tiles."""
    return not packed.is_mkldnn and packed.dim() == 3


# bfloat16 weights go in AMX tiles (to_amx_tiles, multiplied by csrc/cpu_amx_linear.cpp) instead of
# oneDNN's packed layout where the CPU has AMX. On a 2-core Xeon with AMX, a decode step's weights
# streamed from memory 1.4-2.1x faster than through oneDNN's packed bf16 matmul from 1 to 16 rows
# (at 16 rows 13-18 GB/s against 10-11, a plain sum reading 19-22), 2.0x at 32, 0.85-0.93x at 64
# to 128 rows and level at 512; 1.2-2.5x faster than torch's F.linear on the plain weight up to
# 128 rows, 1.27x at 256, 0.85-0.96x at 512. Whole steps: decode batch 16 1.16-1.30x, batch 1
# 1.00-1.11x, batch 64 0.94-0.99x. Past AMX_MAX_ROWS (prefill chunks) F.linear takes over, level
# with oneDNN's packing there. Where the CPU has AVX512-BF16 but no AMX (AMD Zen 4 and 5) they go in
# pair groups (to_pair_groups, multiplied with vdpbf16ps by csrc/cpu_bf16_pair_linear.cpp) at every
# row count: on a Zen 5, 1.2-1.35x oneDNN's packed matmul from 2 to 16 rows, level at 128-512, 0.95x
# at 2048 and still 1.07x F.linear there. PDSERVE_BF16_PACKING=onednn keeps oneDNN's layout.
AMX_MAX_ROWS = 256
BF16_PACKINGS = ("amx", "pairs", "onednn")


@functools.cache
def amx_supported() -> bool:
    """Whether our AMX kernel is built here and the OS lets this process use the tiles."""
    return fused.cpu_kernels_ready() and hasattr(torch.ops.pdserve_cpu, "amx_linear_available") \
        and bool(torch.ops.pdserve_cpu.amx_linear_available())


@functools.cache
def pair_groups_supported() -> bool:
    """Whether our vdpbf16ps kernel is built here (the CPU has AVX512-BF16)."""
    return fused.cpu_kernels_ready() and bool(torch.ops.pdserve_cpu.pair_linear_available())


def bf16_packing() -> str:
    """How bfloat16 weights are prepacked where the CPU has bf16 arithmetic: "amx", "pairs" or "onednn"."""
    chosen = os.environ.get("PDSERVE_BF16_PACKING", "")
    if chosen and chosen not in BF16_PACKINGS:
        raise ValueError(f"PDSERVE_BF16_PACKING={chosen!r}: expected one of {', '.join(BF16_PACKINGS)}")
    if chosen == "onednn":
        return "onednn"
    if amx_supported() and chosen != "pairs":
        return "amx"
    return "pairs" if pair_groups_supported() else "onednn"


PAIR_GROUP = 48  # output rows per group of to_pair_groups: three vectors of 16 float32 sums


def to_pair_groups(weight: torch.Tensor) -> torch.Tensor:
    """A bfloat16 [out, in] weight as [ceil(out / 48), ceil(in / 2), 48, 2]: element [g][q][j][h] is
    W[48g + j][2q + h], zero past the weight's edges, so each group of 48 output rows is one run of
    memory holding, per pair of inputs, every row's two weights side by side."""
    out_features, in_features = weight.shape
    groups, pairs = -(-out_features // PAIR_GROUP), -(-in_features // 2)
    padded = weight.new_zeros(groups * PAIR_GROUP, pairs * 2)
    padded[:out_features, :in_features] = weight
    return padded.view(groups, PAIR_GROUP, pairs, 2).transpose(1, 2).contiguous()


def from_pair_groups(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The [out, in] weight `to_pair_groups` laid out as `packed`."""
    groups, pairs = packed.shape[:2]
    rows = packed.transpose(1, 2).reshape(groups * PAIR_GROUP, pairs * 2)
    return rows[:out_features, :in_features].contiguous()


def is_pair_groups(packed: torch.Tensor) -> bool:
    return not packed.is_mkldnn and packed.dim() == 4


def to_amx_tiles(weight: torch.Tensor) -> torch.Tensor:
    """A bfloat16 (or int8) [out, in] weight as AMX's B tiles, [ceil(out / 64), ceil(in / 32), 4, 16, 32]:
    tile [g][b][j] holds output rows 64g + 16j .. +15 and inputs 32b .. 32b + 31, input pairs
    interleaved (element [r][2c + h] = W[64g + 16j + c][32b + 2r + h]); zero past the weight's edges."""
    out_features, in_features = weight.shape
    groups, k_blocks = -(-out_features // 64), -(-in_features // 32)
    padded = weight.new_zeros(groups * 64, k_blocks * 32)
    padded[:out_features, :in_features] = weight
    # [g][j][c][b][r][h] -> [g][b][j][r][c][h]
    tiles = padded.view(groups, 4, 16, k_blocks, 16, 2).permute(0, 3, 1, 4, 2, 5)
    return tiles.reshape(groups, k_blocks, 4, 16, 32).contiguous()


def from_amx_tiles(tiles: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The [out, in] weight `to_amx_tiles` laid out as `tiles`."""
    groups, k_blocks = tiles.shape[:2]
    # [g][b][j][r][c][h] -> [g][j][c][b][r][h]
    rows = tiles.view(groups, k_blocks, 4, 16, 16, 2).permute(0, 2, 4, 1, 3, 5).reshape(groups * 64, k_blocks * 32)
    return rows[:out_features, :in_features].contiguous()


def is_amx_tiles(packed: torch.Tensor) -> bool:
    return not packed.is_mkldnn and packed.dim() == 5


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight in the CPU's fastest prepacked layout (panels or oneDNN's blocked one), or None
    where neither is available."""
    if weight.device.type != "cpu":
        return None
    # bfloat16 goes in panels where the CPU has no bf16 arithmetic: widened in the tile, half the bytes.
    in_panels = weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and bf16_is_emulated())
    if in_panels and float_packing() == "panels":
        return to_panels(weight.detach())
    if weight.dtype == torch.bfloat16 and bf16_packing() == "amx":
        return to_amx_tiles(weight.detach())
    if weight.dtype == torch.bfloat16 and bf16_packing() == "pairs":
        return to_pair_groups(weight.detach())
    if not packing_supported(weight.dtype):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 64)


# CPUs without bf16 hardware (AVX2-only) run torch's bf16 matmuls 3-7x slower than fp32 ones once
# x has more than a few rows. There bf16 weights go in panels (pack_weight), widened in the tile,
# up to panel_max_rows() rows; past it (long prefill chunks) the weight is widened to fp32 a slab at
# a time (the slab stays in cache, the weight in memory stays bf16) for MKL's fp32 matmul and the
# product rounded back: the same fp32 accumulation torch's emulation does, so results match it to
# the last bit on >99.9% of elements. Without panels (another CPU kind) the same holds from
# WIDEN_MIN_ROWS rows; with fewer the widening costs more than it saves.
WIDEN_MIN_ROWS = 16
WIDEN_SLAB_ROWS = 512


@functools.cache
def bf16_is_emulated() -> bool:
    return not cpu_has_native_bf16()


def linear_widened(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x Wᵀ + b computed in float32 from low-precision operands, rounded back to x's dtype."""
    xf = x.reshape(-1, x.shape[-1]).float()
    out_features = weight.shape[0]
    out = torch.empty(xf.shape[0], out_features, dtype=torch.float32, device=x.device)
    slab = torch.empty(min(WIDEN_SLAB_ROWS, out_features), weight.shape[1], dtype=torch.float32, device=x.device)
    for start in range(0, out_features, WIDEN_SLAB_ROWS):
        w = slab[:min(WIDEN_SLAB_ROWS, out_features - start)]
        w.copy_(weight[start:start + w.shape[0]])
        out[:, start:start + w.shape[0]] = F.linear(xf, w)
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], out_features)


def linear_path(weight: torch.Tensor, packed: torch.Tensor | None, one_row: str | None, rows: int) -> str:
    """Which path `linear` takes for a float weight and `rows` rows of input: for a single row, the
    one linear_tuning measured fastest for this weight (`one_row`: "packed", the weight's prepacked
    layout, or our kernel on all threads or on one: "kernel", "kernel_serial": float32 on AVX2,
    bfloat16 on AVX512-BF16 or AVX2); "panels" for a weight in panels (float32, or bfloat16 on
    AVX2) at 2 to panel_max_rows() rows; "amx" for a bfloat16 weight in AMX tiles up to AMX_MAX_ROWS
    rows; "pairs" for one in pair groups (AVX512-BF16 without AMX) at any row count; "packed" (oneDNN)
    for PACKED_ROWS rows; "widened" bf16 on CPUs without bf16 arithmetic; else "torch" (F.linear).
    The one-call decode step (decode_call) follows it too."""
    if rows == 1 and one_row in ("kernel", "kernel_serial"):
        return one_row
    if packed is not None and is_amx_tiles(packed):
        return "amx" if rows <= AMX_MAX_ROWS else "torch"
    if packed is not None and is_pair_groups(packed):
        return "pairs"
    if packed is not None and is_panels(packed):
        if (rows > 1 or one_row == "packed") and rows <= panel_max_rows():
            return "panels"
    elif packed is not None:
        low, high = PACKED_ROWS[weight.dtype]
        return "packed" if (rows == 1 and one_row == "packed") or low <= rows <= high else "torch"
    if weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and rows >= WIDEN_MIN_ROWS and bf16_is_emulated():
        return "widened"
    return "torch"


def layout_op(layout: str) -> Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]:
    """Our kernel for weights in `layout` ("panels", "amx" or "pairs"): (2-D x, packed weight, out_features)."""
    ops = torch.ops.pdserve_cpu
    return ops.panel_linear if layout == "panels" else ops.amx_linear if layout == "amx" else ops.pair_linear


def linear(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, packed: torch.Tensor | None,
           quantized: Callable[[torch.Tensor], torch.Tensor] | None = None,
           one_row: str | None = None) -> torch.Tensor:
    """x Wᵀ + b by the fastest path this weight has: int8 (engine/model/quant.py), else `linear_path`'s."""
    if quantized is not None:  # an int8 weight: the float one is gone
        y = quantized(x)
        return y if bias is None else y + bias
    # One row means one 2-D row: the single-row kernels take 2-D input only.
    path = linear_path(weight, packed, one_row if x.dim() == 2 else None, x.numel() // x.shape[-1])
    if path in ("kernel", "kernel_serial"):
        y = torch.ops.pdserve_cpu.float_linear(x, weight, path == "kernel_serial")
        return y if bias is None else y + bias
    if path in ("panels", "amx", "pairs"):  # our kernels on our layouts: 2-D x, the bias added after
        y = layout_op(path)(x.reshape(-1, x.shape[-1]), packed, weight.shape[0]).reshape(*x.shape[:-1], weight.shape[0])
        return y if bias is None else y + bias
    if path == "packed":
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
    if path == "widened":
        return linear_widened(x, weight, bias)
    return F.linear(x, weight, bias)


def pack_model_weights(model: nn.Module) -> int:
    """Prepack every float linear weight for the CPU; returns how many were packed."""
    count = 0
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)) and module.quantized is None:
            module.packed_weight = pack_weight(module.weight)
            count += module.packed_weight is not None
    return count


def _copy(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"{what}: checkpoint shape {tuple(src.shape)} does not fit parameter {tuple(dst.shape)}")
    dst.copy_(src)


def check_head_split(num_heads: int, num_kv_heads: int, tp: int) -> None:
    """Raise ValueError unless the attention heads divide evenly over `tp` ranks.

    Query heads must split evenly. KV heads either split evenly too, or, when there are fewer
    than ranks, each is replicated on the same number of ranks. An uneven split (3 KV heads on
    2 ranks) would give ranks different shapes and a query head whose KV head lives elsewhere.
    """
    if num_heads % tp:
        raise ValueError(f"{num_heads} attention heads do not split over tensor_parallel_size={tp}")
    if num_kv_heads >= tp and num_kv_heads % tp:
        raise ValueError(f"{num_kv_heads} KV heads do not split over tensor_parallel_size={tp}: "
                         f"use a size that divides {num_kv_heads}")
    if num_kv_heads < tp and tp % num_kv_heads:
        raise ValueError(f"tensor_parallel_size={tp} ranks cannot replicate {num_kv_heads} KV heads evenly")


class ColumnParallelLinear(nn.Module):
    """y = x Wᵀ with W's output rows split over ranks; each rank yields its slice of y."""

    quantized: Callable[[torch.Tensor], torch.Tensor] | None = None  # set by quant.quantize_model

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        if out_features % self.tp_size:
            raise ValueError(f"{out_features} output features do not split over {self.tp_size} ranks")
        self.out_per_rank = out_features // self.tp_size
        self.weight = nn.Parameter(torch.empty(self.out_per_rank, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(self.out_per_rank, dtype=dtype), requires_grad=False) if bias else None
        self.packed_weight: torch.Tensor | None = None
        self.one_row: str | None = None  # set by linear_tuning where another path serves one row faster
        self.weight.weight_loader = self.load_rows  # type: ignore[attr-defined]
        if self.bias is not None:
            self.bias.weight_loader = self.load_rows  # type: ignore[attr-defined]

    def load_rows(self, param: nn.Parameter, loaded: Any, shard: Any = None) -> None:
        size = param.shape[0]
        _copy(param.data, _rows(loaded, self.tp_rank * size, size), "column-parallel weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed_weight, self.quantized, self.one_row)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one matmul (gate and up)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, dtype: torch.dtype) -> None:
        super().__init__(in_features, sum(out_sizes), bias, dtype)
        self.out_sizes = out_sizes
        self.weight.weight_loader = self.load_part  # type: ignore[attr-defined]

    def load_part(self, param: nn.Parameter, loaded: Any, shard: int) -> None:
        size = self.out_sizes[shard] // self.tp_size
        offset = sum(self.out_sizes[:shard]) // self.tp_size
        _copy(param.data[offset:offset + size], _rows(loaded, self.tp_rank * size, size), f"merged part {shard}")


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul. Heads split over ranks; when there are fewer KV
    heads than ranks, each KV head is replicated on tp_size / num_kv_heads ranks."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 dtype: torch.dtype) -> None:
        tp = tp_size()
        check_head_split(num_heads, num_kv_heads, tp)
        self.num_heads = num_heads // tp
        if num_kv_heads >= tp:
            self.num_kv_heads = num_kv_heads // tp
            self.kv_replicas = 1
        else:
            self.num_kv_heads = 1
            self.kv_replicas = tp // num_kv_heads
        self.head_dim = head_dim
        total = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp
        super().__init__(hidden, total, bias, dtype)
        self.weight.weight_loader = self.load_part  # type: ignore[attr-defined]
        if self.bias is not None:
            self.bias.weight_loader = self.load_part  # type: ignore[attr-defined]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def load_part(self, param: nn.Parameter, loaded: Any, shard: str) -> None:
        if shard == "q":
            offset, size, head_start = 0, self.q_size, self.tp_rank * self.num_heads
        else:
            offset = self.q_size + (0 if shard == "k" else self.kv_size)
            size, head_start = self.kv_size, (self.tp_rank // self.kv_replicas) * self.num_kv_heads
        _copy(param.data[offset:offset + size], _rows(loaded, head_start * self.head_dim, size), f"{shard}_proj")


class RowParallelLinear(nn.Module):
    """y = x Wᵀ with W's input columns split over ranks; partial sums are all-reduced."""

    quantized: Callable[[torch.Tensor], torch.Tensor] | None = None  # set by quant.quantize_model

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        if in_features % self.tp_size:
            raise ValueError(f"{in_features} input features do not split over {self.tp_size} ranks")
        self.in_per_rank = in_features // self.tp_size
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.packed_weight: torch.Tensor | None = None
        self.one_row: str | None = None
        self.weight.weight_loader = self.load_cols  # type: ignore[attr-defined]
        if self.bias is not None:
            self.bias.weight_loader = lambda p, loaded, shard=None: _copy(p.data, loaded[:], "row-parallel bias")

    def load_cols(self, param: nn.Parameter, loaded: Any, shard: Any = None) -> None:
        _copy(param.data, _cols(loaded, self.tp_rank * self.in_per_rank, self.in_per_rank), "row-parallel weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce(linear(x, self.weight, None, self.packed_weight, self.quantized, self.one_row))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split over ranks; ids outside a rank's range contribute zeros, summed by all-reduce."""

    def __init__(self, vocab_size: int, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.vocab_size = vocab_size
        self.rows_per_rank = -(-vocab_size // self.tp_size)
        self.start = self.tp_rank * self.rows_per_rank
        self.weight = nn.Parameter(torch.zeros(self.rows_per_rank, hidden, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.load_rows  # type: ignore[attr-defined]

    def load_rows(self, param: nn.Parameter, loaded: Any, shard: Any = None) -> None:
        total = _shape(loaded)[0]
        end = min(self.start + self.rows_per_rank, total)
        if end > self.start:
            _copy(param.data[:end - self.start], _rows(loaded, self.start, end - self.start), "embedding")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows_per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection to the vocabulary, split by rows like the embedding it may share weights with."""

    packed_weight: torch.Tensor | None = None
    one_row: str | None = None
    quantized: Callable[[torch.Tensor], torch.Tensor] | None = None  # set by quant.quantize_model

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        local = linear(hidden, self.weight, None, self.packed_weight, self.quantized, self.one_row)
        return all_gather_last_dim(local)[..., :self.vocab_size]


class RMSNorm(nn.Module):
    """RMS normalisation in float32, then cast back and scaled, as the reference models do."""

    def __init__(self, hidden: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (normalised(x + residual), x + residual): the sum is the next residual. The
        fused kernels write both over x and residual (see fused.rms_norm)."""
        return fused.rms_norm(x, residual, self.weight, self.eps)
