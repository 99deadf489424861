"""int8 linear weights: one scale per output channel (`quantization="int8"`), or one per group
of 32 consecutive weights in a row (`quantization="q8_0"`, the layout of GGUF's Q8_0).

A weight row w (or group) is stored as round(w / s) in [-127, 127] with s = max|w| / 127: about a
quarter of float32's memory, and of the bytes a decode step streams from RAM. This is weight-only
quantization: activations stay float32 and the product is the float32 one with the rounded
weight, so the only error is the weight rounding (at most half a step of its row or group).

A Q8_0 GGUF file reaches the loader dequantized (engine/model/gguf_convert.py); quantizing it
again in groups of 32 gives back the file's own integers and scales exactly (`quantize_groups`;
`quantize_model(lossless=True)` checks it per layer), so its weights are served as stored, not
rounded a second time.

Kernels:
- up to SMALL_ROWS rows of x (decode; SMALL_ROWS_AVX512 where the GEMM has its AVX-512 tile, with
  weight-only int8): our AVX2 kernel (csrc/cpu_int8_linear.cpp), which widens the int8 weight in
  registers: 1.4-4x faster than float32 F.linear at 1 to 16 rows (with group scales, each widened
  weight is multiplied by its scale first: about 10% slower than row scales; measured on an
  AVX2-only EPYC, one thread);
- more rows (prefill): our GEMM (csrc/cpu_int8_gemm.cpp), which widens 16 weight rows at a time
  into a float32 panel that every row of x then streams past. On a Zen 4 EPYC (2 threads,
  SmolLM2's layer shapes) it runs at oneDNN float32's rate, 185-200 GFLOP/s, where widening the
  whole weight to float32 slabs for MKL (`int8_matmul_slabs`, kept for CPUs without AVX2 and,
  below, big chunks on AVX2) made a 256-token prefill's matmuls 1.6x float32's. It overtakes the
  register kernel from about 24 rows.
  An LM head keeps its values k-major instead (`to_int8_panels`, csrc/cpu_int8_panels.cpp, where
  the AVX-512 GEMM tile is built): the GEMM's arithmetic and bits at every row count, each weight
  widened as the tile loads it, with no per-call transpose; SmolLM2's Q8_0 head at 16 rows 2.57
  against 3.90 ms, a float32 decode step of 16 rows 1.086x (Zen 5).
  On AVX2-only CPUs its 6x16 tile does not beat MKL: on a Zen 3 EPYC (2 threads, SmolLM2's layer
  shapes, weights past the cache) it was 1.0-1.4x the slabs at 64-96 rows, level at 128-256 and
  0.75-0.92x at 384-1024 rows (99-115 against 110-137 GFLOP/s). There the slabs take the chunks
  past GEMM_MAX_ROWS_AVX2 rows.
In a bfloat16 model on a CPU with AMX (Intel Xeon since Sapphire Rapids), weights with a scale per
row keep their int8 values in AMX tiles instead (`to_amx_int8_tiles`; csrc/cpu_amx_linear.cpp's
`amx_int8_linear`), for every row count: each tile is widened to bf16 in registers (int8 values are
exact in bf16; a byte permute looks each one up) and multiplied by the bf16 rows on the tile unit,
the float32 sums scaled by the row scale and rounded to bf16 once. That is the bf16 model's own
product with the rounded weight; the weights stream in at half bf16's bytes. On the AMX Xeon (the
bench model, 2 threads, paired in one process) a bf16 model's whole decode step with int8 weights ran
1.68x its step with bf16 weights at 1 row, 1.25x at 16, 1.03x at 64 and 1.04x at a 512-token
prefill, where computing the int8 product in float32 (as float32 models do) had run 0.3-0.45x from
16 rows. A float32 row reaching such a layer takes the float32 kernels on its rows, unpacked from
the tiles. Group scales (Q8_0) and int8 activations keep the kernels below.
int8 activations (`int8_activations=True`, `--int8-activations`; W8A8): in decode steps (the
register kernel's rows) each row of x is also rounded to int8, in blocks of ACT_BLOCK values with
a float scale each (amax / 127), and each block's 32 products are summed exactly in integers
(`int8_linear_a8`: vpmaddubsw and vpmaddwd, as llama.cpp's Q8_0 x Q8_0 dot product). That is a
third of the instructions per weight of widening at one row, so a few rows read the weights at
memory speed: 1.25-1.4x the widening kernel on SmolLM2's decode matmuls at one row, 1.35x at four,
level at sixteen (Zen 3 EPYC, 2 threads). The error it
adds is x's rounding, at most half a step of its block per value; each row is rounded alone, so a
row's result does not depend on the rows batched with it. Prefill chunks (past SMALL_ROWS rows)
keep float32 activations. Layers whose rows do not split into blocks of 32 keep them too.

Rejected after measuring: ATen's `_weight_int8pack_mm` (a scalar loop without AVX-512: 10-50x
slower than float32 here) and `torch._int_mm` (slower still), and fbgemm's dynamic-quantized
linear (fast, but it rounds x to 7 bits with one scale per call: SmolLM2's outlier activations
then change the greedy output from the first token). Also an integer GEMM for prefill chunks with
int8 activations (x rounded to int16 per block of 32, the int8 weight widened to int16 in panels,
vpmaddwd + vpaddd into int32): on a Zen 3 EPYC vpmaddwd and vpaddd issue on the same two pipes,
so one pair (16 multiply-adds) takes the cycle two float32 FMAs take; it ran SmolLM2's prefill
shapes at 87-109 GFLOP/s against 92-107 for the float32 GEMM above, at 64-512 rows. Bytes
(vpmaddubsw) need x's sign moved onto the weight per product and a widening vpmaddwd: no faster.
Integer prefill needs VNNI (vpdpbusd / vpdpwssd, one instruction per 64 or 32 products).

Quantization happens after loading, so each tensor-parallel rank quantizes its own shard.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from pdserve.engine import cpu_info

log = logging.getLogger("pdserve.engine.quant")

QMAX = 127  # symmetric: -128 is left out so that w and -w round alike
Q8_0_GROUP = 32  # weights per scale in GGUF's Q8_0 blocks
METHODS = ("int8", "q8_0")
ACT_BLOCK = 32  # activations per int8 scale with int8_activations (the kernel's kActBlock)
SMALL_ROWS = 24  # at and below: the register kernel; above: the GEMM (measured crossover 24-32)
# With the GEMM's AVX-512 tile the crossover is lower: on the AMX Xeon (a step's 48 matmuls, 2 threads,
# paired) the GEMM ran 0.94-0.95x the register kernel at 8 rows, 1.18x at 10, 1.32-1.38x at 16.
SMALL_ROWS_AVX512 = 8
SLAB_ROWS = 512  # weight rows widened at a time: 512 x 4096 float32 = 8 MiB at most
GEMM_MAX_ROWS_AVX2 = 128  # past it, on CPUs without AVX-512, the slabs (see the docstring)


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 rows, float32 scales) with weight ≈ q * scales[:, None]; an all-zero row gets scale 1."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scales = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    q = torch.round(w / scales[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scales


def quantize_groups(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 rows, float32 scales of shape [rows, cols / group]) with weight ≈ q * scale of its group.

    On a dequantized Q8_0 tensor this is exact: there each group is d * q with d a float16 number
    and max|q| = 127, so max|w| / 127 is d again (d * 127 fits float32's mantissa) and w / d is q.
    """
    w = weight.detach().float()
    rows, cols = w.shape
    if cols % group:
        raise ValueError(f"{cols} columns do not split into groups of {group}")
    blocks = w.reshape(rows, cols // group, group)
    amax = blocks.abs().amax(dim=2)
    scales = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    q = torch.round(blocks / scales[..., None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q.reshape(rows, cols), scales


def dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 weight (q, scales) stands for: per row (1-D scales) or per group (2-D)."""
    if scales.dim() == 1:
        return q.float() * scales[:, None]
    rows, groups = scales.shape
    return (q.float().reshape(rows, groups, -1) * scales[..., None]).reshape(q.shape)


def kernel_available() -> bool:
    """Whether our vectorized int8 kernel is built and loaded here."""
    from pdserve.engine.attention import cpu_kernels

    return cpu_kernels.available() and bool(torch.ops.pdserve_cpu.int8_linear_vectorized())


def gemm_available() -> bool:
    """Whether our vectorized int8 GEMM (many rows of x) is built and loaded here."""
    from pdserve.engine.attention import cpu_kernels

    return cpu_kernels.available() and bool(torch.ops.pdserve_cpu.gemm_tile_isa())


def amx_available() -> bool:
    """Whether our AMX kernel for int8 weights and bfloat16 rows runs here (csrc/cpu_amx_linear.cpp)."""
    from pdserve.engine.model import layers

    return layers.amx_supported() and hasattr(torch.ops.pdserve_cpu, "amx_int8_linear")


def to_amx_int8_tiles(q: torch.Tensor) -> torch.Tensor:
    """int8 rows [out, in] as the AMX kernel stores them: layers.to_amx_tiles' layout, each byte in
    sign and magnitude (bit 7 the sign, bits 0-6 |v|; |v| <= QMAX) and each 64 bytes reordered so
    that the kernel's widening puts them back in sequence (element 32h + 8L + k at 16L + 8h + k;
    why: csrc/cpu_amx_linear.cpp). uint8, as it is no longer int8 arithmetic."""
    from pdserve.engine.model.layers import to_amx_tiles

    if (q == -QMAX - 1).any():
        raise ValueError("int8 value -128 has no sign-and-magnitude byte: values must lie in [-127, 127]")
    tiles = to_amx_tiles(q)
    magnitude = tiles.to(torch.int16).abs()
    encoded = torch.where(tiles < 0, magnitude | 0x80, magnitude).to(torch.uint8)
    return encoded.view(-1, 2, 4, 8).transpose(1, 2).reshape(tiles.shape).contiguous()


def from_amx_int8_tiles(tiles: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The int8 rows `to_amx_int8_tiles` stored as `tiles`."""
    from pdserve.engine.model.layers import from_amx_tiles

    ordered = tiles.view(-1, 4, 2, 8).transpose(1, 2).reshape(tiles.shape).to(torch.int16)
    values = torch.where(ordered >= 0x80, -(ordered & 0x7F), ordered).to(torch.int8)
    return from_amx_tiles(values, out_features, in_features)


def to_int8_panels(q: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 rows [out, in] and their scales k-major in panels of 16 output rows, as
    csrc/cpu_int8_panels.cpp reads them: values [ceil(out / 16), in, 16] (panel p, step k, row j:
    q[16p + j][k]) and scales [panels, groups, 16] (or [panels, 16] for a scale per row), zero past
    the last row."""
    out_features, in_features = q.shape
    count = -(-out_features // 16)
    padded = torch.zeros(count * 16, in_features, dtype=torch.int8)
    padded[:out_features] = q
    values = padded.view(count, 16, in_features).transpose(1, 2).contiguous()
    s = torch.zeros(count * 16, *scales.shape[1:], dtype=torch.float32)
    s[:out_features] = scales
    s = s.view(count, 16, -1).transpose(1, 2).contiguous() if scales.dim() == 2 else s.view(count, 16)
    return values, s


def register_max_rows(gemm_isa: int, int8_activations: bool) -> int:
    """The most rows of x our register kernel takes; more go to the GEMM. int8 activations keep
    SMALL_ROWS on every CPU: which rows are rounded to int8 is part of what that option means."""
    return SMALL_ROWS_AVX512 if gemm_isa == 512 and not int8_activations else SMALL_ROWS


def gemm_max_rows(cpu_flags: frozenset[str]) -> int | None:
    """The most rows of x the GEMM takes on a CPU with these flags (None: any number)."""
    return None if "avx512f" in cpu_flags else GEMM_MAX_ROWS_AVX2


def int8_matmul_slabs(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x (float32, 2-D) times the dequantized weight ᵀ, widening q to float32 one slab of rows at a
    time: row scales are applied to the product, group scales to the slab."""
    n = q.shape[0]
    out = torch.empty(x.shape[0], n, dtype=torch.float32)
    slab = torch.empty(min(SLAB_ROWS, n), q.shape[1], dtype=torch.float32)
    grouped = scales.dim() == 2
    for start in range(0, n, SLAB_ROWS):
        w = slab[:min(SLAB_ROWS, n - start)]
        rows = slice(start, start + w.shape[0])
        w.copy_(q[rows])
        if grouped:
            w.view(w.shape[0], scales.shape[1], -1).mul_(scales[rows, :, None])
        torch.mm(x, w.t(), out=out[:, rows])
    return out if grouped else out.mul_(scales)


class Int8Linear:
    """One weight matrix (with its bias, if any) in int8, and the matmul by it.

    `group`: None for one scale per output row, else the number of consecutive weights of a row
    that share a scale (a multiple of 8 dividing the row). `amx`: keep the int8 values in AMX tiles
    for bfloat16 rows (see the module docstring); None: where that kernel runs, the weight is
    bfloat16 and the scales are per row, without int8 activations.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 use_kernel: bool | None = None, group: int | None = None,
                 int8_activations: bool = False, amx: bool | None = None) -> None:
        if weight.dim() != 2 or weight.device.type != "cpu":
            raise ValueError(f"int8 quantization takes a 2-D CPU weight, got {tuple(weight.shape)} on {weight.device}")
        if group is not None and (group % 8 or weight.shape[1] % group):
            raise ValueError(f"groups of {group} do not fit rows of {weight.shape[1]} (a multiple of 8 dividing it)")
        self.out_features, self.in_features = weight.shape
        self.group = group
        qweight, self._scales = quantize_per_channel(weight) if group is None else quantize_groups(weight, group)
        self.bias = None if bias is None else bias.detach().float().clone()
        self.use_kernel = kernel_available() if use_kernel is None else use_kernel
        self.use_gemm = self.use_kernel and gemm_available()
        self.gemm_max_rows = gemm_max_rows(cpu_info.flags())
        # The kernel's blocks of x must tile the row and fall inside one weight group each.
        self.int8_activations = (int8_activations and self.in_features % ACT_BLOCK == 0
                                 and (group is None or (group % ACT_BLOCK == 0 and group & (group - 1) == 0)))
        isa = torch.ops.pdserve_cpu.gemm_tile_isa() if self.use_gemm else 0
        self.register_rows = register_max_rows(isa, self.int8_activations)
        if amx is None:
            amx = (weight.dtype == torch.bfloat16 and group is None and not self.int8_activations
                   and self.use_kernel and amx_available())
        if amx and (group is not None or self.int8_activations):
            raise ValueError("int8 weights in AMX tiles take one scale per row and bfloat16 rows of x")
        # One copy of the int8 values: in AMX tiles or k-major panels (then `qweight` unpacks them on
        # demand), or in rows.
        self.tiles: torch.Tensor | None = None
        self._rows: torch.Tensor | None = qweight
        if amx:
            self.tiles, self._rows = to_amx_int8_tiles(qweight), None
        # The values k-major in panels, with their scales (keep_panels).
        self.panels: tuple[torch.Tensor, torch.Tensor] | None = None

    def keep_panels(self) -> bool:
        """Keep the int8 values k-major (to_int8_panels) instead of in rows, for
        csrc/cpu_int8_panels.cpp to take every row count: the GEMM's bits without its per-call byte
        transpose. On a Zen 5 (2 threads, SmolLM2's Q8_0 LM head, 49152 x 576): 1.14-1.5x the
        register kernel and the GEMM at 2 to 32 rows (16 rows: 2.57 against 3.90 ms), level at 1 and
        64, 0.9-0.95x the GEMM at 96-512. Done for the LM head, the biggest matrix, which runs on every
        step outside the C++ decode loop, where rows past 64 come only with bigger batches. Where the
        AVX-512 GEMM is not built, or with int8 activations or AMX tiles, nothing changes (False)."""
        if (not self.use_gemm or torch.ops.pdserve_cpu.gemm_tile_isa() != 512 or self._rows is None
                or self.int8_activations):
            return False
        self.panels, self._rows, self._scales = to_int8_panels(self._rows, self._scales), None, None
        return True

    @property
    def qweight(self) -> torch.Tensor:
        """The int8 values, [out_features, in_features]."""
        if self._rows is not None:
            return self._rows
        if self.panels is not None:
            values = self.panels[0]
            return values.transpose(1, 2).reshape(-1, self.in_features)[:self.out_features].contiguous()
        return from_amx_int8_tiles(self.tiles, self.out_features, self.in_features)

    @property
    def scales(self) -> torch.Tensor:
        """float32 scales: [out_features] (a scale per row) or [out_features, groups]."""
        if self._scales is not None:
            return self._scales
        per_panel = self.panels[1]
        rows = per_panel.transpose(1, 2).reshape(-1, per_panel.shape[1]) if per_panel.dim() == 3 else per_panel.reshape(-1)
        return rows[:self.out_features].contiguous()

    def amx_takes(self, x: torch.Tensor) -> bool:
        """Whether x goes through the AMX kernel: bfloat16 rows, the weight in tiles."""
        return self.tiles is not None and x.dtype == torch.bfloat16

    def kernel_takes(self, rows: int) -> bool:
        """Whether `rows` rows of x go through our register kernel (else the GEMM, or float32 slabs)."""
        return self.use_kernel and rows <= self.register_rows

    def gemm_takes(self, rows: int) -> bool:
        """Whether `rows` rows of x (past the register kernel's) go through our GEMM, else the slabs."""
        return self.use_gemm and (self.gemm_max_rows is None or rows <= self.gemm_max_rows)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x Wᵀ + b in x's dtype, computed in float32 (bfloat16 x on AMX: bf16 products summed in float32)."""
        lead = x.shape[:-1]
        if self.amx_takes(x):
            y = torch.ops.pdserve_cpu.amx_int8_linear(x.reshape(-1, self.in_features), self.tiles, self.scales)
            if self.bias is not None:
                y += self.bias  # in float32, rounded once
            return y.reshape(*lead, self.out_features)
        x2 = x.reshape(-1, self.in_features).float()
        if self.panels is not None:
            qpanels, spanels = self.panels
            y = torch.ops.pdserve_cpu.int8_panel_gemm(x2, qpanels, spanels, self.group or 0, self.out_features)
        elif self.kernel_takes(x2.shape[0]):
            ops = torch.ops.pdserve_cpu
            kernel = ops.int8_linear_a8 if self.int8_activations else ops.int8_linear
            y = kernel(x2, self.qweight, self.scales)
        elif self.gemm_takes(x2.shape[0]):
            y = torch.ops.pdserve_cpu.int8_gemm(x2, self.qweight, self.scales)
        else:
            y = int8_matmul_slabs(x2, self.qweight, self.scales)
        if self.bias is not None:
            y += self.bias
        return y.to(x.dtype).reshape(*lead, self.out_features)

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.qweight, self.scales)

    @property
    def nbytes(self) -> int:
        """Bytes of weight storage: one per element, plus the scales and bias."""
        extra = 0 if self.bias is None else self.bias.numel() * 4
        if self.panels is not None:
            return self.panels[0].numel() + self.panels[1].numel() * 4 + extra
        return (self._rows if self.tiles is None else self.tiles).numel() + self._scales.numel() * 4 + extra


def quantize_model(model: nn.Module, method: str, include_lm_head: bool = True,
                   only: set[str] | None = None, lossless: bool = False, int8_activations: bool = False) -> int:
    """Replace linear layers' float weights by int8 ones; returns how many were quantized.

    `method`: "int8" (a scale per output row) or "q8_0" (a scale per 32 weights; a layer whose
    rows do not split into 32s keeps its float weight). `only`: the names of the modules to
    quantize (default: every linear layer). `lossless`: keep a layer's float weight where the int8
    form would not give it back exactly (for weights that were Q8_0 in a GGUF file).
    `int8_activations`: decode rows are rounded to int8 as well (see the module docstring).

    The float weights are freed, except an lm_head tied to the embedding (the embedding still
    looks rows up in it). Biases of column-parallel layers move into the int8 kernel; a
    row-parallel layer adds its bias after the all-reduce, as before.
    """
    if method not in METHODS:
        raise ValueError(f"unknown quantization {method!r}")
    from pdserve.engine.model.layers import (ColumnParallelLinear, ParallelLMHead, RowParallelLinear,
                                             VocabParallelEmbedding)

    group = Q8_0_GROUP if method == "q8_0" else None
    embeddings = {id(m.weight) for m in model.modules()
                  if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)}
    count = 0
    kept: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, ParallelLMHead):
            if not include_lm_head:
                continue
        elif not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            continue
        if only is not None and name not in only:
            continue
        if group is not None and module.weight.shape[1] % group:
            kept.append(name)
            continue
        own_bias = isinstance(module, ColumnParallelLinear) and module.bias is not None
        layer = Int8Linear(module.weight, module.bias if own_bias else None, group=group,
                           int8_activations=int8_activations)
        if lossless and not torch.equal(layer.dequantize(), module.weight.detach().float()):
            kept.append(name)
            continue
        if isinstance(module, ParallelLMHead):
            layer.keep_panels()
        module.quantized = layer
        if own_bias:
            module.bias = None  # now inside module.quantized
        if id(module.weight) not in embeddings:
            module.weight = None  # type: ignore[assignment]
        module.packed_weight = None
        count += 1
    if kept:
        why = "the int8 form would round them" if lossless else f"rows do not split into groups of {group}"
        log.warning("%d weight matrices keep their float weights (%s): %s", len(kept), why,
                    ", ".join(kept[:4]) + (" ..." if len(kept) > 4 else ""))
    return count


def weight_bytes(model: nn.Module) -> int:
    """Bytes held by the model's parameters and int8 weights, each stored tensor counted once."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    for m in model.modules():
        q = getattr(m, "quantized", None)
        if q is not None:
            total += q.nbytes
    return total
