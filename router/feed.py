"""The coordinator's load feed: a zmq SUB socket and the latest counts per engine.

Each message is one frame, a msgpack map: {"updated", "engines": [{"id", "role", "address",
"dp_rank", "waiting", "running", "kv_usage", "step", "wave", "block_size", "stale"}],
"block_events": [{"id", "stored", "removed", "cleared"}]}. Decoded as plain maps, so a field the
coordinator adds later does not break the router.

Entries are keyed by (address, dp_rank): the data-parallel ranks of one pod share its HTTP
address, and each is an engine of its own (its own queue, KV cache and engine id).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import httpx
import msgspec

from pdserve.engine import internal_auth
from pdserve.router.balancer import EngineLoad
from pdserve.router.prefix import BlockIndex

log = logging.getLogger("pdserve.router")

# The coordinator publishes about every 100 ms; silence this long means it is gone.
FEED_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class EngineReport:
    engine_id: str
    address: str
    role: str
    load: EngineLoad
    block_size: int | None
    kv_usage: float
    dp_rank: int = 0


# A feed entry's key: the HTTP server's host:port, and the data-parallel rank behind it. Every rank
# of a pod reports the pod's address; an engine without data parallelism is rank 0.
RankKey = tuple[str, int]


class FeedState:
    """What the feed said last, looked up by (engine address, data-parallel rank)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, timeout: float = FEED_TIMEOUT_S) -> None:
        self.clock = clock
        self.timeout = timeout
        self.last_message_at: float | None = None
        self.messages = 0
        self.blocks = BlockIndex()
        self._by_key: dict[RankKey, EngineReport] = {}
        self._ranks: dict[str, tuple[int, ...]] = {}  # address -> its ranks, sorted
        self._last_counts: dict[RankKey, tuple[Any, ...]] = {}
        self._reports: dict[RankKey, int] = {}

    def alive(self) -> bool:
        return self.last_message_at is not None and self.clock() - self.last_message_at < self.timeout

    def apply(self, message: dict[str, Any]) -> None:
        """Take one decoded message; raises ValueError/TypeError/KeyError on a malformed one."""
        engines = message.get("engines") or []
        reports: dict[RankKey, EngineReport] = {}
        for entry in engines:
            address = str(entry["address"])
            rank = int(entry.get("dp_rank") or 0)
            if rank < 0:
                raise ValueError(f"negative dp_rank {rank} for {address}")
            key = (address, rank)
            counts = (entry.get("step"), int(entry.get("waiting", 0)), int(entry.get("running", 0)))
            if self._last_counts.get(key) != counts:
                # A new report: the router's picks since the last one are now in these counts.
                self._last_counts[key] = counts
                self._reports[key] = self._reports.get(key, 0) + 1
            load = EngineLoad(waiting=counts[1], running=counts[2], report=self._reports[key],
                              stale=bool(entry.get("stale", False)))
            block_size = entry.get("block_size")
            reports[key] = EngineReport(str(entry.get("id", f"{address}#{rank}")), address,
                                        str(entry.get("role", "both")), load,
                                        int(block_size) if block_size else None, float(entry.get("kv_usage", 0.0)),
                                        rank)
        for event in message.get("block_events") or []:
            self.blocks.apply(event)
        for gone in set(self._by_key) - set(reports):
            self.blocks.forget(self._by_key[gone].engine_id)
            self._last_counts.pop(gone, None)
        ranks: dict[str, list[int]] = {}
        for address, rank in reports:
            ranks.setdefault(address, []).append(rank)
        self._by_key = reports
        self._ranks = {address: tuple(sorted(r)) for address, r in ranks.items()}
        self.last_message_at = self.clock()
        self.messages += 1

    def report(self, address: str, dp_rank: int = 0) -> EngineReport | None:
        """One rank's fresh report, or None when the feed is silent or knows no such rank."""
        if not self.alive():
            return None
        return self._by_key.get((address, dp_rank))

    def load(self, address: str, dp_rank: int = 0) -> EngineLoad | None:
        report = self.report(address, dp_rank)
        return report.load if report is not None else None

    def ranks(self, address: str) -> tuple[int, ...]:
        """The data-parallel ranks the fresh feed lists for an address: () when it lists none."""
        if not self.alive():
            return ()
        return self._ranks.get(address, ())


class FeedSubscriber:
    """Keeps a FeedState up to date from `tcp://<coordinator-address>`; zmq reconnects by itself."""

    def __init__(self, address: str, state: FeedState, seed_url: str | None = None,
                 client: httpx.AsyncClient | None = None) -> None:
        self.address = address
        self.state = state
        self.seed_url = seed_url
        self.client = client
        self._decoder = msgspec.msgpack.Decoder()
        self._seeding: asyncio.Task | None = None

    async def seed(self) -> None:
        """Blocks stored before this router subscribed, from the coordinator's GET /blocks.

        Best effort, merged into what the events already said: an event that crossed the
        snapshot in flight may leave a block listed that was just evicted, which costs one
        misdirected bonus, never a wrong answer.
        """
        if not self.seed_url or self.client is None:
            return
        try:
            # /blocks answers only holders of the internal key (it tells which prompts were sent).
            key = internal_auth.load_internal_key()
            headers = {internal_auth.HEADER: key.decode()} if key is not None else {}
            response = await self.client.get(self.seed_url, timeout=5.0, headers=headers)
            response.raise_for_status()
            snapshot = response.json()
            for engine_id, hashes in snapshot.items():
                self.state.blocks.seed(str(engine_id), (bytes.fromhex(h) for h in hashes))
            log.info("seeded the prefix index from %s (%d engines)", self.seed_url, len(snapshot))
        except (httpx.HTTPError, ValueError, AttributeError, TypeError) as exc:
            log.info("no prefix index snapshot from %s: %s", self.seed_url, exc)

    async def run(self) -> None:
        import zmq
        import zmq.asyncio

        context = zmq.asyncio.Context()
        socket = context.socket(zmq.SUB)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        socket.setsockopt(zmq.RCVHWM, 100)
        socket.setsockopt(zmq.LINGER, 0)
        # The coordinator publishes only to holders of the internal key (CURVE).
        internal_auth.secure_client(socket, internal_auth.load_internal_key())
        socket.connect(f"tcp://{self.address}")
        log.info("subscribed to the coordinator feed at tcp://%s", self.address)
        bad = 0
        try:
            while True:
                frames = await socket.recv_multipart()
                try:
                    message = self._decoder.decode(frames[0])
                    if not isinstance(message, dict):
                        raise TypeError(f"expected a map, got {type(message).__name__}")
                    was_alive = self.state.alive()
                    self.state.apply(message)
                    if not was_alive and (self._seeding is None or self._seeding.done()):
                        # (Re)joined the feed: what was stored meanwhile came in no event we saw.
                        self._seeding = asyncio.ensure_future(self.seed())
                except (msgspec.DecodeError, ValueError, TypeError, KeyError) as exc:
                    bad += 1
                    if bad == 1 or bad % 100 == 0:
                        log.warning("ignoring a malformed coordinator message (%d so far): %s", bad, exc)
        except asyncio.CancelledError:
            raise
        finally:
            if self._seeding is not None:
                self._seeding.cancel()
            socket.close(0)
            context.term()
