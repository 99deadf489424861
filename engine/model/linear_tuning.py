"""Which matmul serves a single row (a decode step of one request), chosen per weight shape by
timing the candidates at start-up on this machine.

One row of x times a weight is a matrix-vector product: reading the weight from memory is all
its cost, and how fast a path streams it depends on the shape and the CPU. Measured on an AVX2
EPYC with the weights coming from memory, MKL's gemv (F.linear, the default rule) reads 11-19
GB/s, oneDNN's packed layout 12-26 GB/s, and our AVX2 kernel (csrc/cpu_int8_linear.cpp's
`float_linear`) 20-29 GB/s, with the order changing from shape to shape. On a Zen 4 EPYC with
AVX512-BF16 the same kernel in bfloat16 (vdpbf16ps) read a SmolLM2 step's weights 12% faster than
oneDNN's packed bf16 and 1.6x faster than F.linear. Where OpenMP's idle
threads sleep (OMP_WAIT_POLICY=PASSIVE, `pdserve up`'s prefill engines) a parallel kernel pays a wake-up
per call, so the kernel is also timed on the calling thread alone. So each distinct weight
shape is timed every available way, once, on the model's own weights (a few of its layers in turn,
after a read of twice the last-level cache, so the weights come from memory as in a real step, not
from cache), and its modules take the fastest path for one row where that beats F.linear by a margin.

The choice changes which kernel computes a row, so results may differ from the untuned path in
the last bits; PDSERVE_TUNE_LINEAR=0 keeps the fixed rule (reproducible across machines).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn

from pdserve.engine import cpu_info
from pdserve.engine.model import decode_call, fused
from pdserve.engine.model.layers import (ColumnParallelLinear, ParallelLMHead, RowParallelLinear, is_amx_tiles,
                                         is_pair_groups, linear)

log = logging.getLogger("pdserve.engine.loader")

# Another path must beat F.linear by this much: a tie keeps the default rule, so a noisy
# measurement does not flip shapes back and forth between starts.
MARGIN = 1.10
# Layers timed per shape, bounded so a large model's start-up does not read all its weights many
# times over.
MAX_MODULES = 6
ROUNDS = 5
# The eviction read's ceiling: it is held only while the shapes are timed, but a pod sized close to
# its model must not run out of memory at start-up on a CPU with hundreds of MiB of L3.
MAX_EVICT_BYTES = 256 << 20


def evictor() -> Callable[[], None]:
    """A read of twice the last-level cache: run before a timed pass, it leaves that pass's weights in
    memory, where a real step finds them (it streams every layer once). Six layers of a small model
    fit in a server's cache: on a Zen 5 EPYC (32 MiB of L3) SmolLM2's six of a shape, timed from cache,
    put our row-major bf16 kernel 3.4-3.8x ahead of F.linear; from memory it is 2.0-2.4x."""
    buffer = torch.ones(min(2 * cpu_info.last_level_cache_bytes(), MAX_EVICT_BYTES) // 4)

    def evict() -> None:
        buffer.sum()
    return evict


def _median_s(fn: Callable[[], None], rounds: int, before: Callable[[], None] = lambda: None) -> float:
    """The median time of `fn` over `rounds` runs, `before` run untimed ahead of each."""
    fn()  # warm: first-call set-up (oneDNN primitive creation) is not the steady cost
    samples = []
    for _ in range(rounds):
        before()
        began = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - began)
    return statistics.median(samples)


def single_row_groups(model: nn.Module) -> dict[tuple[int, int, torch.dtype], list[nn.Module]]:
    """The model's float linear layers on the CPU, by weight shape and dtype."""
    groups: dict[tuple[int, int, torch.dtype], list[nn.Module]] = {}
    for module in model.modules():
        if (isinstance(module, (ColumnParallelLinear, RowParallelLinear, ParallelLMHead))
                and module.quantized is None and module.weight.device.type == "cpu"):
            rows, cols = module.weight.shape
            groups.setdefault((rows, cols, module.weight.dtype), []).append(module)
    return groups


def bf16_kernel_available() -> bool:
    """Whether our single-row kernel takes bfloat16 weights here (built where the CPU has AVX512-BF16)."""
    return fused.cpu_kernels_ready() and bool(torch.ops.pdserve_cpu.bf16_linear_available())


def keeps_own_single_row(packed_weights: list) -> bool:
    """Whether these weights' one row stays on their packed layout whatever is faster: pair groups and
    AMX tiles, whose one row sums each output as every row of a batch does (see candidates)."""
    return all(p is not None and (is_pair_groups(p) or is_amx_tiles(p)) for p in packed_weights)


