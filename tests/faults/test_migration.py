"""Streams survive their decode engine, and a prefill hold nobody pulls is released (issue 18).

Real processes: one prefill engine (p2p producer), three decode engines (p2p consumers) and a
`pdserve router` in front, all on 127.0.0.1, one set for the module. Cases:
- n>1 and a decode-side 400 (max_tokens past the context: the prefill leg passes, since it asks
  for one token) leave no block held on the prefill engine within 1 s;
- a streamed greedy request (completions through P/D, and chat) whose decode engine is killed
  (SIGKILL of its process group) mid-stream completes on another engine, and its text and token
  ids equal an uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any, Iterator

import httpx
import pytest

from support.server import ServerProcess, free_port, launch_server, p2p_config, wait_healthy
from support.scrape import metric_total as metric

MODEL = "tiny"
MAX_MODEL_LEN = 4096
HELD = "pdserve:kv_blocks_held_for_remote"
FREED_WITHIN_S = 1.0
# Long enough (for the router's estimate, 4 characters a token) to take the P/D path at 64 tokens.
LONG_PROMPT = " ".join(f"word{i % 31}" for i in range(60))
# Tokens a migrated stream asks for: its engine is stopped once the client has KILL_AFTER chunks
# of text, which must be long before the end on any machine. The tiny model decodes a token in about
# 1.3 ms here, and the engine's whole answer fits the sockets' buffers: at 320 tokens (0.4 s) a client
# starved of CPU by four engines on two cores once read its 4th chunk after the engine had finished,
# with no stream left to kill. At 2000 (about 2 s) it happened again once, in a fault suite run after
# stop 53's faster kernels; 3800 (under the 4096 context with the prompt) give it about 4 s.
STREAM_TOKENS = 3800
KILL_AFTER = 4


def wait_for(predicate, timeout: float, message: str) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{message} (after {timeout}s)")
        time.sleep(0.05)
    return time.monotonic() - start


def kill(server: ServerProcess) -> None:
    try:
        os.killpg(server.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    server.proc.wait()


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory) -> Iterator[tuple[ServerProcess, list[ServerProcess], ServerProcess]]:
    tmp = tmp_path_factory.mktemp("migration")
    common = ("--served-model-name", MODEL, "--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", "320")
    model = model_dir("llama_long")
    prefill = launch_server(model, *common, "--kv-transfer-config", p2p_config("kv_producer", transport="tcp"),
                            tmp_path=tmp)
    decode = [launch_server(model, *common, "--kv-transfer-config", p2p_config("kv_consumer", transport="tcp"),
                            tmp_path=tmp) for _ in range(3)]
    router: ServerProcess | None = None
    try:
        for server in (prefill, *decode):
            wait_healthy(server.url, server.proc, server.log_path)
        port = free_port()
        log_path = tmp / "router.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "pdserve", "router", "--model", MODEL, "--port", str(port),
                 "--prefill", prefill.url, "--decode", *(d.url for d in decode), "--pd-min-prompt-tokens", "64",
                 "--health-interval", "0.5"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=dict(os.environ, PYTHONSAFEPATH="1"))
        router = ServerProcess(proc, port, log_path)
        wait_healthy(router.url, router.proc, router.log_path, timeout=60)
        yield prefill, decode, router
    finally:
        for server in (router, prefill, *decode):
            if server is not None:
                kill(server)


# --- prefill holds nobody pulls ----------------------------------------------------------------------

def test_n_above_one_and_a_decode_400_leave_no_held_blocks(stack):
    prefill, _, router = stack
    decisions = "pdserve_router_pd_decisions_total"
    multi_before = metric(router.url, decisions, decision="local_multi_choice")
    # n=2 is served by a decode engine alone: no prefill leg, nothing held.
    answer = httpx.post(f"{router.base_url}/completions", timeout=120, json={
        "model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 4, "n": 2, "temperature": 0})
    assert answer.status_code == 200 and len(answer.json()["choices"]) == 2
    wait_for(lambda: metric(prefill.url, HELD) == 0, FREED_WITHIN_S, "blocks held after n=2")
    assert metric(router.url, decisions, decision="local_multi_choice") == multi_before + 1

    # max_tokens past the context: the prefill leg (one token) passes and holds the prompt, the
    # decode engine refuses; the client gets that 400 and the hold is released at once.
    prefill_requests = metric(prefill.url, "vllm:request_success_total")
    refused = httpx.post(f"{router.base_url}/completions", timeout=120, json={
        "model": MODEL, "prompt": LONG_PROMPT, "max_tokens": MAX_MODEL_LEN, "temperature": 0})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
    answered = time.monotonic()
    wait_for(lambda: metric(prefill.url, HELD) == 0, FREED_WITHIN_S, "blocks still held after a decode 400")
    assert time.monotonic() - answered < FREED_WITHIN_S + 0.5
    assert metric(prefill.url, "vllm:request_success_total") == prefill_requests + 1  # the prefill leg ran
    # The engine said it freed them (not that they were gone already).
    wait_for(lambda: metric(router.url, "pdserve_router_kv_releases_total", outcome="released") == 1, 5,
             "the router's release")


# --- mid-stream migration ----------------------------------------------------------------------------

def stream(router: ServerProcess, path: str, body: dict[str, Any], after_chunks=None) -> list[dict[str, Any] | str]:
    """A streamed answer's events; `after_chunks()` runs once KILL_AFTER chunks of text have come."""
    events: list[dict[str, Any] | str] = []
    with httpx.stream("POST", f"{router.base_url}{path}", json=dict(body, stream=True), timeout=120) as response:
        assert response.status_code == 200, response.read()
        texts = 0
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
            if isinstance(events[-1], dict) and any(
                    c.get("text") or (c.get("delta") or {}).get("content") for c in events[-1]["choices"]):
                texts += 1
                if after_chunks is not None and texts == KILL_AFTER:
                    after_chunks()
    return events


