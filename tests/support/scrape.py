"""Reading a server's Prometheus /metrics and waiting for a condition: what the router, picker and
gateway tests check their engines with."""

from __future__ import annotations

import time

import httpx


def metric_total(url: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus series over the label sets that match `labels` (0 when absent)."""
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("#") or not (line.startswith(name + "{") or line.startswith(name + " ")):
            continue
        series, value = line.rsplit(" ", 1)
        if all(f'{k}="{v}"' in series for k, v in labels.items()):
            total += float(value)
    return total


def successes(engine) -> float:
    """Requests an engine (anything with `.url`) finished successfully, over all its ranks."""
    return metric_total(engine.url, "vllm:request_success_total")


def wait_until(predicate, message: str, timeout: float = 30.0, interval: float = 0.1):
    """The predicate's first truthy result; AssertionError naming `message` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {message}")
        time.sleep(interval)
