"""The KV store service: a ROUTER socket over one BlockStore, plus /health and /metrics over HTTP.

One thread owns the store and answers requests in arrival order, so a put lands whole before
the next request is looked at: no reader can see a value half written. Values stay in the
ZMQ frames they arrived in (the store keeps views of them) and go back out as the same memory.
The HTTP server runs in a daemon thread and only reads counters.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterator

import zmq
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from pdserve.engine import internal_auth
from pdserve.engine.logging_config import RateLimitedWarning
from pdserve.kvstore import protocol
from pdserve.kvstore.protocol import Limits, ProtocolError, ReplyHeader, RequestHeader
from pdserve.kvstore.store import BlockStore, ValueTooLarge

log = logging.getLogger("pdserve.kvstore")

POLL_MS = 100
SMALL_VALUE_BYTES = 16 * 1024


@dataclass
class ServiceConfig:
    host: str = "127.0.0.1"
    port: int = 5700
    capacity_bytes: int = 2**30
    # None: port + 1; 0: no HTTP server.
    http_port: int | None = None
    limits: Limits = field(default_factory=Limits)
    # The deployment's internal key (None: plain sockets, insecure mode, warned about at start).
    internal_key: bytes | None = None

    @property
    def resolved_http_port(self) -> int:
        return self.port + 1 if self.http_port is None else self.http_port


def _keepable(frame: zmq.Frame) -> bytes | memoryview:
    # libzmq receives small messages into a shared 8 KiB chunk: keeping a view of one would pin
    # the whole chunk, so small values are copied out. Large ones own their memory: kept as is.
    return frame.bytes if len(frame) < SMALL_VALUE_BYTES else frame.buffer


class ServiceError(RuntimeError):
    """The service cannot start (a port taken, an address that does not resolve)."""


class KVStoreService:
    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self.store = BlockStore(config.capacity_bytes)
        self.errors = 0
        self.requests: Counter[str] = Counter()
        self._stop = threading.Event()
        self._warn = RateLimitedWarning(log)
        self._context = zmq.Context(io_threads=1)
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 200)
        # A frame over the limit is never allocated: libzmq drops the peer on reading its length
        # (a key holder's call then times out and its next call reconnects).
        self._socket.setsockopt(zmq.MAXMSGSIZE, protocol.wire_frame_limit(config.limits.max_frame_bytes))
        self.zmq_address = f"tcp://{config.host}:{config.port}"
        try:
            # Only holders of the internal key complete the handshake; nothing of anyone else's
            # is ever delivered to this socket.
            internal_auth.secure_server(self._socket, config.internal_key)
            self._socket.bind(self.zmq_address)
        except zmq.ZMQError as exc:
            self._close_zmq()
            raise ServiceError(f"cannot bind the KV store to {self.zmq_address}: {exc}") from None
        self._http: ThreadingHTTPServer | None = None
        if config.resolved_http_port:
            try:
                self._http = _start_http(self, config.host, config.resolved_http_port)
            except OSError as exc:
                self._close_zmq()
                raise ServiceError(f"cannot serve HTTP on {config.host}:{config.resolved_http_port}: {exc}") from None

    @property
    def http_address(self) -> str | None:
        return f"http://{self.config.host}:{self.config.resolved_http_port}" if self._http else None

    def stop(self) -> None:
        """Ask `serve_forever` to return; safe from a signal handler or another thread."""
        self._stop.set()

    def serve_forever(self) -> None:
        if self.config.internal_key is None:
            log.warning("kvstore: no internal key (PDSERVE_INTERNAL_KEY / --internal-key-file): the ZMQ socket "
                        "%s is unauthenticated, anyone who can reach it can read and write KV blocks",
                        self.zmq_address)
        log.info("kvstore serving zmq=%s http=%s capacity_bytes=%d max_frame_bytes=%d max_keys=%d",
                 self.zmq_address, self.http_address or "off", self.store.capacity_bytes,
                 self.config.limits.max_frame_bytes, self.config.limits.max_keys)
        try:
            while not self._stop.is_set():
                # A bounded poll so a stop request is seen within POLL_MS even when idle.
                if self._socket.poll(POLL_MS, zmq.POLLIN):
                    frames = self._socket.recv_multipart(copy=False)
                    reply = self.handle(frames[1:])
                    self._socket.send_multipart([frames[0], *reply], copy=False)
        finally:
            self.close()
        log.info("kvstore stopped entries=%d bytes_stored=%d", self.store.stats.entries,
                 self.store.stats.bytes_stored)

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
        self._close_zmq()

    def _close_zmq(self) -> None:
        if not self._socket.closed:
            self._socket.close()
        internal_auth.stop_authenticator(self._context)
        self._context.term()

    def handle(self, frames: list[Any]) -> list[Any]:
        """Reply frames for one request (header frame, then value frames); never raises."""
        if not frames:
            return self._error(0, "empty request")
        header_frame, values = frames[0], frames[1:]
        try:
            request = protocol.decode_request(header_frame.buffer, [len(v) for v in values], self.config.limits)
        except ProtocolError as exc:
            return self._error(protocol.guess_request_id(header_frame.buffer), str(exc))
        self.requests[request.op] += 1
        try:
            return self._dispatch(request, values)
        except ValueTooLarge as exc:
            return self._error(request.request_id, str(exc))
        except Exception as exc:  # a bug must cost one request, never the service
            log.exception("kvstore failed op=%s request_id=%d", request.op, request.request_id)
            return self._error(request.request_id, f"internal error: {type(exc).__name__}: {exc}")

    def _dispatch(self, request: RequestHeader, values: list[Any]) -> list[Any]:
        store, rid = self.store, request.request_id
        keys = [protocol.store_key(request.namespace, key) for key in request.keys]
        if request.op == "put":
            store.put_all(keys, [_keepable(value) for value in values])
            return [protocol.encode(ReplyHeader(rid, True))]
        if request.op == "get":
            found = [store.get(key) for key in keys]
            header = ReplyHeader(rid, True, found=[value is not None for value in found])
            return [protocol.encode(header), *(value for value in found if value is not None)]
        if request.op == "contains":
            return [protocol.encode(ReplyHeader(rid, True, prefix_length=store.prefix_length(keys)))]
        return [protocol.encode(ReplyHeader(rid, True, stats=self.stats()))]

    def _error(self, request_id: int, message: str) -> list[Any]:
        self.errors += 1
        self._warn("kvstore refused a request: %s", message)
        return [protocol.encode(ReplyHeader(request_id, False, error=message))]

    def stats(self) -> dict[str, int]:
        # A copy, so the HTTP thread reads one consistent-enough snapshot while the loop runs.
        snapshot = copy.copy(self.store.stats).as_dict()
        snapshot["errors"] = self.errors
        return snapshot


class _StoreCollector:
    """Reads the service's counters at scrape time (no second set of counters to keep in step)."""

    def __init__(self, service: KVStoreService) -> None:
        self.service = service

    def collect(self) -> Iterator[Any]:
        stats = self.service.stats()
        counters = [("hits", "Keys found by get"), ("misses", "Keys not found by get"),
                    ("bytes_in", "Value bytes stored by put"), ("bytes_out", "Value bytes returned by get"),
                    ("evictions", "Values evicted to make room (least recently used first)"),
                    ("puts", "Values stored"), ("refused", "Values refused as larger than the capacity"),
                    ("errors", "Requests answered with an error")]
        for name, help_text in counters:
            yield CounterMetricFamily(f"pdserve_kvstore_{name}", help_text, value=stats[name])
        yield GaugeMetricFamily("pdserve_kvstore_bytes_stored", "Value bytes held now", value=stats["bytes_stored"])
        yield GaugeMetricFamily("pdserve_kvstore_entries", "Values held now", value=stats["entries"])
        yield GaugeMetricFamily("pdserve_kvstore_capacity_bytes", "Most value bytes held at once",
                                value=stats["capacity_bytes"])
        requests = CounterMetricFamily("pdserve_kvstore_requests", "Requests served, by op", labels=["op"])
        for op in protocol.OPS:
            requests.add_metric([op], self.service.requests[op])
        yield requests


def _start_http(service: KVStoreService, host: str, port: int) -> ThreadingHTTPServer:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_StoreCollector(service))

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/health":
                self._send(200, b"ok\n", "text/plain; charset=utf-8")
            elif self.path == "/metrics":
                self._send(200, generate_latest(registry), CONTENT_TYPE_LATEST)
            else:
                self._send(404, b"not found: try /health or /metrics\n", "text/plain; charset=utf-8")

        def _send(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("kvstore http %s", format % args)

    class Server(ThreadingHTTPServer):
        daemon_threads = True

    server = Server((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="kvstore-http", daemon=True).start()
    return server
