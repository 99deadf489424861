"""The router's P/D decisions for structured outputs, tools and prompt logprobs (issue 19).

The router runs in-process (served by uvicorn on a real 127.0.0.1 socket); the engines are small
recording HTTP servers in the same event loop, so a test sees exactly which leg got which body.
Their "model": the token at position i is 100 + i, text " t<id>"; a decode engine can stall after
a number of tokens to break its stream. The real engines through `pdserve up`:
tests/up/test_up_openai_features.py.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from pdserve.router.app import Router, RouterSettings, build_app
from pdserve.router.pd import FlowSettings
from support.asgi_serving import read_stream, serve_all, serving
from support.auth import internal_key

MODEL = "tiny"
HELD = {"do_remote_prefill": True, "remote_engine_id": "fake-prefill", "remote_block_ids": [3],
        "remote_host": "127.0.0.1", "remote_port": 1, "remote_tp_size": 1}
QUESTION = [{"role": "user", "content": "Name a colour."}]
SCHEMA = {"type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "blue"]}},
          "required": ["colour"], "additionalProperties": False}
JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "colour", "schema": SCHEMA, "strict": True}}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


# --- fake engines ------------------------------------------------------------------------------------

def prompt_length(body: dict[str, Any]) -> int:
    if "messages" in body:
        return sum(len((m.get("content") or "").split()) for m in body["messages"])
    prompt = body["prompt"]
    return len(prompt) if isinstance(prompt, list) else len(prompt.split())


@dataclass
class Engine:
    role: str                        # "prefill" or "decode"
    stall_after: int | None = None   # a stream of the client's own request goes silent after this many tokens
    requests: list[dict[str, Any]] = field(default_factory=list)
    url: str = ""

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/health", lambda _: Response()),
                                 Route("/v1/kv/release", lambda _: JSONResponse({"released": True}), methods=["POST"]),
                                 Route("/v1/completions", self.generate, methods=["POST"]),
                                 Route("/v1/chat/completions", self.generate, methods=["POST"])])

    async def generate(self, request: Request) -> Response:
        body = await request.json()
        self.requests.append(body)
        if self.role == "prefill":
            return JSONResponse({"id": "p", "object": "text_completion", "created": 1, "model": MODEL,
                                 "choices": [{"index": 0, "text": " t0", "finish_reason": "length"}],
                                 "kv_transfer_params": HELD})
        if not body.get("stream"):
            return JSONResponse({"id": "d", "object": "text_completion", "created": 1, "model": MODEL,
                                 "choices": [{"index": 0, "text": " t100", "finish_reason": "length"}]})
        return StreamingResponse(self.stream(request.url.path.endswith("chat/completions"), body),
                                 media_type="text/event-stream")

    async def stream(self, chat: bool, body: dict[str, Any]) -> AsyncIterator[str]:
        context = prompt_length(body)
        count = body.get("max_completion_tokens") or body.get("max_tokens") or 4
        continuation = isinstance(body.get("prompt"), list)  # the router's own resend never stalls
        base = {"id": "s", "created": 1, "model": MODEL, "object": "chat.completion.chunk" if chat else "text_completion"}
        ids = {"prompt_token_ids": list(range(1, context + 1))} if body.get("return_token_ids") else {}
        if chat:
            yield f"data: {json.dumps(dict(base, choices=[{'index': 0, 'delta': {'role': 'assistant'}, **ids}]))}\n\n"
            ids = {}
        for n in range(count):
            if n == self.stall_after and not continuation:
                await asyncio.sleep(3600)
            token = 100 + context + n
            text = {"delta": {"content": f" t{token}"}} if chat else {"text": f" t{token}"}
            choice = {"index": 0, **text, "finish_reason": "length" if n == count - 1 else None, **ids}
            if body.get("return_token_ids"):
                choice["token_ids"] = [token]
            ids = {}
            yield f"data: {json.dumps(dict(base, choices=[choice]))}\n\n"
            await asyncio.sleep(0.01)
        if self.stall_after == count and not continuation:
            await asyncio.sleep(3600)  # all said but the end of the stream
        yield "data: [DONE]\n\n"


@dataclass
class Stack:
    url: str
    router: Router
    prefill: list[Engine]
    decode: list[Engine]

    def decisions(self, decision: str) -> float:
        return self.router.metrics.registry.get_sample_value("pdserve_router_pd_decisions_total",
                                                             {"decision": decision}) or 0.0

    def migrations(self, outcome: str) -> float:
        return self.router.metrics.registry.get_sample_value("pdserve_router_migrations_total",
                                                             {"outcome": outcome}) or 0.0


@asynccontextmanager
async def stack(prefill: int, decode: list[Engine], tokenizer: str | None = None,
                **flow: Any) -> AsyncIterator[tuple[Stack, httpx.AsyncClient]]:
    engines = [Engine("prefill") for _ in range(prefill)] + decode
    async with serve_all(engines) as urls:
        for engine, url in zip(engines, urls):
            engine.url = url
        flow.setdefault("pd_min_prompt_tokens", 0)
        settings = RouterSettings(model=MODEL, health_interval=60.0, internal_key=internal_key().encode(),
                                  tokenizer=tokenizer, flow=FlowSettings(**flow))
        router = Router(settings, [e.url for e in engines[:prefill]], [e.url for e in decode])
        async with serving(build_app(router)) as url, httpx.AsyncClient(base_url=f"{url}/v1", timeout=60) as client:
            yield Stack(url, router, engines[:prefill], decode), client


async def post(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
    answer = await client.post(path, json=body)
    assert answer.status_code == 200, answer.text
    return answer.json()


def streamed_text(events: list[dict[str, Any] | str]) -> str:
    return "".join(c.get("text") or (c.get("delta") or {}).get("content") or ""
                   for e in events if isinstance(e, dict) for c in e.get("choices", ()))


# --- prompt logprobs: one engine ---------------------------------------------------------------------

async def test_prompt_logprobs_are_served_by_one_engine_and_the_rest_is_disaggregated():
    async with stack(1, [Engine("decode")]) as (s, client):
        base = {"model": MODEL, "prompt": "a b c", "max_tokens": 2}
        local = [dict(base, echo=True, logprobs=1), dict(base, echo=True, logprobs=0, stream=True),
                 dict(base, prompt_logprobs=2)]
        for body in local:
            if body.get("stream"):
                assert streamed_text(await read_stream(client, "/completions", body)) == " t103 t104"
            else:
                await post(client, "/completions", body)
        assert s.prefill[0].requests == []
        assert [r for r in s.decode[0].requests if "kv_transfer_params" in r] == []
        assert s.decisions("local_prompt_logprobs") == 3 and s.decisions("disaggregated") == 0

        # Echo alone, logprobs alone and chat logprobs need no prompt logprobs: two legs as usual,
        # the prefill leg without the output-only fields.
        await post(client, "/completions", dict(base, echo=True))
        await post(client, "/completions", dict(base, logprobs=2))
        await post(client, "/chat/completions", {"model": MODEL, "messages": QUESTION, "logprobs": True,
                                                 "top_logprobs": 2})
        assert s.decisions("disaggregated") == 3 and s.decisions("local_prompt_logprobs") == 3
        assert len(s.prefill[0].requests) == 3
        for leg in s.prefill[0].requests:
            assert not {"echo", "logprobs", "top_logprobs"} & set(leg) and leg["max_tokens"] == 1
        assert [r["kv_transfer_params"] for r in s.decode[0].requests[3:]] == [HELD] * 3


# --- structured outputs and tools: disaggregated, the prompt intact ------------------------------------

TOOL_CHAT = {"model": MODEL, "max_tokens": 8, "parallel_tool_calls": False,
             "messages": [{"role": "system", "content": "You call tools."},
                          {"role": "user", "content": "Weather in Paris?"},
                          {"role": "assistant", "content": None, "tool_calls": [
                              {"id": "call_1", "type": "function",
                               "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                          {"role": "tool", "tool_call_id": "call_1", "content": "{\"sky\": \"clear\"}"},
                          {"role": "user", "content": "And in Rome?"}],
             "tools": [WEATHER_TOOL], "tool_choice": "required",
             "chat_template_kwargs": {"enable_thinking": False}, "add_generation_prompt": True}


@pytest.mark.parametrize("path, body", [
    ("/chat/completions", {"model": MODEL, "messages": QUESTION, "max_tokens": 8, "response_format": JSON_SCHEMA_FORMAT}),
    ("/chat/completions", TOOL_CHAT),
    ("/chat/completions", dict(TOOL_CHAT, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                               response_format={"type": "json_object"})),
    ("/completions", {"model": MODEL, "prompt": "Colour:", "max_tokens": 4, "guided_choice": ["red", "blue"]}),
    ("/completions", {"model": MODEL, "prompt": "Colour:", "max_tokens": 4, "structured_outputs": {"json": SCHEMA},
                      "echo": True}),
], ids=["json-schema", "tools-required", "tools-named-json-object", "guided-choice", "structured-outputs-echo"])
async def test_structured_outputs_and_tools_are_disaggregated_with_every_prompt_field(path, body):
    async with stack(1, [Engine("decode")]) as (s, client):
        await post(client, path, body)
        await read_stream(client, path, body)  # a streamed request's legs carry the same fields
        assert s.decisions("disaggregated") == 2
        for leg in s.prefill[0].requests:
            # Everything that shapes the prompt, and the constraint itself (the prefill engine refuses
            # a bad one with the client's 400; it never compiles one for its discarded token).
            for name in ("messages", "prompt", "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs",
                         "add_generation_prompt", "response_format", "guided_choice", "structured_outputs"):
                assert leg.get(name) == body.get(name), name
            assert (leg["max_tokens"], leg["stream"], leg["n"], leg["kv_transfer_params"]) == (
                1, False, 1, {"do_remote_decode": True})
        plain, streamed = s.decode[0].requests
        assert plain == dict(body, kv_transfer_params=HELD)
        # The streamed decode leg asks for token ids (followed for migration), nothing else changes.
        assert streamed == dict(body, stream=True, kv_transfer_params=HELD, return_token_ids=True)


# --- constrained and tool streams are never continued --------------------------------------------------

BLOCKED = [
    ("/chat/completions", {"messages": QUESTION, "response_format": JSON_SCHEMA_FORMAT}, "structured outputs"),
    ("/chat/completions", {"messages": QUESTION, "response_format": {"type": "json_object"}}, "structured outputs"),
    ("/chat/completions", {"messages": QUESTION, "structured_outputs": {"choice": ["red", "blue"]}},
     "structured outputs"),
    ("/completions", {"prompt": "a b c", "guided_regex": "( t[0-9]+)+"}, "structured outputs"),
    ("/chat/completions", {"messages": QUESTION, "tools": [WEATHER_TOOL]}, "tools"),  # tool_choice "auto"
    ("/chat/completions", {"messages": QUESTION, "tools": [WEATHER_TOOL], "tool_choice": "required"}, "tools"),
]


@pytest.mark.parametrize("path, fields, reason", BLOCKED,
                         ids=["json-schema", "json-object", "structured-outputs", "guided-regex", "tools-auto",
                              "tools-required"])
async def test_a_constrained_or_tool_stream_ends_with_an_error_instead_of_a_continuation(path, fields, reason):
    engines = [Engine("decode", stall_after=2), Engine("decode", stall_after=2)]
    async with stack(0, engines, decode_idle_timeout=0.3) as (s, client):
        events = await read_stream(client, path, {"model": MODEL, "max_tokens": 6, **fields})
        assert events[-1] == "[DONE]" and "error" in events[-2]
        message = events[-2]["error"]["message"]
        assert "mid-stream" in message and reason in message and "cannot be continued" in message
        assert len(streamed_text(events).split()) == 2  # what the engine said before it stalled, nothing more
        assert sum(len(e.requests) for e in engines) == 1  # no continuation was sent anywhere
        assert s.migrations("failed") == 1 and s.migrations("resumed") == 0

        # Still followed: one that broke after its last token is closed normally, no error.
        for engine in engines:
            engine.stall_after = 6
        events = await read_stream(client, path, {"model": MODEL, "max_tokens": 6, **fields})
        assert events[-1] == "[DONE]" and not any(isinstance(e, dict) and "error" in e for e in events)
        assert len(streamed_text(events).split()) == 6 and s.migrations("failed") == 1


@pytest.mark.parametrize("fields", [
    {"messages": QUESTION, "tools": [WEATHER_TOOL], "tool_choice": "none", "response_format": {"type": "text"}},
    {"prompt": "a b c", "guided_json": None, "response_format": None},
], ids=["tools-none-text", "null-constraints"])
async def test_a_stream_free_of_constraint_and_tool_calls_is_still_continued(fields):
    engines = [Engine("decode", stall_after=2), Engine("decode", stall_after=2)]
    async with stack(0, engines, decode_idle_timeout=0.3) as (s, client):
        path = "/chat/completions" if "messages" in fields else "/completions"
        events = await read_stream(client, path, {"model": MODEL, "max_tokens": 6, **fields})
        context = prompt_length(fields)
        assert streamed_text(events) == "".join(f" t{100 + context + i}" for i in range(6))
        assert events[-1] == "[DONE]" and s.migrations("resumed") == 1


# --- the router's own tokenizer renders tools as the engines do ---------------------------------------

# A template that writes the tools and the history's tool calls into the prompt, as tool-aware ones do.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] or '' }}"
    "{% for call in message.get('tool_calls') or [] %}<tool_call>{{ call['function'] | tojson }}</tool_call>"
    "{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def reference_ids(path: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
    """The template rendered by transformers itself."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(path).apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                                  tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """tokenizer_dir(template) -> a tokenizer folder (the demo's) with that chat template; None: the
    demo's own plain chatml, which never mentions tools."""
    from pdserve.engine.demo import write_tokenizer

    def make(template: str | None) -> str:
        path = tmp_path_factory.mktemp("tokenizer")
        write_tokenizer(path, 2048)
        if template is not None:
            config = json.loads((path / "tokenizer_config.json").read_text())
            (path / "tokenizer_config.json").write_text(json.dumps(dict(config, chat_template=template)))
        return str(path)

    return make


def test_the_local_tokenizer_renders_tools_as_the_template_does(tokenizer_dir):
    from pdserve.router.local_tokenizer import LocalTokenizer

    path = tokenizer_dir(TOOLS_TEMPLATE)
    local = LocalTokenizer(path, threads=1)
    try:
        assert local.knows_tools
        history = TOOL_CHAT["messages"][:4]
        expected = reference_ids(path, history, [WEATHER_TOOL])
        assert local.chat(history, True, None, [WEATHER_TOOL]) == expected
        assert len(local.chat(history, True, None, None)) < len(expected)
        # The engines' rule: `tools` replaces a chat_template_kwargs entry of that name.
        assert local.chat(QUESTION, True, {"tools": None}, [WEATHER_TOOL]) == reference_ids(path, QUESTION,
                                                                                            [WEATHER_TOOL])
    finally:
        local.close()


@pytest.mark.parametrize("template", [TOOLS_TEMPLATE, None], ids=["template-reads-tools", "plain-template"])
async def test_tools_and_tool_calls_count_toward_the_prompt_length_that_decides_p_d(tokenizer_dir, template):
    """With either kind of template the tools and the history's calls reach the prompt (a plain one
    gets the parser's description of the tools), so they count for --pd-min-prompt-tokens."""
    path = tokenizer_dir(template)
    short = len(reference_ids(path, QUESTION))
    async with stack(1, [Engine("decode")], tokenizer=path, pd_min_prompt_tokens=short + 10) as (s, client):
        await post(client, "/chat/completions", {"model": MODEL, "messages": QUESTION})
        assert s.decisions("local_only") == 1 and s.prefill[0].requests == []
        await post(client, "/chat/completions", {"model": MODEL, "messages": QUESTION, "tools": [WEATHER_TOOL]})
        assert s.decisions("disaggregated") == 1
        # tool_choice "none": the engines describe no tool, and nor does the router.
        await post(client, "/chat/completions", {"model": MODEL, "messages": QUESTION, "tools": [WEATHER_TOOL],
                                                 "tool_choice": "none"})
        assert s.decisions("local_only") == 2
        # A history whose tool call carries the bulk of the prompt is long too.
        call = {"id": "c", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": json.dumps({"city": "Paris " * 20})}}
        await post(client, "/chat/completions", {"model": MODEL, "messages": [
            QUESTION[0], {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c", "content": "ok"}]})
        assert s.decisions("disaggregated") == 2 and len(s.prefill[0].requests) == 2


# --- the model card and unknown routes -------------------------------------------------------------------

@pytest.mark.asyncio
async def test_the_router_retrieves_its_model_and_answers_unknown_routes_in_the_openai_format():
    """The official client's models.retrieve through the router; an unknown model there and an unknown
    route get OpenAI-format 404s, not FastAPI's {"detail": ...}."""
    import openai

    async with stack(0, [Engine("decode")]) as (st, _):
        client = openai.AsyncOpenAI(base_url=f"{st.url}/v1", api_key="unused", max_retries=0)
        card = await client.models.retrieve(MODEL)
        assert card.id == MODEL and card.owned_by == "pdserve"
        with pytest.raises(openai.NotFoundError) as missing:
            await client.models.retrieve("gpt-9")
        assert missing.value.body["code"] == "model_not_found"
        async with httpx.AsyncClient(base_url=st.url) as raw:
            answer = await raw.get("/v1/no-such-route")
        assert answer.status_code == 404 and set(answer.json()["error"]) == {"message", "type", "param", "code"}
        await client.close()


# --- engines at their limit ---------------------------------------------------------------------------------

@dataclass
class FullEngine(Engine):
    """An engine at its limit of waiting requests: 503 with a Retry-After (what AsyncLLM's limit answers),
    or a plain 500 for a broken one."""
    status: int = 503
    retry_after: str = "2"

    async def generate(self, request: Request) -> Response:
        self.requests.append(await request.json())
        headers = {"Retry-After": self.retry_after} if self.status == 503 else {}
        return JSONResponse({"error": {"message": "The engine has 4 requests waiting (the limit is 4)",
                                       "type": "ServiceUnavailableError", "param": None, "code": "engine_overloaded"}},
                            status_code=self.status, headers=headers)


@pytest.mark.asyncio
@pytest.mark.parametrize("stream", [False, True])
async def test_every_decode_engine_full_is_a_503_with_retry_after_not_a_502(stream):
    full = [FullEngine("decode", retry_after="1"), FullEngine("decode", retry_after="3")]
    async with stack(0, full) as (st, client):
        answer = await client.post("/completions", json={"model": MODEL, "prompt": "a b c", "stream": stream})
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["code"] == "engine_overloaded"
    assert answer.headers["retry-after"] == "3"  # the longer of the engines' waits
    assert all(len(e.requests) == 1 for e in full)  # both were tried
    assert st.router.metrics.registry.get_sample_value("pdserve_router_errors_total", {"kind": "overloaded"}) == 1


@pytest.mark.asyncio
async def test_a_full_engine_and_a_broken_one_are_a_502_and_a_full_one_beside_a_free_one_is_served():
    async with stack(0, [FullEngine("decode"), FullEngine("decode", status=500)]) as (_, client):
        answer = await client.post("/completions", json={"model": MODEL, "prompt": "a b c"})
    assert answer.status_code == 502 and answer.json()["error"]["code"] == "upstream_failed"
    free = Engine("decode")
    async with stack(0, [FullEngine("decode"), free]) as (_, client):
        for _ in range(4):  # whichever the balancer picks first, the free one serves it
            answer = await client.post("/completions", json={"model": MODEL, "prompt": "a b c"})
            assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == " t100"


@dataclass
class TokenizingEngine(Engine):
    """Answers /tokenize and /detokenize as a real engine would for a word-per-token model."""

    def app(self) -> Starlette:
        app = super().app()
        app.router.routes.append(Route("/tokenize", self.tokenize, methods=["POST"]))
        app.router.routes.append(Route("/detokenize", self.detokenize, methods=["POST"]))
        return app

    async def tokenize(self, request: Request) -> Response:
        body = await request.json()
        self.requests.append(dict(body, headers=dict(request.headers)))
        ids = [len(w) for w in body["prompt"].split()]
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": 256})

    async def detokenize(self, request: Request) -> Response:
        body = await request.json()
        self.requests.append(body)
        if any(t < 0 for t in body["tokens"]):
            return JSONResponse({"error": {"message": "token ids must be integers in [0, 256)", "type": "BadRequestError",
                                           "param": "tokens", "code": 400}}, status_code=400)
        return JSONResponse({"prompt": " ".join("x" * t for t in body["tokens"])})


@pytest.mark.asyncio
async def test_tokenize_and_detokenize_are_answered_by_an_engine_through_the_router():
    """vLLM's /tokenize and /detokenize on the router: passed on to a healthy engine with the router's
    own key (never a client's), its 4xx passed back; an unknown model never reaches an engine."""
    engine = TokenizingEngine("decode")
    async with stack(0, [engine]) as (st, _), httpx.AsyncClient(base_url=st.url, timeout=30) as client:
        answer = await client.post("/tokenize", json={"model": MODEL, "prompt": "aa bbb c"},
                                   headers={"X-PDServe-Internal-Key": "forged"})
        assert answer.status_code == 200 and answer.json()["tokens"] == [2, 3, 1]
        assert engine.requests[-1]["headers"]["x-pdserve-internal-key"] == internal_key()
        back = await client.post("/detokenize", json={"model": MODEL, "tokens": [2, 3, 1]})
        assert back.status_code == 200 and back.json() == {"prompt": "xx xxx x"}
        refused = await client.post("/detokenize", json={"model": MODEL, "tokens": [-1]})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "tokens"
        seen = len(engine.requests)
        unknown = await client.post("/tokenize", json={"model": "gpt-9", "prompt": "a"})
        assert unknown.status_code == 404 and len(engine.requests) == seen


@pytest.mark.asyncio
async def test_a_client_that_leaves_mid_body_is_no_error_and_the_router_keeps_serving(caplog):
    """A body cut off by the client (starlette's ClientDisconnect while the route reads it) was logged
    as an unhandled error with a traceback; nothing failed on this side."""
    from urllib.parse import urlsplit

    async with stack(0, [Engine("decode")]) as (st, client):
        where = urlsplit(st.url)
        reader, writer = await asyncio.open_connection(where.hostname, where.port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"model\": \"" + MODEL.encode())
        await writer.drain()
        await asyncio.sleep(0.2)  # the route is reading the body
        writer.close()
        await writer.wait_closed()
        await asyncio.sleep(0.3)
        answer = await client.post("/completions", json={"model": MODEL, "prompt": "a b c"})
        assert answer.status_code == 200
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert not errors, [r.getMessage() for r in errors]
    assert st.router.metrics.registry.get_sample_value("pdserve_router_errors_total", {"kind": "internal"}) is None
