"""The OpenAI-compatible HTTP app of one engine: routes, auth, limits and error mapping."""

from __future__ import annotations

import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from pdserve.engine.core.liveness import pod_unresponsive_reason
from pdserve.engine.frontend.async_llm import AsyncLLM
from pdserve.engine.frontend.limits import EngineOverloadedError
from pdserve.engine.frontend.mp_client import EngineDeadError
from pdserve.engine.server.dp_rank import requested_dp_rank
from pdserve.engine.server.errors import (APIError, client_gone, error_body, error_response, http_error, model_card,
                                          new_error_id, unknown_model)
from pdserve.engine.internal_auth import HEADER as INTERNAL_HEADER, header_matches
from pdserve.engine.server.http import LimitsAndAuth, ServerSettings, disconnect_watcher, parse_body
from pdserve.engine.server.kv_params import validate_kv_release, validate_kv_transfer_params
from pdserve.engine.server.metrics import EngineMetrics, cache_infos
from pdserve.engine.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from pdserve.engine.server.rank_ports import RankPorts
from pdserve.engine.server.serving import Serving, new_request_id
from pdserve.engine.server.tool_parsers import DEFAULT_PARSER

log = logging.getLogger("pdserve.server")

class KVReleaseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kv_transfer_params: Any = None  # checked by kv_params.validate_kv_release


class TokenizeRequest(BaseModel):
    model: str
    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(BaseModel):
    model: str
    tokens: list[int]


