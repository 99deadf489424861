"""Our own TCP transport for p2p KV transfers: block memory goes from one KV cache to the other
with no copy on either side when whole blocks move.

The prefill worker runs a `BlockServer` on its side-channel port; a decode worker's `BlockClient`
keeps one connection per peer. Messages are a 4-byte length and a msgpack map; a read answers
with a header, then the raw bytes in block_io's wire order. The server hands the cache's own
memory to `sendmsg` (scatter-gather); the client `recv_into`s each run of consecutive local blocks
directly. Only a head slice (prefill and decode at different TP sizes) is staged through a buffer.

Every connection starts with a mutual challenge-response over the deployment's internal key
(engine.internal_auth), once per connection (connections are kept and reused, so a pull pays
nothing for it): the server sends a magic and a nonce, the client answers with its proof and a
nonce of its own, the server answers with its proof. Before that the server reads exactly that
fixed-size answer, within a few seconds, and nothing else; connections are bounded per peer
address and in total. A decode engine checks the server's proof too, so it never takes KV (or
answers anything) from a side channel that does not hold the key.

Ops after the handshake: `layout`, `read` (the bytes follow the answer), `lease` (NIXL reads),
`nixl_md`, `renew` (a decode engine still means to pull: a batch of [request id, digest] whose
leases run a full term again) and `done` (a reader is finished, or will never read).
"""

from __future__ import annotations

import dataclasses
import logging
import select
import socket
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from pdserve.engine.internal_auth import NONCE_BYTES, PROOF_BYTES, load_internal_key, new_nonce, proof, proof_matches
from pdserve.engine.logging_config import RateLimitedWarning
from pdserve.kvstore.block_io import KVLayout, as_bytes, head_slice, whole_block_views, write_head_slice
from pdserve.kvstore.send_registry import ReadRefused, SendRegistry, UnknownRequest

log = logging.getLogger("pdserve.kvstore.tcp")

_LEN = struct.Struct("!I")
HELLO_MAGIC = b"pdkv-sc1"  # names the protocol (and its version) before the server's nonce
HANDSHAKE_TIMEOUT_S = 3.0  # a peer that has not proven itself by then is dropped
# After the handshake: what a server reads from a client (the largest legal block list is a few
# hundred KiB), and what a client reads from a server (NIXL metadata lists every block of a cache).
MAX_REQUEST_MESSAGE = 1 << 20
MAX_REPLY_MESSAGE = 64 << 20
MAX_BLOCKS_PER_MESSAGE = 1 << 18
MAX_TEXT = 1024
MAX_LEASES_PER_RENEWAL = 4096  # a decode rank's batch to one peer; far above any engine's queue
MAX_CONNECTIONS_PER_PEER = 32  # one decode rank keeps one; a pod's ranks and restarts stay far below
MAX_CONNECTIONS = 256
IOV_MAX = 512  # below Linux's 1024, leaving room
NOT_READY_RETRY_S = 0.005
NIXL_PROGRESS_S = 0.0002
_FROM_ENVIRONMENT: Any = object()  # a BlockServer/BlockClient with no key given loads the deployment's


class TransferError(Exception):
    pass


class AuthenticationError(TransferError):
    """The peer did not prove it holds the internal key."""


@dataclass(frozen=True)
class HeldKV:
    """Which held KV a reader asks for: the prefill engine's request id, and the digest of the
    prompt the reader will use it for (kvstore.binding); the server refuses any other prompt."""

    request_id: str
    prompt_digest: str


def send_message(sock: socket.socket, message: dict[str, Any]) -> None:
    body = msgspec.msgpack.encode(message)
    sock.sendall(_LEN.pack(len(body)) + body)