def text_and_ids(events: list[dict[str, Any] | str]) -> tuple[str, list[int]]:
    text, ids = "", []
    for event in events:
        assert not (isinstance(event, dict) and "error" in event), event
        for choice in event["choices"] if isinstance(event, dict) else ():
            text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            ids += choice.get("token_ids") or []
    return text, ids


def kill_the_serving_engine(router: ServerProcess, decode: list[ServerProcess], killed: list[ServerProcess]) -> None:
    """Freeze (SIGSTOP) the decode engine the stream is on at once, then kill its process group."""
    serving = [d for d in decode if metric(router.url, "pdserve_router_in_flight", pool="decode", endpoint=d.url) == 1]
    assert len(serving) == 1, [metric(router.url, "pdserve_router_in_flight", endpoint=d.url) for d in decode]
    os.killpg(serving[0].proc.pid, signal.SIGSTOP)
    kill(serving[0])
    killed.append(serving[0])


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_a_stream_whose_decode_engine_dies_completes_on_another_equal_to_greedy(stack, route):
    prefill, decode, router = stack
    alive = [d for d in decode if d.proc.poll() is None]
    wait_for(lambda: metric(router.url, "pdserve_router_endpoint_healthy", pool="decode") == len(alive), 10,
             "the router to see the decode engines as they are")
    if route == "chat":
        path, body = "/chat/completions", {"messages": [{"role": "user", "content": "Tell me about dragons."}]}
    else:  # through the P/D path: the decode engine pulled the prompt's KV before it dies
        path, body = "/completions", {"prompt": LONG_PROMPT, "return_token_ids": True}
    body.update(model=MODEL, max_tokens=STREAM_TOKENS, temperature=0, ignore_eos=True,
                stream_options={"include_usage": True})
    reference = stream(router, path, body)
    migrations = metric(router.url, "pdserve_router_migrations_total", outcome="resumed")

    killed: list[ServerProcess] = []
    started = time.monotonic()
    migrated = stream(router, path, body, after_chunks=lambda: kill_the_serving_engine(router, alive, killed))
    assert time.monotonic() - started < 60
    assert killed and killed[0].proc.poll() is not None
    assert metric(router.url, "pdserve_router_migrations_total", outcome="resumed") == migrations + 1
    text, ids = text_and_ids(migrated)
    want_text, want_ids = text_and_ids(reference)
    assert ids == want_ids and (route == "chat" or len(ids) == STREAM_TOKENS)
    assert text == want_text
    # One stream: one id, one [DONE], usage over the whole answer.
    chunks = [e for e in migrated if isinstance(e, dict)]
    assert len({c["id"] for c in chunks}) == 1 and migrated.count("[DONE]") == 1 and migrated[-1] == "[DONE]"
    assert chunks[-1]["usage"]["completion_tokens"] == STREAM_TOKENS
    assert chunks[-1]["usage"]["prompt_tokens"] == next(e for e in reference if isinstance(e, dict) and e.get("usage")
                                                        )["usage"]["prompt_tokens"]
