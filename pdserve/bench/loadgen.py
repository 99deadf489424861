"""A load generator for any OpenAI-compatible endpoint (`/v1/completions` or `/v1/chat/completions`).

    from pdserve.bench.loadgen import LoadConfig, run_load_sync
    result = run_load_sync(LoadConfig(url="http://127.0.0.1:8000", num_requests=200, concurrency=16))
    print(result.summary()["ttft_p99_ms"])

Requests stream (`stream: true`, usage requested in the last chunk) over one httpx client whose
HTTP/1.1 connection pool is as large as the most requests that can be in flight, so no request
waits for a connection inside its own timing. Arrivals follow a seeded Poisson process at
`request_rate` (all at once when it is inf); `concurrency` caps how many are in flight, and with an
infinite rate that means exactly `concurrency` in flight until the queue drains. How each request is
timed is described in `pdserve.bench.openai_stream`.

Prompt lengths are the prompt's own tokens: a server adds its BOS token, and on the chat endpoint
its chat template, on top; the reported input tokens come from the server's usage when it sends one.
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Sequence, TextIO

import httpx

from pdserve.bench.metrics import summarize
from pdserve.bench.openai_stream import RequestResult, error_message, stream_request
from pdserve.bench.workload import WorkloadItem, build_warmup, build_workload, load_tokenizer

__all__ = ["LoadConfig", "LoadError", "LoadResult", "RequestResult", "WorkloadItem", "build_workload",
           "endpoint_url", "normalize_base_url", "run_load", "run_load_sync"]

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


class LoadError(Exception):
    """The run could not start: a bad configuration, or no model name could be found."""


@dataclass
class LoadConfig:
    url: str
    model: str | None = None
    endpoint: str = "completions"
    num_requests: int = 100
    request_rate: float = float("inf")
    concurrency: int | None = None
    input_len: tuple[int, int] = (32, 512)
    output_len: tuple[int, int] = (16, 256)
    seed: int = 0
    # A Hugging Face tokenizer name or directory for exact prompt lengths.
    tokenizer: str | None = None
    # vLLM's `ignore_eos`, so every request generates exactly max_tokens; servers that reject unknown
    # fields need it off.
    ignore_eos: bool = True
    # Merged into every request body last, so it can override any field we set.
    extra_body: dict[str, Any] | None = None
    api_key: str | None = None
    # Per request, from send to the end of the stream.
    timeout: float = 600.0
    warmup: int = 0

    def validate(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise LoadError(f"endpoint must be one of {sorted(ENDPOINTS)}, got {self.endpoint!r}")
        if self.num_requests < 1:
            raise LoadError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.warmup < 0:
            raise LoadError(f"warmup must be >= 0, got {self.warmup}")
        if not (self.request_rate > 0):
            raise LoadError(f"request_rate must be > 0 (or inf), got {self.request_rate}")
        if self.concurrency is not None and self.concurrency < 1:
            raise LoadError(f"concurrency must be >= 1, got {self.concurrency}")
        if not (self.timeout > 0):
            raise LoadError(f"timeout must be > 0, got {self.timeout}")
        for name in ("input_len", "output_len"):
            lo, hi = getattr(self, name)
            if lo < 1 or hi < lo:
                raise LoadError(f"{name} needs 1 <= MIN <= MAX, got {lo}:{hi}")
        if self.extra_body is not None and not isinstance(self.extra_body, dict):
            raise LoadError("extra_body must be a JSON object")
        normalize_base_url(self.url)

    def public(self) -> dict[str, Any]:
        """The settings worth recording next to results: everything but the API key."""
        return {
            "url": self.url, "model": self.model, "endpoint": self.endpoint, "num_requests": self.num_requests,
            "request_rate": self.request_rate if math.isfinite(self.request_rate) else "inf",
            "concurrency": self.concurrency, "input_len": list(self.input_len), "output_len": list(self.output_len),
            "seed": self.seed, "tokenizer": self.tokenizer, "ignore_eos": self.ignore_eos,
            "extra_body": self.extra_body, "timeout": self.timeout, "warmup": self.warmup,
        }


@dataclass
class LoadResult:
    results: list[RequestResult]
    # Wall-clock seconds from the first measured send to the last measured request's end.
    duration: float
    config: LoadConfig
    model: str = ""
    warmup_results: list[RequestResult] = field(default_factory=list)
    # Most measured requests seen in flight at once, as the client counted them.
    max_in_flight: int = 0

    def summary(self) -> dict[str, Any]:
        """completed, failed, duration_s, request_throughput, input_tokens, output_tokens,
        output_tokens_per_s, total_tokens_per_s, and for ttft, tpot, itl and e2e: <name>_mean_ms,
        <name>_p50_ms, <name>_p90_ms, <name>_p99_ms (None when no request gave that measure).
        Throughputs count successful requests only; latencies come from successful requests only."""
        return summarize(self.results, self.duration)

    def errors(self) -> list[tuple[str, int]]:
        """Each distinct failure message once, with how many requests it ended, most frequent first."""
        counts = Counter(r.error or "unknown error" for r in self.results if not r.ok)
        return counts.most_common()


def normalize_base_url(url: str) -> str:
    """'http://h:p', 'http://h:p/' and 'http://h:p/v1' all name the same server root."""
    base = url.strip().rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise LoadError(f"url must start with http:// or https://, got {url!r}")
    if base.endswith("/v1"):
        base = base[: -len("/v1")]
    return base


def endpoint_url(url: str, endpoint: str) -> str:
    return normalize_base_url(url) + ENDPOINTS[endpoint]


def request_body(config: LoadConfig, model: str, item: WorkloadItem) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model}
    if config.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": item.prompt}]
    else:
        body["prompt"] = item.prompt
    body.update(max_tokens=item.max_tokens, stream=True, stream_options={"include_usage": True})
    if config.ignore_eos:
        body["ignore_eos"] = True
    if config.extra_body:
        body.update(config.extra_body)
    return body


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def fetch_model(client: httpx.AsyncClient, url: str, api_key: str | None = None) -> str:
    """The first model id the server lists at GET /v1/models."""
    models_url = normalize_base_url(url) + "/v1/models"
    try:
        response = await client.get(models_url, headers=auth_headers(api_key))
    except httpx.HTTPError as exc:
        raise LoadError(f"cannot list models at {models_url}: {type(exc).__name__}: {exc}") from None
    if response.status_code >= 400:
        raise LoadError(f"cannot list models at {models_url}: HTTP {response.status_code}: "
                        f"{error_message(response.content)}")
    try:
        return str(response.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise LoadError(f"{models_url} lists no model; pass one explicitly") from None


class Progress:
    """One status line on stderr, rewritten in place on a terminal; elsewhere (logs, pipes) a plain
    line now and then, so captured output is not a wall of carriage returns."""

    def __init__(self, label: str, total: int, enabled: bool, stream: TextIO | None = None) -> None:
        self.label = label
        self.total = total
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.tty = enabled and self.stream.isatty()
        self.started = time.perf_counter()
        self.last_shown = -math.inf
        self.done = self.failed = self.in_flight = 0

    def update(self, *, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if not force and now - self.last_shown < (0.1 if self.tty else 10.0):
            return
        self.last_shown = now
        line = (f"{self.label}: {self.done}/{self.total} done ({self.failed} failed), "
                f"{self.in_flight} in flight, {now - self.started:.1f} s")
        self.stream.write(f"\r\x1b[K{line}" if self.tty else f"{line}\n")
        self.stream.flush()

    def close(self) -> None:
        if not self.enabled:
            return
        self.update(force=True)
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


Sender = Callable[[WorkloadItem, float], Awaitable[RequestResult]]


async def run_phase(items: Sequence[WorkloadItem], send: Sender, *, concurrency: int | None, paced: bool,
                    progress: Progress) -> tuple[list[RequestResult], float, int]:
    """Send `items` at their arrival offsets (when `paced`), at most `concurrency` in flight.
    Returns (results in item order, seconds from the first send to the last end, most in flight)."""
    origin = time.perf_counter()
    slots = asyncio.Semaphore(concurrency) if concurrency else None
    in_flight = most = 0
    tasks: list[asyncio.Task[RequestResult]] = []

    async def one(item: WorkloadItem) -> RequestResult:
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        progress.in_flight = in_flight
        try:
            result = await send(item, origin)
        finally:
            in_flight -= 1
            if slots is not None:
                slots.release()
        progress.in_flight = in_flight
        progress.done += 1
        progress.failed += not result.ok
        progress.update()
        return result

    try:
        for item in items:
            if paced:
                delay = origin + item.arrival - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
            if slots is not None:
                await slots.acquire()
            tasks.append(asyncio.create_task(one(item)))
        results = list(await asyncio.gather(*tasks))
    finally:
        # Only reached with work pending when the run itself is cancelled (Ctrl-C): leave nothing behind.
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        progress.close()
    return results, time.perf_counter() - origin, most


async def run_load(config: LoadConfig, *, tokenizer: Any = None, progress: bool = False) -> LoadResult:
    """Run the warm-up (not measured), then the measured requests, and collect their timings.
    `tokenizer` is an already loaded Hugging Face tokenizer, used instead of `config.tokenizer`."""
    config.validate()
    if tokenizer is None and config.tokenizer:
        tokenizer = load_tokenizer(config.tokenizer)
    items = build_workload(config, tokenizer)
    warmup_items = build_warmup(config, tokenizer) if config.warmup else []
    url = endpoint_url(config.url, config.endpoint)
    headers = auth_headers(config.api_key)
    pool = config.concurrency or max(config.num_requests, config.warmup)
    limits = httpx.Limits(max_connections=pool, max_keepalive_connections=pool)
    # httpx's timeouts bound each connect/read/write; stream_request bounds the request as a whole.
    # trust_env=False: a benchmark must hit the server itself, not a proxy from the environment.
    async with httpx.AsyncClient(http1=True, http2=False, limits=limits, timeout=httpx.Timeout(config.timeout),
                                 trust_env=False) as client:
        model = config.model or await fetch_model(client, config.url, config.api_key)

        async def send(item: WorkloadItem, origin: float) -> RequestResult:
            return await stream_request(client, url, request_body(config, model, item), headers=headers,
                                        timeout=config.timeout, prompt_len=item.prompt_len, index=item.index,
                                        origin=origin)

        warmup_results: list[RequestResult] = []
        if warmup_items:
            warmup_results, _, _ = await run_phase(
                warmup_items, send, concurrency=config.concurrency, paced=False,
                progress=Progress("warmup", len(warmup_items), progress))
        results, duration, most = await run_phase(
            items, send, concurrency=config.concurrency, paced=True,
            progress=Progress("bench serve", len(items), progress))
    return LoadResult(results=results, duration=duration, config=config, model=model,
                      warmup_results=warmup_results, max_in_flight=most)


def run_load_sync(config: LoadConfig, *, tokenizer: Any = None, progress: bool = False) -> LoadResult:
    """run_load in a fresh event loop; call it from code that is not already inside one."""
    return asyncio.run(run_load(config, tokenizer=tokenizer, progress=progress))
