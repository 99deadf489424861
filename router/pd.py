"""One request through the router (DESIGN §4): prefill leg, decode leg, streamed back.

1. Long enough prompts (`pd_min_prompt_tokens`) with a prefill pool go to a prefill engine first,
   with max_tokens=1, stream=false, n=1 and kv_transfer_params={"do_remote_decode": true}.
2. The original body plus the `kv_transfer_params` of that answer go to a decode engine, whose
   answer is passed back as it arrives.
Faults: a prefill that fails, is refused or times out leaves the decode engine to compute the
prompt itself; a decode engine failing before its first byte gets one retry elsewhere; after the
first byte a failure becomes an SSE error event then `[DONE]`. Connection refusals eject the
endpoint at once (the health checker re-admits it).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, AsyncIterator, Awaitable, Callable

import anyio
import httpx
from fastapi.responses import Response, StreamingResponse

from pdserve.engine.server.errors import APIError
from pdserve.router import metrics as m
from pdserve.router.balancer import Candidate, Policy
from pdserve.router.endpoints import Endpoint, Health, Pool, Pools, error_text
from pdserve.router.feed import FeedState
from pdserve.router.metrics import RouterMetrics
from pdserve.router.prefix import prompt_block_hashes

log = logging.getLogger("pdserve.router")

STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# Fields the prefill leg must not carry: it produces one token, once, and no extras.
PREFILL_DROPPED = ("stream_options", "best_of", "logprobs", "top_logprobs", "echo", "min_tokens", "suffix")


@dataclass
class FlowSettings:
    pd_min_prompt_tokens: int = 256
    connect_timeout: float = 2.0
    prefill_timeout: float = 60.0
    request_timeout: float = 600.0


@dataclass
class RoutedRequest:
    route: str                         # "completions" or "chat"
    body: dict[str, Any]               # the client's body, as it goes to the decode engine
    headers: dict[str, str]            # forwarded to both legs
    stream: bool = False
    prompt_tokens: int | None = None   # exact with a tokenizer, else an estimate
    token_ids: list[int] | None = None  # for prefix-aware picks
    single_prompt: bool = True         # a batch of prompts is never disaggregated
    _hashes: dict[int, list[bytes]] = field(default_factory=dict)

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.route == "chat" else "/v1/completions"

    def block_hashes(self, block_size: int) -> list[bytes]:
        if self.token_ids is None:
            return []
        if block_size not in self._hashes:
            self._hashes[block_size] = prompt_block_hashes(self.token_ids, block_size)
        return self._hashes[block_size]


class LegFailed(Exception):
    """A leg that failed before sending the client anything: safe to fall back or retry."""


def prefill_body(request: RoutedRequest) -> dict[str, Any]:
    body = {k: v for k, v in request.body.items() if k not in PREFILL_DROPPED}
    body.update(max_tokens=1, stream=False, n=1, kv_transfer_params={"do_remote_decode": True})
    if request.route == "chat":
        body["max_completion_tokens"] = 1
    return body


def sse_error(message: str, status: int = 503) -> bytes:
    payload = {"error": {"message": message, "type": "ServiceUnavailableError", "param": None, "code": status}}
    return f"data: {json.dumps(payload)}\n\ndata: [DONE]\n\n".encode()


class Leg:
    """Book-keeping of one request on one endpoint: in-flight count, gauge, leg time."""

    def __init__(self, flow: "PDFlow", endpoint: Endpoint, leg: str) -> None:
        self.flow, self.endpoint, self.leg = flow, endpoint, leg
        self.started = time.perf_counter()
        self.open = True
        endpoint.in_flight += 1
        flow.metrics.in_flight.labels(endpoint.pool, endpoint.url).inc()
        flow.metrics.picks.labels(endpoint.pool, endpoint.url).inc()

    def finish(self) -> None:
        if not self.open:
            return
        self.open = False
        self.endpoint.in_flight -= 1
        metrics = self.flow.metrics
        if self.endpoint.url in self.flow.pool(self.endpoint.pool).endpoints:
            metrics.in_flight.labels(self.endpoint.pool, self.endpoint.url).dec()
        metrics.leg_seconds.labels(self.leg).observe(time.perf_counter() - self.started)


class PDFlow:
    def __init__(self, pools: Pools, health: Health, client: httpx.AsyncClient, metrics: RouterMetrics,
                 settings: FlowSettings, feed: FeedState | None = None) -> None:
        self.pools = pools
        self.health = health
        self.client = client
        self.metrics = metrics
        self.settings = settings
        self.feed = feed

    def pool(self, name: str) -> Pool:
        return self.pools.prefill if name == self.pools.prefill.name else self.pools.decode

    # -- picking ---------------------------------------------------------------------------------

    def describe(self, endpoint: Endpoint, request: RoutedRequest | None, pool: Pool) -> Candidate:
        report = self.feed.report(endpoint.address) if self.feed is not None else None
        cached = 0
        if (report is not None and request is not None and report.block_size
                and pool.balancer.policy is Policy.PREFIX_AWARE):
            cached = self.feed.blocks.matches(report.engine_id, request.block_hashes(report.block_size))  # type: ignore[union-attr]
        return Candidate(endpoint.address, endpoint.in_flight, report.load if report is not None else None, cached)

    def pick(self, pool: Pool, request: RoutedRequest | None, exclude: tuple[str, ...] = ()) -> Endpoint | None:
        candidates = pool.healthy(exclude)
        if not candidates:
            return None
        return pool.pick(candidates, lambda e: self.describe(e, request, pool))

    def refused(self, endpoint: Endpoint, exc: Exception) -> None:
        if isinstance(exc, httpx.ConnectError):
            self.health.set(endpoint, False, f"connection failed: {error_text(exc)}")

    def timeout(self, total: float) -> httpx.Timeout:
        return httpx.Timeout(total, connect=self.settings.connect_timeout)

    # -- the request -----------------------------------------------------------------------------

    def wants_prefill(self, request: RoutedRequest) -> bool:
        if len(self.pools.prefill) == 0 or not request.single_prompt:
            return False
        tokens = request.prompt_tokens
        return self.settings.pd_min_prompt_tokens <= 0 or (tokens is not None
                                                            and tokens >= self.settings.pd_min_prompt_tokens)

    async def serve(self, request: RoutedRequest) -> Response:
        request.body.pop("kv_transfer_params", None)  # only the router sets these
        kv_params: dict[str, Any] | None = None
        if self.wants_prefill(request):
            try:
                outcome = await self.prefill(request)
            except LegFailed as exc:
                log.warning("prefill failed, the decode engine computes the prompt: %s", exc)
                self.metrics.pd_decisions.labels(m.PREFILL_FAILED).inc()
            else:
                if isinstance(outcome, Response):
                    return outcome  # the engine refused the request itself (4xx): the client's answer
                kv_params = outcome
                self.metrics.pd_decisions.labels(m.DISAGGREGATED).inc()
        else:
            self.metrics.pd_decisions.labels(m.LOCAL_ONLY).inc()
        return await self.decode(request, kv_params)

    async def prefill(self, request: RoutedRequest) -> dict[str, Any] | None | Response:
        endpoint = self.pick(self.pools.prefill, request)
        if endpoint is None:
            raise LegFailed("no healthy engine in the prefill pool")
        leg = Leg(self, endpoint, "prefill")
        try:
            response = await self.client.post(f"{endpoint.url}{request.path}", json=prefill_body(request),
                                              headers=request.headers,
                                              timeout=self.timeout(self.settings.prefill_timeout))
        except httpx.HTTPError as exc:
            self.refused(endpoint, exc)
            raise LegFailed(f"{endpoint.url}: {error_text(exc)}") from None
        finally:
            leg.finish()
        if response.status_code in (401, 403):
            # The engine refuses the router, not the request (a missing or rotated internal key):
            # the client is still served, by a decode engine alone.
            raise LegFailed(f"{endpoint.url} refused the router ({response.status_code}): is the internal key "
                            f"the same on both?")
        if 400 <= response.status_code < 500:
            self.metrics.errors.labels("upstream_4xx").inc()
            return passthrough(response.status_code, response.content, response.headers)
        if response.status_code != 200:
            raise LegFailed(f"{endpoint.url} answered {response.status_code}: {response.text[:200]}")
        try:
            answer = response.json()
        except ValueError:
            raise LegFailed(f"{endpoint.url} answered with invalid JSON") from None
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        return params if isinstance(params, dict) else None

    async def decode(self, request: RoutedRequest, kv_params: dict[str, Any] | None) -> Response:
        body = dict(request.body, kv_transfer_params=kv_params) if kv_params else request.body
        payload = json.dumps(body).encode()
        headers = dict(request.headers, **{"content-type": "application/json"})
        tried: list[str] = []
        failure = "no healthy engine in the decode pool"
        for attempt in range(2):
            endpoint = self.pick(self.pools.decode, None if kv_params else request, tuple(tried))
            if endpoint is None:
                break
            if attempt:
                self.metrics.retries.labels("decode").inc()
            tried.append(endpoint.url)
            try:
                return await self.open_decode(endpoint, request, payload, headers)
            except LegFailed as exc:
                failure = str(exc)
                log.warning("decode leg failed before its first byte%s: %s",
                            "" if attempt else ", retrying on another engine", exc)
        self.metrics.errors.labels("no_engine" if not tried else "decode_failed").inc()
        status = 503 if not tried else 502
        raise APIError(status, f"No decode engine could serve the request: {failure}.",
                       code="no_engines" if not tried else "upstream_failed")

    async def open_decode(self, endpoint: Endpoint, request: RoutedRequest, payload: bytes,
                          headers: dict[str, str]) -> Response:
        leg = Leg(self, endpoint, "decode")
        upstream: httpx.Response | None = None
        streaming = False  # once True, relay() owns the upstream response and the leg
        try:
            upstream = await self.client.send(
                self.client.build_request("POST", f"{endpoint.url}{request.path}", content=payload, headers=headers,
                                          timeout=self.timeout(self.settings.request_timeout)),
                stream=True)
            if upstream.status_code >= 500:
                text = (await upstream.aread())[:200].decode(errors="replace")
                raise LegFailed(f"{endpoint.url} answered {upstream.status_code}: {text}")
            if upstream.status_code != 200 or not request.stream:
                content = await upstream.aread()
                if upstream.status_code != 200:
                    self.metrics.errors.labels("upstream_4xx").inc()
                return passthrough(upstream.status_code, content, upstream.headers)
            # Wait for the first chunk before answering: until then a failure can still be retried.
            chunks = upstream.aiter_raw()
            first = await anext(chunks, b"")
            streaming = True
            return RelayResponse(self.relay(first, chunks, upstream, leg), release=partial(release, upstream, leg),
                                 media_type=upstream.headers.get("content-type", "text/event-stream"),
                                 headers=STREAM_HEADERS)
        except httpx.HTTPError as exc:
            self.refused(endpoint, exc)
            raise LegFailed(f"{endpoint.url}: {error_text(exc)}") from None
        finally:
            if not streaming:
                await release(upstream, leg)

    async def relay(self, first: bytes, chunks: AsyncIterator[bytes], upstream: httpx.Response,
                    leg: Leg) -> AsyncIterator[bytes]:
        """The decode engine's stream, chunk by chunk as it arrives; a failure becomes an SSE error."""
        last = first
        try:
            if first:
                yield first
            async for chunk in chunks:
                if chunk:
                    last = chunk
                    yield chunk
        except httpx.HTTPError as exc:
            self.metrics.errors.labels("mid_stream").inc()
            log.warning("decode stream from %s broke: %s", leg.endpoint.url, error_text(exc))
            # Close a half-sent event first, so the error is an event of its own.
            yield (b"" if not last or last.endswith(b"\n\n") else b"\n\n") + sse_error(
                f"The decode engine failed mid-stream: {error_text(exc)}")
        finally:
            with anyio.CancelScope(shield=True):
                await release(upstream, leg)


class RelayResponse(StreamingResponse):
    """A StreamingResponse that releases the upstream leg even if its body is never iterated
    (the client gone before the first send): the generator's own `finally` never runs then."""

    def __init__(self, content: AsyncIterator[bytes], release: Callable[[], Awaitable[None]], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.release = release

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.release()


async def release(upstream: httpx.Response | None, leg: Leg) -> None:
    """Close the engine's response (the engine then aborts the request) and end the leg; idempotent."""
    leg.finish()
    await close_quietly(upstream)


def passthrough(status: int, content: bytes, headers: httpx.Headers) -> Response:
    return Response(content=content, status_code=status, media_type=headers.get("content-type", "application/json"))


async def close_quietly(response: httpx.Response | None) -> None:
    if response is None:
        return
    try:
        await response.aclose()
    except Exception:  # closing a broken connection can fail again; nothing is left to do
        pass
