"""What the coordinator publishes to routers (zmq PUB, one msgpack frame per update, DESIGN §5).

Decode with `msgspec.msgpack.Decoder(CoordinatorUpdate)`. Structs are map-encoded and ignore keys
they do not know, so fields can be added without breaking older readers.

Block events are the changes to each engine's prefix-cache index since the previous publish
(merged: a hash is never in both lists). Apply `cleared` first (forget every block of that
engine), then `removed` and `stored` in either order. An engine that disappears from `engines`
also gets one last event with `cleared` set. A reader that starts late seeds its index from the
coordinator's `GET /blocks` and then follows these events.
"""

from __future__ import annotations

import msgspec

ROLES = ("prefill", "decode", "both")


class EngineLoad(msgspec.Struct, gc=False):
    id: str
    role: str  # prefill | decode | both
    address: str  # host:port of the engine's HTTP API
    dp_rank: int
    waiting: int
    running: int
    kv_usage: float  # 0..1
    step: int
    wave: int
    block_size: int
    stale: bool  # no report for --stale-after seconds: do not route to it


class BlockEvent(msgspec.Struct, gc=False):
    id: str  # the engine
    stored: list[bytes] = []
    removed: list[bytes] = []
    cleared: bool = False


class CoordinatorUpdate(msgspec.Struct, gc=False):
    updated: float  # unix time of this view
    engines: list[EngineLoad] = []
    block_events: list[BlockEvent] = []
