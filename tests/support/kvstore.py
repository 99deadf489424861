"""Start `pdserve kvstore` as a real process on 127.0.0.1 (shared by the KV store tests)."""

from __future__ import annotations

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


def free_port_pair() -> int:
    """A port p with p + 1 free too (the store's HTTP port defaults to p + 1)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 65535:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port
    raise RuntimeError("no two consecutive free ports")


@dataclass
class StoreProcess:
    proc: subprocess.Popen
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port + 1}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.http}/metrics", timeout=5).text
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                for line in text.splitlines() if line and not line.startswith("#")}


def wait_ports_bindable(port: int, count: int = 2, timeout: float = 30.0) -> None:
    """Before a restart on the same ports: a killed store's ports come from the ephemeral range, so
    an outgoing connection (an engine retrying the dead store) may hold one as its local port for a
    moment; binding then fails with EADDRINUSE. Wait until every port binds as a server's would."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            for p in range(port, port + count):
                with socket.socket() as s:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    s.bind(("127.0.0.1", p))
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def start_store(cmd: list[str], port: int, log_path: Path, env: dict[str, str] | None = None) -> StoreProcess:
    """`env`: the process's whole environment (default: this one's, so it holds the session key)."""
    with open(log_path, "a") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env=dict(os.environ if env is None else env, PYTHONSAFEPATH="1"))
    store = StoreProcess(proc, port, log_path)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kvstore exited with {proc.returncode}:\n{store.log()}")
        try:
            if httpx.get(f"{store.http}/health", timeout=2).status_code == 200:
                return store
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise TimeoutError(f"kvstore not healthy:\n{store.log()}")


def kvstore_cmd(port: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "pdserve", "kvstore", "--host", "127.0.0.1", "--port", str(port), *args]


@contextmanager
def running_store(tmp_path: Path, *args: str) -> Iterator[StoreProcess]:
    port = free_port_pair()
    store = start_store(kvstore_cmd(port, *args), port, tmp_path / f"kvstore-{port}.log")
    try:
        yield store
    finally:
        stop(store)


def stop(store: StoreProcess) -> int:
    if store.proc.poll() is None:
        store.proc.send_signal(signal.SIGTERM)
        try:
            store.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            store.proc.kill()
            store.proc.wait()
    return store.proc.returncode