def recv_exact(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill `view`; with a deadline, the whole read must end by then (a peer trickling bytes
    cannot hold the connection open beyond it)."""
    got, total = 0, len(view)
    while got < total:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the peer was too slow")
            sock.settimeout(left)
        n = sock.recv_into(view[got:], total - got)
        if n == 0:
            raise ConnectionError("the peer closed the connection")
        got += n


def recv_message(sock: socket.socket, limit: int = MAX_REPLY_MESSAGE) -> dict[str, Any]:
    """One framed message; the declared size is checked against `limit` before anything is
    allocated for it."""
    header = bytearray(4)
    recv_exact(sock, memoryview(header))
    (size,) = _LEN.unpack(header)
    if size > limit:
        raise ConnectionError(f"message of {size} bytes is over the limit of {limit}")
    body = bytearray(size)
    recv_exact(sock, memoryview(body))
    message = msgspec.msgpack.decode(body)
    if not isinstance(message, dict):
        raise ConnectionError("a message must be a map")
    return message


# -- the handshake ----------------------------------------------------------------------------------

def server_handshake(sock: socket.socket, key: bytes | None, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> bool:
    """Challenge the client; True when it proved it holds the key (and it got our proof back).
    Reads exactly one fixed-size answer, within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    nonce = new_nonce()
    sock.settimeout(timeout_s)
    sock.sendall(HELLO_MAGIC + nonce)
    answer = bytearray(PROOF_BYTES + NONCE_BYTES)
    recv_exact(sock, memoryview(answer), deadline)
    if not proof_matches(key, "client", nonce, bytes(answer[:PROOF_BYTES])):
        return False
    sock.sendall(proof(key, "server", bytes(answer[PROOF_BYTES:])))
    sock.settimeout(None)
    return True


def client_handshake(sock: socket.socket, key: bytes | None, deadline: float) -> None:
    """Answer the server's challenge and check its proof; raises AuthenticationError or
    TransferError (both mean: this peer's KV is not to be used)."""
    hello = bytearray(len(HELLO_MAGIC) + NONCE_BYTES)
    recv_exact(sock, memoryview(hello), deadline)
    if bytes(hello[:len(HELLO_MAGIC)]) != HELLO_MAGIC:
        raise TransferError("the peer is not a pdserve KV side channel (or runs another version)")
    client_nonce = new_nonce()
    sock.sendall(proof(key, "client", bytes(hello[len(HELLO_MAGIC):])) + client_nonce)
    answer = bytearray(PROOF_BYTES)
    try:
        recv_exact(sock, memoryview(answer), deadline)
    except ConnectionError:
        raise AuthenticationError("the peer closed the side channel during the handshake: it does not hold "
                                  "this engine's internal key") from None
    if not proof_matches(key, "server", client_nonce, bytes(answer)):
        raise AuthenticationError("the peer does not hold this engine's internal key")


# -- checks of a peer's message (after the handshake; a bad one is answered, never fatal) -----------

def _text(message: dict[str, Any], name: str) -> str:
    value = message.get(name)
    if not isinstance(value, str) or len(value) > MAX_TEXT:
        raise ValueError(f"{name} must be a string of at most {MAX_TEXT} characters")
    return value


def _block_ids(message: dict[str, Any]) -> list[int]:
    value = message.get("blocks")
    if not isinstance(value, list) or len(value) > MAX_BLOCKS_PER_MESSAGE \
            or not all(type(b) is int and 0 <= b < 2**31 for b in value):
        raise ValueError("blocks must be a list of block ids")
    return value


def _held_kv(message: dict[str, Any]) -> HeldKV:
    return HeldKV(_text(message, "req"), _text(message, "digest"))


def _leases(message: dict[str, Any]) -> list[HeldKV]:
    value = message.get("leases")
    if not isinstance(value, list) or len(value) > MAX_LEASES_PER_RENEWAL:
        raise ValueError(f"leases must be a list of at most {MAX_LEASES_PER_RENEWAL} [request id, digest] pairs")
    leases = []
    for item in value:
        if not isinstance(item, list) or len(item) != 2:
            raise ValueError("each lease must be a [request id, digest] pair")
        leases.append(_held_kv({"req": item[0], "digest": item[1]}))
    return leases


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
    """Serves reads of held blocks out of one worker rank's KV cache, to peers holding the key.

    `host` is the address to listen on: the engine's own (never every interface by default).
    `key`: the internal key (None: insecure mode, the empty key); by default the deployment's.
    """

    def __init__(self, kv_caches: list[torch.Tensor], registry: SendRegistry, host: str = "127.0.0.1",
                 port: int = 0, key: bytes | None = _FROM_ENVIRONMENT,
                 handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S) -> None:
        self.kv_caches = kv_caches
        self.layout = KVLayout.of(kv_caches)
        self.registry = registry
        self.key = load_internal_key() if key is _FROM_ENVIRONMENT else key
        self.handshake_timeout_s = handshake_timeout_s
        self.nixl: Any = None  # a NixlEndpoint, when NIXL moves the data and we only lease
        self.bytes_sent = 0
        self.auth_failures = 0  # peers that did not prove they hold the key
        self.refused_connections = 0  # over the connection bounds
        self._warn = RateLimitedWarning(log)
        self._lock = threading.Lock()
        self._listener = socket.create_server((host, port), reuse_port=False, backlog=64)
        self.host = host
        self.port = self._listener.getsockname()[1]
        self._closed = False
        self._conns: set[socket.socket] = set()
        self._per_peer: Counter[str] = Counter()
        threading.Thread(target=self._accept_loop, name="kv-block-server", daemon=True).start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, address = self._listener.accept()
            except OSError:
                return
            peer = address[0]
            if not self._admit(conn, peer):
                conn.close()
                self._warn("kv transfer: refused a side-channel connection from %s (over %d per peer or %d in all)",
                           peer, MAX_CONNECTIONS_PER_PEER, MAX_CONNECTIONS)
                continue
            tune(conn)
            threading.Thread(target=self._serve, args=(conn, peer), name="kv-block-conn", daemon=True).start()

    def _admit(self, conn: socket.socket, peer: str) -> bool:
        with self._lock:
            if len(self._conns) >= MAX_CONNECTIONS or self._per_peer[peer] >= MAX_CONNECTIONS_PER_PEER:
                self.refused_connections += 1
                return False
            self._conns.add(conn)
            self._per_peer[peer] += 1
            return True

    def _authenticate(self, conn: socket.socket, peer: str) -> bool:
        try:
            if server_handshake(conn, self.key, self.handshake_timeout_s):
                return True
            reason = "a wrong proof (it does not hold the internal key)"
        except (ConnectionError, OSError) as exc:  # OSError covers the timeout
            reason = f"no proof in time ({exc.__class__.__name__})"
        with self._lock:
            self.auth_failures += 1
        self._warn("kv transfer: closed a side-channel connection from %s: %s", peer, reason)
        return False

    def _serve(self, conn: socket.socket, peer: str) -> None:
        leases: Counter[str] = Counter()  # NIXL reads in progress from this peer, by request id
        try:
            with conn:
                if not self._authenticate(conn, peer):
                    return
                while True:
                    if leases and self.nixl is not None:
                        self._progress_until_readable(conn)
                    try:
                        message = recv_message(conn, MAX_REQUEST_MESSAGE)
                    except (ConnectionError, OSError, msgspec.DecodeError):
                        return
                    try:
                        self._handle(conn, message, leases)
                    except (ConnectionError, OSError):
                        return
                    except Exception as exc:  # a bad message from a peer must not kill the engine
                        log.warning("kv transfer: bad message from %s: %s", peer, exc)
                        send_message(conn, {"ok": False, "error": f"bad message: {exc}", "retry": False})
        finally:
            with self._lock:
                self._conns.discard(conn)
                self._per_peer[peer] -= 1
                if self._per_peer[peer] <= 0:
                    del self._per_peer[peer]
            for request_id, count in leases.items():  # a reader that vanished mid-read no longer pins the blocks
                for _ in range(count):
                    self.registry.end_read(request_id)

    def _progress_until_readable(self, conn: socket.socket) -> None:
        """While a peer READs our memory with NIXL, our agent must make progress for it (we run
        without NIXL's progress thread): poll it until the peer's next message arrives."""
        while not select.select([conn], [], [], NIXL_PROGRESS_S)[0]:
            self.nixl.progress()

    def _handle(self, conn: socket.socket, message: dict[str, Any], leases: Counter[str]) -> None:
        op = message.get("op")
        if op == "layout":
            send_message(conn, {"ok": True, "layout": dataclasses.asdict(self.layout)})
        elif op == "read":
            heads = message.get("heads")
            self._read(conn, _held_kv(message), _block_ids(message), heads)
        elif op == "lease":
            # NIXL READs are one-sided: the lease names every block the reader will READ, and is
            # granted only when the request holds each of them for this prompt.
            held = _held_kv(message)
            if not self._begin_read(conn, held, _block_ids(message)):
                return
            leases[held.request_id] += 1
            send_message(conn, {"ok": True})
        elif op == "nixl_md":
            if self.nixl is None:
                send_message(conn, {"ok": False, "error": "this engine does not serve NIXL", "retry": False})
            else:
                send_message(conn, {"ok": True, "md": self.nixl.metadata()})
        elif op == "renew":
            # A decode engine that will pull these still wants them: each lease runs a full term
            # again. Only a reader of the very prompt can keep its blocks alive.
            missing = [h.request_id for h in _leases(message)
                       if not self.registry.renew(h.request_id, h.prompt_digest)]
            send_message(conn, {"ok": True, "missing": missing})
        elif op == "done":
            held = _held_kv(message)
            expected = message.get("expected", 1)
            if type(expected) is not int:
                raise ValueError("expected must be an integer")
            # Only a reader of this very prompt may let its blocks go before their timeout.
            if not self.registry.done(held.request_id, expected, held.prompt_digest):
                send_message(conn, {"ok": False, "error": f"request {held.request_id!r} holds the KV of another "
                                                          "prompt", "retry": False})
                return
            for _ in range(leases.pop(held.request_id, 0)):
                self.registry.end_read(held.request_id)
            send_message(conn, {"ok": True})
        else:
            send_message(conn, {"ok": False, "error": f"unknown op {op!r}", "retry": False})

    def _begin_read(self, conn: socket.socket, held: HeldKV, blocks: list[int]) -> bool:
        """Lease the blocks for this reader, or answer why not."""
        try:
            self.registry.begin_read(held.request_id, held.prompt_digest, blocks)
        except (UnknownRequest, ReadRefused) as exc:
            send_message(conn, {"ok": False, "error": str(exc), "retry": exc.retry})
            return False
        return True

    def _read(self, conn: socket.socket, held: HeldKV, wanted: list[int], heads: Any) -> None:
        h0, h1 = heads if heads else (0, self.layout.num_kv_heads)
        if type(h0) is not int or type(h1) is not int or not 0 <= h0 < h1 <= self.layout.num_kv_heads:
            send_message(conn, {"ok": False, "error": f"no heads {heads!r} here", "retry": False})
            return
        if not self._begin_read(conn, held, wanted):
            return
        try:
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
            self.registry.end_read(held.request_id)

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

    def __init__(self, kv_caches: list[torch.Tensor], timeout_s: float = 10.0, nixl: Any = None,
                 key: bytes | None = _FROM_ENVIRONMENT) -> None:
        self.kv_caches = kv_caches
        self.layout = KVLayout.of(kv_caches)
        self.timeout_s = timeout_s
        self.nixl = nixl  # a NixlEndpoint: whole-block reads go through it
        self.key = load_internal_key() if key is _FROM_ENVIRONMENT else key
        self._conns: dict[tuple[str, int], socket.socket] = {}
        self._locks: dict[tuple[str, int], threading.Lock] = {}
        self._guard = threading.Lock()

    def _peer_lock(self, peer: tuple[str, int]) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(peer, threading.Lock())

    def _connect(self, peer: tuple[str, int], deadline: float) -> socket.socket:
        sock = self._conns.get(peer)
        if sock is not None:
            return sock
        sock = socket.create_connection(peer, timeout=max(0.1, min(self.timeout_s, deadline - time.monotonic())))
        try:
            tune(sock)
            client_handshake(sock, self.key, deadline)
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            send_message(sock, {"op": "layout"})
            reply = recv_message(sock)
            remote = KVLayout(**reply["layout"])
            problem = self.layout.compatible(remote)
            if problem:
                raise TransferError(f"the KV layouts of the two engines differ ({problem})")
        except BaseException:
            sock.close()
            raise
        self._conns[peer] = sock
        return sock

    def _drop(self, peer: tuple[str, int]) -> None:
        sock = self._conns.pop(peer, None)
        if sock is not None:
            sock.close()

    def pull(self, peer: tuple[str, int], held: HeldKV, remote_blocks: list[int], local_blocks: list[int],
             remote_heads: tuple[int, int], local_heads: tuple[int, int], deadline: float) -> int:
        """Copy the remote blocks' heads into the local blocks; returns bytes moved. Waits (until
        `deadline`) for a prefill rank that has not registered the request yet."""
        with self._peer_lock(peer):
            try:
                return self._pull(peer, held, remote_blocks, local_blocks, remote_heads, local_heads, deadline)
            except TransferError:
                raise  # a refusal: the connection is still in step
            except (OSError, ConnectionError, msgspec.DecodeError, KeyError, TypeError, ValueError) as exc:
                self._drop(peer)
                raise TransferError(f"pulling KV of {held.request_id!r} from {peer[0]}:{peer[1]} failed: {exc}") \
                    from exc

    def _ask(self, peer: tuple[str, int], message: dict[str, Any], deadline: float) -> dict[str, Any]:
        """Send a request, retrying while the peer says the request is not registered yet."""
        while True:
            sock = self._connect(peer, deadline)
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            send_message(sock, message)
            reply = recv_message(sock)
            if reply.get("ok"):
                return reply
            if reply.get("retry") and time.monotonic() + NOT_READY_RETRY_S < deadline:
                time.sleep(NOT_READY_RETRY_S)
                continue
            raise TransferError(str(reply.get("error")))

    def nixl_pull(self, peer: tuple[str, int], engine_id: str, held: HeldKV, remote_blocks: list[int],
                  local_blocks: list[int], deadline: float) -> int:
        """Lease exactly the blocks to read over the side channel, READ those with NIXL. The
        caller's `release` ends the lease."""
        key = f"{engine_id}@{peer[0]}:{peer[1]}"
        with self._peer_lock(peer):
            try:
                if not self.nixl.has_peer(key):
                    self.nixl.add_peer(key, self._ask(peer, {"op": "nixl_md"}, deadline)["md"])
                self._ask(peer, {"op": "lease", "req": held.request_id, "digest": held.prompt_digest,
                                 "blocks": list(remote_blocks)}, deadline)
            except TransferError:
                raise
            except (OSError, ConnectionError, msgspec.DecodeError, KeyError, TypeError, ValueError) as exc:
                self._drop(peer)
                raise TransferError(f"leasing KV of {held.request_id!r} from {peer[0]}:{peer[1]} failed: {exc}") \
                    from exc
        try:
            return self.nixl.read(key, remote_blocks, local_blocks, deadline)
        except Exception as exc:
            self.nixl.forget_peer(key)  # a restarted peer registers new memory: fetch it again
            raise TransferError(f"NIXL read of {held.request_id!r} from {peer[0]}:{peer[1]} failed: {exc}") from exc

    def _pull(self, peer, held, remote_blocks, local_blocks, remote_heads, local_heads, deadline) -> int:
        nheads = remote_heads[1] - remote_heads[0]
        whole_local = (local_heads[1] - local_heads[0]) == self.layout.num_kv_heads
        expected = self.layout.transfer_bytes(len(remote_blocks), nheads)
        reply = self._ask(peer, {"op": "read", "req": held.request_id, "digest": held.prompt_digest,
                                 "blocks": list(remote_blocks), "heads": list(remote_heads)}, deadline)
        sock = self._conns[peer]
        if reply["nbytes"] != expected:
            self._drop(peer)  # its bytes follow: the connection is out of step
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

    def release(self, peer: tuple[str, int], held: HeldKV, expected: int) -> None:
        """Tell the peer this reader is finished with the request (best effort)."""
        with self._peer_lock(peer):
            try:
                sock = self._connect(peer, time.monotonic() + self.timeout_s)
                sock.settimeout(self.timeout_s)
                send_message(sock, {"op": "done", "req": held.request_id, "digest": held.prompt_digest,
                                    "expected": expected})
                recv_message(sock)
            except (OSError, ConnectionError, msgspec.DecodeError, TransferError, KeyError, TypeError) as exc:
                self._drop(peer)
                log.debug("could not release %s at %s: %s", held.request_id, peer, exc)

    def renew(self, peer: tuple[str, int], leases: list[HeldKV]) -> list[str]:
        """Renew the leases of held KV at one peer, in one message; returns the request ids the
        peer no longer holds for those prompts (released, expired, or never held). Raises
        TransferError when the peer cannot be asked."""
        with self._peer_lock(peer):
            deadline = time.monotonic() + self.timeout_s
            try:
                sock = self._connect(peer, deadline)
                sock.settimeout(self.timeout_s)
                send_message(sock, {"op": "renew", "leases": [[h.request_id, h.prompt_digest] for h in leases]})
                reply = recv_message(sock)
                if not reply.get("ok"):
                    raise TransferError(str(reply.get("error")))
                missing = reply.get("missing")
                if not isinstance(missing, list):
                    raise TransferError("the peer's renewal answer has no list of missing leases")
                return [str(m) for m in missing]
            except TransferError:
                raise
            except (OSError, ConnectionError, msgspec.DecodeError, KeyError, TypeError, ValueError) as exc:
                self._drop(peer)
                raise TransferError(f"renewing {len(leases)} leases at {peer[0]}:{peer[1]} failed: {exc}") from exc

    def close(self) -> None:
        for peer in list(self._conns):
            self._drop(peer)
