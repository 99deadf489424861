"""The load generator against a real (fake) OpenAI server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import math
import re

import pytest

from pdserve.bench.loadgen import (LoadConfig, LoadError, LoadResult, build_workload, endpoint_url,
                                   normalize_base_url, run_load, run_load_sync)

# Every run is bounded; a hang fails the test instead of stalling the suite.
RUN_LIMIT_S = 30


def cfg(server, **kw) -> LoadConfig:
    kw.setdefault("num_requests", 12)
    kw.setdefault("concurrency", 4)
    kw.setdefault("input_len", (4, 12))
    kw.setdefault("output_len", (3, 10))
    kw.setdefault("timeout", 20.0)
    return LoadConfig(url=server.url, **kw)


async def run(config: LoadConfig) -> LoadResult:
    return await asyncio.wait_for(run_load(config), RUN_LIMIT_S)


def sent_by_prompt(server, chat: bool = False) -> dict[str, int]:
    out = {}
    for s in server.fake.served:
        prompt = s.body["messages"][-1]["content"] if chat else s.body["prompt"]
        out[prompt] = s.tokens_sent
    return out


def assert_consistent(result: LoadResult, server, chat: bool = False) -> None:
    """Every request accounted for, token counts equal what the server sent, timings ordered."""
    config = result.config
    items = build_workload(config)
    assert len(result.results) == config.num_requests
    summary = result.summary()
    assert summary["completed"] + summary["failed"] == config.num_requests
    sent = sent_by_prompt(server, chat)
    for item, r in zip(items, result.results):
        assert r.index == item.index
        if not r.ok:
            continue
        assert r.output_tokens == sent[item.prompt]
        assert r.ttft is not None and r.e2e is not None
        assert 0 <= r.ttft <= r.e2e
        assert all(gap >= 0 for gap in r.itls)
    assert summary["output_tokens"] == sum(r.output_tokens for r in result.results if r.ok)


def test_url_normalisation():
    for url in ("http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/", " http://h:1/v1 "):
        assert normalize_base_url(url) == "http://h:1"
    assert endpoint_url("http://h:1/v1", "chat") == "http://h:1/v1/chat/completions"
    assert endpoint_url("https://h/v1", "completions") == "https://h/v1/completions"
    with pytest.raises(LoadError):
        normalize_base_url("h:1")


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("send_done", [True, False])
async def test_streams_are_fully_accounted(server, endpoint, send_done):
    server.fake.behaviour.send_done = send_done
    result = await run(cfg(server, endpoint=endpoint))
    chat = endpoint == "chat"
    assert result.model == "fake-model"  # the first id from GET /v1/models
    assert result.summary()["completed"] == 12
    assert_consistent(result, server, chat)
    items = build_workload(result.config)
    for item, r in zip(items, result.results):
        assert r.output_tokens == item.max_tokens  # ignore_eos: exactly max_tokens
        assert len(r.itls) == r.output_tokens - 1  # one token per chunk
        assert r.usage_reported and r.finish_reason == "length"
        assert r.prompt_tokens == len(item.prompt.split())  # the server's usage wins
    body = server.fake.served[0].body
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True
    assert ("messages" in body) == chat


async def test_without_usage_the_content_chunks_are_counted(server):
    server.fake.behaviour.send_usage = False
    server.fake.behaviour.send_done = False
    result = await run(cfg(server))
    assert_consistent(result, server)
    assert result.summary()["completed"] == 12
    assert not any(r.usage_reported for r in result.results)
    # Without usage, prompt tokens fall back to the workload's own length.
    assert [r.prompt_tokens for r in result.results] == [it.prompt_len for it in build_workload(result.config)]


async def test_multi_token_chunks_with_token_ids_split_the_gap(server):
    server.fake.behaviour.tokens_per_chunk = 3
    server.fake.behaviour.token_ids = True
    result = await run(cfg(server, output_len=(4, 14)))
    assert_consistent(result, server)
    for r in result.results:
        assert r.ok
        assert len(r.itls) == r.output_tokens - 1
        assert r.content_chunks == math.ceil(r.output_tokens / 3)
        # The first chunk's extra tokens arrived with the first one.
        assert r.itls[:2] == [0.0, 0.0]


async def test_multi_token_chunks_without_token_ids_trust_usage(server):
    server.fake.behaviour.tokens_per_chunk = 3
    result = await run(cfg(server, output_len=(4, 14)))
    assert_consistent(result, server)
    for r in result.results:
        assert r.ok and r.usage_reported
        # Chunks are counted as one token each; the usage gives the real total.
        assert len(r.itls) == r.content_chunks - 1
        assert r.tpot is not None


async def test_rejected_prompts_fail_with_the_servers_message(server):
    pattern = r"\bwater\b"
    server.fake.behaviour.reject_pattern = pattern
    config = cfg(server, num_requests=20, seed=0)
    expected = {it.index for it in build_workload(config) if re.search(pattern, it.prompt)}
    assert 0 < len(expected) < 20  # the seeded workload has both kinds
    result = await run(config)
    assert {r.index for r in result.results if not r.ok} == expected
    assert result.errors() == [("HTTP 400: prompt rejected by policy", len(expected))]
    assert all(r.status == 400 for r in result.results if not r.ok)
    assert_consistent(result, server)


async def test_unknown_fields_rejected_then_accepted_without_ignore_eos(server):
    server.fake.behaviour.reject_unknown_fields = True
    result = await run(cfg(server))
    assert result.summary()["completed"] == 0
    assert result.errors() == [("HTTP 422: body.ignore_eos: Extra inputs are not permitted", 12)]

    server.fake.reset(server.fake.behaviour)
    server.fake.behaviour.eos_after = 2  # the model "stops" early once EOS is honoured
    result = await run(cfg(server, ignore_eos=False))
    assert result.summary()["completed"] == 12
    assert "ignore_eos" not in server.fake.served[0].body
    assert all(r.output_tokens == 2 for r in result.results)
    assert_consistent(result, server)


async def test_concurrency_is_never_exceeded(server):
    result = await run(cfg(server, num_requests=24, concurrency=3, output_len=(6, 16)))
    assert result.summary()["completed"] == 24
    assert 1 <= server.fake.max_in_flight <= 3
    assert result.max_in_flight == 3
    assert_consistent(result, server)


async def test_all_at_once_without_a_cap(server):
    result = await run(cfg(server, num_requests=10, concurrency=None))
    assert result.summary()["completed"] == 10
    assert result.max_in_flight == 10  # every task started before the first one finished
    assert_consistent(result, server)


async def test_poisson_pacing_sends_no_request_before_it_is_due(server):
    config = cfg(server, num_requests=10, concurrency=None, request_rate=100.0, seed=4)
    result = await run(config)
    items = build_workload(config)
    assert result.summary()["completed"] == 10
    for item, r in zip(items, result.results):
        assert r.start >= item.arrival - 1e-3
    assert result.duration >= items[-1].arrival


async def test_stalled_server_times_out_and_the_run_ends(server):
    server.fake.behaviour.stall_after = 2
    result = await run(cfg(server, num_requests=4, concurrency=2, timeout=0.5))
    assert result.summary()["failed"] == 4
    assert result.errors() == [("timed out after 0.5 s", 4)]
    assert all(r.output_tokens == 0 or not r.ok for r in result.results)


async def test_dropped_stream_counts_as_failed(server):
    server.fake.behaviour.abort_after = 2
    result = await run(cfg(server, num_requests=6, output_len=(5, 8)))
    assert result.summary()["failed"] == 6
    assert all(r.error for r in result.results)


async def test_error_event_inside_the_stream_counts_as_failed(server):
    server.fake.behaviour.error_after = 1
    result = await run(cfg(server, num_requests=4))
    assert result.errors() == [("error in stream: engine died", 4)]
    assert all(r.status == 200 and not r.ok for r in result.results)


async def test_unreachable_server(server):
    with pytest.raises(LoadError, match="cannot list models"):
        await run(LoadConfig(url="http://127.0.0.1:9", num_requests=2, timeout=5.0))
    result = await run(LoadConfig(url="http://127.0.0.1:9", model="m", num_requests=3, timeout=5.0))
    assert result.summary()["failed"] == 3
    assert all(r.error and r.error.startswith("ConnectError") for r in result.results)


async def test_warmup_is_sent_first_and_not_counted(server):
    result = await run(cfg(server, num_requests=5, warmup=3))
    assert len(server.fake.served) == 8
    assert len(result.warmup_results) == 3 and all(r.ok for r in result.warmup_results)
    assert len(result.results) == 5
    warm_prompts = {s.body["prompt"] for s in server.fake.served[:3]}
    assert warm_prompts.isdisjoint(it.prompt for it in build_workload(result.config))


async def test_extra_body_overrides_and_api_key(server):
    result = await run(cfg(server, extra_body={"temperature": 0.5, "max_tokens": 2}, api_key="sekret",
                           model="chosen"))
    assert result.model == "chosen"
    assert all(r.output_tokens == 2 for r in result.results)
    for s in server.fake.served:
        assert s.body["temperature"] == 0.5 and s.body["model"] == "chosen"
        assert s.headers["authorization"] == "Bearer sekret"


async def test_awkward_framing_crlf_split_events_and_comments(server):
    b = server.fake.behaviour
    b.crlf = b.split_events = b.comments = True
    result = await run(cfg(server, endpoint="chat"))
    assert result.summary()["completed"] == 12
    assert_consistent(result, server, chat=True)
    assert all(len(r.itls) == r.output_tokens - 1 for r in result.results)


async def test_server_that_ignores_stream_true(server):
    server.fake.behaviour.ignore_stream = True
    result = await run(cfg(server))
    assert result.summary()["completed"] == 12
    assert_consistent(result, server)
    assert all(r.ttft == r.e2e and r.itls == [] for r in result.results)


def test_run_load_sync_outside_an_event_loop(server):
    result = run_load_sync(cfg(server, num_requests=3, tokenizer=None))
    assert result.summary()["completed"] == 3
    assert result.summary()["request_throughput"] > 0


async def test_exact_prompt_lengths_reach_the_server(server, tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    config = cfg(server, num_requests=6, input_len=(20, 60), tokenizer=tiny_tokenizer_dir)
    result = await asyncio.wait_for(run_load(config, tokenizer=tokenizer), RUN_LIMIT_S)
    assert result.summary()["completed"] == 6
    items = build_workload(config, tokenizer)
    assert sorted(s.body["prompt"] for s in server.fake.served) == sorted(it.prompt for it in items)
    for it in items:
        assert len(tokenizer.encode(it.prompt, add_special_tokens=False)) == it.prompt_len


async def _closing_server(closes_first: int):
    """A raw HTTP server that closes its first `closes_first` connections on reading the request,
    answering nothing (as llama-server does to a keep-alive connection it has ended), then streams
    one completion token. Returns the server and the list of connections it took."""
    seen: list[bool] = []
    body = (b'data: {"choices": [{"index": 0, "text": "hi", "finish_reason": null}]}\n\n'
            b'data: {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}\n\ndata: [DONE]\n\n')

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
        await reader.readexactly(length)
        answered = len(seen) >= closes_first
        seen.append(answered)
        if answered:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body) + body)
            await writer.drain()
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0), seen


@pytest.mark.parametrize("closes_first, ok", [(1, True), (2, True), (10, False)])
async def test_a_request_whose_connection_closes_unanswered_is_sent_again(closes_first, ok):
    """A connection closed before any response means the server never took the request: it goes
    again (a bounded number of times), so a peer's keep-alive policy does not count as failures."""
    import httpx

    from pdserve.bench.openai_stream import STALE_CONNECTION_RETRIES, stream_request

    srv, seen = await _closing_server(closes_first)
    port = srv.sockets[0].getsockname()[1]
    async with srv, httpx.AsyncClient(trust_env=False) as client:
        result = await stream_request(client, f"http://127.0.0.1:{port}/v1/completions",
                                      {"model": "m", "prompt": "x", "stream": True}, timeout=5.0)
    assert result.ok is ok
    if ok:
        assert result.output_tokens == 1 and seen == [False] * closes_first + [True]
    else:
        assert "RemoteProtocolError" in result.error and len(seen) == 1 + STALE_CONNECTION_RETRIES
