"""The in-pod coordinator of a data-parallel `pdserve serve` without `--coordinator-address`.

The ranks report their load to it like any engine and the DP client follows its feed, so
balancing works the same in a pod as across pods. It runs as a child process
(`pdserve coordinator` on 127.0.0.1): the engine package never imports the router's code, and
the child is told to exit when the server dies, even by SIGKILL (Linux parent-death signal).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx

log = logging.getLogger("pdserve.serve.dp_coordinator")

START_TIMEOUT_S = 60.0
_PR_SET_PDEATHSIG = 1


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: the server's shutdown still stops it


@dataclass
class InPodCoordinator:
    proc: subprocess.Popen
    stats_address: str  # where the ranks report (host:port)
    publish_address: str  # where the DP client follows the feed (host:port)
    http_url: str  # /stats, /health, /metrics

    @classmethod
    def start(cls, http_port: int = 0, host: str = "127.0.0.1") -> "InPodCoordinator":
        stats_port, publish_port, http_port = _free_port(), _free_port(), http_port or _free_port()
        cmd = [sys.executable, "-m", "pdserve", "coordinator", "--host", host, "--stats-port", str(stats_port),
               "--publish-port", str(publish_port), "--http-port", str(http_port)]
        env = dict(os.environ, PYTHONSAFEPATH="1")
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        coordinator = cls(proc, f"{host}:{stats_port}", f"{host}:{publish_port}", f"http://{host}:{http_port}")
        coordinator._wait_healthy()
        log.info("in-pod coordinator ready: %s/stats", coordinator.http_url)
        return coordinator

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise OSError(f"the in-pod coordinator exited with code {self.proc.returncode}")
            try:
                if httpx.get(f"{self.http_url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise OSError(f"the in-pod coordinator did not answer on {self.http_url} within {START_TIMEOUT_S:.0f}s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
