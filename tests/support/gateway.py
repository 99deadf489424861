"""The pieces of a gateway stack for tests: engines, `pdserve epp`, a canary that must never be
reached, and Envoy (support.envoy) in front. All real processes on 127.0.0.1."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator

import openai

from support.envoy import BodyMode, EnvoyProcess, FailureMode, GatewaySpec, run_envoy
from support.server import ServerProcess, free_port, p2p_config, wait_healthy
from support.scrape import wait_until

MODEL = "tiny"  # the served model name every engine and the EPP use
ENGINE_ARGS = ("--max-model-len", "512", "--num-kv-blocks", "160", "--max-num-seqs", "16")


def launch(cmd: list[str], port: int, log_path: Path) -> ServerProcess:
    with open(log_path, "a") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, PYTHONSAFEPATH="1"))
    return ServerProcess(proc, port, log_path)


def stop(*servers: ServerProcess, grace: float = 15.0) -> None:
    """SIGTERM every process group at once (the engine core and workers are in it), SIGKILL what is
    left after `grace` seconds."""
    for server in servers:
        if server.proc.poll() is None:
            try:
                os.killpg(server.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace
    for server in servers:
        try:
            server.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(server.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        server.proc.wait()


def kill_now(server: ServerProcess) -> None:
    """kill -9 the whole process group: its sockets close at once."""
    os.killpg(server.proc.pid, signal.SIGKILL)
    server.proc.wait()


# --- engines -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class EngineSpec:
    role: str  # "both" (a single pool), "prefill" or "decode" (P/D, with the p2p connector over TCP)

    def args(self) -> list[str]:
        if self.role == "both":
            return []
        kv_role = "kv_producer" if self.role == "prefill" else "kv_consumer"
        return ["--engine-role", self.role, "--kv-transfer-config", p2p_config(kv_role, transport="tcp")]


def launch_engines(model: str, tmp: Path, roles: list[str], *extra: str) -> list[ServerProcess]:
    """Engines for `roles`, started and not waited for (see wait_all)."""
    started = []
    for role in roles:
        port = free_port()
        cmd = [sys.executable, "-m", "pdserve", "serve", "--model", model, "--served-model-name", MODEL,
               "--port", str(port), "--dtype", "float32", *ENGINE_ARGS, *EngineSpec(role).args(), *extra]
        started.append(launch(cmd, port, tmp / f"engine-{role}-{port}.log"))
    return started


def wait_all(*servers: ServerProcess, timeout: float = 180.0) -> None:
    """Wait for each to answer /health 200 (their start-ups overlap)."""
    for server in servers:
        wait_healthy(server.url, server.proc, server.log_path, timeout=timeout)


@contextmanager
def engines(model: str, tmp: Path, roles: list[str], *extra: str) -> Iterator[list[ServerProcess]]:
    """Engines for `roles`, started together, healthy when this yields, stopped on the way out."""
    started: list[ServerProcess] = []
    try:
        started = launch_engines(model, tmp, roles, *extra)
        wait_all(*started)
        yield started
    finally:
        stop(*started)


# --- the endpoint picker ---------------------------------------------------------------------------------

@dataclass
class EppProcess:
    server: ServerProcess  # .port is the metrics/health port
    grpc_port: int

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def url(self) -> str:
        return self.server.url


def launch_epp(tmp: Path, pool: list[ServerProcess], *args: str, prefill: list[ServerProcess] = ()) -> EppProcess:
    grpc_port, metrics_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "pdserve", "epp", "--model", MODEL, "--host", "127.0.0.1",
           "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port),
           "--pool-endpoints", ",".join(e.url for e in pool), "--health-interval", "0.5", "--log-level", "WARNING"]
    if prefill:
        cmd += ["--prefill-endpoints", ",".join(e.url for e in prefill)]
    server = launch([*cmd, *args], metrics_port, tmp / f"epp-{grpc_port}.log")
    return EppProcess(server, grpc_port)


@contextmanager
def run_epp(tmp: Path, pool: list[ServerProcess], *args: str, prefill: list[ServerProcess] = ()
            ) -> Iterator[EppProcess]:
    """`pdserve epp` over `pool` (and `prefill`), healthy when this yields, stopped on the way out."""
    epp = launch_epp(tmp, pool, *args, prefill=prefill)
    try:
        wait_all(epp.server, timeout=60)
        yield epp
    finally:
        stop(epp.server)


@contextmanager
def gateway(tmp: Path, epp: EppProcess, pool: list[ServerProcess], failure_mode: FailureMode = "FailClose",
            body_mode: BodyMode | None = None) -> Iterator[EnvoyProcess]:
    """Envoy in front of `pool`, its ext_proc filter pointed at `epp`, with an access log."""
    listener = free_port()
    spec = GatewaySpec(listener_port=listener, admin_port=free_port(), epp=epp.address,
                       pool=tuple(e.url for e in pool), failure_mode=failure_mode, body_mode=body_mode,
                       access_log=str(tmp / f"access-{listener}.log"))
    with run_envoy(spec, tmp) as envoy:
        yield envoy


# --- clients and checks -----------------------------------------------------------------------------------

def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def complete(url: str, prompt: str, max_tokens: int, **kw) -> openai.types.Completion:
    return client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, **kw)


def streamed_text(url: str, prompt: str, max_tokens: int) -> list[str]:
    """The text pieces of a streamed completion, chunk by chunk."""
    stream = client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                            stream=True)
    return [chunk.choices[0].text for chunk in stream if chunk.choices]


def chat(url: str, content: str, max_tokens: int, stream: bool = False) -> str:
    messages = [{"role": "user", "content": content}]
    if not stream:
        return client(url).chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                                   temperature=0).choices[0].message.content
    chunks = client(url).chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                                 temperature=0, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def host_of(server: ServerProcess) -> str:
    return f"127.0.0.1:{server.port}"


def picks_steered(envoy: EnvoyProcess, count: int, pool: list[ServerProcess]) -> list[dict]:
    """The last `count` access log entries, after checking that in each the EPP's first choice is the
    upstream that served it and is a member of `pool`."""
    members = {host_of(e) for e in pool}
    entries = wait_until(lambda: (lambda log: log[-count:] if len(log) >= count else None)(envoy.access_entries()),
                         f"{count} access log entries")
    for entry in entries:
        picked = entry["picked"].split(",")
        assert entry["upstream"] == picked[0] and set(picked) <= members, entry
    return entries


class Canary:
    """An HTTP server standing for anything on the gateway's network that is not in the pool (a
    metadata service, an admin port): it counts every connection, and must count none."""

    def __init__(self) -> None:
        self.connections = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def setup(self) -> None:
                outer.connections += 1
                super().setup()

            def do_GET(self) -> None:
                self._answer()

            def do_POST(self) -> None:
                self._answer()

            def _answer(self) -> None:
                body = json.dumps({"canary": True}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.address = f"127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@contextmanager
def canary() -> Iterator[Canary]:
    c = Canary()
    try:
        yield c
    finally:
        c.close()

