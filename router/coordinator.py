"""The coordinator service: engines' load in, one aggregate view out (DESIGN §5).

One asyncio loop, no threads: a zmq PULL socket takes every engine's reports into the LoadBook;
a zmq PUB socket publishes the view to routers about every 100 ms (at once when an engine joins,
goes stale or is forgotten); a small ASGI app under uvicorn answers `/stats`, `/blocks`,
`/health` and `/metrics`. Everything is bound before anything runs, so a port in use is a clear
start-up error rather than a half-started service.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterator

import msgspec
import uvicorn
import zmq
import zmq.asyncio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from pdserve.engine import internal_auth
from pdserve.engine.core.load_reporter import MAX_REPORT_BYTES, LoadReport, tcp_endpoint
from pdserve.engine.logging_config import RateLimitedWarning
from pdserve.router.coordinator_state import Ignored, LoadBook

log = logging.getLogger("pdserve.coordinator")

# A router that reads slower than this many updates loses the oldest; the next one is complete.
PUBLISH_HWM = 100
# Between two reads of the clock, let the publisher and HTTP run even under a flood of reports.
_YIELD_EVERY = 64


@dataclass
class CoordinatorSettings:
    host: str = "0.0.0.0"
    stats_port: int = 5557
    publish_port: int = 5558
    http_port: int = 8080
    publish_interval: float = 0.1
    stale_after: float = 3.0
    forget_after: float = 60.0
    # The deployment's internal key: only its holders may report, subscribe or read /blocks.
    # None: plain sockets and an open /blocks (insecure mode, warned about at start).
    internal_key: bytes | None = None


class CoordinatorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.engines = Gauge("pdserve_coordinator_engines", "Engines known to the coordinator", ["state"],
                             registry=self.registry)
        self.reports = Counter("pdserve_coordinator_reports", "Load reports taken into the view",
                               registry=self.registry)
        self.ignored = Counter("pdserve_coordinator_reports_ignored", "Load reports ignored, by reason", ["reason"],
                               registry=self.registry)
        self.publishes = Counter("pdserve_coordinator_publishes", "Updates published to routers",
                                 registry=self.registry)
        self.cached_blocks = Gauge("pdserve_coordinator_cached_blocks", "Cached KV blocks the engines hold",
                                   registry=self.registry)
        self.hashes_dropped = Counter("pdserve_coordinator_block_hashes_dropped",
                                      "Block hashes not indexed, by the bound they exceeded", ["bound"],
                                      registry=self.registry)
        for reason in Ignored:
            self.ignored.labels(reason.value)
        for bound in ("per_report", "per_engine"):
            self.hashes_dropped.labels(bound)


class Coordinator:
    def __init__(self, settings: CoordinatorSettings) -> None:
        self.settings = settings
        self.book = LoadBook(settings.stale_after, settings.forget_after)
        self.metrics = CoordinatorMetrics()
        self._decoder = msgspec.msgpack.Decoder(LoadReport)
        self._encoder = msgspec.msgpack.Encoder()
        self._json = msgspec.json.Encoder()
        self._warn_malformed = RateLimitedWarning(log)  # a flood of garbage must not flood the log

    # -- reports in ---------------------------------------------------------------------------

    def handle_report(self, frames: list[bytes], now: float) -> Ignored | None:
        """Decode and apply one message from the stats socket; never raises."""
        try:
            if len(frames) != 1:
                raise ValueError(f"{len(frames)} frames")
            report = self._decoder.decode(frames[0])
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            self._warn_malformed("ignoring a malformed message on the stats socket: %s", exc)
            reason: Ignored | None = Ignored.MALFORMED
        else:
            dropped_before = dict(self.book.hashes_dropped)
            reason = self.book.accept(report, now)
            for bound, count in self.book.hashes_dropped.items():
                if count > dropped_before[bound]:
                    self.metrics.hashes_dropped.labels(bound).inc(count - dropped_before[bound])
        if reason is None:
            self.metrics.reports.inc()
        else:
            self.metrics.ignored.labels(reason.value).inc()
        return reason

    async def _receive(self, pull: zmq.asyncio.Socket, wake: asyncio.Event) -> None:
        handled = 0
        while True:
            frames = await pull.recv_multipart()
            try:
                self.handle_report(frames, time.monotonic())
            except Exception:  # a bug on one message must not stop the coordinator
                log.exception("failed to handle a report")
            if self.book.urgent:
                wake.set()
            handled += 1
            if handled % _YIELD_EVERY == 0:
                # An already-delivered message resolves the await without yielding to the loop.
                await asyncio.sleep(0)

    # -- updates out --------------------------------------------------------------------------

    def next_update(self) -> bytes:
        self.book.sweep(time.monotonic())
        return self._encoder.encode(self.book.take_update())

    async def _publish(self, pub: zmq.asyncio.Socket, wake: asyncio.Event) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(wake.wait(), self.settings.publish_interval)
            wake.clear()
            body = self.next_update()
            if self.book.urgent:  # the sweep itself found a change: publish that right away too
                wake.set()
            try:
                await pub.send(body, zmq.NOBLOCK)  # PUB drops for slow readers; it never blocks
                self.metrics.publishes.inc()
            except zmq.Again:
                pass

    # -- HTTP ---------------------------------------------------------------------------------

    def _route(self, path: str, key_header: str | None = None) -> tuple[int, bytes, bytes]:
        now = time.monotonic()
        if path == "/stats":
            # Load numbers only, all from authenticated reports: open to the autoscaler and people.
            self.book.sweep(now)
            return 200, b"application/json", self._json.encode(self.book.stats(now))
        if path == "/blocks":
            # The hashes tell which prompts were sent: for the routers (key holders) only.
            key = self.settings.internal_key
            if key is not None and not internal_auth.header_matches(key_header, key):
                return 401, b"application/json", self._json.encode(
                    {"error": f"/blocks needs the {internal_auth.HEADER} header"})
            return 200, b"application/json", self._json.encode(self.book.blocks_hex())
        if path == "/health":
            return 200, b"application/json", b'{"status":"ok"}'
        if path == "/metrics":
            self.book.sweep(now)
            engines = self.book.engines.values()
            stale = sum(1 for e in engines if e.stale)
            self.metrics.engines.labels("live").set(len(engines) - stale)
            self.metrics.engines.labels("stale").set(stale)
            self.metrics.cached_blocks.set(sum(len(e.blocks) for e in engines))
            return 200, CONTENT_TYPE_LATEST.encode(), generate_latest(self.metrics.registry)
        return 404, b"application/json", self._json.encode({"error": f"no route {path}; try /stats, /blocks, "
                                                                        "/health or /metrics"})

    async def http_app(self, scope: dict[str, Any], receive: Callable[[], Awaitable[dict]],
                       send: Callable[[dict], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            return
        if scope["method"] not in ("GET", "HEAD"):
            status, ctype, body = 405, b"application/json", b'{"error":"only GET is served here"}'
        else:
            try:
                status, ctype, body = self._route(scope["path"], _header(scope, _KEY_HEADER))
            except Exception:
                log.exception("failed to answer %s", scope["path"])
                status, ctype, body = 500, b"application/json", b'{"error":"internal error"}'
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", ctype), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body})

    # -- running ------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event, on_ready: Callable[[], None] | None = None) -> None:
        """Bind everything (raising OSError/zmq.ZMQError on failure), then serve until `stop` is set."""
        s = self.settings
        ctx = zmq.asyncio.Context()
        http_sock = None
        if s.internal_key is None:
            log.warning("coordinator: no internal key (PDSERVE_INTERNAL_KEY / --internal-key-file): its ZMQ sockets "
                        "are unauthenticated (anyone who can reach them can report load or read the feed) and "
                        "/blocks is open")
        try:
            pull = _bound(ctx, zmq.PULL, s.host, s.stats_port, s.internal_key, max_message=MAX_REPORT_BYTES)
            pub = _bound(ctx, zmq.PUB, s.host, s.publish_port, s.internal_key)
            pub.setsockopt(zmq.SNDHWM, PUBLISH_HWM)
            http_sock = _http_socket(s.host, s.http_port)
            server = _SignalFreeServer(uvicorn.Config(self.http_app, interface="asgi3", log_level="warning",
                                                      access_log=False, lifespan="off", timeout_graceful_shutdown=2))
            wake = asyncio.Event()
            tasks = [asyncio.create_task(self._receive(pull, wake), name="coordinator-receive"),
                     asyncio.create_task(self._publish(pub, wake), name="coordinator-publish"),
                     asyncio.create_task(server.serve(sockets=[http_sock]), name="coordinator-http")]
            log.info("coordinator: reports on %s, publishing on %s, http on %s:%d", tcp_endpoint(s.host, s.stats_port),
                     tcp_endpoint(s.host, s.publish_port), s.host, s.http_port)
            if on_ready is not None:
                on_ready()
            stopped = asyncio.create_task(stop.wait())
            done, _ = await asyncio.wait([stopped, *tasks], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is not stopped and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
            server.should_exit = True
            for task in tasks[:2]:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            stopped.cancel()
        finally:
            if http_sock is not None:
                http_sock.close()
            internal_auth.stop_authenticator(ctx)
            ctx.destroy(linger=0)
        log.info("coordinator stopped")


_KEY_HEADER = internal_auth.HEADER.lower().encode()


def _header(scope: dict[str, Any], name: bytes) -> str | None:
    for key, value in scope.get("headers") or ():
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _bound(ctx: zmq.asyncio.Context, kind: int, host: str, port: int, key: bytes | None,
           max_message: int | None = None) -> zmq.asyncio.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if max_message is not None:
        # A larger frame is never allocated: libzmq drops the peer on reading its length.
        sock.setsockopt(zmq.MAXMSGSIZE, max_message)
    if ":" in host:
        sock.setsockopt(zmq.IPV6, 1)
    try:
        internal_auth.secure_server(sock, key)  # only key holders complete the handshake
        sock.bind(tcp_endpoint(host, port))
    except zmq.ZMQError as exc:
        sock.close()
        raise OSError(f"cannot listen on {tcp_endpoint(host, port)}: {exc}") from exc
    return sock


def _http_socket(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on http://{host}:{port}: {exc.strerror or exc}") from exc
    sock.listen(128)
    sock.setblocking(False)
    return sock


class _SignalFreeServer(uvicorn.Server):
    """uvicorn, minus its signal handling: the coordinator's loop owns SIGTERM/SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield
