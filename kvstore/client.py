"""Client of the KV store service: batched put/get/contains, values as zero-copy frames.

    client = KVStoreClient("tcp://kvstore:5700", namespace="llama-3-8b")
    client.put([hash_0, hash_1], [block_0, block_1])   # any C-contiguous buffers, CPU tensors too
    count = client.contains([hash_0, hash_1, hash_2])  # 2: the store has the first two, in order
    views = client.get([hash_0, hash_2])               # [memoryview, None]

Every call is one round trip for all its keys and either returns within `timeout_s` or raises
KVStoreError: when the store is down, slow, restarted or refuses the request. The client needs
no repair afterwards: a timed-out socket is dropped (so its late reply cannot answer a later
call) and the next call connects again. A call that could not even be sent (no connection) keeps
the socket, which goes on reconnecting in the background; with `connect_timeout_s`, calls on a
socket that has had that long to connect fail at once instead of waiting for the store, so a
caller that must not stall (the engine's step) learns "down" for free.

One thread at a time: a client holds one socket, and ZMQ sockets are not thread-safe. Give every
thread that talks to the store its own client.
"""

from __future__ import annotations

import itertools
import sys
import time
from typing import Any, Sequence

import msgspec
import zmq

from pdserve.engine import internal_auth
from pdserve.kvstore import protocol
from pdserve.kvstore.protocol import ReplyHeader, RequestHeader

RECONNECT_MS = 100
# `internal_key` default: the deployment's key from the environment (PDSERVE_INTERNAL_KEY[_FILE]).
FROM_ENV: Any = object()


class KVStoreError(RuntimeError):
    """The store could not answer the call: unreachable, no reply in time, or an error reply."""


def normalize_url(url: str) -> str:
    """`tcp://host:port`; a bare `host:port` (as the operator renders `kvstore_address`) gets
    the scheme added."""
    if "://" not in url:
        url = f"tcp://{url}"
    scheme, _, rest = url.partition("://")
    host, sep, port = rest.rpartition(":")
    if scheme != "tcp" or not sep or not host or not port.isdigit():
        raise ValueError(f"KV store URL must look like tcp://host:port, got {url!r}")
    return url


