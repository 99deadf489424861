"""One request through the router (DESIGN §4): prefill leg, decode leg, streamed back.

1. Long enough prompts (`pd_min_prompt_tokens`) with a prefill pool go to a prefill engine first,
   with max_tokens=1, stream=false, n=1 and kv_transfer_params={"do_remote_decode": true}.
2. The original body plus the `kv_transfer_params` of that answer go to a decode engine, whose
   answer is passed back as it arrives.
Requests with n>1 (or best_of>1) skip step 1: the decode engine computes such prompts itself. So do
completions that ask for the prompt's own logprobs (echo + logprobs, or prompt_logprobs): only an
engine that runs the prompt through the model has them, and a decode engine that pulled the KV did not.

Structured outputs and tools are disaggregated. The prefill leg keeps every field that shapes the
prompt (messages, tools, tool_choice, chat_template_kwargs, add_generation_prompt, ...), so both
engines render the same prompt ids, and the constraint fields too (response_format, structured_outputs,
guided_*): the prefill engine then refuses an invalid schema with the 400 the client gets, before any
decode leg runs, and compiles no grammar for its one discarded token (a do_remote_decode request is
never constrained); the decode engine constrains from the first token.

Faults (every wait is bounded, and cut at once when its endpoint is ejected, see legs.py): a
prefill that fails, is refused or times out leaves the decode engine to compute the prompt
itself; a decode engine failing before its first byte gets one retry elsewhere; a prefill hold
that no decode leg will pull (it failed, was refused, the client left) is released at once
(release.py). A streamed single-choice answer that breaks after its first byte (the engine died,
went silent, was ejected) continues on another decode engine (migration.py); other streams, one
out of migrations, or one under a constraint or with tools (a continuation would lose them), end
with an SSE error event then `[DONE]`. Connection refusals eject the endpoint at once (the health
checker re-admits it); engines the coordinator marks stale take no new work while a fresh one is
left.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx
from fastapi.responses import Response

from pdserve.engine.server.errors import APIError, error_response
from pdserve.router import metrics as m
from pdserve.router.balancer import Candidate
from pdserve.router.endpoints import Endpoint, Health, Pool, Pools, error_text
from pdserve.router.feed import FeedState
from pdserve.router.legs import LegFailed, LegOverloaded, Legs
from pdserve.router.metrics import RouterMetrics
from pdserve.router.migration import StreamState, single_choice_stream
from pdserve.router.picking import FeedPicker
from pdserve.router.prefix import prompt_block_hashes
from pdserve.router.relay import DecodeStream, RelayResponse, Upstream, close_leg
from pdserve.router.release import HoldReleaser

log = logging.getLogger("pdserve.router")

STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# Fields the prefill leg must not carry: it produces one token, once, and no extras. Nothing that
# shapes the prompt's ids may be here (see the module's docstring).
PREFILL_DROPPED = ("stream_options", "best_of", "logprobs", "top_logprobs", "echo", "min_tokens", "suffix")


@dataclass
class FlowSettings:
    """Time bounds in seconds; the defaults and how they were chosen: `pdserve router --help`."""

    pd_min_prompt_tokens: int = 256
    # Disaggregate only while every decode engine has requests of this router in flight: an idle
    # one computes the prompt itself (engines sharing cores gain nothing from the hop then).
    pd_only_when_busy: bool = False
    connect_timeout: float = 2.0
    prefill_timeout: float = 60.0             # a prefill leg's answer (max_tokens=1)
    decode_first_byte_timeout: float = 120.0  # a streamed decode leg's first output
    decode_idle_timeout: float = 60.0         # silence between two chunks of a streamed decode leg
    request_timeout: float = 600.0            # a non-streamed decode leg's whole answer
    max_connections_per_endpoint: int = 256   # legs in flight to one engine server
    migration_limit: int = 1                  # continuations of one broken stream
    release_timeout: float = 2.0              # a prefill hold release's answer


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


@dataclass(frozen=True)
class Hold:
    """Prefill KV held for a decode leg: the prefill endpoint and the params it answered."""

    endpoint: Endpoint
    params: dict[str, Any]


def multi_choice(body: dict[str, Any]) -> bool:
    """n>1 or best_of>1: the decode engine ignores kv_transfer_params for these."""
    return any(isinstance(body.get(name), int) and body[name] > 1 for name in ("n", "best_of"))


def prompt_logprobs(route: str, body: dict[str, Any]) -> bool:
    """The prompt's own logprobs are asked for: vLLM's prompt_logprobs, or a completion's echo with
    logprobs (OpenAI's legacy API, and lm-evaluation-harness's loglikelihood requests)."""
    if body.get("prompt_logprobs") is not None:
        return True
    return route == "completions" and bool(body.get("echo")) and body.get("logprobs") is not None


def prefill_body(request: RoutedRequest) -> dict[str, Any]:
    body = {k: v for k, v in request.body.items() if k not in PREFILL_DROPPED}
    body.update(max_tokens=1, stream=False, n=1, kv_transfer_params={"do_remote_decode": True})
    if request.route == "chat":
        body["max_completion_tokens"] = 1
    return body


class PDFlow:
    def __init__(self, pools: Pools, health: Health, client: httpx.AsyncClient, metrics: RouterMetrics,
                 settings: FlowSettings, feed: FeedState | None = None) -> None:
        self.pools = pools
        self.health = health
        self.client = client
        self.metrics = metrics
        self.settings = settings
        self.feed = feed
        self.picker = FeedPicker(feed)
        self.legs = Legs(metrics, settings.max_connections_per_endpoint,
                         known=lambda e: e.url in self.pool(e.pool).endpoints)
        self.releaser = HoldReleaser(client, metrics, settings.release_timeout, settings.connect_timeout)
        health.on_eject(self.legs.cut)

    def pool(self, name: str) -> Pool:
        return self.pools.prefill if name == self.pools.prefill.name else self.pools.decode

    # -- picking ---------------------------------------------------------------------------------

    # The rules live in picking.py, shared with the endpoint picker (`pdserve epp`).

    def describe(self, endpoint: Endpoint, request: RoutedRequest | None, pool: Pool) -> Candidate:
        return self.picker.describe(endpoint, request, pool)

    def pick(self, pool: Pool, request: RoutedRequest | None, exclude: tuple[str, ...] = ()) -> Endpoint | None:
        # Pods whose ranks the feed lists are offered rank by rank (`exclude` lists pod URLs).
        return self.picker.pick(pool, request, exclude)

    def stale(self, endpoint: Endpoint, pool: Pool) -> bool:
        return self.picker.stale(endpoint, pool)

    def refused(self, endpoint: Endpoint, exc: Exception) -> None:
        if isinstance(exc, httpx.ConnectError):
            self.health.set(endpoint, False, f"connection failed: {error_text(exc)}")

    def timeout(self, total: float | None) -> httpx.Timeout:
        # The legs' own bounds (Leg.within) are the real ones; httpx's only bound the connect.
        return httpx.Timeout(total, connect=self.settings.connect_timeout)

    # -- the request -----------------------------------------------------------------------------

    def wants_prefill(self, request: RoutedRequest) -> bool:
        if len(self.pools.prefill) == 0 or not request.single_prompt:
            return False
        tokens = request.prompt_tokens
        return self.settings.pd_min_prompt_tokens <= 0 or (tokens is not None
                                                            and tokens >= self.settings.pd_min_prompt_tokens)

    def idle_decode(self) -> Endpoint | None:
        """A decode engine this router has nothing in flight on, if any. Only this router's own
        requests count (the feed's counts lag by a report): exact where the router is the engines'
        only client, as in `pdserve up`."""
        return next((e for e in self.picker.candidates(self.pools.decode) if e.in_flight == 0), None)

    async def serve(self, request: RoutedRequest) -> Response:
        request.body.pop("kv_transfer_params", None)  # only the router sets these
        hold: Hold | None = None
        if not self.wants_prefill(request):
            self.metrics.pd_decisions.labels(m.LOCAL_ONLY).inc()
        elif multi_choice(request.body):
            # Never disaggregate what will not be pulled: the blocks would sit held until they expire.
            self.metrics.pd_decisions.labels(m.LOCAL_MULTI_CHOICE).inc()
        elif prompt_logprobs(request.route, request.body):
            self.metrics.pd_decisions.labels(m.LOCAL_PROMPT_LOGPROBS).inc()
        elif self.settings.pd_only_when_busy and (idle := self.idle_decode()) is not None:
            self.metrics.pd_decisions.labels(m.LOCAL_DECODE_IDLE).inc()
            return await self.decode(request, None, first=idle)
        else:
            try:
                outcome = await self.prefill(request)
            except LegFailed as exc:
                log.warning("prefill failed, the decode engine computes the prompt: %s", exc)
                self.metrics.pd_decisions.labels(m.PREFILL_FAILED).inc()
            else:
                if isinstance(outcome, Response):
                    return outcome  # the engine refused the request itself (4xx): the client's answer
                hold = outcome
                self.metrics.pd_decisions.labels(m.DISAGGREGATED).inc()
        return await self.decode(request, hold)

    async def prefill(self, request: RoutedRequest) -> Hold | None | Response:
        endpoint = self.pick(self.pools.prefill, request)
        if endpoint is None:
            raise LegFailed("no healthy engine in the prefill pool")
        leg = self.legs.open(endpoint, "prefill")

        async def answer() -> httpx.Response:
            await leg.take_slot()
            return await self.client.post(f"{endpoint.url}{request.path}", json=prefill_body(request),
                                          headers=dict(request.headers, **endpoint.extra_headers),
                                          timeout=self.timeout(self.settings.prefill_timeout))

        try:
            response = await leg.within(self.settings.prefill_timeout, answer(), "prefill answer")
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
            answer_body = response.json()
        except ValueError:
            raise LegFailed(f"{endpoint.url} answered with invalid JSON") from None
        params = answer_body.get("kv_transfer_params") if isinstance(answer_body, dict) else None
        return Hold(endpoint, params) if isinstance(params, dict) else None

    def release(self, hold: Hold | None, request: RoutedRequest, why: str) -> None:
        if hold is not None:
            self.releaser.release(hold.endpoint, hold.params, request.headers, why)

    async def decode(self, request: RoutedRequest, hold: Hold | None, first: Endpoint | None = None) -> Response:
        state = (StreamState.for_request(request.route, request.body) if self.settings.migration_limit > 0
                 and single_choice_stream(request.body, request.stream, request.single_prompt) else None)
        body = dict(request.body, kv_transfer_params=hold.params) if hold is not None else request.body
        if state is not None:
            body = state.decode_body(body)
        payload = json.dumps(body).encode()
        headers = dict(request.headers, **{"content-type": "application/json"})
        tried: list[str] = []
        failure = "no healthy engine in the decode pool"
        taken = False  # the decode leg took the prefill hold over (pulled it, or owns its release)
        overloaded: list[LegOverloaded] = []
        try:
            for attempt in range(2):
                endpoint = first if not attempt and first is not None else \
                    self.pick(self.pools.decode, None if hold is not None else request, tuple(tried))
                if endpoint is None:
                    break
                if attempt:
                    self.metrics.retries.labels("decode").inc()
                tried.append(endpoint.url)
                try:
                    opened = await self.open_decode(endpoint, request.path, payload, headers, request.stream)
                except LegFailed as exc:
                    failure = str(exc)
                    if isinstance(exc, LegOverloaded):
                        overloaded.append(exc)
                    log.warning("decode leg failed before its first byte%s: %s",
                                "" if attempt else ", retrying on another engine", exc)
                    continue
                if isinstance(opened, Response):
                    taken = opened.status_code == 200
                    return opened
                stream = DecodeStream(self, request, state, opened, tried, headers, hold)
                taken = True
                return RelayResponse(stream.events(), release=stream.close,
                                     media_type=opened.response.headers.get("content-type", "text/event-stream"),
                                     headers=STREAM_HEADERS)
            if tried and len(overloaded) == len(tried):
                # Every engine tried is up and full: the client should come back later (503 and the
                # engines' Retry-After, as from one engine), not take it for a failure (502).
                self.metrics.errors.labels("overloaded").inc()
                response = error_response(503, f"Every decode engine tried is at its limit of waiting requests; "
                                               f"retry later. Last: {failure}.", code="engine_overloaded")
                response.headers["Retry-After"] = max((o.retry_after for o in overloaded), key=_seconds)
                return response
            self.metrics.errors.labels("no_engine" if not tried else "decode_failed").inc()
            status = 503 if not tried else 502
            raise APIError(status, f"No decode engine could serve the request: {failure}.",
                           code="no_engines" if not tried else "upstream_failed")
        finally:
            # Failed, refused (4xx) or cancelled (the client left) before any decode leg took the
            # prefill's blocks: nobody will pull them.
            if not taken:
                self.release(hold, request, "the decode leg did not take it")

    async def open_decode(self, endpoint: Endpoint, path: str, payload: bytes, headers: dict[str, str],
                          stream: bool) -> Response | Upstream:
        """A decode leg up to its first byte (streamed) or its whole answer; raises LegFailed when
        another engine may still serve the request (no byte reached the client)."""
        leg = self.legs.open(endpoint, "decode")
        opened: list[httpx.Response] = []  # the engine's response once there: closed unless handed on
        kept = False

        async def first_answer() -> Response | Upstream:
            await leg.take_slot()
            response = await self.client.send(
                self.client.build_request("POST", f"{endpoint.url}{path}", content=payload,
                                          headers=dict(headers, **endpoint.extra_headers), timeout=self.timeout(None)),
                stream=True)
            opened.append(response)
            if response.status_code >= 500:
                text = (await response.aread())[:200].decode(errors="replace")
                failed = f"{endpoint.url} answered {response.status_code}: {text}"
                retry_after = response.headers.get("retry-after")
                if response.status_code == 503 and retry_after is not None:
                    raise LegOverloaded(failed, retry_after)
                raise LegFailed(failed)
            if response.status_code != 200 or not stream:
                return passthrough(response.status_code, await response.aread(), response.headers)
            # Wait for the first chunk before answering: until then a failure can still be retried.
            chunks = response.aiter_raw()
            return Upstream(leg, response, chunks, await anext(chunks, b""))

        try:
            if stream:
                outcome = await leg.within(self.settings.decode_first_byte_timeout, first_answer(), "first byte")
            else:
                outcome = await leg.within(self.settings.request_timeout, first_answer(), "answer")
            if isinstance(outcome, Upstream):
                kept = True
            elif outcome.status_code != 200:
                self.metrics.errors.labels("upstream_4xx").inc()
            return outcome
        except httpx.HTTPError as exc:
            self.refused(endpoint, exc)
            raise LegFailed(f"{endpoint.url}: {error_text(exc)}") from None
        finally:
            if not kept:
                with anyio.CancelScope(shield=True):
                    await close_leg(opened[0] if opened else None, leg)


def _seconds(retry_after: str) -> float:
    try:
        return float(retry_after)
    except ValueError:  # an HTTP date: as good as any
        return 0.0


def passthrough(status: int, content: bytes, headers: httpx.Headers) -> Response:
    return Response(content=content, status_code=status, media_type=headers.get("content-type", "application/json"))
