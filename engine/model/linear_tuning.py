"""Which matmul serves a single row (a decode step of one request), chosen per weight shape by
timing both paths at start-up on this machine.

PACKED_ROWS (layers.py) sends one row to F.linear: on average that is the faster path, but not
for every shape. Measured on an AVX2 EPYC (bench_kernels' matmul rows), oneDNN's packed weights
read a wide projection (gate/up 4096x768, a 32000-row LM head) about twice as fast as MKL's gemv,
while F.linear wins on the narrower ones; which shapes cross over depends on the CPU and its
caches. So each distinct weight shape is timed both ways, once, on the model's own weights (its
layers in turn, so the weights come from memory as in a real step, not from cache), and its
modules take the packed path for one row only where that measured faster by a margin.

The choice changes which kernel computes a row, so results may differ from the untuned path in
the last bits; PDSERVE_TUNE_LINEAR=0 keeps the fixed rule (reproducible across machines).
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.model.layers import PACKED_ROWS, ColumnParallelLinear, ParallelLMHead, RowParallelLinear

log = logging.getLogger("pdserve.engine.loader")

# Packed must beat F.linear by this much: a tie keeps the default rule, so a noisy measurement
# does not flip shapes back and forth between starts.
MARGIN = 1.10
# Layers timed per shape: enough weight that the pass reads from memory, bounded so a large
# model's start-up does not read all its weights ten times.
MAX_MODULES = 6
ROUNDS = 5


def _median_s(fn: Callable[[], None], rounds: int) -> float:
    fn()  # warm: first-call set-up (oneDNN primitive creation) is not the steady cost
    samples = []
    for _ in range(rounds):
        began = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - began)
    return statistics.median(samples)


def single_row_groups(model: nn.Module) -> dict[tuple[int, int, torch.dtype], list[nn.Module]]:
    """Modules with a packed weight, by weight shape and dtype."""
    groups: dict[tuple[int, int, torch.dtype], list[nn.Module]] = {}
    for module in model.modules():
        if (isinstance(module, (ColumnParallelLinear, RowParallelLinear, ParallelLMHead))
                and module.packed_weight is not None and module.quantized is None):
            rows, cols = module.weight.shape
            groups.setdefault((rows, cols, module.weight.dtype), []).append(module)
    return groups


def tune_single_row(model: nn.Module, rounds: int = ROUNDS) -> dict[str, float]:
    """Times one row through each packed shape both ways and widens `packed_rows` to 1 where packed
    wins; returns "ROWSxCOLS" -> F.linear time / packed time, for the log and the tests."""
    ratios: dict[str, float] = {}
    for (rows, cols, dtype), modules in single_row_groups(model).items():
        low, high = PACKED_ROWS[dtype]
        if low <= 1:
            continue  # packed already serves one row
        timed = modules[:MAX_MODULES]
        x = torch.randn(1, cols, generator=torch.Generator().manual_seed(0)).to(dtype)  # not the global RNG

        def plain() -> None:
            for m in timed:
                F.linear(x, m.weight)

        def packed() -> None:
            for m in timed:
                torch.ops.mkldnn._linear_pointwise(x, m.packed_weight, None, "none", [], "")

        # Alternated, so a slow spell of the machine falls on both.
        plain_s, packed_s = [], []
        for _ in range(2):
            plain_s.append(_median_s(plain, rounds))
            packed_s.append(_median_s(packed, rounds))
        ratio = min(plain_s) / min(packed_s)
        ratios[f"{rows}x{cols}"] = ratio
        if ratio >= MARGIN:
            for m in modules:
                m.packed_rows = (1, high)
    return ratios


def maybe_tune(model: nn.Module) -> None:
    if os.environ.get("PDSERVE_TUNE_LINEAR", "1") == "0":
        return
    began = time.perf_counter()
    ratios = tune_single_row(model)
    if ratios:
        chosen = [shape for shape, r in ratios.items() if r >= MARGIN]
        log.info("single-row matmuls: packed for %s of %d shapes (F.linear/packed time: %s) in %.2fs",
                 ", ".join(chosen) or "none", len(ratios),
                 ", ".join(f"{s} {r:.2f}" for s, r in ratios.items()), time.perf_counter() - began)
