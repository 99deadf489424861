"""Whether bfloat16 matmuls beat float32 ones on this CPU, timed once and remembered on disk.

`dtype auto` must never run a half checkpoint in a precision slower than float32 (issue 20). The
hardware does not settle it where a CPU has AVX512-BF16 but no AMX: on an Intel Xeon of that kind
bf16 decoded 16 streams more slowly than float32, while on an AMD EPYC (Zen 4) bf16 step matmuls
ran 3.2x float32's speed at one row and 1.9x at sixteen (benchmarks/bench_precision.py). So there
the model's own matmul shapes are timed, in both dtypes, through the engine's `linear` with the
weights prepacked as the engine packs them, at the row counts of a decode step (1 and 16) and of a
prefill chunk (256), the two dtypes in alternation. bfloat16 wins only if it is faster at every one
of them by a margin, in the median of the paired ratios. The
weights are copied until they outgrow the last-level cache, so they stream from memory as in a
real step. The verdict is kept per CPU, torch version and shape set; later starts read it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from pdserve.engine import cpu_info

log = logging.getLogger("pdserve.engine.dtype_probe")

ROWS = (1, 16, 256)
# bfloat16 must beat float32 by this much at every row count: a near tie keeps the exact dtype.
MARGIN = 1.10
# Bytes of float32 weights per shape set: past a server CPU's last-level cache (32 MiB here).
STREAM_BYTES = 96 << 20
ROUNDS = 9
# A big model's matmuls are timed on a band of their rows: its whole layer would cost seconds and
# gigabytes at start-up, and the ratio asked for does not change with the band's height.
MAX_WEIGHT_ELEMENTS = 4 << 20
# 4: bfloat16 weights in pair groups on AVX512-BF16 CPUs without AMX; 5: their one row in pair groups too;
# 6: the dtypes timed in alternation, the verdict on paired ratios
PROBE_VERSION = 6


@dataclass(frozen=True)
class Verdict:
    bf16_faster: bool
    # seconds per pass over the copies, per row count: {"1": [float32, bfloat16], ...} (medians)
    seconds: dict[str, list[float]]
    # the median of the paired ratios float32 / bfloat16, per row count: what the verdict compares
    ratios: dict[str, float] = field(default_factory=dict)

    def why(self) -> str:
        ratios = self.ratios or {rows: f32 / bf16 for rows, (f32, bf16) in self.seconds.items()}
        shown = ", ".join(f"{rows} rows {r:.2f}x" for rows, r in ratios.items())
        return f"bfloat16 vs float32 matmuls timed on this CPU: {shown}"


def shapes(hidden: int, intermediate: int, q_out: int, kv_out: int) -> list[tuple[int, int]]:
    """(out, in) of one decoder layer's matmuls: qkv, o, gate_up, down."""
    return [(q_out + 2 * kv_out, hidden), (hidden, q_out), (2 * intermediate, hidden), (hidden, intermediate)]


def _cache_path(layer_shapes: list[tuple[int, int]]) -> Path:
    from pdserve.engine.demo import cache_root

    digest = hashlib.sha256(json.dumps([PROBE_VERSION, cpu_info.identity(), torch.__version__, os.cpu_count(),
                                        layer_shapes]).encode()).hexdigest()[:16]
    return cache_root() / "dtype-probe" / f"{digest}.json"


def _weights(layer_shapes: list[tuple[int, int]], dtype: torch.dtype, copies: int):
    from pdserve.engine.model.layers import pack_weight

    gen = torch.Generator().manual_seed(0)
    weights = []
    for _ in range(copies):
        for out_f, in_f in layer_shapes:
            w = (torch.randn(out_f, in_f, generator=gen) * 0.02).to(dtype)
            weights.append((w, pack_weight(w)))
    return weights


def _one_row_paths(dtype: torch.dtype, weights) -> list[str | None]:
    """The single-row paths linear_tuning may give these weights of this dtype (None: the fixed rule):
    each dtype's one row is timed by its fastest, as the engine would run it."""
    from pdserve.engine.model import fused, linear_tuning

    if dtype == torch.float32:
        return [None, "packed", *(["kernel"] if fused.cpu_kernels_ready() else [])]
    if linear_tuning.keeps_own_single_row([packed for _, packed in weights]):
        return [None]
    return [None, *(["kernel"] if linear_tuning.bf16_kernel_available() else [])]


def _fns(weights, one_row: str | None):
    from pdserve.engine.model.layers import linear

    return [(w.shape[1], functools.partial(linear, weight=w, bias=None, packed=packed, one_row=one_row))
            for w, packed in weights]


def _inputs(fns, rows: int, dtype: torch.dtype) -> dict[int, torch.Tensor]:
    gen = torch.Generator().manual_seed(rows)  # not the global RNG: a caller's seeded draws stay theirs
    return {in_f: torch.randn(rows, in_f, generator=gen).to(dtype) for in_f, _ in fns}


