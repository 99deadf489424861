"""The router's P/D flow under engine faults, against fake engines on 127.0.0.1 (router-only logic).

The router runs in-process (its app served by uvicorn on a real socket); the engines are small
HTTP servers in the same event loop whose faults a test switches on: a decode engine that stalls
after two chunks, one that never answers, one that answers 400, a prefill engine that records
`/v1/kv/release`. Their "model" is deterministic (the token at position i is 100 + i, text " t<id>"),
so a stream continued on another engine can be checked against an uninterrupted one exactly.
Real engines across a real kill: tests/faults/test_migration.py.
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from pdserve.engine.internal_auth import HEADER as INTERNAL_HEADER
from pdserve.router.app import Router, RouterSettings, build_app
from pdserve.router.endpoints import Health, Pools
from pdserve.router.feed import FeedState
from pdserve.router.metrics import RouterMetrics
from pdserve.router.pd import FlowSettings, PDFlow
from support.asgi_serving import read_stream, serve_all, serving
from support.auth import internal_key

MODEL = "tiny"
PARAMS = {"do_remote_prefill": True, "remote_engine_id": "fake-prefill", "remote_block_ids": [3, 4],
          "remote_host": "127.0.0.1", "remote_port": 1, "remote_tp_size": 1}


# --- fake engines ----------------------------------------------------------------------------------

# A token that ends inside a multi-byte character: an engine holds its text back and sends it with
# the next token's (its chunk carries the id and no text).
HELD_BACK = {103}


def next_tokens(context: int, count: int) -> list[int]:
    """The fake model: the token at position i is 100 + i, whatever came before."""
    return [100 + context + i for i in range(count)]


def text_of(ids: list[int]) -> str:
    return "".join(f" t{i}" for i in ids)


def prompt_ids(body: dict[str, Any]) -> list[int]:
    if "messages" in body:
        return list(range(1, 1 + sum(len(m["content"].split()) for m in body["messages"])))
    prompt = body["prompt"]
    return list(prompt) if isinstance(prompt, list) else list(range(1, 1 + len(prompt.split())))


@dataclass
class Fault:
    status: int = 200                # answer this status (with an OpenAI error body) instead
    hang: bool = False               # never answer
    stall_after: int | None = None   # stream this many token chunks, then go silent
    stall_continuations: bool = True  # False: continuations of a broken stream (prompt ids) run through
    health: int = 200


@dataclass
class FakeEngine:
    role: str                        # "prefill" or "decode"
    fault: Fault = field(default_factory=Fault)
    requests: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    releases: list[tuple[dict[str, Any], dict[str, str]]] = field(default_factory=list)
    active: int = 0
    most_active: int = 0
    url: str = ""

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/health", self.health_route), Route("/v1/kv/release", self.release,
                                                                             methods=["POST"]),
                                 Route("/v1/completions", self.generate, methods=["POST"]),
                                 Route("/v1/chat/completions", self.generate, methods=["POST"])])

    async def health_route(self, _: Request) -> Response:
        return Response(status_code=self.fault.health)

    async def release(self, request: Request) -> Response:
        if request.headers.get(INTERNAL_HEADER) != internal_key():
            return JSONResponse({"error": {"message": "no key"}}, status_code=403)
        self.releases.append((await request.json(), dict(request.headers)))
        return JSONResponse({"released": True})

    async def generate(self, request: Request) -> Response:
        body = await request.json()
        self.requests.append(body)
        self.headers.append(dict(request.headers))
        self.active += 1
        self.most_active = max(self.most_active, self.active)
        streaming = False  # once True, the stream's own `finally` counts the request out
        try:
            if self.fault.hang:
                await asyncio.sleep(3600)
            if self.fault.status != 200:
                return JSONResponse({"error": {"message": "refused", "type": "BadRequestError", "param": None,
                                               "code": self.fault.status}}, status_code=self.fault.status)
            if self.role == "prefill":
                return JSONResponse({"id": "cmpl-p", "object": "text_completion", "created": 1, "model": MODEL,
                                     "choices": [{"index": 0, "text": " t0", "finish_reason": "length"}],
                                     "kv_transfer_params": PARAMS})
            if not body.get("stream"):
                ids = next_tokens(len(prompt_ids(body)), body.get("max_tokens") or 4)
                return JSONResponse({"id": "cmpl-d", "object": "text_completion", "created": 1, "model": MODEL,
                                     "choices": [{"index": 0, "text": text_of(ids), "finish_reason": "length"}]})
            streaming = True
            return StreamingResponse(self.stream(request.url.path, body), media_type="text/event-stream")
        finally:
            if not streaming:
                self.active -= 1

    async def stream(self, path: str, body: dict[str, Any]) -> AsyncIterator[str]:
        try:
            chat = path.endswith("chat/completions")
            prompt = prompt_ids(body)
            wants_ids = bool(body.get("return_token_ids"))
            max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 4
            base = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{len(self.requests)}", "created": 7 + len(self.requests),
                    "model": MODEL, "object": "chat.completion.chunk" if chat else "text_completion"}

            def event(choice: dict[str, Any]) -> str:
                return f"data: {json.dumps(dict(base, choices=[choice]))}\n\n"

            first = {"prompt_token_ids": prompt} if wants_ids else {}
            if chat:
                yield event({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None, **first})
                first = {}
            stalls = self.fault.stall_after is not None and (self.fault.stall_continuations
                                                              or not isinstance(body.get("prompt"), list))
            held = ""
            for n, token in enumerate(next_tokens(len(prompt), max_tokens)):
                if stalls and n == self.fault.stall_after:
                    await asyncio.sleep(3600)
                finish = "length" if n == max_tokens - 1 else None
                extra = dict(first, token_ids=[token]) if wants_ids else {}
                first = {}
                if token in HELD_BACK and finish is None:
                    text, held = "", held + f" t{token}"
                else:
                    text, held = held + f" t{token}", ""
                if chat:
                    yield event({"index": 0, "delta": {"content": text}, "finish_reason": finish, **extra})
                else:
                    yield event({"index": 0, "text": text, "finish_reason": finish, **extra})
                await asyncio.sleep(0.01)
            if (body.get("stream_options") or {}).get("include_usage"):
                yield f"data: {json.dumps(dict(base, choices=[], usage={'prompt_tokens': len(prompt)}))}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            self.active -= 1


@dataclass
class Stack:
    url: str
    router: Router
    prefill: list[FakeEngine]
    decode: list[FakeEngine]

    def metric(self, name: str, **labels: str) -> float:
        """A counter of the router, e.g. metric("migrations", outcome="resumed")."""
        value = self.router.metrics.registry.get_sample_value(f"pdserve_router_{name}_total", labels)
        return value or 0.0

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=f"{self.url}/v1", timeout=60)


@asynccontextmanager
async def stack(prefill: list[Fault] = (), decode: list[Fault] = (), **flow: Any) -> AsyncIterator[Stack]:
    """Fake engines with these faults behind an in-process router (P/D for every prompt)."""
    engines = [FakeEngine("prefill", f) for f in prefill] + [FakeEngine("decode", f) for f in decode]
    async with serve_all(engines) as urls:
        for engine, url in zip(engines, urls):
            engine.url = url
        settings = RouterSettings(model=MODEL, health_interval=flow.pop("health_interval", 60.0),
                                  internal_key=internal_key().encode(),
                                  flow=FlowSettings(pd_min_prompt_tokens=0, **flow))
        router = Router(settings, [e.url for e in engines if e.role == "prefill"],
                        [e.url for e in engines if e.role == "decode"])
        async with serving(build_app(router)) as url:
            yield Stack(url, router, [e for e in engines if e.role == "prefill"],
                        [e for e in engines if e.role == "decode"])


def streamed_text(events: list[dict[str, Any] | str]) -> str:
    text = ""
    for e in events:
        if isinstance(e, dict):
            for c in e.get("choices", ()):
                text += c.get("text") or (c.get("delta") or {}).get("content") or ""
    return text


async def eventually(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


# --- never disaggregate what will not be pulled ------------------------------------------------------

async def test_n_above_one_never_reaches_the_prefill_engine():
    async with stack([Fault()], [Fault()]) as s, s.client() as client:
        for extra in ({"n": 2}, {"n": 3, "stream": True}, {"best_of": 2, "n": 1}):
            answer = await client.post("/completions", json={"model": MODEL, "prompt": "a b c", "max_tokens": 2,
                                                             **extra})
            assert answer.status_code == 200
        assert s.prefill[0].requests == []
        assert all("kv_transfer_params" not in body for body in s.decode[0].requests)
        assert s.metric("pd_decisions", decision="local_multi_choice") == 3
        # One choice is disaggregated as before.
        assert (await client.post("/completions", json={"model": MODEL, "prompt": "a b c", "max_tokens": 2})
                ).status_code == 200
        assert len(s.prefill[0].requests) == 1 and s.decode[0].requests[-1]["kv_transfer_params"] == PARAMS


# --- only when busy (`pdserve up`): an idle decode engine computes the prompt itself ------------------

async def test_only_when_busy_an_idle_decode_engine_takes_the_prompt_and_busy_ones_get_it_disaggregated():
    async with stack([Fault()], [Fault(stall_after=1), Fault(stall_after=1)], pd_only_when_busy=True) as s, \
            s.client() as client:
        body = {"model": MODEL, "prompt": "a b c", "max_tokens": 3}
        # Two streams that stall after their first token hold one decode engine each.
        streams = [asyncio.ensure_future(read_stream(client, "/completions", body)) for _ in range(2)]
        await eventually(lambda: [d.active for d in s.decode] == [1, 1])
        assert s.prefill[0].requests == []
        assert all("kv_transfer_params" not in r for d in s.decode for r in d.requests)
        assert s.metric("pd_decisions", decision="local_decode_idle") == 2
        # Every decode engine busy: the next prompt goes through the prefill engine.
        answer = await client.post("/completions", json=body)
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == text_of(next_tokens(3, 3))
        assert len(s.prefill[0].requests) == 1
        assert [r["kv_transfer_params"] for d in s.decode for r in d.requests if "kv_transfer_params" in r] == [PARAMS]
        assert s.metric("pd_decisions", decision="disaggregated") == 1
        for stream in streams:
            stream.cancel()
        await eventually(lambda: [d.active for d in s.decode] == [0, 0])
        # Idle again: no prefill leg.
        assert (await client.post("/completions", json=body)).status_code == 200
        assert len(s.prefill[0].requests) == 1 and s.metric("pd_decisions", decision="local_decode_idle") == 3


# --- releasing prefill holds nobody pulls ------------------------------------------------------------

@pytest.mark.parametrize("fault, expected_status", [(Fault(status=400), 400), (Fault(status=500), 502)])
async def test_a_refused_or_failed_decode_leg_releases_the_prefill_hold(fault, expected_status):
    async with stack([Fault()], [fault]) as s, s.client() as client:
        answer = await client.post("/completions", json={"model": MODEL, "prompt": "a b c", "max_tokens": 2})
        assert answer.status_code == expected_status
        await eventually(lambda: len(s.prefill[0].releases) == 1)
        body, headers = s.prefill[0].releases[0]
        assert body == {"kv_transfer_params": PARAMS}
        assert headers[INTERNAL_HEADER.lower()] == internal_key()
        await s.router.flow.releaser.drain()  # the engine's answer reaches the router after its record
        assert s.metric("kv_releases", outcome="released") == 1


async def test_a_client_leaving_before_the_first_byte_releases_the_hold_and_a_pulled_one_is_kept():
    async with stack([Fault()], [Fault(hang=True)]) as s, s.client() as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.post("/completions", json={"model": MODEL, "prompt": "a b", "max_tokens": 2}, timeout=0.5)
        await eventually(lambda: len(s.prefill[0].releases) == 1)
        # Served in full: the decode engine pulled the blocks itself, nothing to release.
        s.decode[0].fault.hang = False
        for stream in (False, True):
            body = {"model": MODEL, "prompt": "a b", "max_tokens": 2}
            if stream:
                assert streamed_text(await read_stream(client, "/completions", body)) == text_of(next_tokens(2, 2))
            else:
                assert (await client.post("/completions", json=body)).status_code == 200
        await s.router.flow.releaser.drain()
        assert len(s.prefill[0].releases) == 1


# --- stale engines --------------------------------------------------------------------------------

def test_stale_engines_get_no_new_picks_unless_all_are_stale():
    pools = Pools("least-loaded")
    urls = ["http://127.0.0.1:9001", "http://127.0.0.1:9002", "http://127.0.0.1:9003"]
    pools.decode.replace(urls)
    pools.prefill.replace(["http://127.0.0.1:9101", "http://127.0.0.1:9102"])
    feed = FeedState()
    stale = {"127.0.0.1:9001", "127.0.0.1:9101"}

    def publish() -> None:
        feed.apply({"engines": [{"id": a, "address": a, "waiting": 0, "running": 0, "stale": a in stale}
                                for a in ["127.0.0.1:9001", "127.0.0.1:9002", "127.0.0.1:9003",
                                          "127.0.0.1:9101", "127.0.0.1:9102"]]})

    publish()
    flow = PDFlow(pools, Health(), None, RouterMetrics(), FlowSettings(), feed)  # type: ignore[arg-type]
    decode_picks = {flow.pick(pools.decode, None).url for _ in range(20)}
    assert decode_picks == set(urls[1:])
    assert {flow.pick(pools.prefill, None).url for _ in range(10)} == {"http://127.0.0.1:9102"}
    stale |= {"127.0.0.1:9002", "127.0.0.1:9003", "127.0.0.1:9102"}  # all stale: better one than none
    publish()
    assert {flow.pick(pools.decode, None).url for _ in range(20)} == set(urls)
    assert flow.pick(pools.prefill, None) is not None


# --- time bounds, ejection, failover ---------------------------------------------------------------

async def test_a_decode_engine_silent_before_its_first_byte_is_retried_elsewhere():
    async with stack([], [Fault(hang=True), Fault(hang=True)], decode_first_byte_timeout=0.5) as s:
        s.decode[1].fault.hang = False
        async with s.client() as client:
            for _ in range(2):
                events = await read_stream(client, "/completions", {"model": MODEL, "prompt": "x y", "max_tokens": 3})
                assert streamed_text(events) == text_of(next_tokens(2, 3)) and events[-1] == "[DONE]"
        assert s.metric("legs_interrupted", leg="decode", cause="timeout") >= 1
        assert s.metric("retries", pool="decode") >= 1


async def test_an_ejected_prefill_engine_leaves_the_prompt_to_the_decode_engine_at_once():
    async with stack([Fault(hang=True)], [Fault()], prefill_timeout=60, health_interval=0.2) as s, \
            s.client() as client:
        request = asyncio.ensure_future(client.post("/completions", json={"model": MODEL, "prompt": "a b",
                                                                           "max_tokens": 2}))
        await eventually(lambda: len(s.prefill[0].requests) == 1)
        started = time.monotonic()
        s.prefill[0].fault.health = 503  # as a frozen core's /health does
        answer = await request
        assert answer.status_code == 200 and time.monotonic() - started < 5  # not the 60 s bound
        assert s.metric("pd_decisions", decision="prefill_failed") == 1
        assert "kv_transfer_params" not in s.decode[0].requests[0]


@pytest.mark.parametrize("route", ["completions", "chat"])
async def test_a_stream_that_stalls_mid_way_continues_on_another_engine(route):
    stall = Fault(stall_after=2, stall_continuations=False)
    async with stack([], [stall, Fault(**vars(stall))], decode_idle_timeout=0.5) as s, s.client() as client:
        body: dict[str, Any] = {"model": MODEL, "max_tokens": 6, "stream_options": {"include_usage": True}}
        body.update({"messages": [{"role": "user", "content": "one two three"}]} if route == "chat"
                    else {"prompt": "one two three"})
        path = "/chat/completions" if route == "chat" else "/completions"
        events = await read_stream(client, path, body)
        # The original request and its continuation (a prompt of token ids), whichever engine got which.
        (first,), (continued,) = sorted((e.requests for e in s.decode),
                                        key=lambda requests: isinstance(requests[0].get("prompt"), list))
        assert first["return_token_ids"] is True
        # The continuation: prompt + the two tokens streamed, the rest of max_tokens, a plain completion.
        assert continued["prompt"] == [1, 2, 3] + next_tokens(3, 2) and continued["max_tokens"] == 4
        assert continued["stream"] is True and "kv_transfer_params" not in continued
        # One stream as the client sees it: its id and format throughout, no ids it did not ask for.
        assert streamed_text(events) == text_of(next_tokens(3, 6))
        chunks = [e for e in events if isinstance(e, dict)]
        assert {c["id"] for c in chunks} == {chunks[0]["id"]} and {c["created"] for c in chunks} == {chunks[0]["created"]}
        expected_object = "chat.completion.chunk" if route == "chat" else "text_completion"
        assert {c["object"] for c in chunks} == {expected_object}
        assert all("token_ids" not in c and "prompt_token_ids" not in c for e in chunks for c in e["choices"])
        assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
        assert chunks[-1]["usage"]["prompt_tokens"] == 3 and chunks[-1]["usage"]["completion_tokens"] == 6
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
        assert s.metric("migrations", outcome="resumed") == 1


async def test_ejecting_an_engine_cuts_its_stalled_stream_at_once():
    stall = Fault(stall_after=2, stall_continuations=False)
    async with stack([], [stall, Fault(**vars(stall))], decode_idle_timeout=60, health_interval=0.2) as s, \
            s.client() as client:
        body = {"model": MODEL, "prompt": "p q", "max_tokens": 5, "return_token_ids": True}
        reading = asyncio.ensure_future(read_stream(client, "/completions", body))
        await eventually(lambda: any(e.requests for e in s.decode))
        stalled = next(e for e in s.decode if e.requests)
        await asyncio.sleep(0.3)
        started = time.monotonic()
        stalled.fault.health = 503
        events = await reading
        assert time.monotonic() - started < 5  # the ejection, not the 60 s idle bound
        # The engine stalled after 102 and 103, whose text it held back: the seam goes before 103.
        (continued,) = next(e for e in s.decode if e is not stalled).requests
        assert continued["prompt"] == [1, 2, 102] and continued["max_tokens"] == 4
        assert streamed_text(events) == text_of(next_tokens(2, 5))
        # The client asked for token ids itself: they stay, and add up to the whole output.
        chunks = [e for e in events if isinstance(e, dict) and e["choices"]]
        assert [i for c in chunks for i in c["choices"][0]["token_ids"]] == next_tokens(2, 5)
        assert chunks[0]["choices"][0]["prompt_token_ids"] == [1, 2]
        assert s.metric("legs_interrupted", leg="decode", cause="ejected") == 1


async def test_a_stream_out_of_migrations_ends_with_an_error_event():
    async with stack([], [Fault(stall_after=1), Fault(stall_after=1), Fault(stall_after=1)],
                     decode_idle_timeout=0.3, migration_limit=1) as s, s.client() as client:
        events = await read_stream(client, "/completions", {"model": MODEL, "prompt": "x", "max_tokens": 5})
        assert events[-1] == "[DONE]" and "error" in events[-2]
        assert "mid-stream" in events[-2]["error"]["message"]
        assert streamed_text(events) == text_of(next_tokens(1, 2))  # one token from each engine
        assert s.metric("migrations", outcome="resumed") == 1 and s.metric("migrations", outcome="failed") == 1
        # Several choices cannot be continued: an error event at once.
        events = await read_stream(client, "/completions", {"model": MODEL, "prompt": "x", "max_tokens": 5, "n": 2})
        assert "error" in events[-2] and "single-choice" in events[-2]["error"]["message"]


# --- connection limits ---------------------------------------------------------------------------

async def test_legs_to_one_endpoint_never_exceed_the_limit():
    async with stack([], [Fault(stall_after=0)], max_connections_per_endpoint=2, decode_first_byte_timeout=30,
                     request_timeout=30) as s, s.client() as client:
        decode = s.decode[0]
        body = {"model": MODEL, "prompt": "a", "max_tokens": 2}
        streams = [asyncio.ensure_future(read_stream(client, "/completions", body)) for _ in range(5)]
        await eventually(lambda: decode.active == 2)
        await asyncio.sleep(0.3)
        assert decode.active == 2 and len(decode.requests) == 2  # three wait for a slot
        decode.fault.stall_after = None
        for stream in streams[:2]:
            stream.cancel()  # the two stalled streams' clients give up: their slots free up
        results = await asyncio.gather(*streams[2:])
        assert all(streamed_text(events) == text_of(next_tokens(1, 2)) for events in results)
        assert decode.most_active == 2
        # Waiting for a slot counts toward the leg's bound.
        s.router.flow.settings.decode_first_byte_timeout = 0.3
        decode.fault.stall_after = 0
        stalled = [asyncio.ensure_future(read_stream(client, "/completions", body)) for _ in range(2)]
        await eventually(lambda: decode.active == 2)
        answer = await client.post("/completions", json=dict(body, stream=True))
        assert answer.status_code == 502 and "first byte" in answer.json()["error"]["message"]
        for stream in stalled:
            stream.cancel()
