"""The KV store's wire format: ZMQ multipart messages, a msgpack header and raw value frames.

Clients use a DEALER socket and the service a ROUTER socket, so a request is
`[header, value_0, value_1, ...]` and its reply `[header, value_0, ...]` (the ROUTER adds and
strips the peer identity frame). Headers are msgpack arrays (`msgspec.Struct(array_like=True)`);
values never enter the msgpack body: each is its own frame, sent and received without copies.

Requests (`RequestHeader.op`):
- `put`: one value frame per key, in order. Each value is stored under `namespace` + key.
- `get`: no value frames. The reply's `found` flags one entry per key, and one value frame
  follows for each found key, in key order.
- `contains`: no value frames. The reply's `prefix_length` counts the leading keys present.
- `stats`: no keys. The reply carries the store's counters.
A request the service cannot serve gets `ok=False` and a message in `error`; nothing of it is
applied (a put is checked whole before its first value is stored).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

OPS = ("put", "get", "contains", "stats")
DEFAULT_MAX_FRAME_BYTES = 64 * 2**20
# The most `--max-frame-bytes` may be: one value is one KV block (or one layer of it), a few MiB
# for large models; 256 MiB is far above that and still a bounded allocation per frame.
MAX_FRAME_BYTES_LIMIT = 256 * 2**20
DEFAULT_MAX_KEYS = 16384
MAX_KEY_BYTES = 1024
MAX_NAMESPACE_BYTES = 1024
# A header holds keys only, so it is far smaller than a value frame could be.
MAX_HEADER_BYTES = 4 * 2**20
# Room on top of a frame's payload for what the wire adds to it (CURVE's box and nonce, framing).
WIRE_SLACK_BYTES = 64 * 2**10


def wire_frame_limit(max_frame_bytes: int) -> int:
    """The largest frame libzmq may receive (ZMQ_MAXMSGSIZE): any value or header frame the
    service would accept, plus wire overhead. A larger frame makes libzmq drop the peer when it
    reads the frame's length, before allocating it; checked during the CURVE handshake too, so an
    unauthenticated peer cannot make the store allocate more than this either."""
    return max(max_frame_bytes, MAX_HEADER_BYTES) + WIRE_SLACK_BYTES


class ProtocolError(ValueError):
    """A request the service refuses; the message goes back to the client as is."""


class RequestHeader(msgspec.Struct, array_like=True):
    op: str
    request_id: int
    # The model id: blocks of different models never share a key even when their hashes do.
    namespace: str
    keys: list[bytes] = []


class ReplyHeader(msgspec.Struct, array_like=True):
    request_id: int
    ok: bool
    error: str = ""
    found: list[bool] = []
    prefix_length: int = 0
    stats: dict[str, int] = {}


@dataclass(frozen=True)
class Limits:
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    max_keys: int = DEFAULT_MAX_KEYS


_request_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(RequestHeader)
_reply_decoder = msgspec.msgpack.Decoder(ReplyHeader)
_any_decoder = msgspec.msgpack.Decoder()


def encode(header: RequestHeader | ReplyHeader) -> bytes:
    return _request_encoder.encode(header)


def decode_reply(frame: Any) -> ReplyHeader:
    return _reply_decoder.decode(frame)


def store_key(namespace: str, key: bytes) -> bytes:
    # Length-prefixed so that no (namespace, key) pair can collide with another.
    ns = namespace.encode()
    return len(ns).to_bytes(2, "big") + ns + key


def guess_request_id(frame: Any) -> int:
    """The request id of a header that failed to decode, if it has one where it belongs (else 0),
    so that even a malformed request's error reply reaches the call that sent it."""
    try:
        body = _any_decoder.decode(frame)
    except (msgspec.DecodeError, ValueError):
        return 0
    if isinstance(body, list) and len(body) > 1 and isinstance(body[1], int) and not isinstance(body[1], bool):
        return body[1]
    return 0


def decode_request(frame: Any, value_sizes: list[int], limits: Limits) -> RequestHeader:
    """The header of a request whose value frames have `value_sizes`; ProtocolError if the
    request is malformed or over a limit."""
    header_size = memoryview(frame).nbytes
    if header_size > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {header_size} bytes exceeds the limit of {MAX_HEADER_BYTES} bytes")
    try:
        header = _request_decoder.decode(frame)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"malformed request header: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"request header is not msgpack: {exc}") from None
    if header.op not in OPS:
        raise ProtocolError(f"unknown op {header.op!r}; expected one of {', '.join(OPS)}")
    if len(header.namespace.encode()) > MAX_NAMESPACE_BYTES:
        raise ProtocolError(f"namespace longer than {MAX_NAMESPACE_BYTES} bytes")
    if len(header.keys) > limits.max_keys:
        raise ProtocolError(f"{len(header.keys)} keys in one request exceed the limit of {limits.max_keys}")
    for key in header.keys:
        if len(key) > MAX_KEY_BYTES:
            raise ProtocolError(f"a key of {len(key)} bytes exceeds the limit of {MAX_KEY_BYTES} bytes")
    if header.op == "put" and len(value_sizes) != len(header.keys):
        raise ProtocolError(f"put needs one value frame per key: {len(header.keys)} keys, "
                            f"{len(value_sizes)} value frames")
    if header.op != "put" and value_sizes:
        raise ProtocolError(f"{header.op} takes no value frames, got {len(value_sizes)}")
    for index, size in enumerate(value_sizes):
        if size > limits.max_frame_bytes:
            raise ProtocolError(f"value {index} is {size} bytes, over the frame limit of "
                                f"{limits.max_frame_bytes} bytes")
    return header
