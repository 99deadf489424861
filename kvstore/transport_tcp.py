"""Our own TCP transport for p2p KV transfers: block memory goes from one KV cache to the other
with no copy on either side when whole blocks move.

The prefill worker runs a `BlockServer` on its side-channel port; a decode worker's `BlockClient`
keeps one connection per peer. Messages are a 4-byte length and a msgpack map; a read answers
with a header, then the raw bytes in block_io's wire order. The server hands the cache's own
memory to `sendmsg` (scatter-gather); the client `recv_into`s each run of consecutive local blocks
directly. Only a head slice (prefill and decode at different TP sizes) is staged through a buffer.
"""

from __future__ import annotations

import dataclasses
import logging
import select
import socket
import struct
import threading
import time
from typing import Any

import msgspec
import torch

from pdserve.kvstore.block_io import KVLayout, as_bytes, head_slice, whole_block_views, write_head_slice
from pdserve.kvstore.send_registry import SendRegistry, UnknownRequest

log = logging.getLogger("pdserve.kvstore.tcp")

_LEN = struct.Struct("!I")
MAX_MESSAGE = 64 << 20
IOV_MAX = 512  # below Linux's 1024, leaving room
NOT_READY_RETRY_S = 0.005
NIXL_PROGRESS_S = 0.0002


class TransferError(Exception):
    pass


def send_message(sock: socket.socket, message: dict[str, Any]) -> None:
    body = msgspec.msgpack.encode(message)
    sock.sendall(_LEN.pack(len(body)) + body)


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    got, total = 0, len(view)
    while got < total:
        n = sock.recv_into(view[got:], total - got)
        if n == 0:
            raise ConnectionError("the peer closed the connection")
        got += n


def recv_message(sock: socket.socket) -> dict[str, Any]:
    header = bytearray(4)
    recv_exact(sock, memoryview(header))
    (size,) = _LEN.unpack(header)
    if size > MAX_MESSAGE:
        raise ConnectionError(f"message of {size} bytes is over the limit")
    body = bytearray(size)
    recv_exact(sock, memoryview(body))
    message = msgspec.msgpack.decode(body)
    if not isinstance(message, dict):
        raise ConnectionError("a message must be a map")
    return message


def send_views(sock: socket.socket, views: list[memoryview]) -> None:
    """sendmsg in batches of IOV_MAX buffers, resuming after partial sends."""
    pending = [v.cast("B") for v in views if len(v)]
    at = 0
    while at < len(pending):
        sent = sock.sendmsg(pending[at:at + IOV_MAX])
        while at < len(pending) and sent >= len(pending[at]):
            sent -= len(pending[at])
            at += 1
        if sent:
            pending[at] = pending[at][sent:]


def recv_views(sock: socket.socket, views: list[memoryview]) -> None:
    """recvmsg_into the buffers in order (scatter), IOV_MAX at a time, resuming after short reads."""
    pending = [v.cast("B") for v in views if len(v)]
    at = 0
    while at < len(pending):
        got = sock.recvmsg_into(pending[at:at + IOV_MAX])[0]
        if got == 0:
            raise ConnectionError("the peer closed the connection")
        while at < len(pending) and got >= len(pending[at]):
            got -= len(pending[at])
            at += 1
        if got:
            pending[at] = pending[at][got:]