def build_app(engine: AsyncLLM, settings: ServerSettings | None = None, *,
              tool_call_parser: str = DEFAULT_PARSER, rank_ports: RankPorts | None = None) -> FastAPI:
    """The app behind every port of the server; with `rank_ports`, a request that arrives on a
    rank's port runs on that rank (engine/server/rank_ports.py)."""
    settings = settings or ServerSettings()
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None)
    metrics = EngineMetrics(engine.model_name, cache_infos(engine))
    engine.stats_listeners.append(metrics.observe)
    metrics.watch_liveness(engine.liveness)
    serving = Serving(engine, tool_call_parser)
    app.state.engine = engine
    app.state.metrics = metrics
    started = int(time.time())

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code)

    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(ClientDisconnect, client_gone)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(503, f"The engine is not running: {exc}", code="engine_dead")

    @app.exception_handler(EngineOverloadedError)
    async def overloaded(_: Request, exc: EngineOverloadedError) -> JSONResponse:
        response = error_response(503, str(exc), code="engine_overloaded")
        response.headers["Retry-After"] = str(exc.retry_after_s)
        return response

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        # Exception text can carry paths and internals: it goes to the log, the client gets an id.
        error_id = new_error_id()
        log.error("unhandled error (error id %s)", error_id, exc_info=exc)
        return error_response(500, f"Internal server error (error id {error_id}).")

    async def respond(result: Any) -> Response:
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def check_alive() -> None:
        if engine.errored:
            raise EngineDeadError(str(engine.dead_error or engine.client.dead_reason))

    max_blocks = -(-engine.config.model.max_model_len // engine.config.cache.block_size)

    def check_kv_transfer(request: Request, body: Any) -> None:
        """Only the deployment's own router may hand an engine kv_transfer_params (they name other
        engines' memory): without the internal key they are refused, never acted on."""
        if body.kv_transfer_params is None:
            return
        if not header_matches(request.headers.get(INTERNAL_HEADER), settings.internal_key):
            raise APIError(403, "kv_transfer_params are accepted only from the deployment's router (the "
                                f"{INTERNAL_HEADER} header is missing or wrong).",
                           param="kv_transfer_params", code="forbidden")
        body.kv_transfer_params = validate_kv_transfer_params(body.kv_transfer_params, max_blocks)

    def port_rank(request: Request) -> int | None:
        return rank_ports.rank_of(request.scope) if rank_ports is not None else None

    def pinned_rank(request: Request) -> int | None:
        """The rank whose port the request came in on; else the data-parallel rank the router picked
        (X-PDServe-DP-Rank, honoured only with the internal key). On a rank port the header is
        ignored: see rank_ports.py for why the port wins."""
        rank = port_rank(request)
        if rank is not None:
            return rank
        return requested_dp_rank(request.headers, settings.internal_key, engine.config.parallel.data_parallel_size)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        check_alive()
        body = await parse_body(request, CompletionRequest)
        check_kv_transfer(request, body)
        request_id = new_request_id("cmpl")  # never the client's X-Request-ID (see _echo_request_id)
        return await respond(await serving.completions(body, request_id, disconnect_watcher(request),
                                                       dp_rank=pinned_rank(request)))

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        check_alive()
        body = await parse_body(request, ChatCompletionRequest)
        check_kv_transfer(request, body)
        request_id = new_request_id("chatcmpl")
        return await respond(await serving.chat(body, request_id, disconnect_watcher(request),
                                                dp_rank=pinned_rank(request)))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        """The prompt's token ids as the completion routes compute them (routers hash them for prefix routing)."""
        check_alive()
        body = await parse_body(request, TokenizeRequest)
        serving.check_model(body.model)
        try:
            if body.messages is not None:
                messages = [{"role": m.role, "content": m.text()} for m in body.messages]
                ids = await serving.render_chat(messages, body.add_generation_prompt, body.chat_template_kwargs)
            elif isinstance(body.prompt, str):
                ids = await serving.tokenize(body.prompt)
            elif body.prompt is not None:
                ids = engine.input_processor.tokenize(body.prompt)[1]
            else:
                raise APIError(400, "give either prompt or messages", param="prompt")
        except (ValueError, TypeError) as exc:
            raise APIError(400, f"cannot tokenize: {exc}") from None
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.config.model.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        """Token ids back to text, as vLLM's server does (/tokenize's inverse)."""
        check_alive()
        body = await parse_body(request, DetokenizeRequest)
        serving.check_model(body.model)
        vocab = engine.config.model.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"token ids must be integers in [0, {vocab})", param="tokens")
        try:
            text = await serving.off_loop(engine.tokenizer.decode, body.tokens)
        except (ValueError, TypeError, OverflowError) as exc:  # an id the model has but its tokenizer lacks
            raise APIError(400, f"cannot detokenize: {exc}", param="tokens") from None
        return {"prompt": text}

    @app.post("/v1/kv/release")
    async def release_kv(request: Request) -> dict[str, bool]:
        """The router frees a prefill's held KV that no decode leg will pull (the decode leg failed,
        was refused, or the client left): body {"kv_transfer_params": <what this engine answered>}."""
        check_alive()
        if not header_matches(request.headers.get(INTERNAL_HEADER), settings.internal_key):
            raise APIError(403, f"Held KV is released only by the deployment's router (the {INTERNAL_HEADER} header "
                                "is missing or wrong).", code="forbidden")
        body = await parse_body(request, KVReleaseRequest)
        release = validate_kv_release(body.kv_transfer_params, max_blocks)
        try:
            released = await engine.release_kv_hold(release.engine_id, release.request_id, release.prompt_digest)
        except TimeoutError:
            raise APIError(503, "The engine core did not answer the release in time.", code="engine_busy") from None
        return {"released": released}

    def card() -> dict[str, Any]:
        mc = engine.config.model
        return model_card(engine.model_name, started, root=mc.path, max_model_len=mc.max_model_len)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model_id:path}")  # the SDK's models.retrieve; a model name may hold slashes
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != engine.model_name:
            raise unknown_model(model_id)
        return card()

    @app.get("/health")
    async def health(request: Request) -> Response:
        if engine.errored:
            return JSONResponse(error_body(503, "The engine is not running.", code="engine_dead"), status_code=503)
        # Alive but not making progress: routers should skip this engine; its requests are kept.
        # A rank's port speaks for that rank only: the others' ports keep serving.
        rank = port_rank(request)
        if rank is None:
            reason = engine.unresponsive_reason()
        else:
            reason = pod_unresponsive_reason([r for r in engine.liveness() if r.rank == rank])
        if reason is not None:
            return JSONResponse(error_body(503, f"The engine is not responding: {reason}.",
                                           code="engine_unresponsive"), status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus(request: Request) -> Response:
        return Response(metrics.render(port_rank(request)), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict[str, str]:
        from importlib.metadata import PackageNotFoundError, version as pkg_version

        try:
            return {"version": pkg_version("pdserve")}
        except PackageNotFoundError:
            return {"version": "unknown"}

    return LimitsAndAuth(app, settings)  # type: ignore[return-value]
