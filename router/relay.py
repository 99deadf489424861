"""The client's stream of a decode leg: its events passed on as they arrive, and continued on
another decode engine when the leg breaks after its first byte (see migration.py).

A break is a transport error, silence past --decode-idle-timeout, the endpoint's ejection, an end
without `[DONE]`, or the engine's own 5xx error event. A single-choice stream then goes on from
where it was (`migration_limit` times); any other stream, one out of migrations, or one whose
constraint or tools a continuation would lose (migration.resume_blocker), ends with an SSE error
event then `[DONE]`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable

import anyio
import httpx
from fastapi.responses import Response, StreamingResponse

from pdserve.router import metrics as m
from pdserve.router.endpoints import error_text
from pdserve.router.legs import Leg, LegFailed
from pdserve.router.migration import DONE, EventSplitter, StreamState, event_payload, server_error, sse

if TYPE_CHECKING:
    from pdserve.router.pd import Hold, PDFlow, RoutedRequest

log = logging.getLogger("pdserve.router")


def sse_error(message: str, status: int = 503) -> bytes:
    payload = {"error": {"message": message, "type": "ServiceUnavailableError", "param": None, "code": status}}
    return f"data: {json.dumps(payload)}\n\ndata: [DONE]\n\n".encode()


@dataclass
class Upstream:
    """A decode leg's streamed answer, open, its first chunk read."""

    leg: Leg
    response: httpx.Response
    chunks: AsyncIterator[bytes]
    first: bytes

    async def close(self) -> None:
        await close_leg(self.response, self.leg)


class StreamBroke(Exception):
    """The decode engine's stream ended early: a transport error, silence, ejection, or its own 5xx."""