def as_buffer(value: Any) -> memoryview:
    """A flat byte view of `value` without copying it: bytes, bytearray, memoryview, numpy arrays
    and CPU torch tensors (any dtype, bfloat16 included), all C-contiguous."""
    if type(value).__module__.partition(".")[0] == "torch":
        # torch is already imported if we hold one of its tensors; bfloat16 has no numpy dtype,
        # so the tensor is viewed as bytes before crossing over.
        torch = sys.modules["torch"]
        tensor = value.detach()
        if tensor.device.type != "cpu":
            raise ValueError(f"KV store values must be CPU tensors, got one on {tensor.device}")
        if not tensor.is_contiguous():
            raise ValueError("KV store values must be contiguous tensors")
        value = tensor.reshape(-1).view(torch.uint8).numpy()
    view = memoryview(value)
    if not view.c_contiguous:
        raise ValueError("KV store values must be C-contiguous buffers")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class KVStoreClient:
    def __init__(self, url: str, namespace: str, timeout_s: float = 2.0,
                 internal_key: bytes | None = FROM_ENV, connect_timeout_s: float | None = None) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if connect_timeout_s is not None and connect_timeout_s < 0:
            raise ValueError(f"connect_timeout_s must not be negative, got {connect_timeout_s}")
        # A CURVE client of the store when a key is set; a store that holds another key (or none)
        # never completes the handshake, so calls time out as if it were down.
        self._key = internal_auth.load_internal_key() if internal_key is FROM_ENV else internal_key
        self.url = normalize_url(url)
        self.namespace = namespace
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._context = zmq.Context(io_threads=1)
        self._socket: zmq.Socket | None = None
        self._connecting_since = 0.0  # when the current socket started connecting
        self._request_ids = itertools.count(1)
        self._closed = False

    def __enter__(self) -> KVStoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def put(self, keys: Sequence[bytes], values: Sequence[Any]) -> None:
        """Store `values[i]` under `keys[i]`, all or none (a value larger than the store is refused)."""
        if len(keys) != len(values):
            raise ValueError(f"put needs one value per key: {len(keys)} keys, {len(values)} values")
        if keys:
            self._call("put", keys, [as_buffer(value) for value in values])

    def get(self, keys: Sequence[bytes]) -> list[memoryview | None]:
        """The value of each key (a read-only view of the received frame), None where absent."""
        if not keys:
            return []
        reply, frames = self._call("get", keys)
        if len(reply.found) != len(keys) or sum(reply.found) != len(frames):
            self._reset()
            raise KVStoreError(f"KV store at {self.url} sent a malformed get reply: {len(reply.found)} flags and "
                               f"{len(frames)} values for {len(keys)} keys")
        values = iter(frames)
        return [next(values).buffer if found else None for found in reply.found]

    def contains(self, keys: Sequence[bytes]) -> int:
        """How many of `keys`, from the first, the store holds (the cached prefix, in blocks)."""
        if not keys:
            return 0
        reply, _ = self._call("contains", keys)
        return reply.prefix_length

    def stats(self) -> dict[str, int]:
        reply, _ = self._call("stats", [])
        return dict(reply.stats)

    def connect(self) -> None:
        """Start connecting now (in the background), so the first call finds the store connected."""
        if self._socket is None and not self._closed:
            self._socket = self._connect()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._reset()
        self._context.term()

    def _connect(self) -> zmq.Socket:
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        # Queue nothing for a store that is not connected: a send then waits (bounded by the
        # call's timeout) instead of parking requests that a restarted store would answer late.
        socket.setsockopt(zmq.IMMEDIATE, 1)
        socket.setsockopt(zmq.RECONNECT_IVL, RECONNECT_MS)
        internal_auth.secure_client(socket, self._key)
        socket.connect(self.url)
        self._connecting_since = time.monotonic()
        return socket

    def _reset(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None

    def _call(self, op: str, keys: Sequence[bytes], values: Sequence[memoryview] = ()) -> tuple[ReplyHeader, list]:
        if self._closed:
            raise KVStoreError("KV store client is closed")
        for key in keys:
            if not isinstance(key, bytes):
                raise TypeError(f"KV store keys must be bytes, got {type(key).__name__}")
        request_id = next(self._request_ids)
        header = protocol.encode(RequestHeader(op, request_id, self.namespace, list(keys)))
        deadline = time.monotonic() + self.timeout_s
        try:
            if self._socket is None:
                self._socket = self._connect()
            socket = self._socket
            send_by = deadline
            if self.connect_timeout_s is not None:
                send_by = min(deadline, self._connecting_since + self.connect_timeout_s)
            # 0: do not wait at all (the socket had its time to connect and is not connected).
            socket.setsockopt(zmq.SNDTIMEO, max(0, int((send_by - time.monotonic()) * 1000)))
            try:
                socket.send_multipart([header, *values], copy=False)
            except zmq.Again:
                # Nothing was queued (IMMEDIATE): no late reply can come, so the socket stays and
                # keeps reconnecting on its own; the next call is sent as soon as the store is back.
                raise KVStoreError(f"KV store at {self.url} is not reachable ({op} not sent: no connection)"
                                   ) from None
            while True:
                if not socket.poll(_ms_left(deadline), zmq.POLLIN):
                    self._reset()
                    raise KVStoreError(f"KV store at {self.url} did not answer {op} within {self.timeout_s:g}s")
                frames = socket.recv_multipart(copy=False)
                try:
                    reply = protocol.decode_reply(frames[0].buffer)
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    self._reset()
                    raise KVStoreError(f"KV store at {self.url} sent a malformed reply: {exc}") from None
                if reply.request_id == request_id:
                    break
                # A reply to a call that gave up earlier on this socket: not ours, drop it.
        except zmq.ZMQError as exc:
            self._reset()
            raise KVStoreError(f"KV store at {self.url}: {exc}") from None
        if not reply.ok:
            raise KVStoreError(f"KV store at {self.url} refused {op}: {reply.error}")
        return reply, frames[1:]


def _ms_left(deadline: float) -> int:
    # zmq timeouts are whole milliseconds; 0 would mean "do not wait at all" for a poll and
    # "fail at once" for a send, so a call always gets at least one.
    return max(1, int((deadline - time.monotonic()) * 1000))
