"""One streaming request to an OpenAI-compatible server, timed chunk by chunk.

Timing rules (seconds, from `time.perf_counter`, stamped when a network read returns):
- TTFT: send -> the first chunk that carries content (a non-empty text delta, or token ids).
- ITL: one entry per output token after the first. A chunk that says how many tokens it carries
  (`token_ids`, or `logprobs` entries) and arrives a gap g after the previous content chunk gives
  k entries of g/k: the gap is split evenly, since we cannot see when each token was made. Extra
  tokens in the first content chunk arrived together with the first token and get entries of 0.
  A chunk that does not say is counted as one token. If the final `usage` then reports more tokens
  than the chunks revealed (a server that batches tokens silently), the ITLs stay per chunk; TPOT,
  which divides by the usage count, is the per-token figure to read in that case.
- E2E: send -> `data: [DONE]`, or the end of the body for servers that never send it.
- Output tokens: `usage.completion_tokens` from the last usage seen, else the tokens counted above.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from pdserve.bench.sse import SSEDecoder, SSEEvent

# After [DONE] the body should end at once; reading it to the end keeps the connection reusable,
# but a server that holds it open must not turn a complete request into a timeout.
DRAIN_AFTER_DONE_S = 1.0
MAX_ERROR_CHARS = 500


class StreamError(Exception):
    """The server answered with an error: an HTTP error status, or an error inside the stream."""


@dataclass
class RequestResult:
    ok: bool
    # From the server's usage when it reports one, else the workload's length for the prompt.
    prompt_tokens: int | None = None
    output_tokens: int = 0
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    e2e: float | None = None
    error: str | None = None
    index: int = -1
    # Send time, seconds after the start of the run (or of the warm-up).
    start: float = 0.0
    status: int | None = None
    content_chunks: int = 0
    usage_reported: bool = False
    finish_reason: str | None = None

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def error_message(body: bytes) -> str:
    """The human part of an error body: OpenAI's {"error": {"message"}}, FastAPI's {"detail"}, or text."""
    text = body.decode("utf-8", errors="replace").strip()
    try:
        doc = json.loads(text)
    except ValueError:
        return _clip(text) or "(empty body)"
    if isinstance(doc, dict):
        err = doc.get("error")
        if isinstance(err, dict) and err.get("message"):
            return _clip(str(err["message"]))
        if isinstance(err, str) and err:
            return _clip(err)
        detail = doc.get("detail")
        if isinstance(detail, list):
            parts = []
            for item in detail:
                if isinstance(item, dict):
                    loc = ".".join(str(p) for p in item.get("loc", []))
                    parts.append(f"{loc}: {item.get('msg', '')}" if loc else str(item.get("msg", item)))
                else:
                    parts.append(str(item))
            return _clip("; ".join(parts))
        if detail:
            return _clip(str(detail))
        if doc.get("message"):
            return _clip(str(doc["message"]))
    return _clip(text)


def chunk_tokens(chunk: dict[str, Any]) -> tuple[int, str | None]:
    """(output tokens carried by one completions or chat chunk, its finish_reason if any)."""
    tokens = 0
    finish_reason = None
    for choice in chunk.get("choices") or []:
        if not isinstance(choice, dict):
            continue
        finish_reason = choice.get("finish_reason") or finish_reason
        delta = choice.get("delta")
        if isinstance(delta, dict):  # chat; reasoning deltas are generated tokens too
            text = delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or ""
        else:
            text = choice.get("text") or ""
        token_ids = choice.get("token_ids")
        logprobs = choice.get("logprobs")
        if isinstance(token_ids, list) and token_ids:
            tokens += len(token_ids)
        elif isinstance(logprobs, dict) and isinstance(logprobs.get("tokens"), list) and logprobs["tokens"]:
            tokens += len(logprobs["tokens"])
        elif isinstance(logprobs, dict) and isinstance(logprobs.get("content"), list) and logprobs["content"]:
            tokens += len(logprobs["content"])
        elif text:
            tokens += 1
    return tokens, finish_reason


class _Timing:
    """Accumulates one request's timings as content arrives."""

    def __init__(self, result: RequestResult, sent: float) -> None:
        self.result = result
        self.sent = sent
        self.last: float | None = None
        self.counted = 0
        self.usage: dict[str, Any] | None = None
        self.done_at: float | None = None

    def content(self, now: float, tokens: int) -> None:
        r = self.result
        if self.last is None:
            r.ttft = now - self.sent
            r.itls.extend([0.0] * (tokens - 1))
        else:
            gap = now - self.last
            r.itls.extend([gap / tokens] * tokens)
        self.last = now
        self.counted += tokens
        r.content_chunks += 1

    def chunk(self, doc: dict[str, Any], now: float) -> None:
        if "error" in doc and doc["error"]:
            raise StreamError(f"error in stream: {error_message(json.dumps(doc).encode())}")
        tokens, finish_reason = chunk_tokens(doc)
        if tokens:
            self.content(now, tokens)
        if finish_reason:
            self.result.finish_reason = finish_reason
        if isinstance(doc.get("usage"), dict):
            self.usage = doc["usage"]

    def event(self, event: SSEEvent, now: float) -> bool:
        """Handle one SSE event; True once the stream says it is done."""
        data = event.data.strip()
        if data == "[DONE]":
            self.done_at = now
            return True
        if event.event == "error":
            raise StreamError(f"error in stream: {error_message(data.encode())}")
        try:
            doc = json.loads(data)
        except ValueError:
            raise StreamError(f"stream chunk is not JSON: {_clip(data, 120)}") from None
        if isinstance(doc, dict):
            self.chunk(doc, now)
        return False

    def finish(self, end: float) -> None:
        r = self.result
        r.e2e = end - self.sent
        r.output_tokens = self.counted
        if self.usage is not None:
            completion = self.usage.get("completion_tokens")
            prompt = self.usage.get("prompt_tokens")
            if isinstance(completion, int):
                r.output_tokens = completion
                r.usage_reported = True
            if isinstance(prompt, int):
                r.prompt_tokens = prompt
        if self.counted == 0 and self.usage is None and r.finish_reason is None:
            raise StreamError("stream ended without any output")
        r.ok = True