class DecodeStream:
    """The client's stream: the decode leg's events, passed on as they arrive, and continued on
    another engine when that leg breaks (single-choice streams, `migration_limit` times)."""

    def __init__(self, flow: "PDFlow", request: "RoutedRequest", state: StreamState | None, upstream: Upstream,
                 tried: list[str], headers: dict[str, str], hold: "Hold | None") -> None:
        self.flow, self.request, self.state = flow, request, state
        self.upstream: Upstream | None = upstream
        self.tried = tried
        self.headers = headers
        self.hold = hold
        self.migrations = 0
        self.continuing = False  # the upstream is a continuation: its chunks are rewritten for the client
        self.done = False        # the upstream's [DONE] went out
        self.output_started = False  # an event past the chat role chunks went out
        self.closed = False

    @property
    def pulled(self) -> bool:
        """The decode engine used the prefill's blocks (it generated a token from them)."""
        return self.state is None or bool(self.state.generated)

    async def events(self) -> AsyncIterator[bytes]:
        try:
            while self.upstream is not None:
                try:
                    async for out in self.pump(self.upstream):
                        yield out
                    return
                except StreamBroke as exc:
                    broke = str(exc)
                await self.drop_upstream()
                self.flow.metrics.errors.labels("mid_stream").inc()
                log.warning("decode stream broke after its first byte: %s", broke)
                state = self.state
                if state is not None and (state.finished or state.remaining() == 0):
                    for event in state.closing():  # all output is out; only the stream's end is missing
                        yield event
                    return
                why = await self.resume()
                if why is not None:
                    self.flow.metrics.migrations.labels(m.NOT_RESUMED).inc()
                    yield sse_error(f"The decode engine failed mid-stream: {broke} ({why}).")
                    return
                self.flow.metrics.migrations.labels(m.RESUMED).inc()
        finally:
            with anyio.CancelScope(shield=True):
                await self.close()

    async def pump(self, upstream: Upstream) -> AsyncIterator[bytes]:
        """The upstream's events for the client; raises StreamBroke if it ends before [DONE]."""
        splitter = EventSplitter()
        chunk: bytes | None = upstream.first
        settings = self.flow.settings
        while True:
            for event in splitter.feed(chunk or b""):
                if self.done:
                    continue
                out = self.event(event)
                if out:
                    yield out
            # A chat stream opens with role chunks before the prompt is computed: until output
            # follows them, the wait is still for the first byte of the answer.
            idle = settings.decode_idle_timeout if self.output_started else settings.decode_first_byte_timeout
            try:
                chunk = await upstream.leg.within(idle, anext(upstream.chunks, None), "chunk")
            except (LegFailed, httpx.HTTPError) as exc:
                if self.done:
                    return  # all was said; only the connection's end went wrong
                raise StreamBroke(str(exc) if isinstance(exc, LegFailed) else
                                  f"{upstream.leg.endpoint.url}: {error_text(exc)}") from None
            if chunk is None:
                if self.done:
                    return
                raise StreamBroke(f"{upstream.leg.endpoint.url} ended its stream without [DONE]")

    def event(self, raw: bytes) -> bytes | None:
        """One upstream event as the client gets it (None: nothing); raises StreamBroke on the
        engine's own error event, which another engine may not have."""
        if not self.output_started and b'"role"' not in raw:
            self.output_started = True  # (quotes inside generated text are escaped: no false match)
        if self.state is None:
            if raw.strip() == b"data: " + DONE.encode():
                self.done = True
            return raw
        payload = event_payload(raw)
        if payload == DONE:
            self.done = True
            return raw
        if not isinstance(payload, dict):
            return None if self.continuing else raw
        if server_error(payload) and not self.state.finished:
            raise StreamBroke(f"{self.upstream.leg.endpoint.url if self.upstream else 'the engine'} sent an error: "
                              f"{payload['error'].get('message')}")
        if self.continuing:
            converted = self.state.convert(payload)
            return sse(converted) if converted is not None else None
        return sse(self.state.take(payload))

    async def resume(self) -> str | None:
        """Continue on another decode engine; None when it streams, else why it could not."""
        state = self.state
        if state is None:
            return "only single-choice streams are continued" if self.flow.settings.migration_limit else \
                "migration is off"
        if state.blocker is not None:
            return state.blocker
        if not state.resumable:
            return "the engine sent no token ids to continue from"
        if self.migrations >= self.flow.settings.migration_limit:
            return f"migration limit {self.flow.settings.migration_limit} reached"
        while self.migrations < self.flow.settings.migration_limit:
            self.migrations += 1
            endpoint = self.flow.pick(self.flow.pools.decode, None, tuple(self.tried))
            if endpoint is None:
                return "no other decode engine"
            self.tried.append(endpoint.url)
            payload = json.dumps(state.continuation_body()).encode()
            try:
                opened = await self.flow.open_decode(endpoint, "/v1/completions", payload, self.headers, True)
            except LegFailed as exc:
                log.warning("continuing the stream on %s failed: %s", endpoint.url, exc)
                continue
            if isinstance(opened, Response):
                return f"{endpoint.url} refused the continuation ({opened.status_code})"
            log.info("stream continued on %s after %d tokens", endpoint.url, len(state.generated))
            self.upstream, self.continuing, self.done = opened, True, False
            return None
        return f"migration limit {self.flow.settings.migration_limit} reached"

    async def drop_upstream(self) -> None:
        upstream, self.upstream = self.upstream, None
        if upstream is not None:
            await upstream.close()
        if self.hold is not None and not self.pulled:
            hold, self.hold = self.hold, None
            self.flow.release(hold, self.request, "the decode stream broke before its first token")

    async def close(self) -> None:
        """End the stream: close the engine's answer (the engine aborts the request), end the leg,
        and release the prefill hold if no token came from it; idempotent."""
        if self.closed:
            return
        self.closed = True
        await self.drop_upstream()


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


async def close_leg(upstream: httpx.Response | None, leg: Leg) -> None:
    """Close the engine's response (the engine then aborts the request) and end the leg; idempotent."""
    leg.finish()
    await close_quietly(upstream)


async def close_quietly(response: httpx.Response | None) -> None:
    if response is None:
        return
    try:
        await response.aclose()
    except Exception:  # closing a broken connection can fail again; nothing is left to do
        pass
