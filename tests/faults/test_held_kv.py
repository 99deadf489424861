"""KV a prefill engine holds for a remote decode is never stranded (issue 18, leases).

One real prefill engine (p2p producer, a short lease) and one real decode engine (p2p consumer,
one sequence at a time, so a long request keeps later ones waiting in its queue), driven as the
router drives them: the prefill leg with `do_remote_decode`, the decode leg with the params the
prefill answered. Cases: the router's release route frees a hold at once (and only with the
internal key); a hold nobody renews ends with its lease; a decode request that waits in the queue
longer than the lease still pulls, because the decode engine renews the lease, and answers as a
local greedy run; a decode request whose client leaves while it waits frees the hold at once; a
decode engine that has the whole prompt cached frees the hold at once.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from support.auth import internal_headers
from support.server import ServerProcess, launch_server, p2p_config, wait_healthy
from support.streams import stream_in_background

LEASE_S = 4.0  # the prefill engine's kv_lease_duration
FREED_WITHIN_S = 1.0  # a hold nobody will pull goes this fast once that is known (issue 18)
HELD = "pdserve:kv_blocks_held_for_remote"
EXPIRED = "pdserve:kv_transfers_expired_total"
EXTERNAL = "pdserve:kv_external_tokens_total"
RENEWAL_FAILURES = "pdserve:kv_lease_renewal_failures_total"
MAX_MODEL_LEN = 65536
# Keeps the decode engine's only slot busy well past 1.5 leases on any machine (8176 tokens did not
# on a Zen 5: under 7 s; these take about 40 s there); the test hangs up on it when it is done waiting.
LONG_BODY = {"prompt": [7, 8, 9, 10, 11], "max_tokens": MAX_MODEL_LEN - 16, "temperature": 0, "ignore_eos": True,
             "stream": True}


def stats(server: ServerProcess) -> dict[str, float]:
    """The engine's Prometheus series by name (one engine rank: labels dropped; absent reads 0)."""
    out: dict[str, float] = defaultdict(float)
    for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name.split("{")[0]] = float(value)
    return out


def wait_for(predicate, timeout: float, message: str) -> float:
    """Seconds until `predicate()` held; fails after `timeout`."""
    start = time.monotonic()
    while True:
        if predicate():
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{message} (after {timeout}s)")
        time.sleep(0.05)


def complete(server: ServerProcess, model: str, prompt: list[int], timeout: float = 120, **extra) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0, **extra}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=timeout, headers=internal_headers())
    assert response.status_code == 200, response.text
    return response.json()


def prefill_leg(prefill: ServerProcess, model: str, prompt: list[int]) -> dict:
    """What the router does first: the prompt's KV is computed and held; returns where it is."""
    answer = complete(prefill, model, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    return answer["kv_transfer_params"]


def release(prefill: ServerProcess, params: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{prefill.url}/v1/kv/release", json={"kv_transfer_params": params}, timeout=30,
                      headers=internal_headers() if headers is None else headers)


def prompt_of(seed: int, length: int, vocab: int = 1000) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, vocab) for _ in range(length)]


@pytest.fixture(scope="module")
def model(model_dir) -> str:
    return model_dir("llama_64k")


