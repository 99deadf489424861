"""Latency percentiles and throughput for a load run, as pure functions of the per-request numbers."""

from __future__ import annotations

import math
from typing import Any, Iterable, Protocol, Sequence

PERCENTILES: tuple[int, ...] = (50, 90, 99)
# (summary prefix, per-request attribute); times are kept in seconds and reported in ms.
LATENCIES: tuple[tuple[str, str], ...] = (("ttft", "ttft"), ("tpot", "tpot"), ("itl", "itls"), ("e2e", "e2e"))


class RequestNumbers(Protocol):
    ok: bool
    prompt_tokens: int | None
    output_tokens: int
    ttft: float | None
    itls: list[float]
    e2e: float | None

    @property
    def tpot(self) -> float | None: ...


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between closest ranks, which is what
    numpy.percentile does by default; None for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within [0, 100], got {q}")
    ordered = sorted(values)
    if not ordered:
        return None
    rank = (len(ordered) - 1) * q / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    frac = rank - lo
    # a + (b - a) * t loses the exact endpoints for huge spans; weigh both ends instead.
    return ordered[lo] * (1.0 - frac) + ordered[hi] * frac if frac else float(ordered[lo])


def mean(values: Sequence[float]) -> float | None:
    return math.fsum(values) / len(values) if values else None


def distribution(values: Sequence[float], scale: float = 1.0) -> dict[str, float | None]:
    """mean and PERCENTILES of `values`, each multiplied by `scale`."""
    out: dict[str, float | None] = {"mean": _scaled(mean(values), scale)}
    for q in PERCENTILES:
        out[f"p{q}"] = _scaled(percentile(values, q), scale)
    return out


def rate(count: float, duration: float) -> float | None:
    return count / duration if duration > 0 else None


def summarize(results: Iterable[RequestNumbers], duration: float) -> dict[str, Any]:
    """The flat summary of a run: counts, throughputs over the wall-clock `duration`, and latency
    distributions in ms over the requests that succeeded (a failed request has no valid timings)."""
    results = list(results)
    done = [r for r in results if r.ok]
    input_tokens = sum(r.prompt_tokens or 0 for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    summary: dict[str, Any] = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration,
        "request_throughput": rate(len(done), duration),
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "output_tokens_per_s": rate(output_tokens, duration),
        "total_tokens_per_s": rate(input_tokens + output_tokens, duration),
    }
    for prefix, attr in LATENCIES:
        if attr == "itls":
            values = [gap for r in done for gap in r.itls]
        else:
            values = [v for v in (getattr(r, attr) for r in done) if v is not None]
        for stat, value in distribution(values, scale=1000.0).items():
            summary[f"{prefix}_{stat}_ms"] = value
    return summary


def _scaled(value: float | None, scale: float) -> float | None:
    return None if value is None else value * scale
