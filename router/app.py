"""The router's OpenAI-compatible HTTP app: the engine server's validation, limits and errors, in front
of the P/D flow; background tasks for health checks, the coordinator feed and discovery."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from pdserve.engine.internal_auth import HEADER as INTERNAL_HEADER
from pdserve.engine.server.http import LimitsAndAuth, ServerSettings, disconnect_watcher, parse_body
from pdserve.engine.server.errors import (APIError, client_gone, error_response, http_error, model_card, new_error_id,
                                          unknown_model)
from pdserve.engine.server import tools as chat_tools
from pdserve.engine.server.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.engine.server.tool_parsers import DEFAULT_PARSER, get_parser
from pdserve.router.balancer import Policy
from pdserve.router.endpoints import Endpoint, Health, HealthChecker, Pool, Pools, error_text, health_client
from pdserve.router.feed import FeedState, FeedSubscriber
from pdserve.router.metrics import RouterMetrics
from pdserve.router.pd import FlowSettings, PDFlow, RoutedRequest
from pdserve.router.local_tokenizer import LocalTokenizer
from pdserve.router.prefix import estimate_tokens
from pdserve.router.background import restarting_task

log = logging.getLogger("pdserve.router")

# Tasks that keep the pools current (discovery); each gets the pools and runs until cancelled.
PoolTask = Callable[[Pools], Awaitable[None]]
# How long a request waits for its local token ids: past this (every tokenizer thread busy with
# huge prompts) it is routed on a character estimate, without the prefix hint.
TOKENIZE_WAIT_S = 1.0


class _NamesAModel(BaseModel):
    """What the router reads of a body it passes on whole: the model it names."""

    model_config = ConfigDict(extra="allow")
    model: str


@dataclass
class RouterSettings:
    model: str
    policy: Policy = Policy.LEAST_LOADED
    api_key: str | None = None
    max_body_bytes: int = 8 << 20
    health_interval: float = 2.0
    tokenizer: str | None = None
    coordinator_address: str | None = None
    coordinator_http_port: int = 8080
    flow: FlowSettings = field(default_factory=FlowSettings)
    # Engine connections in all: none by default, since each engine's own limit
    # (flow.max_connections_per_endpoint) bounds them, and a shared cap lets busy engines starve the rest.
    max_connections: int | None = None
    internal_key: bytes | None = None  # sent to engines: kv_transfer_params are accepted only with it
    # Prompts over this many characters get a 400 before tokenizing; None: derived from the tokenizer; 0: off.
    max_prompt_chars: int | None = None
    metrics_require_key: bool = False
    tool_call_parser: str = DEFAULT_PARSER  # the engines': chat prompts with tools are rendered as theirs


class Router:
    """Everything one router process holds: pools, feed, flow, metrics, and its background tasks."""

    def __init__(self, settings: RouterSettings, static_prefill: list[str] = (), static_decode: list[str] = (),
                 discovery: list[PoolTask] = ()) -> None:  # type: ignore[assignment]
        self.settings = settings
        self.metrics = RouterMetrics()
        self.pools = Pools(settings.policy, on_change=self._pool_changed)
        self.health = Health(on_change=self._health_changed)
        self.feed = FeedState() if settings.coordinator_address else None
        if settings.max_prompt_chars is not None and settings.max_prompt_chars < 0:
            raise ValueError(f"--max-prompt-chars must be 0 or more, got {settings.max_prompt_chars}")
        self.tokenizer = LocalTokenizer(settings.tokenizer) if settings.tokenizer else None
        self.tool_parser = get_parser(settings.tool_call_parser)
        # Prompts longer than this (characters) are refused before tokenizing: the flag, or what
        # the tokenizer proves no valid prompt exceeds (router/local_tokenizer.py); 0 or None: none.
        self.max_prompt_chars = settings.max_prompt_chars if settings.max_prompt_chars is not None else (
            self.tokenizer.char_limit if self.tokenizer is not None else None)
        self.health_client: httpx.AsyncClient | None = None
        self.discovery = list(discovery)
        self.client: httpx.AsyncClient | None = None
        self.flow: PDFlow | None = None
        self._tasks: list[asyncio.Task] = []
        self._known: dict[str, set[str]] = {}
        self._tokenize_turn = itertools.count()
        self.pools.prefill.replace(static_prefill)
        self.pools.decode.replace(static_decode)

    # -- metrics follow the pools --------------------------------------------------------------

    def _pool_changed(self, pool: Pool) -> None:
        known = self._known.setdefault(pool.name, set())
        for url in set(pool.endpoints) - known:
            self.metrics.endpoint_added(pool.name, url, pool.endpoints[url].healthy)
        for url in known - set(pool.endpoints):
            self.metrics.endpoint_removed(pool.name, url)
        self._known[pool.name] = set(pool.endpoints)

    def _health_changed(self, endpoint: Endpoint) -> None:
        if endpoint.url in self._known.get(endpoint.pool, ()):
            self.metrics.healthy.labels(endpoint.pool, endpoint.url).set(1 if endpoint.healthy else 0)

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        limits = httpx.Limits(max_connections=self.settings.max_connections,
                              max_keepalive_connections=min(256, self.settings.max_connections or 256))
        self.client = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(60.0, connect=2.0))
        self.flow = PDFlow(self.pools, self.health, self.client, self.metrics, self.settings.flow, self.feed)
        # Its own client: health checks never queue behind streams for a connection of the main pool.
        self.health_client = health_client()
        checker = HealthChecker(self.pools, self.health, self.health_client, self.settings.health_interval)
        self._spawn(checker.run, "health checks")
        if self.feed is not None and self.settings.coordinator_address:
            subscriber = FeedSubscriber(self.settings.coordinator_address, self.feed,
                                        seed_url=self._blocks_url(), client=self.client)
            self._spawn(subscriber.run, "coordinator feed")
            self._spawn(self._watch_feed, "coordinator feed gauge")
        for discover in self.discovery:
            self._spawn(lambda discover=discover: discover(self.pools), "endpoint discovery")

    def _blocks_url(self) -> str | None:
        host = (self.settings.coordinator_address or "").rsplit(":", 1)[0]
        return f"http://{host}:{self.settings.coordinator_http_port}/blocks" if host else None

    def _spawn(self, run: Callable[[], Awaitable[None]], what: str) -> None:
        """Run a background loop for the router's lifetime, restarting it if it crashes."""
        self._tasks.append(restarting_task(run, what, log))

    async def _watch_feed(self) -> None:
        while True:
            self.metrics.feed_alive.set(1 if self.feed is not None and self.feed.alive() else 0)
            await asyncio.sleep(0.5)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(BaseException):
                await task
        self._tasks.clear()
        if self.client is not None:
            await self.client.aclose()
        if self.health_client is not None:
            await self.health_client.aclose()
        if self.tokenizer is not None:
            self.tokenizer.close()

    # -- requests --------------------------------------------------------------------------------

    def check_model(self, model: str) -> None:
        if model != self.settings.model:
            raise unknown_model(model)

    def forwarded_headers(self, request: Request, prefix: str) -> dict[str, str]:
        # Built from scratch, never copied: a client's own X-PDServe-Internal-Key never reaches an engine.
        headers = {"x-request-id": request.headers.get("x-request-id") or f"{prefix}-{uuid.uuid4().hex}"}
        auth = request.headers.get("authorization")
        if auth:
            headers["authorization"] = auth
        if self.settings.internal_key is not None:
            headers[INTERNAL_HEADER] = self.settings.internal_key.decode()
        return headers

    async def completion_request(self, request: Request) -> RoutedRequest:
        parsed: CompletionRequest = await parse_body(request, CompletionRequest)
        self.check_model(parsed.model)
        body = json.loads(await request.body())
        prompts = parsed.prompts()
        routed = RoutedRequest("completions", body, self.forwarded_headers(request, "cmpl"), stream=parsed.stream,
                               single_prompt=len(prompts) == 1)
        self.check_prompt_chars(sum(len(p) for p in prompts if isinstance(p, str)), "prompt")
        if routed.single_prompt:
            prompt = prompts[0]
            if self.tokenizer is not None:
                routed.token_ids = await self._tokenize(self.tokenizer.completion, prompt)
            elif isinstance(prompt, list):
                routed.token_ids = list(prompt)
            routed.prompt_tokens = len(routed.token_ids) if routed.token_ids is not None else (
                estimate_tokens(len(prompt)) if isinstance(prompt, str) else None)
        await self._remote_tokens(routed, {"prompt": prompts[0]} if routed.single_prompt else None)
        return routed

    async def chat_request(self, request: Request) -> RoutedRequest:
        parsed: ChatCompletionRequest = await parse_body(request, ChatCompletionRequest)
        self.check_model(parsed.model)
        body = json.loads(await request.body())
        routed = RoutedRequest("chat", body, self.forwarded_headers(request, "chatcmpl"), stream=parsed.stream)
        messages, tools = self.chat_prompt(parsed)
        # Only user turns count: every template renders them verbatim (some drop earlier reasoning).
        self.check_prompt_chars(sum(len(msg["content"]) for msg in messages if msg["role"] == "user"), "messages")
        if self.tokenizer is not None:
            routed.token_ids = await self._tokenize(self.tokenizer.chat, messages, parsed.add_generation_prompt,
                                                    parsed.chat_template_kwargs, tools)
        routed.prompt_tokens = len(routed.token_ids) if routed.token_ids is not None else estimate_tokens(
            rendered_chars(messages, tools))
        await self._remote_tokens(routed, {"messages": body["messages"],
                                           "add_generation_prompt": parsed.add_generation_prompt,
                                           **({"chat_template_kwargs": parsed.chat_template_kwargs}
                                              if parsed.chat_template_kwargs else {})})
        return routed

    def chat_prompt(self, parsed: ChatCompletionRequest) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """The chat template's messages and `tools`, built as the engines build them (engine/server/
        tools.py, with the same --tool-call-parser): a template that reads `tools` gets them and the
        history's calls; one that does not gets the parser's description of the tools and the calls
        written into the messages. APIError (400) for messages the engines refuse too."""
        return chat_prompt(parsed, self.tool_parser, self.tokenizer)

    def check_prompt_chars(self, chars: int, param: str) -> None:
        """Refuse at once a prompt too long for any engine: tokenizing it would only waste a thread."""
        limit = self.max_prompt_chars
        if limit and chars > limit:
            raise APIError(400, f"Prompt too long: {chars} characters in the {param}, over this model's limit of "
                                f"{limit}. Please reduce the length of the {param}.",
                           param=param, code="context_length_exceeded")

    async def _tokenize(self, compute: Callable[..., list[int]], *args: Any) -> list[int] | None:
        """The prompt's token ids from a tokenizer thread, or None (routing then goes without them)."""
        assert self.tokenizer is not None
        return await tokenize_within(self.tokenizer, compute, *args)

    def _engines_in_turn(self) -> list[Endpoint]:
        """The healthy engines (the decode pool, else the prefill pool) to ask for tokenizer work,
        starting one further on at each call so that such calls spread over them."""
        engines = self.pools.decode.healthy() or self.pools.prefill.healthy()
        if not engines:
            return []
        start = next(self._tokenize_turn) % len(engines)
        return engines[start:] + engines[:start]

    async def _remote_tokens(self, routed: RoutedRequest, prompt: dict[str, Any] | None) -> None:
        """Prefix-aware without a local tokenizer: ask an engine for the prompt's token ids."""
        if (prompt is None or routed.token_ids is not None or self.settings.policy is not Policy.PREFIX_AWARE
                or self.feed is None or not self.feed.alive() or self.client is None):
            return
        engines = self._engines_in_turn()
        if not engines:
            return
        engine = engines[0]
        try:
            response = await self.client.post(f"{engine.url}/tokenize", json={"model": self.settings.model, **prompt},
                                              headers={k: v for k, v in routed.headers.items()
                                                       if k in ("authorization", INTERNAL_HEADER)},
                                              timeout=httpx.Timeout(5.0, connect=self.settings.flow.connect_timeout))
            if response.status_code == 200:
                tokens = response.json().get("tokens")
                if isinstance(tokens, list):
                    routed.token_ids = tokens
                    routed.prompt_tokens = len(tokens)
        except (httpx.HTTPError, ValueError) as exc:
            log.debug("tokenizing through %s failed: %s", engine.url, error_text(exc))

    async def to_an_engine(self, request: Request, path: str) -> Response:
        """/tokenize and /detokenize, which need no generation: answered by the first healthy engine that
        answers (decode pool first; every engine holds the model's tokenizer), the body passed on as sent."""
        self.check_model((await parse_body(request, _NamesAModel)).model)
        engines = self._engines_in_turn()
        if not engines or self.client is None:
            raise APIError(503, "No healthy engine to answer.", code="no_engines")
        failure = ""
        for engine in engines:
            try:
                response = await self.client.post(f"{engine.url}{path}", content=await request.body(),
                                                  headers=dict(self.forwarded_headers(request, "tok"),
                                                               **{"content-type": "application/json"},
                                                               **engine.extra_headers),
                                                  timeout=httpx.Timeout(30.0,
                                                                        connect=self.settings.flow.connect_timeout))
            except httpx.HTTPError as exc:
                failure = f"{engine.url}: {error_text(exc)}"
                continue
            if response.status_code < 500:
                return Response(response.content, status_code=response.status_code,
                                media_type=response.headers.get("content-type", "application/json"))
            failure = f"{engine.url} answered {response.status_code}"
        raise APIError(502, f"No engine could answer: {failure}.", code="upstream_failed")

    async def serve(self, request: Request, routed: RoutedRequest) -> Response:
        """Run the flow, cancelling both legs if the client goes away before the answer starts."""
        assert self.flow is not None
        work = asyncio.ensure_future(self.flow.serve(routed))
        gone = asyncio.ensure_future(disconnect_watcher(request)())
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await work
                self.metrics.errors.labels("client_disconnected").inc()
        if work.cancelled():
            return Response(status_code=499)  # nobody is listening any more
        return work.result()

    def health_body(self) -> dict[str, Any]:
        pools = {pool.name: {"endpoints": len(pool), "healthy": len(pool.healthy())} for pool in self.pools}
        body: dict[str, Any] = {"status": "ok", "model": self.settings.model, "pools": pools}
        if self.feed is not None:
            body["coordinator"] = "alive" if self.feed.alive() else "silent"
        return body