@pytest.fixture(scope="module")
def pair(model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("held-kv")
    # Blocks of 16 tokens: the long request's whole context and the few short ones beside it.
    common = ("--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", str(MAX_MODEL_LEN // 16 + 200))
    started = [
        launch_server(model, *common, "--kv-transfer-config",
                      p2p_config("kv_producer", transport="tcp", kv_lease_duration=LEASE_S), tmp_path=tmp),
        launch_server(model, *common, "--max-num-seqs", "1", "--kv-transfer-config",
                      p2p_config("kv_consumer", transport="tcp"), tmp_path=tmp),
    ]
    try:
        for server in started:
            wait_healthy(server.url, server.proc, server.log_path)
        yield started
    finally:
        for server in started:
            if server.proc.poll() is None:
                os.killpg(server.proc.pid, signal.SIGKILL)
            server.proc.wait()


def test_the_router_releases_a_hold_at_once_and_only_with_the_key(pair, model):
    prefill, _ = pair
    expired = stats(prefill)[EXPIRED]
    params = prefill_leg(prefill, model, prompt_of(1, 70))
    blocks = len(params["remote_block_ids"])
    assert stats(prefill)[HELD] == blocks

    refused = release(prefill, params, headers={})
    assert refused.status_code == 403, refused.text
    bad = release(prefill, dict(params, prompt_digest="not-a-digest"))
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "kv_transfer_params.prompt_digest"
    missing = release(prefill, {k: v for k, v in params.items() if k != "remote_request_id"})
    assert missing.status_code == 400 and "remote_request_id" in missing.json()["error"]["message"]
    # Another prompt's digest names no hold here: nothing is released.
    foreign = release(prefill, dict(params, prompt_digest="0" * 64))
    assert foreign.status_code == 200 and foreign.json() == {"released": False}
    assert stats(prefill)[HELD] == blocks

    answer = release(prefill, params)
    assert answer.status_code == 200 and answer.json() == {"released": True}
    wait_for(lambda: stats(prefill)[HELD] == 0, FREED_WITHIN_S, "the released blocks are still held")
    assert release(prefill, params).json() == {"released": False}  # nothing held any more
    assert stats(prefill)[EXPIRED] == expired  # the release freed them, not the lease


def test_a_hold_nobody_renews_ends_with_its_lease(pair, model):
    prefill, _ = pair
    expired = stats(prefill)[EXPIRED]
    params = prefill_leg(prefill, model, prompt_of(2, 40))
    held_since = time.monotonic()
    assert stats(prefill)[HELD] == len(params["remote_block_ids"])
    wait_for(lambda: stats(prefill)[HELD] == 0, LEASE_S + 10, "the unrenewed hold never expired")
    assert time.monotonic() - held_since > LEASE_S - 0.5  # the lease, not anything sooner
    assert stats(prefill)[EXPIRED] == expired + 1


def test_a_queued_decode_request_keeps_its_kv_and_an_abandoned_one_frees_it(pair, model):
    prefill, decode = pair
    reader, long_run = stream_in_background(decode, dict(LONG_BODY, model=model))  # takes the only slot
    try:
        kept_prompt, left_prompt = prompt_of(3, 70), prompt_of(4, 50)
        kept, left = prefill_leg(prefill, model, kept_prompt), prefill_leg(prefill, model, left_prompt)
        kept_blocks = len(kept["remote_block_ids"])
        prefill_before, decode_before = stats(prefill), stats(decode)
        assert prefill_before[HELD] == kept_blocks + len(left["remote_block_ids"])
        with ThreadPoolExecutor(1) as pool:
            sent = time.monotonic()
            waiting = pool.submit(complete, decode, model, kept_prompt, kv_transfer_params=kept)
            # A client that gives up while its request waits in the decode queue.
            with pytest.raises(httpx.ReadTimeout):
                complete(decode, model, left_prompt, timeout=1.5, kv_transfer_params=left)
            wait_for(lambda: stats(prefill)[HELD] == kept_blocks, FREED_WITHIN_S,
                     "the abandoned request's KV is still held")
            # The other one waits past 1.5 leases: its lease is renewed all the while.
            time.sleep(max(0.0, sent + 1.5 * LEASE_S - time.monotonic()))
            assert not waiting.done() and long_run["finish"] is None and long_run["error"] is None, long_run
            assert stats(prefill)[HELD] == kept_blocks
            long_run["stop"] = True  # hang up: the slot frees, the waiting request pulls
            got = waiting.result(timeout=60)
    finally:
        long_run["stop"] = True
        reader.join(timeout=30)
    want = complete(prefill, model, kept_prompt)  # an uninterrupted local greedy run
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == len(kept_prompt) - 1
    decode_after = stats(decode)
    assert decode_after[EXTERNAL] - decode_before[EXTERNAL] == len(kept_prompt) - 1  # pulled, not recomputed
    assert decode_after[RENEWAL_FAILURES] == decode_before[RENEWAL_FAILURES]
    wait_for(lambda: stats(prefill)[HELD] == 0, FREED_WITHIN_S, "the pulled KV is still held")
    assert stats(prefill)[EXPIRED] == prefill_before[EXPIRED]  # nothing ran out of lease


def test_a_decode_engine_with_the_prompt_cached_frees_the_hold_at_once(pair, model):
    prefill, decode = pair
    prompt = prompt_of(5, 49)  # 48 tokens in full blocks: all a prefix cache may hit
    complete(decode, model, prompt)  # now cached on the decode engine
    expired = stats(prefill)[EXPIRED]
    params = prefill_leg(prefill, model, prompt)
    assert stats(prefill)[HELD] == len(params["remote_block_ids"])
    before = stats(decode)
    got = complete(decode, model, prompt, kv_transfer_params=params)
    wait_for(lambda: stats(prefill)[HELD] == 0, FREED_WITHIN_S, "the decode engine never said it will not pull")
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
    assert stats(decode)[EXTERNAL] == before[EXTERNAL]  # nothing was pulled
    assert stats(prefill)[EXPIRED] == expired