def tune(sock: socket.socket) -> None:
    # Buffer sizes stay with the kernel's autotuning: fixing them measured no faster here.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class BlockServer:
    """Serves reads of held blocks out of one worker rank's KV cache."""

    def __init__(self, kv_caches: list[torch.Tensor], registry: SendRegistry, host: str = "0.0.0.0",
                 port: int = 0) -> None:
        self.kv_caches = kv_caches
        self.layout = KVLayout.of(kv_caches)
        self.registry = registry
        self.nixl: Any = None  # a NixlEndpoint, when NIXL moves the data and we only lease
        self.bytes_sent = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server((host, port), reuse_port=False, backlog=64)
        self.port = self._listener.getsockname()[1]
        self._closed = False
        self._conns: set[socket.socket] = set()
        threading.Thread(target=self._accept_loop, name="kv-block-server", daemon=True).start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            tune(conn)
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="kv-block-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        leases: set[str] = set()  # NIXL reads in progress from this peer
        try:
            with conn:
                while True:
                    if leases and self.nixl is not None:
                        self._progress_until_readable(conn)
                    try:
                        message = recv_message(conn)
                    except (ConnectionError, OSError, msgspec.DecodeError):
                        return
                    try:
                        self._handle(conn, message, leases)
                    except (ConnectionError, OSError):
                        return
                    except Exception as exc:  # a bad message from a peer must not kill the engine
                        log.warning("kv transfer: bad message from a peer: %s", exc)
                        send_message(conn, {"ok": False, "error": f"bad message: {exc}", "retry": False})
        finally:
            with self._lock:
                self._conns.discard(conn)
            for request_id in leases:  # a reader that vanished mid-read no longer pins the blocks
                self.registry.end_read(request_id)

    def _progress_until_readable(self, conn: socket.socket) -> None:
        """While a peer READs our memory with NIXL, our agent must make progress for it (we run
        without NIXL's progress thread): poll it until the peer's next message arrives."""
        while not select.select([conn], [], [], NIXL_PROGRESS_S)[0]:
            self.nixl.progress()

    def _handle(self, conn: socket.socket, message: dict[str, Any], leases: set[str]) -> None:
        op = message.get("op")
        if op == "layout":
            send_message(conn, {"ok": True, "layout": dataclasses.asdict(self.layout)})
        elif op == "read":
            self._read(conn, str(message["req"]), [int(b) for b in message["blocks"]], message.get("heads"))
        elif op == "lease":
            request_id = str(message["req"])
            try:
                self.registry.begin_read(request_id)
            except UnknownRequest as exc:
                send_message(conn, {"ok": False, "error": str(exc), "retry": exc.retry})
                return
            leases.add(request_id)
            send_message(conn, {"ok": True})
        elif op == "nixl_md":
            if self.nixl is None:
                send_message(conn, {"ok": False, "error": "this engine does not serve NIXL", "retry": False})
            else:
                send_message(conn, {"ok": True, "md": self.nixl.metadata()})
        elif op == "done":
            request_id = str(message["req"])
            if request_id in leases:
                leases.discard(request_id)
                self.registry.end_read(request_id)
            self.registry.done(request_id, int(message.get("expected", 1)))
            send_message(conn, {"ok": True})
        else:
            send_message(conn, {"ok": False, "error": f"unknown op {op!r}", "retry": False})

    def _read(self, conn: socket.socket, request_id: str, wanted: list[int], heads: list[int] | None) -> None:
        try:
            held = self.registry.begin_read(request_id)
        except UnknownRequest as exc:
            send_message(conn, {"ok": False, "error": str(exc), "retry": exc.retry})
            return
        try:
            held_set = set(held)
            if any(b not in held_set for b in wanted):
                send_message(conn, {"ok": False, "error": f"request {request_id!r} does not hold those blocks",
                                    "retry": False})
                return
            h0, h1 = heads if heads else (0, self.layout.num_kv_heads)
            if not 0 <= h0 < h1 <= self.layout.num_kv_heads:
                send_message(conn, {"ok": False, "error": f"no heads [{h0}, {h1}) here", "retry": False})
                return
            whole = (h0, h1) == (0, self.layout.num_kv_heads)
            if whole and not self.kv_caches[0].is_cuda:
                views = whole_block_views(self.kv_caches, wanted)
            else:
                views = [as_bytes(head_slice(self.kv_caches, layer, kv, wanted, h0, h1).cpu())
                         for layer in range(self.layout.num_layers) for kv in (0, 1)]
            nbytes = sum(len(v) for v in views)
            send_message(conn, {"ok": True, "nbytes": nbytes})
            send_views(conn, views)
            with self._lock:
                self.bytes_sent += nbytes
        finally:
            self.registry.end_read(request_id)

    def close(self) -> None:
        self._closed = True
        with self._lock:
            sockets = [self._listener, *self._conns]
        for sock in sockets:  # shutdown first: it wakes a thread blocked in accept() or recv()
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()


