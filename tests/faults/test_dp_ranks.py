"""A DP=2 pod with one busy rank: new work goes to the idle rank (issue 18, part 7).

Real processes on 127.0.0.1: a coordinator, one `pdserve serve --data-parallel-size 2` reporting
to it (every rank under the pod's address, each with its own engine id) and a router in front
that reads the coordinator's feed. The router scores the ranks as endpoints of their own and
sends `X-PDServe-DP-Rank` with its pick; the pod honours it (with the internal key only). The
pod runs the p2p connector in both roles, so one rank can prefill for another.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from contextlib import ExitStack

import httpx
import pytest

from pdserve.engine.server.dp_rank import DP_RANK_HEADER
from support.auth import internal_headers
from support.coordinator import run_coordinator
from support.server import ServerProcess, free_port, launch_server, p2p_config, wait_healthy

MODEL = "tiny"
# Long enough to still run when the test acts, whatever the machine's speed (hung up by the test).
LONG_TOKENS = 16000
POD_ARGS = ("--served-model-name", MODEL, "--data-parallel-size", "2", "--num-kv-blocks", "2100",
            "--max-model-len", "16384", "--kv-transfer-config", p2p_config("kv_both", transport="tcp"))
SHORT_REQUESTS = 6


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    try:  # engine cores and workers share the process group
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dp_ranks")
    with ExitStack() as cleanup:
        coordinator = cleanup.enter_context(run_coordinator(tmp_path=tmp))
        pod = launch_server(model_dir("llama_long"), *POD_ARGS, "--coordinator-address", coordinator.stats_address,
                            tmp_path=tmp)
        cleanup.callback(stop, pod.proc)
        port = free_port()
        log_path = tmp / f"router-{port}.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "pdserve", "router", "--model", MODEL, "--port", str(port), "--decode", pod.url,
                 "--coordinator-address", f"127.0.0.1:{coordinator.publish_port}", "--health-interval", "0.5"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=dict(os.environ, PYTHONSAFEPATH="1"))
        router = ServerProcess(proc, port, log_path)
        cleanup.callback(stop, proc)
        wait_healthy(pod.url, pod.proc, pod.log_path)
        wait_healthy(router.url, router.proc, router.log_path, timeout=60)
        yield coordinator, pod, router


def ranks_in_stats(coordinator, pod: ServerProcess) -> dict[int, dict]:
    """The pod's entries in the coordinator's /stats, by rank."""
    return {e["dp_rank"]: e for e in coordinator.stats()["engines"] if e["address"] == f"127.0.0.1:{pod.port}"}


def wait_until(predicate, message: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {message}")
        time.sleep(0.1)


def successes_by_rank(pod: ServerProcess) -> dict[str, float]:
    values = {"0": 0.0, "1": 0.0}
    for line in httpx.get(f"{pod.url}/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:request_success_total{"):
            rank = re.search(r'engine="(\d+)"', line).group(1)
            values[rank] = values.get(rank, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


def feed_alive(router: ServerProcess) -> bool:
    for line in httpx.get(f"{router.url}/metrics", timeout=10).text.splitlines():
        if line.startswith("pdserve_router_coordinator_feed_alive"):
            return float(line.rsplit(" ", 1)[1]) == 1.0
    return False


def pinned(rank: int | str) -> dict[str, str]:
    """What the router sends with a pick of `rank`."""
    return {**internal_headers(), DP_RANK_HEADER: str(rank)}


def long_stream(pod: ServerProcess, rank: int) -> tuple[threading.Thread, dict]:
    """A long generation pinned to `rank`, read on a thread until `result["stop"]` is set."""
    result: dict = {"chunks": 0, "error": None, "stop": False}
    started = threading.Event()

    def run() -> None:
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": LONG_TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", f"{pod.base_url}/completions", json=body, headers=pinned(rank),
                              timeout=120) as response:
                if response.status_code != 200:
                    result["error"] = f"HTTP {response.status_code}: {response.read().decode()}"
                    return
                for line in response.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        result["chunks"] += 1
                        started.set()
                    if result["stop"]:
                        return
        except httpx.HTTPError as exc:
            result["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            started.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(60) and result["error"] is None, result
    return thread, result


def complete(url: str, prompt: str, headers: dict[str, str] | None = None, **extra) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 3,
                                                     "temperature": 0, **extra},
                      headers=headers or {}, timeout=60)


def test_the_coordinator_lists_each_rank_under_the_pods_address(stack):
    coordinator, pod, router = stack
    ranks = wait_until(lambda: (r := ranks_in_stats(coordinator, pod)) and len(r) == 2 and r, "both ranks in /stats")
    assert {r: e["id"][-4:] for r, e in ranks.items()} == {0: "-dp0", 1: "-dp1"}
    assert not any(e["stale"] for e in ranks.values())


def test_a_busy_rank_gets_no_new_work_through_the_router(stack):
    coordinator, pod, router = stack
    wait_until(lambda: len(ranks_in_stats(coordinator, pod)) == 2 and feed_alive(router), "the router's feed")
    streams = [long_stream(pod, 0) for _ in range(2)]
    try:
        # Rank 0 runs both long generations (pinned there, though the pod's own balancer would
        # have put the second one on the idle rank); rank 1 runs nothing.
        wait_until(lambda: {r: e["running"] for r, e in ranks_in_stats(coordinator, pod).items()} == {0: 2, 1: 0},
                   "rank 0 running both pinned generations", timeout=20)

        before = successes_by_rank(pod)
        for i in range(2):  # pinned by hand, as the router pins: they run on the busy rank too
            response = complete(pod.url, f"pinned {i}", pinned(0))
            assert response.status_code == 200, response.text
        after = successes_by_rank(pod)
        assert (after["0"] - before["0"], after["1"] - before["1"]) == (2, 0)

        before = after
        for i in range(SHORT_REQUESTS):
            # Let the feed show rank 1 idle again: the router reads it every ~100 ms.
            wait_until(lambda: ranks_in_stats(coordinator, pod)[1]["running"] == 0, "rank 1 idle")
            time.sleep(0.3)
            response = complete(router.url, f"short request {i}")
            assert response.status_code == 200, response.text
        after = successes_by_rank(pod)
        assert all(result["error"] is None and result["chunks"] > 0 for _, result in streams), streams
        served = {rank: after[rank] - before[rank] for rank in ("0", "1")}
        assert served == {"0": 0, "1": SHORT_REQUESTS}, served
    finally:
        for thread, result in streams:
            result["stop"] = True
        for thread, _ in streams:
            thread.join(30)
    # Hung up: the pod frees rank 0 again.
    wait_until(lambda: ranks_in_stats(coordinator, pod)[0]["running"] == 0, "rank 0 idle after the hang-ups")


def test_the_rank_header_is_a_400_when_bad_and_ignored_without_the_internal_key(stack):
    _, pod, _ = stack
    for value in ("2", "one", "-1"):
        response = complete(pod.url, "bad rank", pinned(value))
        assert response.status_code == 400, response.text
        assert response.json()["error"]["code"] == "invalid_dp_rank"
    # Without the key the header asks for nothing: the pod serves the request where it likes.
    response = complete(pod.url, "no key", {DP_RANK_HEADER: "7"})
    assert response.status_code == 200, response.text


def test_one_rank_prefills_for_another_and_the_answer_names_the_prefilling_rank(stack):
    _, pod, _ = stack
    prompt = "The data-parallel ranks of one pod are engines of their own, " * 3
    # Rank 0 never sees the prompt before its decode leg: no local prefix hit spares it the pull.
    reference = complete(pod.url, prompt, pinned(1), max_tokens=6).json()["choices"][0]["text"]
    first = complete(pod.url, prompt, pinned(1), max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    assert first.status_code == 200, first.text
    params = first.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_engine_id"].endswith("-dp1"), params
    before = successes_by_rank(pod)
    second = complete(pod.url, prompt, pinned(0), max_tokens=6, kv_transfer_params=params)
    assert second.status_code == 200, second.text
    answer = second.json()
    assert answer["choices"][0]["text"] == reference
    prompt_tokens = answer["usage"]["prompt_tokens"]
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == prompt_tokens - 1  # pulled from rank 1
    after = successes_by_rank(pod)
    assert after["0"] - before["0"] == 1 and after["1"] == before["1"], json.dumps([before, after])