def _one_pass_s(fns, xs: dict[int, torch.Tensor]) -> float:
    began = time.perf_counter()
    for in_f, fn in fns:
        fn(xs[in_f])
    return time.perf_counter() - began


def _pass_s(fns, rows: int, dtype: torch.dtype) -> float:
    xs = _inputs(fns, rows, dtype)
    _one_pass_s(fns, xs)  # warm: oneDNN creates its primitives on first use
    return statistics.median(_one_pass_s(fns, xs) for _ in range(ROUNDS))


def _alternated_s(contenders, rows: int) -> tuple[list[float], float]:
    """Median seconds per pass of each of `contenders` ([(fns, dtype)], float32's first), timed in
    alternation, and the median of the per-round ratios float32 / bfloat16. Timed one dtype after
    the other, a shared machine's minute-to-minute swings (another process starting, a neighbour
    guest) landed on one dtype only: on a 2-core Zen 4 EPYC, as `pdserve serve` started, the probe
    once found bfloat16 0.94x float32 at 16 rows, where alone it found 1.4-1.7x, and the whole
    decode step ran 2.4x faster in bfloat16; auto then chose float32."""
    xs = [_inputs(fns, rows, dtype) for fns, dtype in contenders]
    for (fns, _), x in zip(contenders, xs):
        _one_pass_s(fns, x)  # warm: oneDNN creates its primitives on first use
    samples: list[list[float]] = [[] for _ in contenders]
    for r in range(ROUNDS):
        order = range(len(contenders)) if r % 2 == 0 else reversed(range(len(contenders)))
        for i in order:
            samples[i].append(_one_pass_s(contenders[i][0], xs[i]))
    ratio = statistics.median(f / b for f, b in zip(samples[0], samples[1]))
    return [statistics.median(s) for s in samples], ratio


def bounded(layer_shapes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The shapes timed: each weight cut to at most MAX_WEIGHT_ELEMENTS, by its output rows."""
    return [(max(1, min(out_f, MAX_WEIGHT_ELEMENTS // in_f)), in_f) for out_f, in_f in layer_shapes]


def measure(layer_shapes: list[tuple[int, int]]) -> Verdict:
    """Time both dtypes at each row count, on enough copies of the layer to stream from memory."""
    layer_shapes = bounded(layer_shapes)
    layer_bytes = 4 * sum(o * i for o, i in layer_shapes)
    copies = max(1, -(-STREAM_BYTES // layer_bytes))
    weights = {dtype: _weights(layer_shapes, dtype, copies) for dtype in (torch.float32, torch.bfloat16)}
    seconds: dict[str, list[float]] = {}
    ratios: dict[str, float] = {}
    with torch.inference_mode():
        for rows in ROWS:
            contenders = []
            for dtype in (torch.float32, torch.bfloat16):
                # One row: each dtype by its fastest single-row path, as the engine would run it.
                paths = _one_row_paths(dtype, weights[dtype]) if rows == 1 else [None]
                best = min(paths, key=lambda p: _pass_s(_fns(weights[dtype], p), rows, dtype)) if len(paths) > 1 \
                    else paths[0]
                contenders.append((_fns(weights[dtype], best), dtype))
            seconds[str(rows)], ratios[str(rows)] = _alternated_s(contenders, rows)
    faster = all(r > MARGIN for r in ratios.values())
    return Verdict(faster, seconds, ratios)


def _read(path: Path) -> Verdict | None:
    try:
        verdict = Verdict(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None
    return verdict if isinstance(verdict.bf16_faster, bool) and isinstance(verdict.seconds, dict) else None


@functools.cache
def bf16_beats_float32(layer_shapes: tuple[tuple[int, int], ...]) -> Verdict:
    """The remembered verdict for these shapes on this CPU, measured first if there is none.

    An API server and its engine core resolve the config at once: the second waits for the
    first's measurement (one machine-wide turn, as linear_tuning's) and reads its verdict, so both
    agree and neither times while the other loads the cores."""
    from pdserve.engine.model.linear_tuning import machine_wide_turn

    path = _cache_path(list(layer_shapes))
    verdict = _read(path)
    if verdict is not None:
        return verdict
    with machine_wide_turn():
        verdict = _read(path)
        if verdict is not None:
            return verdict
        log.info("dtype auto: timing bfloat16 against float32 matmuls on this CPU (once per machine)")
        verdict = measure(list(layer_shapes))
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(asdict(verdict)))
            tmp.replace(path)  # atomic: a reader sees no verdict or a whole one
        except OSError as exc:
            log.warning("dtype auto: could not keep the probe's verdict in %s: %s", path, exc)
    return verdict
