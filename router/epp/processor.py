"""The ext_proc service: one gRPC stream is one HTTP request passing through the gateway.

Two request body modes are understood, told apart by the `protocol_config` Envoy sends with the
first message (without one, BUFFERED is assumed). Response modes are SKIP/NONE.

BUFFERED (Envoy waits for each answer before sending the next message):
  request_headers  -> CONTINUE (client copies of the headers the picker owns removed), or, for a
                      request without a body (GET /v1/models), the placement at once;
  request_body     -> the placement: `x-gateway-destination-endpoint` and the `envoy.lb` metadata,
                      the body replaced where it must change (P/D, or client kv_transfer_params);
                      or an immediate OpenAI error (400, 404, 413, 429, 503, or the prefill
                      engine's own 4xx).
  The whole body comes in one message.

FULL_DUPLEX_STREAMED (the GIE reference gateways' mode; Envoy sends the body chunks without
waiting for the headers' answer, so a request costs the picker one round trip, not two):
  request_headers  -> nothing yet (the placement needs the body), or the placement at once for a
                      request without a body;
  request_body ... -> chunks collected (413 as soon as they pass the limit); after the last one
                      (or the trailers) two answers: the headers' (destination, mutations,
                      metadata) and the body's, which carries the whole body back as one streamed
                      chunk (in this mode Envoy forwards only what the picker sends back).
  request_trailers -> ends the body if it had not ended; answered with CONTINUE.

A body before headers is a protocol error in both. Once a request is placed or refused the picker
ends the stream with OK: Envoy then finishes the request without it (response phases, if a gateway
is configured to send them, are not sent; the picker would only have answered CONTINUE).

A stream never takes the server down: a protocol error ends it with INVALID_ARGUMENT, anything
unexpected with INTERNAL (logged with an id); both are counted. The picker keeps no per-request
counts that a vanished stream could leak: its load signal is the feed (state.py).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

import grpc
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from pdserve.engine.internal_auth import HEADER as INTERNAL_HEADER
from pdserve.engine.server.dp_rank import DP_RANK_HEADER
from pdserve.engine.server.errors import APIError, new_error_id
from pdserve.router.balancer import Policy
from pdserve.router.epp import messages
from pdserve.router.epp.metrics import EppMetrics
from pdserve.router.epp.prefill import PrefillLeg, Refusal, decode_body
from pdserve.router.epp.request import PromptReader, check_model, read_json, route_of
from pdserve.router.epp.settings import DESTINATION_HEADER, OBJECTIVE_HEADER, EppSettings
from pdserve.router.epp.state import PoolState
from pdserve.router.legs import LegFailed
from pdserve.router.pd import Hold, RoutedRequest, multi_choice, prompt_logprobs

log = logging.getLogger("pdserve.epp")

# Client copies of these never reach an engine: the destination is the picker's to choose, and
# the engines trust the other two only from the deployment itself.
OWNED_HEADERS = (DESTINATION_HEADER, INTERNAL_HEADER.lower(), DP_RANK_HEADER.lower())
RESPONSE_PHASES = ("response_headers", "response_body", "response_trailers")
FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED


class ProtocolError(Exception):
    """A message the ext_proc exchange does not allow here."""


@dataclass
class Exchange:
    """What one stream has seen of its HTTP request."""

    started: float = field(default_factory=time.perf_counter)
    duplex: bool = False                       # FULL_DUPLEX_STREAMED: answers wait for the whole body
    headers: dict[str, str] | None = None
    subset: list[str] | None = None
    placed: bool = False                       # answered with a pick or an immediate response
    chunks: list[bytes] = field(default_factory=list)
    size: int = 0
    hold: Hold | None = None                   # prefill KV waiting for the answer to be sent
    routed: RoutedRequest | None = None

    @property
    def path(self) -> str:
        return (self.headers or {}).get(":path", "")


class Processor(pb_grpc.ExternalProcessorServicer):
    def __init__(self, settings: EppSettings, state: PoolState, metrics: EppMetrics, reader: PromptReader,
                 prefill: PrefillLeg | None) -> None:
        self.settings = settings
        self.state = state
        self.metrics = metrics
        self.reader = reader
        self.prefill_leg = prefill
        # The prompt (parsed by the engines' request schema, tokenized) only matters to a prefill
        # leg and to the prefix bonus; without either, reading it would be the picker's largest
        # cost per request for nothing.
        self.reads_prompts = prefill is not None or settings.policy is Policy.PREFIX_AWARE
        # The pool serves one model: its labelled series, looked up once.
        model = settings.model
        self.served = metrics.requests.labels(model, model)
        self.duration = metrics.duration.labels(model, model)
        self.sizes = metrics.sizes.labels(model, model)

    async def Process(self, requests: AsyncIterator[pb.ProcessingRequest],  # noqa: N802 (gRPC's name)
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ProcessingResponse]:
        exchange = Exchange()
        try:
            async for message in requests:
                answers = await self.answer(exchange, message)
                # Handed to gRPC, the answers carry the hold to the decode leg. Envoy resets the
                # stream as soon as it has them, which can close this generator at a `yield` below
                # after they went out: releasing then would free the KV the decode engine is about
                # to pull.
                exchange.hold = None
                for answer in answers:
                    yield answer
                if exchange.placed:
                    # Placed or refused: nothing the gateway could still send needs the picker (its
                    # response phases would only get CONTINUE). Ending the stream now, with OK,
                    # tells Envoy to finish the request without it, and saves the picker about a
                    # tenth of its gRPC work per request (the stream's later close).
                    return
        except ProtocolError as exc:
            self.metrics.stream_errors.labels("protocol").inc()
            log.warning("ext_proc protocol error: %s", exc)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except grpc.aio.AbortError:
            raise
        except Exception:  # (cancellation is no Exception: a vanished client just ends the stream)
            error_id = new_error_id()
            log.exception("ext_proc stream failed (error id %s)", error_id)
            self.metrics.stream_errors.labels("internal").inc()
            await context.abort(grpc.StatusCode.INTERNAL, f"endpoint picker error (error id {error_id})")
        finally:
            if exchange.hold is not None and exchange.routed is not None and self.prefill_leg is not None:
                self.prefill_leg.release(exchange.hold, exchange.routed,
                                         "the ext_proc stream failed before its answer went out")

    # -- one message -----------------------------------------------------------------------------

    async def answer(self, exchange: Exchange, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        """The answers to one message: none while a duplex body is still arriving, two when it
        completes (headers, then body), else one."""
        phase = message.WhichOneof("request")
        if message.HasField("metadata_context"):
            subset = messages.subset_hint(message.metadata_context)
            if subset is not None:
                exchange.subset = subset
        if message.HasField("protocol_config"):
            exchange.duplex = message.protocol_config.request_body_mode == FULL_DUPLEX
        if phase is None:
            raise ProtocolError("a ProcessingRequest with no request phase set")
        if phase == "request_headers":
            if exchange.headers is not None:
                raise ProtocolError("request headers sent twice on one stream")
            exchange.headers = messages.header_map(message.request_headers.headers)
            if message.request_headers.end_of_stream:
                return [self.place_bodiless(exchange)]
            if exchange.duplex:
                return []  # answered with the body, once it has all arrived
            return [messages.continue_headers(remove=OWNED_HEADERS)]
        if phase == "request_body":
            if exchange.headers is None:
                raise ProtocolError("a request body before the request headers")
            body = message.request_body
            if not exchange.duplex:
                return await self.place(exchange, body.body)
            return await self.collect(exchange, body.body, body.end_of_stream)
        if phase == "request_trailers":
            answers: list[pb.ProcessingResponse] = []
            if exchange.duplex and not exchange.placed:
                if exchange.headers is None:
                    raise ProtocolError("request trailers before the request headers")
                answers = await self.collect(exchange, b"", True, trailers=True)
            return [*answers, messages.passthrough(phase)]
        if phase in RESPONSE_PHASES:
            return [messages.passthrough(phase)]
        raise ProtocolError(f"unexpected phase {phase}")

    async def collect(self, exchange: Exchange, chunk: bytes, last: bool,
                      trailers: bool = False) -> list[pb.ProcessingResponse]:
        """A duplex body chunk: kept until the last one, then placed."""
        exchange.size += len(chunk)
        if exchange.size > self.settings.max_body_bytes:
            # Refused as soon as it is known; the rest of the body is never kept.
            exchange.chunks.clear()
            return await self.place(exchange, b"", too_large=exchange.size)
        if chunk:
            exchange.chunks.append(chunk)
        if not last:
            return []
        raw = b"".join(exchange.chunks)
        exchange.chunks.clear()
        return await self.place(exchange, raw, trailers=trailers)

    def refuse(self, exchange: Exchange, exc: APIError) -> pb.ProcessingResponse:
        exchange.placed = True
        code = exc.code or str(exc.status)
        model = self.settings.model
        self.metrics.request_errors.labels(model, model, code).inc()
        self.duration.observe(time.perf_counter() - exchange.started)
        return messages.immediate(exc.status, exc.message, exc.code, exc.param)

    def placed(self, exchange: Exchange, answer: pb.ProcessingResponse, destination: str) -> pb.ProcessingResponse:
        exchange.placed = True
        self.served.inc()
        self.metrics.picks.labels(destination.split(",", 1)[0]).inc()
        self.duration.observe(time.perf_counter() - exchange.started)
        return answer

    def no_endpoint(self, subset: list[str] | None) -> APIError:
        where = "in the gateway's endpoint subset" if subset is not None else "in the pool"
        return APIError(503, f"No ready endpoint {where} for model `{self.settings.model}`.", code="no_endpoints")

    def place_bodiless(self, exchange: Exchange) -> pb.ProcessingResponse:
        candidates = self.state.candidates(self.state.pools.decode, exchange.subset)
        if not candidates:
            return self.refuse(exchange, self.no_endpoint(exchange.subset))
        choice = self.state.any_of(candidates)
        answer = messages.routed("request_headers", choice.header, {}, OWNED_HEADERS)
        return self.placed(exchange, answer, choice.header)

    async def place(self, exchange: Exchange, raw: bytes, too_large: int | None = None,
                    trailers: bool = False) -> list[pb.ProcessingResponse]:
        """The answers that place a request whose body is `raw`, or the one that refuses it."""
        settings, state, pool = self.settings, self.state, self.state.pools.decode
        model = settings.model
        self.sizes.observe(too_large or len(raw))
        headers = exchange.headers or {}
        try:
            if too_large is not None:
                raise APIError(413, f"Request body too large: {too_large} bytes so far, over the limit of "
                                    f"{settings.max_body_bytes}.", code="request_too_large")
            body = read_json(raw, settings.max_body_bytes)
            check_model(body, settings.model)
        except APIError as exc:
            return [self.refuse(exchange, exc)]
        candidates = state.candidates(pool, exchange.subset)
        if not candidates:
            return [self.refuse(exchange, self.no_endpoint(exchange.subset))]
        priority = settings.objectives.get(headers.get(OBJECTIVE_HEADER, ""), 0)
        if priority < 0 and state.saturated(candidates, pool):
            return [self.refuse(exchange, APIError(
                429, "The pool is saturated and this request's objective is sheddable; retry later.",
                code="rate_limit_exceeded"))]
        route = route_of(exchange.path)
        routed = await self.reader.routed(route, body) if route is not None and self.reads_prompts else None
        hold: Hold | None = None
        if routed is not None and self.wants_prefill(routed):
            # Only the picker sets these (a copy: `body` is still the client's, for the decode body).
            routed.body = {k: v for k, v in routed.body.items() if k != "kv_transfer_params"}
            routed.headers = self.prefill_leg.headers(  # type: ignore[union-attr]
                headers.get("x-request-id") or f"epp-{uuid.uuid4().hex}", headers.get("authorization"))
            exchange.routed = routed
            outcome = await self.prefill(routed)
            if isinstance(outcome, Refusal):
                exchange.placed = True
                self.metrics.request_errors.labels(model, model, str(outcome.status)).inc()
                return [messages.immediate_raw(outcome.status, outcome.body, outcome.content_type, "prefill_refused")]
            hold = exchange.hold = outcome
            # Re-read after the prefill leg: an endpoint may have been ejected meanwhile.
            candidates = state.candidates(pool, exchange.subset)
            if not candidates:
                return [self.refuse(exchange, self.no_endpoint(exchange.subset))]
        # With a hold the KV comes from the prefill engine: no prefix bonus, as the router does.
        choice = state.choose(pool, candidates, None if hold is not None else routed)
        extra: dict[str, str] = {}
        new_body: bytes | None = None
        if hold is not None or "kv_transfer_params" in body:
            new_body = json.dumps(decode_body(body, hold)).encode()
            if "content-length" in headers:
                # Envoy keeps the client's content-length, so it must be the new one.
                extra["content-length"] = str(len(new_body))
            if hold is not None and settings.internal_key is not None:
                extra[INTERNAL_HEADER.lower()] = settings.internal_key.decode()
        if not exchange.duplex:
            answer = messages.routed("request_body", choice.header, extra, OWNED_HEADERS, new_body)
            return [self.placed(exchange, answer, choice.header)]
        # Duplex: the mutations and the pick ride on the headers' answer; the body (changed or
        # not) must be sent back, or the engine would get an empty one.
        answer = messages.routed("request_headers", choice.header, extra, OWNED_HEADERS)
        return [self.placed(exchange, answer, choice.header),
                messages.streamed_body(new_body if new_body is not None else raw, last=not trailers)]

    # -- P/D -------------------------------------------------------------------------------------

    def wants_prefill(self, request: RoutedRequest) -> bool:
        """The router's rule (router/pd.py): a single prompt long enough, with a prefill pool, and
        nothing only the engine that computes the prompt could answer (n>1, prompt logprobs)."""
        if self.prefill_leg is None or len(self.state.pools.prefill) == 0 or not request.single_prompt:
            return False
        if multi_choice(request.body) or prompt_logprobs(request.route, request.body):
            return False
        tokens, least = request.prompt_tokens, self.settings.pd_min_prompt_tokens
        return least <= 0 or (tokens is not None and tokens >= least)

    async def prefill(self, request: RoutedRequest) -> Hold | Refusal | None:
        """The hold, the engine's refusal, or None when the decode engine computes the prompt."""
        assert self.prefill_leg is not None
        endpoint = self.state.picker.pick(self.state.pools.prefill, request)
        try:
            if endpoint is None:
                raise LegFailed("no healthy engine in the prefill pool")
            self.metrics.prefill_legs.labels(endpoint.url).inc()
            return await self.prefill_leg.run(endpoint, request)
        except LegFailed as exc:
            log.warning("prefill failed, the decode engine computes the prompt: %s", exc)
            self.metrics.prefill_fallbacks.inc()
            return None
