"""The router never starves itself (issue 18): health checks have their own connections, and
tokenizing runs on worker threads after a cheap length check.

The router runs in-process (its real app under uvicorn, on a thread of its own, on a real
socket) with the tiny model's real tokenizer, in front of fake engines: small asyncio HTTP
servers that answer /health and stream completions slowly, so that many streams are in flight
at once without any model compute.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pdserve.router.app import Router, RouterSettings, build_app
from pdserve.router.pd import FlowSettings
from support.server import free_port

MODEL = "tiny"
BIG_PROMPT_CHARS = 7_800_000  # the prompt; the router's body limit is 8 MiB
DELAY_BOUND_S = 0.5  # what another request may lose while a huge one is handled (the issue: 12.9 s)


class FakeEngine:
    """/health, and completions: streamed as `chunks` pieces `interval` s apart, or answered at once."""

    def __init__(self, chunks: int = 10, interval: float = 0.05) -> None:
        self.health_checks = 0
        self.completions = 0
        app = FastAPI()

        @app.get("/health")
        async def health() -> dict[str, str]:
            self.health_checks += 1
            return {"status": "ok"}

        @app.post("/v1/completions")
        async def completions(request: Request) -> Any:
            body = json.loads(await request.body())
            self.completions += 1
            ids = bool(body.get("return_token_ids"))
            if not body.get("stream"):
                return JSONResponse({"id": "cmpl-fake", "object": "text_completion", "created": 0, "model": MODEL,
                                     "choices": [{"index": 0, "text": "x", "logprobs": None, "finish_reason": "length",
                                                  "stop_reason": None}],
                                     "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

            async def events() -> Any:
                for i in range(chunks):
                    await asyncio.sleep(interval)
                    choice = {"index": 0, "text": "x", "logprobs": None,
                              "finish_reason": "length" if i == chunks - 1 else None, "stop_reason": None}
                    if ids:
                        choice.update(token_ids=[7], **({"prompt_token_ids": [1, 2, 3]} if i == 0 else {}))
                    chunk = {"id": "cmpl-fake", "object": "text_completion", "created": 0, "model": MODEL,
                             "choices": [choice]}
                    yield f"data: {json.dumps(chunk)}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        self.app = app


@contextmanager
def serving(app: Any) -> Iterator[str]:
    """`app` under uvicorn on a thread of its own: its own event loop, a real socket."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
                                           lifespan="on", timeout_keep_alive=30))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


@contextmanager
def router_over(engines: list[str], **settings: Any) -> Iterator[tuple[Router, str]]:
    router = Router(RouterSettings(model=MODEL, health_interval=0.2, **settings), static_decode=engines)
    with serving(build_app(router)) as url:
        yield router, url


@pytest.fixture(scope="module")
def tokenizer_dir(model_dir) -> str:
    return model_dir("llama")


def test_200_streams_on_a_16_connection_pool_never_eject_an_engine():
    engine = FakeEngine(chunks=10, interval=0.05)  # 0.5 s streams: 200 over 16 connections take ~6 s
    # A generous connect bound: the router, the engine and 200 clients share this process (and its GIL).
    with serving(engine.app) as engine_url, \
            router_over([engine_url], max_connections=16, flow=FlowSettings(connect_timeout=30.0)) as (router, url):
        endpoint = router.pools.decode.endpoints[engine_url]
        changed_at = endpoint.changed_at
        samples: list[bool] = []

        async def run() -> list[str]:
            async def one(i: int) -> str:
                text = ""
                async with client.stream("POST", f"{url}/v1/completions",
                                         json={"model": MODEL, "prompt": f"stream {i}", "max_tokens": 10,
                                               "stream": True}) as response:
                    assert response.status_code == 200, await response.aread()
                    async for line in response.aiter_lines():
                        if line.startswith("data: {"):
                            payload = json.loads(line[6:])
                            assert "error" not in payload, payload
                            text += payload["choices"][0]["text"]
                return text

            async def watch() -> None:
                while True:
                    samples.append(endpoint.healthy)
                    await asyncio.sleep(0.02)

            limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
            async with httpx.AsyncClient(limits=limits, timeout=120) as client:
                watcher = asyncio.ensure_future(watch())
                try:
                    return await asyncio.gather(*(one(i) for i in range(200)))
                finally:
                    watcher.cancel()

        checks_before = engine.health_checks
        started = time.monotonic()
        texts = asyncio.run(run())
        took = time.monotonic() - started
        assert texts == ["x" * 10] * 200
        # The checks ran all along (every 0.2 s) and all passed: the engine was never ejected.
        assert engine.health_checks - checks_before >= took / 0.2 / 3, (engine.health_checks - checks_before, took)
        assert samples and all(samples)
        assert endpoint.healthy and endpoint.changed_at == changed_at


def latencies_meanwhile(url: str, busy: threading.Event, done: threading.Event) -> list[float]:
    """Small requests, one after another, from just before `busy` is set until `done` is."""
    seen = []
    with httpx.Client(timeout=30) as client:
        busy.set()
        while not done.is_set():
            started = time.monotonic()
            response = client.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hello there",
                                                                  "max_tokens": 1})
            seen.append(time.monotonic() - started)
            assert response.status_code == 200, response.text
    return seen


