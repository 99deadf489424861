"""A fake OpenAI-compatible server (real uvicorn on 127.0.0.1, in a background thread) and a tiny
locally trained tokenizer, for testing the load generator against real sockets."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

KNOWN_FIELDS = {"model", "prompt", "messages", "max_tokens", "stream", "stream_options", "temperature"}


@dataclass
class Behaviour:
    """How the fake server answers; tests change it between runs."""

    model: str = "fake-model"
    first_delay: float = 0.003
    chunk_delay: float = 0.001
    send_done: bool = True
    send_usage: bool = True
    tokens_per_chunk: int = 1
    # Put vLLM-style `token_ids` in each choice, so the client can see multi-token chunks.
    token_ids: bool = False
    # 400 for prompts matching this regex.
    reject_pattern: str | None = None
    # 422 for any request field outside KNOWN_FIELDS, the way strict pydantic models answer.
    reject_unknown_fields: bool = False
    # Send this many tokens, then go silent until the client gives up.
    stall_after: int | None = None
    # Send this many tokens, then an error event in the stream (as vLLM does) and end the body.
    error_after: int | None = None
    # Send this many tokens, then drop the connection mid-body (no terminating chunk).
    abort_after: int | None = None
    # Without ignore_eos, stop after this many tokens (as if the model emitted EOS).
    eos_after: int | None = None
    crlf: bool = False
    # Deliver each event in two writes, cut in the middle of the line.
    split_events: bool = False
    # Interleave SSE comment lines (keep-alives).
    comments: bool = False
    # Answer with one JSON body even though stream=true was asked.
    ignore_stream: bool = False


@dataclass
class Served:
    """What the server did for one request."""

    body: dict[str, Any]
    status: int
    tokens_sent: int = 0
    headers: dict[str, str] = field(default_factory=dict)


class FakeOpenAI:
    def __init__(self, behaviour: Behaviour) -> None:
        self.behaviour = behaviour
        self.served: list[Served] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.app = self._build_app()

    def reset(self, behaviour: Behaviour | None = None) -> None:
        if behaviour is not None:
            self.behaviour = behaviour
        self.served = []
        self.in_flight = 0
        self.max_in_flight = 0

    def _build_app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": self.behaviour.model, "object": "model"},
                                               {"id": "other-model", "object": "model"}]}

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await self._answer(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            return await self._answer(request, chat=True)

        return app

    async def _answer(self, request: Request, chat: bool):
        b = self.behaviour
        body = await request.json()
        served = Served(body=body, status=200, headers=dict(request.headers))
        self.served.append(served)
        unknown = sorted(set(body) - KNOWN_FIELDS)
        if b.reject_unknown_fields and unknown:
            served.status = 422
            detail = [{"type": "extra_forbidden", "loc": ["body", name], "msg": "Extra inputs are not permitted"}
                      for name in unknown]
            return JSONResponse({"detail": detail}, status_code=422)
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        if b.reject_pattern and re.search(b.reject_pattern, prompt):
            served.status = 400
            return JSONResponse({"error": {"message": "prompt rejected by policy", "type": "BadRequestError",
                                           "code": 400}}, status_code=400)
        n_tokens = body["max_tokens"]
        if b.eos_after is not None and not body.get("ignore_eos"):
            n_tokens = min(n_tokens, b.eos_after)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        prompt_tokens = len(prompt.split())
        if b.ignore_stream:
            served.tokens_sent = n_tokens
            text = "".join(f" t{i}" for i in range(n_tokens))
            choice = {"index": 0, "message": {"role": "assistant", "content": text}} if chat else \
                {"index": 0, "text": text}
            return JSONResponse({"choices": [choice | {"finish_reason": "length"}],
                                 "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n_tokens}})
        return StreamingResponse(self._events(served, chat, n_tokens, prompt_tokens, include_usage),
                                 media_type="text/event-stream")

    async def _events(self, served: Served, chat: bool, n_tokens: int, prompt_tokens: int,
                      include_usage: bool) -> AsyncIterator[bytes]:
        b = self.behaviour
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            base = {"id": "cmpl-fake", "created": int(time.time()), "model": b.model,
                    "object": "chat.completion.chunk" if chat else "text_completion"}
            if chat:  # like vLLM and OpenAI: a role-only first delta that carries no content
                yield self._frame(base | {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                      "finish_reason": None}]})
            await asyncio.sleep(b.first_delay)
            sent = 0
            while sent < n_tokens:
                if b.stall_after is not None and sent >= b.stall_after:
                    await asyncio.sleep(3600)
                if b.error_after is not None and sent >= b.error_after:
                    yield self._frame({"error": {"object": "error", "message": "engine died", "code": 500}})
                    return
                if b.abort_after is not None and sent >= b.abort_after:
                    raise ConnectionAbortedError("fake server drops the stream on purpose")
                k = min(b.tokens_per_chunk, n_tokens - sent)
                text = "".join(f" t{sent + j}" for j in range(k))
                finish = "length" if sent + k == n_tokens else None
                choice: dict[str, Any] = ({"index": 0, "delta": {"content": text}} if chat
                                          else {"index": 0, "text": text, "logprobs": None})
                choice["finish_reason"] = finish
                if b.token_ids:
                    choice["token_ids"] = list(range(sent, sent + k))
                sent += k
                served.tokens_sent = sent
                frame = self._frame(base | {"choices": [choice]})
                if b.split_events:
                    cut = len(frame) // 2
                    yield frame[:cut]
                    await asyncio.sleep(0)
                    yield frame[cut:]
                else:
                    yield frame
                if b.comments:
                    yield self._line_end(b": keep-alive") + self._line_end(b"")
                if sent < n_tokens:
                    await asyncio.sleep(b.chunk_delay)
            if include_usage and b.send_usage:
                usage = {"prompt_tokens": prompt_tokens, "completion_tokens": sent,
                         "total_tokens": prompt_tokens + sent}
                yield self._frame(base | {"choices": [], "usage": usage})
            if b.send_done:
                yield self._line_end(b"data: [DONE]") + self._line_end(b"")
        finally:
            self.in_flight -= 1

    def _frame(self, doc: dict[str, Any]) -> bytes:
        return self._line_end(b"data: " + json.dumps(doc).encode()) + self._line_end(b"")

    def _line_end(self, line: bytes) -> bytes:
        return line + (b"\r\n" if self.behaviour.crlf else b"\n")


class RunningServer:
    def __init__(self, fake: FakeOpenAI) -> None:
        self.fake = fake
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(fake.app, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self) -> "RunningServer":
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("fake OpenAI server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


@pytest.fixture(scope="module")
def fake_server():
    """One running fake server per test module; each test sets its behaviour with `server.fake.reset(...)`."""
    running = RunningServer(FakeOpenAI(Behaviour())).start()
    yield running
    running.stop()


@pytest.fixture
def server(fake_server):
    fake_server.fake.reset(Behaviour())
    return fake_server


CORPUS = """
The quick brown fox jumps over the lazy dog. A benchmark sends many requests and measures how long
each one takes, from the first byte to the last. Servers stream tokens as they are generated, and
clients read them as events. Prefill computes the prompt; decode produces one token at a time.
Latency percentiles tell more than averages: the slowest requests are the ones users remember.
""" * 20


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> str:
    """A byte-level BPE trained here on a few paragraphs, saved as a Hugging Face tokenizer directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    out = tmp_path_factory.mktemp("tokenizer")
    wrapped.save_pretrained(out)
    return str(out)