def chat_prompt(parsed: ChatCompletionRequest, tool_parser: Any, tokenizer: LocalTokenizer | None
                ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Router.chat_prompt for any holder of a tool parser and an optional local tokenizer."""
    functions = None
    if parsed.tools and parsed.tool_choice != "none":  # the engines describe no tool for "none"
        functions = chat_tools.check_functions(parsed.tools)
    # Without a tokenizer nothing is rendered, only counted: the tools then count as their JSON.
    knows_tools = tokenizer.knows_tools if tokenizer is not None else True
    messages = chat_tools.template_messages(parsed.messages, tool_parser, knows_tools, functions)
    return messages, ([f.openai() for f in functions] if functions and knows_tools else None)


async def tokenize_within(tokenizer: LocalTokenizer, compute: Callable[..., list[int]], *args: Any) -> list[int] | None:
    """The prompt's token ids from a tokenizer thread within TOKENIZE_WAIT_S, or None (routing then
    goes without them)."""
    work = asyncio.get_running_loop().run_in_executor(tokenizer.executor, compute, *args)
    try:
        # A timeout cancels the job if it has not started; a started one ends in its thread.
        return await asyncio.wait_for(work, TOKENIZE_WAIT_S)
    except asyncio.TimeoutError:
        log.debug("local tokenization took over %.1fs: routing without the token ids", TOKENIZE_WAIT_S)
        return None
    except Exception as exc:  # the engine reports a bad prompt itself; routing just loses the hint
        log.debug("local tokenization failed: %s", error_text(exc))
        return None


def rendered_chars(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> int:
    """About how many characters a template writes for these messages and tools (no tokenizer at hand)."""
    calls = sum(len(json.dumps(msg["tool_calls"])) for msg in messages if msg.get("tool_calls"))
    return sum(len(msg["content"]) for msg in messages) + calls + (len(json.dumps(tools)) if tools else 0)


def build_app(router: Router) -> Any:
    settings = router.settings

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="pdserve router", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.router = router
    started = int(time.time())

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        if exc.status < 500 and exc.code not in ("no_engines", "upstream_failed"):
            router.metrics.errors.labels("bad_request" if exc.status != 404 else "model_not_found").inc()
        return error_response(exc.status, exc.message, exc.param, exc.code)

    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(ClientDisconnect, client_gone)

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        # Exception text can carry addresses and internals: it goes to the log, the client gets an id.
        error_id = new_error_id()
        log.error("unhandled error (error id %s)", error_id, exc_info=exc)
        router.metrics.errors.labels("internal").inc()
        return error_response(500, f"Internal server error (error id {error_id}).")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        router.metrics.requests.labels("completions").inc()
        return await router.serve(request, await router.completion_request(request))

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        router.metrics.requests.labels("chat").inc()
        return await router.serve(request, await router.chat_request(request))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await router.to_an_engine(request, "/tokenize")

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await router.to_an_engine(request, "/detokenize")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(settings.model, started)]}

    @app.get("/v1/models/{model_id:path}")  # the SDK's models.retrieve; a model name may hold slashes
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != settings.model:
            raise unknown_model(model_id)
        return model_card(settings.model, started)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        # The router itself is up even with empty pools: completions then answer 503 "no engines".
        return router.health_body()

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(router.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return LimitsAndAuth(app, ServerSettings(api_key=settings.api_key, max_body_bytes=settings.max_body_bytes,
                                             metrics_require_key=settings.metrics_require_key))