def candidates(modules: list[nn.Module], x: torch.Tensor) -> list[str]:
    """The `one_row` paths of layers.linear that can compute one row through all these modules'
    weights (F.linear, the default, always can). "packed" is the weight's prepacked layout,
    panels or oneDNN's (layers.float_packing)."""
    if keeps_own_single_row([m.packed_weight for m in modules]):
        # One row through pair groups sums each output in the order every row of a batch does, so a
        # request's tokens do not depend on what it is batched with (bf16 logits tie often: with the
        # row-major kernel at one row, only 5 of 16 SmolLM2 answers decoded alone matched the same
        # prompts sent 16 at once; with pair groups 16 of 16 did). They cost no speed either: one
        # request decoding SmolLM2 on the Zen 5, the two alternated in one process, took 1.03-1.17x as
        # long a token with the row-major kernel (paired medians of two runs), although each shape
        # timed alone favoured that kernel. So nothing else is tried. The same holds for AMX tiles: on
        # an AMX Xeon the tuned picks (the row-major kernel for some shapes, a pick that moved from one
        # start to the next) left 10-12 of 16 SmolLM2 answers through `pdserve serve` equal to the
        # same prompts sent 16 at once, the tiles 16 of 16; and one request's decode step ran 1.02-1.05x
        # faster on the tiles (SmolLM2 and the bench model, alternated in one process).
        return []
    paths = []
    if all(m.packed_weight is not None for m in modules):
        paths.append("packed")
    if (all(m.weight.is_contiguous() for m in modules) and fused.cpu_kernels_ready()
            and (x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and bf16_kernel_available()))):
        paths += ["kernel", "kernel_serial"]
    return paths


def one_pass(modules: list[nn.Module], x: torch.Tensor, path: str | None) -> Callable[[], None]:
    """One row through every module by `path` (None: F.linear), as the model's forward runs it."""
    def run() -> None:
        for m in modules:
            linear(x, m.weight, None, m.packed_weight if path else None, one_row=path)
    return run


def tune_single_row(model: nn.Module, rounds: int = ROUNDS) -> dict[str, tuple[str, float]]:
    """Times one row through each weight shape every available way and sets `one_row` on the
    shape's modules where a path beats F.linear by MARGIN; returns "ROWSxCOLS" -> (the fastest
    other path, F.linear's time over its time), for the log and the tests."""
    found: dict[str, tuple[str, float]] = {}
    evict: Callable[[], None] | None = None  # made for the first shape timed: none may need it
    for (rows, cols, dtype), modules in single_row_groups(model).items():
        timed = modules[:MAX_MODULES]
        x = torch.randn(1, cols, generator=torch.Generator().manual_seed(0)).to(dtype)  # not the global RNG
        others = candidates(timed, x)
        if not others:
            continue
        runs = {path: one_pass(timed, x, path) for path in (None, *others)}
        evict = evict or evictor()
        # Alternated, so a slow spell of the machine falls on every path.
        best = {path: float("inf") for path in runs}
        for _ in range(2):
            for path, run in runs.items():
                best[path] = min(best[path], _median_s(run, rounds, evict))
        other = min(others, key=best.__getitem__)
        ratio = best[None] / best[other]
        found[f"{rows}x{cols}"] = (other, ratio)
        if ratio >= MARGIN:
            for m in modules:
                m.one_row = other
    decode_call.forget(model)  # its matmul paths were read from one_row
    return found


@contextlib.contextmanager
def machine_wide_turn() -> Iterator[None]:
    """One engine on this machine times its matmuls at a time. Engines that start together
    (`pdserve up`: a prefill and a decode engine, or data-parallel ranks) would otherwise time
    them while competing for the same cores, and choose from numbers that hold for neither."""
    path = Path(tempfile.gettempdir()) / "pdserve-linear-tuning.lock"
    try:
        handle = open(path, "a")
    except OSError:  # an unwritable temp folder: time without the turn rather than not start
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def maybe_tune(model: nn.Module) -> None:
    if os.environ.get("PDSERVE_TUNE_LINEAR", "1") == "0":
        return
    with machine_wide_turn():
        began = time.perf_counter()
        found = tune_single_row(model)
    if found:
        log.info("single-row matmuls: %s (F.linear time / the path's; below %.2f keeps F.linear) in %.2fs",
                 ", ".join(f"{shape} {path} {ratio:.2f}" for shape, (path, ratio) in found.items()), MARGIN,
                 time.perf_counter() - began)