async def stream_request(client: httpx.AsyncClient, url: str, payload: dict[str, Any], *,
                         headers: dict[str, str] | None = None, timeout: float, prompt_len: int | None = None,
                         index: int = -1, origin: float | None = None) -> RequestResult:
    """POST `payload` to `url` and time the streamed answer. Never raises for what the server or the
    network does: errors and timeouts (the whole request, connection to last byte, is bounded by
    `timeout`) come back as a failed RequestResult."""
    for attempt in range(1 + STALE_CONNECTION_RETRIES):
        result = RequestResult(ok=False, index=index, prompt_tokens=prompt_len)
        sent = time.perf_counter()
        result.start = sent - (origin if origin is not None else sent)
        try:
            return await _attempt(client, url, payload, headers, timeout, result, sent)
        except httpx.RemoteProtocolError as exc:
            # No response at all: the pooled connection was closed by the server as the request went
            # out (llama-server ends keep-alive connections after a few requests). The server never
            # saw this request, so it goes again, on a fresh connection.
            result.error = _http_error(exc)
    return result


def _http_error(exc: httpx.HTTPError) -> str:
    return f"{type(exc).__name__}: {_clip(str(exc)) or 'connection failed'}"


# How often a request whose pooled connection turned out closed (no response at all) is sent again.
STALE_CONNECTION_RETRIES = 2


async def _attempt(client: httpx.AsyncClient, url: str, payload: dict[str, Any], headers: dict[str, str] | None,
                   timeout: float, result: RequestResult, sent: float) -> RequestResult:
    """One try of stream_request; raises only httpx.RemoteProtocolError before any response."""
    timing = _Timing(result, sent)
    try:
        await asyncio.wait_for(_exchange(client, url, payload, headers, timing), timeout)
    except (asyncio.TimeoutError, httpx.TimeoutException):
        # A complete answer whose connection was still draining when time ran out stays a success.
        if not result.ok:
            result.error = f"timed out after {timeout:g} s"
    except StreamError as exc:
        result.error = str(exc)
    except httpx.HTTPError as exc:
        if isinstance(exc, httpx.RemoteProtocolError) and result.status is None:
            raise  # no response at all: stream_request sends it again
        result.error = _http_error(exc)
    except (OSError, ValueError, RuntimeError) as exc:
        # Whatever else one odd exchange throws (a socket error httpx did not wrap, a body it could
        # not decode) fails that request, not the run.
        result.error = f"{type(exc).__name__}: {_clip(str(exc))}"
    if result.error is not None:
        result.ok = False
    return result


async def _exchange(client: httpx.AsyncClient, url: str, payload: dict[str, Any], headers: dict[str, str] | None,
                    timing: _Timing) -> None:
    async with client.stream("POST", url, json=payload, headers=headers) as response:
        timing.result.status = response.status_code
        if response.status_code >= 400:
            body = await response.aread()
            raise StreamError(f"HTTP {response.status_code}: {error_message(body)}")
        content_type = response.headers.get("content-type", "")
        if "event-stream" not in content_type and "json" in content_type:
            # The server ignored stream=true: the whole answer is one chunk.
            body = await response.aread()
            now = time.perf_counter()
            try:
                doc = json.loads(body)
            except ValueError:
                raise StreamError(f"response is not JSON: {_clip(body.decode(errors='replace'), 120)}") from None
            _whole_answer(doc, now, timing)
            timing.finish(now)
            return
        decoder = SSEDecoder()
        reads = response.aiter_bytes()
        done = False
        now = time.perf_counter()
        async for raw in reads:
            now = time.perf_counter()
            for event in decoder.feed(raw):
                if timing.event(event, now):
                    done = True
                    break
            if done:
                break
        if not done:
            # Whatever close() releases arrived with the last read; the stream ends at EOF.
            for event in decoder.close():
                if timing.event(event, now):
                    break
            timing.finish(timing.done_at if timing.done_at is not None else time.perf_counter())
            return
        timing.finish(timing.done_at if timing.done_at is not None else time.perf_counter())
        try:
            await asyncio.wait_for(_drain(reads), DRAIN_AFTER_DONE_S)
        except (asyncio.TimeoutError, httpx.HTTPError):
            pass  # the answer is complete; this connection just won't be reused


async def _drain(reads: Any) -> None:
    async for _ in reads:
        pass


def _whole_answer(doc: Any, now: float, timing: _Timing) -> None:
    if not isinstance(doc, dict):
        raise StreamError("response is not a JSON object")
    if doc.get("error"):
        raise StreamError(error_message(json.dumps(doc).encode()))
    for choice in doc.get("choices") or []:
        if not isinstance(choice, dict):
            continue
        message = choice.get("message")
        text = message.get("content") if isinstance(message, dict) else choice.get("text")
        if text:
            timing.content(now, 1)
        timing.result.finish_reason = choice.get("finish_reason") or timing.result.finish_reason
    if isinstance(doc.get("usage"), dict):
        timing.usage = doc["usage"]


def _clip(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