class BlockClient:
    """One decode worker rank's connections to prefill ranks; one pull at a time per peer."""

    def __init__(self, kv_caches: list[torch.Tensor], timeout_s: float = 10.0, nixl: Any = None) -> None:
        self.kv_caches = kv_caches
        self.layout = KVLayout.of(kv_caches)
        self.timeout_s = timeout_s
        self.nixl = nixl  # a NixlEndpoint: whole-block reads go through it
        self._conns: dict[tuple[str, int], socket.socket] = {}
        self._locks: dict[tuple[str, int], threading.Lock] = {}
        self._guard = threading.Lock()

    def _peer_lock(self, peer: tuple[str, int]) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(peer, threading.Lock())

    def _connect(self, peer: tuple[str, int]) -> socket.socket:
        sock = self._conns.get(peer)
        if sock is not None:
            return sock
        sock = socket.create_connection(peer, timeout=self.timeout_s)
        tune(sock)
        send_message(sock, {"op": "layout"})
        reply = recv_message(sock)
        remote = KVLayout(**reply["layout"])
        problem = self.layout.compatible(remote)
        if problem:
            sock.close()
            raise TransferError(f"the KV layouts of the two engines differ ({problem})")
        self._conns[peer] = sock
        return sock

    def _drop(self, peer: tuple[str, int]) -> None:
        sock = self._conns.pop(peer, None)
        if sock is not None:
            sock.close()

    def pull(self, peer: tuple[str, int], request_id: str, remote_blocks: list[int], local_blocks: list[int],
             remote_heads: tuple[int, int], local_heads: tuple[int, int], deadline: float) -> int:
        """Copy the remote blocks' heads into the local blocks; returns bytes moved. Waits (until
        `deadline`) for a prefill rank that has not registered the request yet."""
        with self._peer_lock(peer):
            try:
                return self._pull(peer, request_id, remote_blocks, local_blocks, remote_heads, local_heads, deadline)
            except (OSError, ConnectionError, msgspec.DecodeError, KeyError, TypeError) as exc:
                self._drop(peer)
                raise TransferError(f"pulling KV of {request_id!r} from {peer[0]}:{peer[1]} failed: {exc}") from exc

    def _ask(self, peer: tuple[str, int], message: dict[str, Any], deadline: float) -> dict[str, Any]:
        """Send a request, retrying while the peer says the request is not registered yet."""
        while True:
            sock = self._connect(peer)
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            send_message(sock, message)
            reply = recv_message(sock)
            if reply.get("ok"):
                return reply
            if reply.get("retry") and time.monotonic() + NOT_READY_RETRY_S < deadline:
                time.sleep(NOT_READY_RETRY_S)
                continue
            raise TransferError(str(reply.get("error")))

    def nixl_pull(self, peer: tuple[str, int], engine_id: str, request_id: str, remote_blocks: list[int],
                  local_blocks: list[int], deadline: float) -> int:
        """Lease the blocks over the side channel, READ them with NIXL. The caller's `release`
        ends the lease."""
        key = f"{engine_id}@{peer[0]}:{peer[1]}"
        with self._peer_lock(peer):
            try:
                if not self.nixl.has_peer(key):
                    self.nixl.add_peer(key, self._ask(peer, {"op": "nixl_md"}, deadline)["md"])
                self._ask(peer, {"op": "lease", "req": request_id}, deadline)
            except (OSError, ConnectionError, msgspec.DecodeError, KeyError, TypeError) as exc:
                self._drop(peer)
                raise TransferError(f"leasing KV of {request_id!r} from {peer[0]}:{peer[1]} failed: {exc}") from exc
        try:
            return self.nixl.read(key, remote_blocks, local_blocks, deadline)
        except Exception as exc:
            self.nixl.forget_peer(key)  # a restarted peer registers new memory: fetch it again
            raise TransferError(f"NIXL read of {request_id!r} from {peer[0]}:{peer[1]} failed: {exc}") from exc

    def _pull(self, peer, request_id, remote_blocks, local_blocks, remote_heads, local_heads, deadline) -> int:
        nheads = remote_heads[1] - remote_heads[0]
        whole_local = (local_heads[1] - local_heads[0]) == self.layout.num_kv_heads
        expected = self.layout.transfer_bytes(len(remote_blocks), nheads)
        reply = self._ask(peer, {"op": "read", "req": request_id, "blocks": remote_blocks, "heads": list(remote_heads)},
                          deadline)
        sock = self._conns[peer]
        if reply["nbytes"] != expected:
            raise TransferError(f"expected {expected} bytes, the peer sends {reply['nbytes']}")
        if whole_local and not self.kv_caches[0].is_cuda:
            # Straight into the cache: every run of consecutive local blocks is one buffer.
            recv_views(sock, whole_block_views(self.kv_caches, local_blocks))
            return expected
        shape = (len(local_blocks), self.layout.block_size, nheads, self.layout.head_dim)
        staging = torch.empty(shape, dtype=self.kv_caches[0].dtype)
        for layer in range(self.layout.num_layers):
            for kv in (0, 1):
                recv_exact(sock, as_bytes(staging))
                write_head_slice(self.kv_caches, layer, kv, local_blocks, local_heads[0], local_heads[1], staging)
        return expected

    def release(self, peer: tuple[str, int], request_id: str, expected: int) -> None:
        """Tell the peer this reader is finished with the request (best effort)."""
        with self._peer_lock(peer):
            try:
                sock = self._connect(peer)
                sock.settimeout(self.timeout_s)
                send_message(sock, {"op": "done", "req": request_id, "expected": expected})
                recv_message(sock)
            except (OSError, ConnectionError, msgspec.DecodeError, TransferError) as exc:
                self._drop(peer)
                log.debug("could not release %s at %s: %s", request_id, peer, exc)

    def close(self) -> None:
        for peer in list(self._conns):
            self._drop(peer)
