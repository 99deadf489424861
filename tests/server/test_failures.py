"""Engine failures are reported, not hung on; SIGTERM drains in-flight requests before exit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from support.checkpoints import truncated_checkpoint
from support.server import free_port, run_server
from support.streams import stream_in_background

STREAM = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 1000, "temperature": 0, "ignore_eos": True,
          "stream": True}


def wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def health(server) -> int:
    try:
        return httpx.get(f"{server.url}/health", timeout=2).status_code
    except httpx.HTTPError:
        return -1


# TP=2 in the fault suite (make test-faults): make test keeps TP=1, within its time budget.
@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.faults)])
def test_kill_9_of_the_engine_core_fails_requests_within_5s(model_dir, tmp_path, tp):
    with run_server(model_dir("llama"), "--served-model-name", "tiny", "--tensor-parallel-size", str(tp),
                    tmp_path=tmp_path) as server:
        thread, result = stream_in_background(server, STREAM)
        killed_at = time.monotonic()
        os.kill(server.engine_core_pid(), signal.SIGKILL)
        thread.join(10)
        assert result["ended"] is not None and result["ended"] - killed_at < 5.0
        assert result["error"] is not None and result["finish"] is None
        assert wait_for(lambda: health(server) == 503, 5.0)
        resp = httpx.post(f"{server.base_url}/completions", json={"model": "tiny", "prompt": "hi"}, timeout=10)
        assert resp.status_code == 503 and "not running" in resp.json()["error"]["message"]


# In the fault suite (make test-faults), to keep make test within its time budget.
@pytest.mark.faults
def test_kill_9_of_a_tensor_parallel_worker_fails_requests_within_5s(model_dir, tmp_path):
    import psutil

    with run_server(model_dir("llama"), "--served-model-name", "tiny", "--tensor-parallel-size", "2",
                    tmp_path=tmp_path) as server:
        core = psutil.Process(server.engine_core_pid())
        workers = core.children()
        assert len(workers) == 2, [w.cmdline() for w in workers]
        thread, result = stream_in_background(server, STREAM)
        killed_at = time.monotonic()
        workers[1].kill()
        thread.join(10)
        assert result["ended"] is not None and result["ended"] - killed_at < 5.0
        assert result["error"] is not None and result["finish"] is None
        assert wait_for(lambda: health(server) == 503, 5.0)


# DP=2 in the fault suite (make test-faults): make test keeps DP=1, within its time budget.
@pytest.mark.parametrize("dp", [1, pytest.param(2, marks=pytest.mark.faults)])
def test_sigterm_lets_in_flight_requests_finish_then_exits(model_dir, tmp_path, dp):
    with run_server(model_dir("llama"), "--served-model-name", "tiny", "--data-parallel-size", str(dp),
                    tmp_path=tmp_path) as server:
        # With DP=2 the balancer puts one stream on each rank: both ranks drain.
        streams = [stream_in_background(server, dict(STREAM, max_tokens=150, prompt=f"drain {i}")) for i in range(dp)]
        server.proc.send_signal(signal.SIGTERM)
        for thread, result in streams:
            thread.join(60)
            assert result["error"] is None, result
            assert result["finish"] == "length" and result["chunks"] >= 100, result
        server.proc.wait(timeout=60)
        assert server.proc.returncode == 0
        assert wait_for(lambda: not _alive_children(server), 10.0)


def _alive_children(server) -> list:
    import psutil

    alive = []
    for pid in [p.pid for p in psutil.process_iter() if p.ppid() == server.proc.pid]:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


# In the fault suite (make test-faults), to keep make test within its time budget.
@pytest.mark.faults
def test_a_worker_dying_while_idle_turns_health_503(model_dir, tmp_path):
    import psutil

    with run_server(model_dir("llama"), "--served-model-name", "tiny", "--tensor-parallel-size", "2",
                    tmp_path=tmp_path) as server:
        assert health(server) == 200
        psutil.Process(server.engine_core_pid()).children()[0].kill()
        assert wait_for(lambda: health(server) == 503, 5.0)


def test_a_model_that_fails_to_load_ends_the_server_with_the_engine_error(model_dir, tmp_path):
    broken = truncated_checkpoint(model_dir("llama"), tmp_path / "broken")  # the engine core cannot load it
    cmd = [sys.executable, "-m", "pdserve", "serve", "--model", str(broken), "--port", str(free_port())]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=dict(os.environ, PYTHONSAFEPATH="1"))
    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert "exited with code 1 before READY" in output
    assert "safetensors" in output.lower()  # the loader's own error reaches the log
    assert "AttributeError" not in output
