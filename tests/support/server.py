"""Start `pdserve serve` as a real subprocess on a free port, for integration tests."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx


# Ports free_port has handed out in this process. A server binds its port only once its model has
# loaded, seconds after the port was picked, and in that window the kernel may offer the same free
# port again: two decode engines of the migration test's stack once got one port, the second failed
# to listen, and both answered to one URL.
_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port free on 127.0.0.1 now, never one this process was given before."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def children(self) -> list:
        import psutil

        return psutil.Process(self.proc.pid).children(recursive=True)

    def engine_core_pid(self) -> int:
        for child in self.children():
            if "EngineCore" in " ".join(child.cmdline()) or child.name().startswith("EngineCore"):
                return child.pid
        # spawn children run `python -c from multiprocessing.spawn ...`; the engine core is the direct one
        import psutil

        direct = [c for c in psutil.Process(self.proc.pid).children() if "spawn_main" in " ".join(c.cmdline())]
        assert direct, f"no engine core process under {self.proc.pid}"
        return direct[0].pid

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)


def wait_healthy(url: str, proc: subprocess.Popen, log_path: Path, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log_path.read_text(errors='replace')}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"server not healthy after {timeout}s:\n{log_path.read_text(errors='replace')}")


def launch_server(model: str, *args: str, tmp_path: Path, env: dict[str, str | None] | None = None
                  ) -> ServerProcess:
    """`pdserve serve` started on a free port, not waited for. `env` entries override the test's
    environment; a None value removes the variable."""
    port = free_port()
    log_path = tmp_path / f"server-{port}.log"
    cmd = [sys.executable, "-m", "pdserve", "serve", "--model", model, "--port", str(port), "--dtype", "float32", *args]
    full_env = dict(os.environ, PYTHONSAFEPATH="1")
    for name, value in (env or {}).items():
        if value is None:
            full_env.pop(name, None)
        else:
            full_env[name] = value
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
    return ServerProcess(proc, port, log_path)


def p2p_config(role: str, **extra) -> str:
    """--kv-transfer-config of the p2p connector."""
    return json.dumps({"kv_connector": "p2p", "kv_role": role, "kv_connector_extra_config": extra})


@contextmanager
def run_server(model: str, *args: str, tmp_path: Path, env: dict[str, str | None] | None = None
               ) -> Iterator[ServerProcess]:
    server = launch_server(model, *args, tmp_path=tmp_path, env=env)
    proc, log_path = server.proc, server.log_path
    try:
        wait_healthy(server.url, proc, log_path)
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        else:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
