"""Through a real Envoy + `pdserve epp`: single pool and P/D, completions and chat, streamed and
not, each the same greedy output as one engine answering directly; P/D requests really prefill on
the prefill engine. Run with `make e2e-gateway`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

from support.envoy import EnvoyProcess
from support.gateway import MODEL, client, gateway, launch_engines, launch_epp, picks_steered, stop, wait_all
from support.scrape import metric_total, wait_until
from support.server import ServerProcess

# Over the P/D gateway's --pd-min-prompt-tokens (64) whatever the API wraps around it.
LONG = " ".join(f"token{i % 41}" for i in range(110))


@dataclass
class Stack:
    prefill: ServerProcess
    pool: list[ServerProcess]
    gateways: dict[str, EnvoyProcess]


@pytest.fixture(scope="module")
def stack(model, tmp_path_factory) -> Iterator[Stack]:
    tmp: Path = tmp_path_factory.mktemp("gateway-matrix")
    launched: list[ServerProcess] = []
    try:
        launched += launch_engines(model, tmp, ["prefill", "decode", "decode"])
        prefill, pool = launched[0], launched[1:]
        single_epp = launch_epp(tmp, pool)
        pd_epp = launch_epp(tmp, pool, "--tokenizer", model, "--pd-min-prompt-tokens", "64", prefill=[prefill])
        launched += [single_epp.server, pd_epp.server]
        wait_all(*launched)
        with gateway(tmp, single_epp, pool) as single, gateway(tmp, pd_epp, pool) as pd:
            yield Stack(prefill, pool, {"single": single, "pd": pd})
    finally:
        stop(*launched)


def ask(url: str, api: str, stream: bool, prompt: str, max_tokens: int = 8) -> tuple[str, int]:
    """(text, number of streamed pieces) of one greedy request."""
    c = client(url)
    if api == "completions":
        if not stream:
            return c.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                        temperature=0).choices[0].text, 1
        pieces = [ch.choices[0].text for ch in c.completions.create(
            model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True) if ch.choices]
        return "".join(pieces), len(pieces)
    messages = [{"role": "user", "content": prompt}]
    if not stream:
        return c.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                         temperature=0).choices[0].message.content, 1
    pieces = [ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, stream=True) if ch.choices]
    return "".join(pieces), len(pieces)


def prefill_legs(stack: Stack) -> float:
    return metric_total(stack.prefill.url, "vllm:request_success_total", finished_reason="length")


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("api", ["completions", "chat"])
@pytest.mark.parametrize("path", ["single", "pd"])
def test_through_the_gateway_equals_one_engine(stack, path, api, stream):
    prompt = f"{path} {api} {stream}: {LONG}" if path == "pd" else f"A short {api} question, {stream}?"
    expected, _ = ask(stack.pool[0].url, api, False, prompt)
    legs = prefill_legs(stack)
    got, pieces = ask(stack.gateways[path].url, api, stream, prompt)
    assert got == expected
    if stream:
        assert pieces >= 2  # streamed chunk by chunk through Envoy
    if path == "pd":
        wait_until(lambda: prefill_legs(stack) == legs + 1, "the prefill leg on the prefill engine")
    else:
        assert prefill_legs(stack) == legs
    picks_steered(stack.gateways[path], 1, stack.pool)
