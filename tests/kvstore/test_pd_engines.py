"""Prefill and decode engines as real server processes, handing KV over each connector.

The flow is the router's (DESIGN §4): the prefill engine gets the request with max_tokens=1 and
`kv_transfer_params={"do_remote_decode": true}`, answers with where the KV is, and the decode
engine gets the original request with those params. Its greedy output must equal a single
engine's token for token, and its counters must show it computed only what it could not load.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest

from pdserve.kvstore.binding import prompt_digest
from support.auth import internal_headers
from support.server import ServerProcess, free_port, launch_server, p2p_config, wait_healthy

BLOCK = 16
LENGTHS = [5, 16, 17, 31, 32, 33, 47, 64, 65, 70, 100, 130]  # mixed, some block-aligned, one > 4 blocks
MAX_TOKENS = 8


def start(model: str, tmp_path: Path, *args: str) -> ServerProcess:
    return launch_server(model, "--max-model-len", "512", "--num-kv-blocks", "256", *args, tmp_path=tmp_path)


def stop(server: ServerProcess) -> None:
    if server.proc.poll() is None:
        os.killpg(server.proc.pid, signal.SIGKILL)
    server.proc.wait()


@contextmanager
def servers(model: str, tmp_path: Path, *arg_lists: list[str]) -> Iterator[list[ServerProcess]]:
    """Start them all at once (start-up is mostly import and model load), wait for each."""
    started = [start(model, tmp_path, *args) for args in arg_lists]
    try:
        for s in started:
            wait_healthy(s.url, s.proc, s.log_path)
        yield started
    finally:
        for s in started:
            stop(s)


def prompts(seed: int, vocab: int) -> list[list[int]]:
    """Distinct first tokens, so no two prompts share a cached prefix on the decode engine."""
    rng = random.Random(seed)
    firsts = rng.sample(range(1, vocab), len(LENGTHS))
    return [[first] + [rng.randrange(1, vocab) for _ in range(n - 1)] for first, n in zip(firsts, LENGTHS)]


def complete(url: str, model: str, prompt: list[int], **extra) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}
    # As the router does: engines act on kv_transfer_params only from holders of the internal key.
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60, headers=internal_headers())
    assert response.status_code == 200, response.text
    return response.json()


def disaggregated(prefill: ServerProcess, decode: ServerProcess, model: str, prompt: list[int]) -> tuple[dict, dict]:
    first = complete(prefill.url, model, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    params = first["kv_transfer_params"]
    assert params["do_remote_prefill"] is True
    return first, complete(decode.url, model, prompt, kv_transfer_params=params)


def stats(server: ServerProcess) -> dict[str, float]:
    """The engine's Prometheus counters and gauges, by name (a labelled series never touched is
    absent from the exposition: it reads as zero)."""
    out: dict[str, float] = defaultdict(float)
    for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name.split("{")[0]] = float(value)
    return out


def loaded_tokens(connector: str, n: int) -> int:
    """Prompt tokens a decode engine loads instead of computing: all but the last for p2p; the
    full blocks, capped to leave the last token, for the block stores."""
    if connector == "p2p":
        return n - 1
    return min((n // BLOCK) * BLOCK, n - 1)


def check_parity(prefill, decode, model, seed, vocab, connector, reference=None):
    reference = reference or prefill
    batch = prompts(seed, vocab)
    before = stats(decode)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda p: disaggregated(prefill, decode, model, p), batch))
        expected = list(pool.map(lambda p: complete(reference.url, model, p), batch))
    after = stats(decode)
    computed = 0
    for prompt, (_, got), want in zip(batch, results, expected):
        assert got["choices"][0]["text"] == want["choices"][0]["text"], len(prompt)
        assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]
        cached = got["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == loaded_tokens(connector, len(prompt)), (len(prompt), cached)
        computed += len(prompt) - cached
    # The decode engine's own counter: it ran only the tokens it could not load through the model.
    assert after["pdserve:prompt_tokens_computed_total"] - before["pdserve:prompt_tokens_computed_total"] == computed
    assert after["pdserve:kv_transfer_failures_total"] == before["pdserve:kv_transfer_failures_total"]
    return results


def wait_for(predicate, timeout: float, message: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(message)


@pytest.fixture(scope="module")
def model(model_dir):
    return model_dir("llama")


@pytest.fixture(scope="module")
def vocab(model):
    return json.loads((Path(model) / "config.json").read_text())["vocab_size"]


# -- p2p over TCP: parity, TP mismatch both ways, faults ------------------------------------------

@pytest.fixture(scope="module")
def tcp_pool(model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tcp")
    with servers(model, tmp,
                 ["--kv-transfer-config", p2p_config("kv_producer", transport="tcp", abort_timeout_s=4)],
                 ["--kv-transfer-config", p2p_config("kv_consumer", transport="tcp", pull_timeout_s=3)],
                 ["--kv-transfer-config", p2p_config("kv_producer", transport="tcp"), "--tensor-parallel-size", "2"],
                 ["--kv-transfer-config", p2p_config("kv_consumer", transport="tcp"), "--tensor-parallel-size", "2"],
                 ) as pool:
        yield pool


def test_p2p_tcp_output_equals_one_engine(tcp_pool, model, vocab):
    prefill, decode, _, _ = tcp_pool
    results = check_parity(prefill, decode, model, 1, vocab, "p2p")
    assert {first["kv_transfer_params"]["transport"] for first, _ in results} == {"tcp"}
    # The prefill engine freed every block once the decode side said it was done.
    wait_for(lambda: stats(prefill)["pdserve:kv_blocks_held_for_remote"] == 0, 10, "prefill blocks still held")
    assert stats(prefill)["pdserve:kv_transfers_expired_total"] == 0


def test_decode_pulls_only_the_blocks_its_prefix_cache_lacks(tcp_pool, model, vocab):
    prefill, decode, _, _ = tcp_pool
    shared = prompts(7, vocab)[-1][:64]  # four blocks
    complete(decode.url, model, shared + [5, 6])  # the decode engine now caches these blocks
    before = stats(decode)
    _, got = disaggregated(prefill, decode, model, shared + list(range(10, 40)))
    after = stats(decode)
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 64 + 30 - 1
    assert after["pdserve:kv_external_tokens_total"] - before["pdserve:kv_external_tokens_total"] == 30 - 1
    assert after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"] == 64


def test_p2p_prefill_tp2_to_decode_tp1(tcp_pool, model, vocab):
    _, decode, prefill_tp2, _ = tcp_pool
    results = check_parity(prefill_tp2, decode, model, 2, vocab, "p2p")
    assert {first["kv_transfer_params"]["remote_tp_size"] for first, _ in results} == {2}
    wait_for(lambda: stats(prefill_tp2)["pdserve:kv_blocks_held_for_remote"] == 0, 10, "TP=2 prefill still holds")


def test_p2p_prefill_tp1_to_decode_tp2(tcp_pool, model, vocab):
    prefill, _, _, decode_tp2 = tcp_pool
    check_parity(prefill, decode_tp2, model, 3, vocab, "p2p")
    wait_for(lambda: stats(prefill)["pdserve:kv_blocks_held_for_remote"] == 0, 10, "prefill still holds")


def test_blocks_nobody_pulls_are_freed_after_the_abort_timeout(tcp_pool, model, vocab):
    prefill = tcp_pool[0]
    free_before = stats(prefill)["vllm:kv_cache_usage_perc"]
    first = complete(prefill.url, model, prompts(4, vocab)[-1], max_tokens=1,
                     kv_transfer_params={"do_remote_decode": True})
    held = len(first["kv_transfer_params"]["remote_block_ids"])
    assert stats(prefill)["pdserve:kv_blocks_held_for_remote"] == held
    # abort_timeout_s=4 on this engine; nobody pulls
    wait_for(lambda: stats(prefill)["pdserve:kv_blocks_held_for_remote"] == 0, 20, "held blocks never expired")
    after = stats(prefill)
    assert after["pdserve:kv_transfers_expired_total"] >= 1
    assert after["vllm:kv_cache_usage_perc"] == free_before  # the blocks are free again


# In the fault suite (make test-faults), to keep make test within its time budget.
@pytest.mark.faults
def test_decode_recomputes_when_the_prefill_engine_dies_before_the_pull(tcp_pool, model, vocab, tmp_path):
    decode = tcp_pool[1]
    with servers(model, tmp_path, ["--kv-transfer-config", p2p_config("kv_producer", transport="tcp")]) as (doomed,):
        prompt = prompts(5, vocab)[-1]
        first = complete(doomed.url, model, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        os.killpg(doomed.proc.pid, signal.SIGKILL)
        doomed.proc.wait()
    before = stats(decode)
    start = time.monotonic()
    got = complete(decode.url, model, prompt, kv_transfer_params=first["kv_transfer_params"])
    assert time.monotonic() - start < 10
    want = complete(tcp_pool[0].url, model, prompt)
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert stats(decode)["pdserve:kv_transfer_failures_total"] == before["pdserve:kv_transfer_failures_total"] + 1


def test_a_hung_prefill_times_out_and_an_abort_while_pulling_frees_the_blocks(tcp_pool, model, vocab):
    """A prefill side that accepts the connection and never answers: the pull times out (3 s on
    this decode engine) and the request is recomputed; a client that gives up while the pull
    hangs leaves no block behind once the pull ends."""
    import socket

    decode, reference = tcp_pool[1], tcp_pool[0]
    hung = socket.create_server(("127.0.0.1", 0))
    accepted = []
    threading_accept = __import__("threading").Thread(
        target=lambda: [accepted.append(hung.accept()) for _ in range(4)], daemon=True)
    threading_accept.start()
    prompt = prompts(8, vocab)[-1]
    params = {"do_remote_prefill": True, "remote_engine_id": "hung", "remote_request_id": "nothing",
              "remote_block_ids": list(range(len(prompt) // BLOCK + 1)), "remote_host": "127.0.0.1",
              "remote_port": hung.getsockname()[1], "remote_tp_size": 1, "transport": "tcp",
              "prompt_digest": prompt_digest(prompt)}
    try:
        start = time.monotonic()
        got = complete(decode.url, model, prompt, kv_transfer_params=params)
        assert 2.5 < time.monotonic() - start < 10
        assert got["choices"][0]["text"] == complete(reference.url, model, prompt)["choices"][0]["text"]
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

        usage_before = stats(decode)["vllm:kv_cache_usage_perc"]
        other = prompts(9, vocab)[-1]
        with pytest.raises(httpx.ReadTimeout):  # the client gives up while the pull hangs
            httpx.post(f"{decode.url}/v1/completions", timeout=1, headers=internal_headers(), json={
                "model": model, "prompt": other, "max_tokens": 4,
                "kv_transfer_params": dict(params, remote_request_id="other", prompt_digest=prompt_digest(other))})
        assert stats(decode)["pdserve:num_requests_waiting_for_remote_kvs"] == 1
        wait_for(lambda: stats(decode)["pdserve:num_requests_waiting_for_remote_kvs"] == 0, 15, "pull never ended")
        wait_for(lambda: stats(decode)["vllm:kv_cache_usage_perc"] == usage_before, 5, "blocks leaked")
    finally:
        hung.close()


def test_blocks_the_prefill_does_not_hold_are_recomputed(tcp_pool, model, vocab):
    prefill, decode = tcp_pool[0], tcp_pool[1]
    a = prompts(10, vocab)[-2]
    first = complete(prefill.url, model, a, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    params = first["kv_transfer_params"]
    wrong = dict(params, remote_block_ids=[9999] * len(params["remote_block_ids"]))  # not the request's blocks
    before = stats(decode)
    got = complete(decode.url, model, a, kv_transfer_params=wrong)
    assert got["choices"][0]["text"] == complete(prefill.url, model, a)["choices"][0]["text"]
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert stats(decode)["pdserve:kv_transfer_failures_total"] == before["pdserve:kv_transfer_failures_total"] + 1
    # the decode side said it was done with `a`: the prefill engine lets its blocks go
    wait_for(lambda: stats(prefill)["pdserve:kv_blocks_held_for_remote"] == 0, 10, "prefill still holds")


def test_chat_through_the_openai_sdk(tcp_pool, model):
    prefill, decode, _, _ = tcp_pool
    messages = [{"role": "user", "content": "hello there, " * 12}]
    p = openai.OpenAI(base_url=prefill.base_url, api_key="none", default_headers=internal_headers())
    d = openai.OpenAI(base_url=decode.base_url, api_key="none", default_headers=internal_headers())
    first = p.chat.completions.create(model=model, messages=messages, max_tokens=1, temperature=0,
                                      extra_body={"kv_transfer_params": {"do_remote_decode": True}})
    params = first.model_extra["kv_transfer_params"]
    got = d.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                    extra_body={"kv_transfer_params": params})
    want = p.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    assert got.choices[0].message.content == want.choices[0].message.content
    assert got.usage.prompt_tokens_details.cached_tokens == got.usage.prompt_tokens - 1


def test_bad_kv_transfer_config_is_a_clear_start_up_error(model):
    for config, message in ((p2p_config("kv_producer", transport="rdma"), "transport must be one of"),
                            ('{"kv_connector": "lmcache"}', "unknown kv_connector 'lmcache'")):
        result = subprocess.run([sys.executable, "-m", "pdserve", "serve", "--model", model,
                                 "--kv-transfer-config", config], capture_output=True, text=True, timeout=120,
                                env=dict(os.environ, PYTHONSAFEPATH="1"))
        assert result.returncode == 2, result.stderr
        assert message in result.stderr


# -- p2p over NIXL ----------------------------------------------------------------------------------

def test_p2p_nixl_output_equals_one_engine(model, vocab, tmp_path):
    with servers(model, tmp_path, ["--kv-transfer-config", p2p_config("kv_producer", transport="nixl")],
                 ["--kv-transfer-config", p2p_config("kv_consumer", transport="nixl")]) as (prefill, decode):
        results = check_parity(prefill, decode, model, 11, vocab, "p2p")
        assert {first["kv_transfer_params"]["transport"] for first, _ in results} == {"nixl"}
        wait_for(lambda: stats(prefill)["pdserve:kv_blocks_held_for_remote"] == 0, 10, "prefill blocks still held")


# -- the KV store service ------------------------------------------------------------------------

@contextmanager
def kv_store(tmp_path: Path, port: int) -> Iterator[subprocess.Popen]:
    log = open(tmp_path / f"kvstore-{port}.log", "a")
    proc = subprocess.Popen([sys.executable, "-m", "pdserve", "kvstore", "--host", "127.0.0.1", "--port", str(port),
                             "--capacity", "256Mi", "--http-port", "0"], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, env=dict(os.environ, PYTHONSAFEPATH="1"))
    try:
        wait_for(lambda: _connectable(port), 60, "the KV store did not start")
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        log.close()


def _connectable(port: int) -> bool:
    import socket

    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


# In the fault suite (make test-faults), to keep make test within its time budget.
@pytest.mark.faults
def test_kvstore_connector_and_its_faults(model, vocab, tmp_path):
    store_port = free_port()
    url = f"tcp://127.0.0.1:{store_port}"
    config = {"kv_connector": "kvstore", "kv_connector_extra_config": {"kvstore_url": url, "timeout_s": 1.0}}
    with kv_store(tmp_path, store_port) as store, servers(
            model, tmp_path, ["--kv-transfer-config", json.dumps(dict(config, kv_role="kv_producer"))],
            ["--kv-transfer-config", json.dumps(dict(config, kv_role="kv_consumer"))]) as (prefill, decode):
        check_parity(prefill, decode, model, 21, vocab, "kvstore")
        # Prompt X's params sent with prompt Y load nothing of X: the store is read by Y's own
        # prefix hashes. Y then answers exactly as one engine does, with or without params.
        x, y = prompts(25, vocab)[-2:]
        first, _ = disaggregated(prefill, decode, model, x)
        poisoned = complete(decode.url, model, y, kv_transfer_params=first["kv_transfer_params"])
        want = complete(prefill.url, model, y)["choices"][0]["text"]
        assert poisoned["choices"][0]["text"] == want
        assert complete(decode.url, model, y)["choices"][0]["text"] == want
        # The store is a prefix cache for every engine: a second consumer-side request of a
        # prompt the prefill engine computed loads it too, without any kv_transfer_params.
        prompt = prompts(22, vocab)[-1]
        complete(prefill.url, model, prompt)
        assert complete(decode.url, model, prompt)["usage"]["prompt_tokens_details"]["cached_tokens"] == 128

        # The store goes down: both engines keep serving, computing locally.
        store.kill()
        store.wait()
        for p in prompts(23, vocab)[-3:]:
            _, got = disaggregated(prefill, decode, model, p)
            assert got["choices"][0]["text"] == complete(prefill.url, model, p)["choices"][0]["text"]
            assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        # ... and it comes back (empty): saves and loads resume.
        with kv_store(tmp_path, store_port):
            time.sleep(6)  # the consumer skips lookups for a few seconds after a failure
            p = prompts(24, vocab)[-1]
            _, got = disaggregated(prefill, decode, model, p)
            assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 128


def test_shared_storage_connector(model, vocab, tmp_path):
    config = {"kv_connector": "shared-storage", "kv_connector_extra_config": {"path": str(tmp_path / "kv")}}
    with servers(model, tmp_path, ["--kv-transfer-config", json.dumps(dict(config, kv_role="kv_producer"))],
                 ["--kv-transfer-config", json.dumps(dict(config, kv_role="kv_consumer"))]) as (prefill, decode):
        check_parity(prefill, decode, model, 31, vocab, "shared-storage")
        assert any((tmp_path / "kv").rglob("*.kv"))
