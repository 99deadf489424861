"""Start `pdserve coordinator` as a real subprocess, and speak to it as engines and routers do."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import msgspec
import zmq

from pdserve.engine import internal_auth
from pdserve.engine.core.load_reporter import LoadReport
from pdserve.router.coordinator_protocol import CoordinatorUpdate
from support.server import free_port, wait_healthy


@dataclass
class CoordinatorProcess:
    proc: subprocess.Popen
    stats_port: int
    publish_port: int
    http_port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def stats_address(self) -> str:
        """What engines pass as --coordinator-address."""
        return f"127.0.0.1:{self.stats_port}"

    def stats(self) -> dict[str, Any]:
        response = httpx.get(f"{self.url}/stats", timeout=10)
        response.raise_for_status()
        return response.json()

    def engine(self, engine_id: str) -> dict[str, Any] | None:
        return next((e for e in self.stats()["engines"] if e["id"] == engine_id), None)

    def metric(self, name: str, **labels: str) -> float:
        wanted = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            series, _, value = line.rpartition(" ")
            if series == wanted:
                return float(value)
        raise KeyError(wanted)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


FROM_ENV: Any = object()


def _key(key: Any) -> bytes | None:
    return internal_auth.load_internal_key() if key is FROM_ENV else key


@contextmanager
def run_coordinator(*args: str, tmp_path: Path, env: dict[str, str] | None = None) -> Iterator[CoordinatorProcess]:
    """`env`: the process's whole environment (default: this one's, so it holds the session key)."""
    ports = [free_port() for _ in range(3)]
    log_path = tmp_path / f"coordinator-{ports[2]}.log"
    cmd = [sys.executable, "-m", "pdserve", "coordinator", "--host", "127.0.0.1", "--stats-port", str(ports[0]),
           "--publish-port", str(ports[1]), "--http-port", str(ports[2]), *args]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env=dict(os.environ if env is None else env, PYTHONSAFEPATH="1"),
                                start_new_session=True)
    coordinator = CoordinatorProcess(proc, *ports, log_path)
    try:
        wait_healthy(coordinator.url, proc, log_path, timeout=60)
        yield coordinator
    finally:
        stop(proc)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def wait_for(predicate: Callable[[], Any], what: str, timeout: float = 20.0, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


class FakeEngine:
    """Pushes hand-made reports to a coordinator's stats socket, as an engine core would; with the
    session's internal key unless `key` says otherwise (None: a plain socket, as an outsider)."""

    def __init__(self, stats_address: str, engine_id: str, role: str = "decode", address: str = "10.0.0.1:8000",
                 ctx: zmq.Context | None = None, key: Any = FROM_ENV) -> None:
        self.ctx = ctx or zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 1000)
        # A PUSH socket with no peer blocks on send: an outsider whose handshake the coordinator refused
        # has none. A send fails (zmq.Again) after this long instead of hanging the test.
        self.sock.setsockopt(zmq.SNDTIMEO, 5000)
        internal_auth.secure_client(self.sock, _key(key))
        self.sock.connect(f"tcp://{stats_address}")
        self.engine_id, self.role, self.address = engine_id, role, address
        self.seq = 0

    def report(self, seq: int | None = None, time_: float | None = None, **fields: Any) -> LoadReport:
        if seq is None:
            self.seq += 1
            seq = self.seq
        values = dict(waiting=0, running=0, kv_usage=0.0, step=0)
        values.update(fields)
        report = LoadReport(id=self.engine_id, role=self.role, address=self.address, dp_rank=0, seq=seq,
                            time=time.time() if time_ is None else time_, **values)
        self.send_raw(msgspec.msgpack.encode(report))
        return report

    def send_raw(self, *frames: bytes) -> None:
        self.sock.send_multipart(list(frames))

    def close(self) -> None:
        self.sock.close()


class PeriodicReporter:
    """Engine reports pushed to the coordinator every 0.2 s, as engine cores would: `loads` maps an
    engine id to its fields (address, dp_rank, waiting, running, step); ids in `paused` go silent."""

    def __init__(self, stats_address: str) -> None:
        self.stats_address = stats_address
        self.loads: dict[str, dict] = {}
        self.paused: set[str] = set()
        self.lock = threading.Lock()
        self.running = True
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def set(self, **loads: dict) -> None:
        with self.lock:
            self.loads = {k.replace("_", "-"): v for k, v in loads.items()}
            self.paused = set()

    def _loop(self) -> None:
        context = zmq.Context()
        sock = context.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        internal_auth.secure_client(sock, internal_auth.load_internal_key())
        sock.connect(f"tcp://{self.stats_address}")
        seq = 0
        try:
            while self.running:
                with self.lock:
                    loads = {k: v for k, v in self.loads.items() if k not in self.paused}
                for engine_id, fields in loads.items():
                    seq += 1
                    report = LoadReport(id=engine_id, role="both", address=fields["address"],
                                        dp_rank=fields.get("dp_rank", 0), seq=seq, time=time.time(),
                                        waiting=fields.get("waiting", 0), running=fields.get("running", 0),
                                        kv_usage=fields.get("kv_usage", 0.0), step=fields.get("step", 1))
                    sock.send(msgspec.msgpack.encode(report))
                time.sleep(0.2)
        finally:
            sock.close()
            context.term()

    def close(self) -> None:
        self.running = False
        self.thread.join()


class Subscriber:
    """A router's view of the publish feed."""

    def __init__(self, publish_port: int, ctx: zmq.Context | None = None, key: Any = FROM_ENV) -> None:
        self.ctx = ctx or zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.SUB)
        internal_auth.secure_client(self.sock, _key(key))
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://127.0.0.1:{publish_port}")
        self.decoder = msgspec.msgpack.Decoder(CoordinatorUpdate)

    def updates(self, seconds: float) -> list[CoordinatorUpdate]:
        """Every update received during the next `seconds`."""
        received = []
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if self.sock.poll(max(1, int(left * 1000))):
                received.append(self.decoder.decode(self.sock.recv()))
        return received

    def until(self, predicate: Callable[[CoordinatorUpdate], bool], what: str, timeout: float = 20.0,
              seen: list[CoordinatorUpdate] | None = None) -> CoordinatorUpdate:
        """Read updates (appending them to `seen`) until one satisfies `predicate`."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if self.sock.poll(max(1, int(left * 1000))):
                update = self.decoder.decode(self.sock.recv())
                if seen is not None:
                    seen.append(update)
                if predicate(update):
                    return update
        raise AssertionError(f"no published update showed {what} within {timeout}s")

    def close(self) -> None:
        self.sock.close()
