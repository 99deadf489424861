"""A frozen engine core is noticed, and forgiven when it comes back (issue 18, wedged engines).

One real `pdserve serve` (the tiny model, TP=2 over gloo, a short --step-timeout) reporting to a
real coordinator. (a) SIGSTOP of the engine core process: its heartbeats stop, /health turns 503
`engine_unresponsive` within seconds and the coordinator marks it stale; SIGCONT brings both back
and the stream that was in flight completes as if nothing happened. (b) A step that never ends
(one TP worker stopped, so the core waits for it inside the step): the core still heartbeats, but
its step outgrows --step-timeout, so /health turns 503 and the load reporter stops vouching for
the engine, which the coordinator then marks stale; SIGCONT of the worker heals both.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import httpx
import psutil
import pytest

from support.coordinator import CoordinatorProcess, run_coordinator, wait_for
from support.server import ServerProcess, run_server
from support.streams import stream_in_background

# Bounds, with margin for a 2-core machine shared with other work. The design's numbers: a
# heartbeat every 0.5 s, unresponsive after 3 s without one; the coordinator's stale limit is 3 s.
STOPPED_NOTICED_S = 8.0  # 3 s of silence + a heartbeat period + a poll, x2
RECOVERED_S = 6.0
STEP_TIMEOUT_S = 2.0
HUNG_STEP_NOTICED_S = STEP_TIMEOUT_S + 6.0
STALE_AFTER_S = 3.0  # the coordinator's default
STALE_NOTICED_S = STEP_TIMEOUT_S + STALE_AFTER_S + 7.0

# Long enough to be still running when the test acts on its first chunk, short enough to be cheap.
BODY = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 200, "temperature": 0, "ignore_eos": True}


@dataclass
class Stack:
    server: ServerProcess
    coordinator: CoordinatorProcess
    expected: str  # BODY's greedy text from an uninterrupted run

    def health(self) -> httpx.Response | None:
        try:
            return httpx.get(f"{self.server.url}/health", timeout=5)
        except httpx.HTTPError:
            return None

    def wait_health(self, status: int, within: float) -> tuple[httpx.Response, float]:
        """The first /health answer with `status`, and how long it took to come."""
        start = time.monotonic()
        last = None
        while time.monotonic() - start < within:
            last = self.health()
            if last is not None and last.status_code == status:
                return last, time.monotonic() - start
            time.sleep(0.1)
        raise AssertionError(f"/health did not answer {status} within {within}s; last: "
                             f"{None if last is None else (last.status_code, last.text)}")

    def coordinator_entry(self) -> dict[str, Any]:
        address = f"127.0.0.1:{self.server.port}"
        entry = next((e for e in self.coordinator.stats()["engines"] if e["address"] == address), None)
        assert entry is not None, f"the coordinator does not list {address}"
        return entry

    def stale(self) -> bool:
        return self.coordinator_entry()["stale"]

    def unresponsive_metric(self) -> float:
        return self.server.metric("pdserve:engine_unresponsive")

    def check_completed(self, thread, result: dict) -> None:
        thread.join(60)
        assert result["error"] is None and result["crash"] is None, result
        assert result["finish"] == "length"
        assert result["text"] == self.expected  # greedy output unchanged by the pause


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("frozen-core")
    with run_coordinator(tmp_path=tmp) as coordinator:
        with run_server(model_dir("llama"), "--served-model-name", "tiny", "--tensor-parallel-size", "2",
                        "--coordinator-address", coordinator.stats_address, "--step-timeout", str(STEP_TIMEOUT_S),
                        tmp_path=tmp) as server:
            response = httpx.post(f"{server.base_url}/completions", json=BODY, timeout=120)
            response.raise_for_status()
            stack = Stack(server, coordinator, response.json()["choices"][0]["text"])
            wait_for(lambda: not stack.stale(), "the engine's load reports")
            yield stack


def resume(process: psutil.Process) -> None:
    try:
        process.resume()  # SIGCONT
    except psutil.NoSuchProcess:
        pass


def test_a_stopped_engine_core_turns_health_503_and_recovers_with_its_stream_intact(stack):
    assert stack.health().status_code == 200 and stack.unresponsive_metric() == 0
    core = psutil.Process(stack.server.engine_core_pid())
    thread, result = stream_in_background(stack.server, dict(BODY, stream=True))
    core.suspend()  # SIGSTOP
    try:
        chunks_at_stop = result["chunks"]
        response, took = stack.wait_health(503, STOPPED_NOTICED_S)
        error = response.json()["error"]
        assert error["code"] == "engine_unresponsive" and error["type"] == "ServiceUnavailableError", error
        assert "no heartbeat" in error["message"], error
        assert stack.unresponsive_metric() == 1
        wait_for(stack.stale, "the coordinator marking the stopped engine stale", timeout=STOPPED_NOTICED_S)
        # The stream waits, neither failed nor finished: the engine is not dead.
        assert result["ended"] is None and result["error"] is None
        assert chunks_at_stop < BODY["max_tokens"], "the stream finished before the core was stopped"
    finally:
        resume(core)

    stack.wait_health(200, RECOVERED_S)
    assert stack.unresponsive_metric() == 0
    wait_for(lambda: not stack.stale(), "the engine reporting again", timeout=RECOVERED_S)
    stack.check_completed(thread, result)
    print(f"stopped core: /health 503 after {took:.1f}s")


def test_a_step_that_hangs_on_a_stopped_tp_worker_is_reported_and_stops_the_load_heartbeat(stack):
    workers = psutil.Process(stack.server.engine_core_pid()).children()
    assert len(workers) == 2, [w.cmdline() for w in workers]
    thread, result = stream_in_background(stack.server, dict(BODY, stream=True))
    workers[1].suspend()  # the other worker and the core wait for it inside the step
    stopped_at = time.monotonic()
    try:
        response, took = stack.wait_health(503, HUNG_STEP_NOTICED_S)
        error = response.json()["error"]
        assert error["code"] == "engine_unresponsive", error
        assert "step has been running for" in error["message"], error
        assert took >= STEP_TIMEOUT_S * 0.9, f"503 after {took:.1f}s, before the step timeout"
        # The core process is alive and heartbeating: only the load reporter going quiet by itself
        # lets the coordinator see the engine is wedged.
        wait_for(stack.stale, "the coordinator marking the wedged engine stale",
                 timeout=STALE_NOTICED_S - (time.monotonic() - stopped_at))
        assert stack.server.metric("pdserve:engine_step_running_seconds") > STEP_TIMEOUT_S
        assert result["ended"] is None and result["error"] is None
    finally:
        resume(workers[1])

    stack.wait_health(200, RECOVERED_S)
    wait_for(lambda: not stack.stale(), "the engine reporting again", timeout=RECOVERED_S)
    stack.check_completed(thread, result)
    assert "past the step timeout" in stack.server.log()  # the reporter said why it went quiet
    print(f"hung step: /health 503 after {took:.1f}s")