def with_small_requests_alongside(url: str, big_body: dict) -> tuple[httpx.Response, float, list[float], float]:
    """(the big request's answer, its seconds, the small ones' latencies meanwhile, their usual latency)."""
    with httpx.Client(timeout=30) as client:
        usual = []
        for _ in range(10):
            started = time.monotonic()
            assert client.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hello there",
                                                              "max_tokens": 1}).status_code == 200
            usual.append(time.monotonic() - started)
    payload = json.dumps(big_body).encode()
    busy, done = threading.Event(), threading.Event()
    result: dict[str, Any] = {}
    small = threading.Thread(target=lambda: result.update(seen=latencies_meanwhile(url, busy, done)), daemon=True)
    small.start()
    busy.wait(10)
    time.sleep(0.2)
    started = time.monotonic()
    try:
        big = httpx.post(f"{url}/v1/completions", content=payload, timeout=120,
                         headers={"content-type": "application/json"})
        took = time.monotonic() - started
        time.sleep(0.3)  # and a little after: a stalled loop would show here too
    finally:
        done.set()
        small.join(60)
    return big, took, result["seen"], statistics.median(usual)


def test_an_oversized_prompt_is_refused_at_once_and_delays_nobody(tokenizer_dir):
    engine = FakeEngine()
    with serving(engine.app) as engine_url, router_over([engine_url], tokenizer=tokenizer_dir) as (router, url):
        # The tiny model: 1024 positions; its tokenizer's longest entry and NFC folding bound the
        # characters a prompt that fits can have. A 7.8 MB prompt is far over it.
        limit = router.max_prompt_chars
        assert limit is not None and 1024 * 4 < limit < BIG_PROMPT_CHARS
        words = " ".join(f"word{i % 37}" for i in range(200)) + " "
        prompt = (words * (BIG_PROMPT_CHARS // len(words) + 1))[:BIG_PROMPT_CHARS]
        before = engine.completions
        big, took, seen, usual = with_small_requests_alongside(
            url, {"model": MODEL, "prompt": prompt, "max_tokens": 1})
        assert big.status_code == 400, big.text
        error = big.json()["error"]
        assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
        assert took < 5.0  # the issue: 25 s
        assert seen and max(seen) < usual + DELAY_BOUND_S, (max(seen), usual)
        assert engine.completions - before == 10 + len(seen)  # the big one never reached an engine
        # A prompt just within the bound is not refused by it (the engine judges its real length).
        fits = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "a" * limit, "max_tokens": 1},
                          timeout=60)
        assert fits.status_code == 200, fits.text
        # Chat: the user turns count.
        chat = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                          json={"model": MODEL, "messages": [{"role": "user", "content": "a" * (limit + 1)}]})
        assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"


def test_a_long_prompt_is_tokenized_off_the_event_loop(tokenizer_dir):
    """Under the bound (here: no bound at all) a long prompt is tokenized on a worker thread for
    seconds, while other requests go on as usual; it still reaches an engine."""
    engine = FakeEngine()
    with serving(engine.app) as engine_url, \
            router_over([engine_url], tokenizer=tokenizer_dir, max_prompt_chars=0) as (router, url):
        assert router.max_prompt_chars == 0
        words = " ".join(f"word{i % 37}" for i in range(200)) + " "
        prompt = words * (2_000_000 // len(words))  # about 2 s of tokenizing on one core
        big, took, seen, usual = with_small_requests_alongside(
            url, {"model": MODEL, "prompt": prompt, "max_tokens": 1})
        assert big.status_code == 200, big.text
        assert seen and max(seen) < usual + DELAY_BOUND_S, (max(seen), usual)


def test_the_length_bound_holds_for_the_texts_that_pack_most_characters_per_token(tokenizer_dir):
    """The bound must never refuse a prompt that fits: texts made to pack the most characters into
    each token (the longest vocabulary entries, long runs of spaces, special tokens, characters
    that NFC composes from several) still have at least characters / (limit / positions) tokens."""
    from pdserve.router.local_tokenizer import LocalTokenizer

    local = LocalTokenizer(tokenizer_dir)
    try:
        tokenizer = local._idle.get()
        per_token = local.char_limit / 1024  # the tiny model's max_position_embeddings
        vocab = tokenizer.get_vocab()
        longest = sorted(vocab, key=len)[-20:]
        texts = [tokenizer.decode([vocab[entry]]) * 50 for entry in longest]
        texts += [" " * 5000, "\n" * 5000, "<|endoftext|>" * 200, "a" * 5000,
                  "\u0391\u0313\u0342\u0345" * 500,  # NFC: four characters become one
                  "\u1100\u1161\u11a8" * 500]  # Hangul jamo: three become one syllable
        for text in texts:
            tokens = len(tokenizer.encode(text))
            assert len(text) <= per_token * tokens, (text[:40], len(text), tokens, per_token)
    finally:
        local.close()
