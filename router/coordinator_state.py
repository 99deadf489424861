"""The coordinator's view of the engines: freshest load per engine, liveness, cached blocks.

Pure bookkeeping, no sockets: `accept` takes one decoded report, `sweep` ages engines out,
`take_update` builds the next publish. Times passed in as `now` are the coordinator's monotonic
clock at receipt (engines' clocks only order one engine's own reports).

Which report wins, per engine id:
- a higher `seq` wins unless its `time` is older than the last accepted report's (a late message
  from an earlier process of the same engine);
- a lower or equal `seq` is a duplicate or late message and is ignored, unless its `time` is more
  than RESTART_MIN_GAP after the last accepted report's: then the engine restarted (its `seq`
  began again at 1). A restart takes longer than that gap (a new process loads its model), while
  a duplicate or delayed message is never newer than what it trails; and if two live processes
  wrongly share an id, the one seen first keeps it instead of the two flapping.
An engine silent for `stale_after` seconds is stale (still listed, flagged); after `forget_after`
more seconds it is dropped, and routers get a `cleared` block event for it.
"""

from __future__ import annotations

import enum
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

from pdserve.engine.core.block_events import BlockEvents
from pdserve.engine.core.load_reporter import MAX_BLOCK_EVENTS_PER_REPORT, MAX_HASH_BYTES, LoadReport
from pdserve.router.coordinator_protocol import ROLES, BlockEvent, CoordinatorUpdate, EngineLoad

log = logging.getLogger("pdserve.coordinator")

RESTART_MIN_GAP = 1.0
# No engine queues or runs this many requests: a report that says so is forged or broken, and
# would scale a pool to its maximum through the autoscaler.
MAX_REQUESTS = 1_000_000
MAX_BLOCK_SIZE = 1 << 16
MAX_TEXT = 512  # engine id, role and address characters
# Cached block hashes kept per engine. A large KV cache holds a few hundred thousand blocks (e.g.
# 100 GB of a 1B model's 512 KiB blocks is 200k); a million is far above that, and bounds the
# memory one engine can make us hold (~100 MB) and the size of `/blocks`.
MAX_BLOCKS_PER_ENGINE = 1_000_000


class Ignored(str, enum.Enum):
    MALFORMED = "malformed"  # not a LoadReport at all
    INVALID = "invalid"  # decodes, but its values make no sense
    OLD_SEQ = "old_seq"  # duplicate or out of order
    OLDER_TIME = "older_time"  # newer seq but older time: an earlier process of the engine


@dataclass
class TrackedEngine:
    report: LoadReport
    received: float  # coordinator monotonic time of the last accepted report
    stale_since: float | None = None
    blocks: dict[bytes, None] = field(default_factory=dict)  # ordered set of cached block hashes

    @property
    def stale(self) -> bool:
        return self.stale_since is not None


def problem_with(report: LoadReport) -> str | None:
    if not report.id:
        return "empty engine id"
    if report.role not in ROLES:
        return f"unknown role {report.role!r}"
    if max(len(report.id), len(report.address)) > MAX_TEXT:
        return "engine id or address too long"
    if min(report.waiting, report.running, report.seq, report.step, report.block_size, report.dp_rank) < 0:
        return "negative count"
    if not (math.isfinite(report.kv_usage) and math.isfinite(report.time)):
        return "non-finite number"
    if max(report.waiting, report.running) > MAX_REQUESTS:
        return f"waiting or running above {MAX_REQUESTS}"
    if not 0.0 <= report.kv_usage <= 1.0:
        return f"kv_usage {report.kv_usage} outside [0, 1]"
    if report.block_size > MAX_BLOCK_SIZE:
        return f"block_size above {MAX_BLOCK_SIZE}"
    if any(len(h) > MAX_HASH_BYTES for h in report.stored) or any(len(h) > MAX_HASH_BYTES for h in report.removed):
        return f"a block hash longer than {MAX_HASH_BYTES} bytes"
    return None


def capped_events(stored: list[bytes], removed: list[bytes],
                  limit: int = MAX_BLOCK_EVENTS_PER_REPORT) -> tuple[list[bytes], list[bytes], int]:
    """(stored, removed, dropped): at most `limit` hashes of one report, removals first (they
    free room); an honest engine never sends more (its reporter caps the same way)."""
    if len(stored) + len(removed) <= limit:
        return stored, removed, 0
    kept_removed = removed[:limit]
    kept_stored = stored[:limit - len(kept_removed)]
    return kept_stored, kept_removed, len(stored) + len(removed) - len(kept_stored) - len(kept_removed)


class LoadBook:
    def __init__(self, stale_after: float = 3.0, forget_after: float = 60.0) -> None:
        self.stale_after = stale_after
        self.forget_after = forget_after
        self.engines: dict[str, TrackedEngine] = {}
        # Block hashes dropped by the bounds, by which bound: counted, never silently lost.
        self.hashes_dropped = {"per_report": 0, "per_engine": 0}
        self._pending: dict[str, BlockEvents] = {}
        # Set when routers should hear now rather than at the next tick: an engine appeared,
        # came back, restarted, changed its wave, went stale or was forgotten.
        self.urgent = False

    def accept(self, report: LoadReport, now: float) -> Ignored | None:
        """Take a report into the view; the reason when it is ignored."""
        problem = problem_with(report)
        if problem is not None:
            log.debug("ignoring a report from %r: %s", report.id, problem)
            return Ignored.INVALID
        engine = self.engines.get(report.id)
        if engine is None:
            engine = self.engines[report.id] = TrackedEngine(report, now)
            log.info("engine %s joined: role=%s address=%s", report.id, report.role, report.address)
            self.urgent = True
        else:
            last = engine.report
            if report.seq > last.seq:
                if report.time < last.time:
                    return Ignored.OLDER_TIME
            elif report.time > last.time + RESTART_MIN_GAP:
                log.info("engine %s restarted (seq %d after %d)", report.id, report.seq, last.seq)
                self._apply_blocks(engine, (), (), cleared=True)
                self.urgent = True
            else:
                return Ignored.OLD_SEQ
            if engine.stale:
                log.info("engine %s reports again", report.id)
            if engine.stale or report.wave != last.wave or (report.role, report.address) != (last.role, last.address):
                self.urgent = True
            engine.report, engine.received, engine.stale_since = report, now, None
        stored, removed, dropped = capped_events(report.stored, report.removed)
        if dropped:
            self.hashes_dropped["per_report"] += dropped
            log.warning("engine %s sent %d block events in one report; kept %d", report.id,
                        len(report.stored) + len(report.removed), MAX_BLOCK_EVENTS_PER_REPORT)
        self._apply_blocks(engine, stored, removed, report.cleared)
        return None

    def _apply_blocks(self, engine: TrackedEngine, stored: Iterable[bytes], removed: Iterable[bytes],
                      cleared: bool) -> None:
        if cleared:
            engine.blocks.clear()
        for block_hash in removed:
            engine.blocks.pop(block_hash, None)
        kept = []
        for block_hash in stored:
            if block_hash not in engine.blocks and len(engine.blocks) >= MAX_BLOCKS_PER_ENGINE:
                self.hashes_dropped["per_engine"] += 1
                continue
            engine.blocks[block_hash] = None
            kept.append(block_hash)
        stored = kept
        if stored or removed or cleared:
            pending = self._pending.get(engine.report.id)
            if pending is None:
                pending = self._pending[engine.report.id] = BlockEvents()
            pending.merge(stored, removed, cleared)

    def sweep(self, now: float) -> None:
        """Mark engines that went silent as stale, and forget the long-stale ones."""
        for engine_id, engine in list(self.engines.items()):
            if engine.stale_since is None:
                if now - engine.received >= self.stale_after:
                    engine.stale_since = now
                    log.warning("engine %s (%s) is stale: no report for %.1fs", engine_id, engine.report.address,
                                now - engine.received)
                    self.urgent = True
            elif now - engine.stale_since >= self.forget_after:
                del self.engines[engine_id]
                gone = self._pending[engine_id] = BlockEvents()
                gone.cleared()
                log.info("engine %s forgotten after %.0fs stale", engine_id, now - engine.stale_since)
                self.urgent = True

    def take_update(self, wall_time: float | None = None) -> CoordinatorUpdate:
        """The next publish: every engine's load, and the block events since the previous one."""
        engines = [EngineLoad(id=r.id, role=r.role, address=r.address, dp_rank=r.dp_rank, waiting=r.waiting,
                              running=r.running, kv_usage=r.kv_usage, step=r.step, wave=r.wave,
                              block_size=r.block_size, stale=e.stale)
                   for e in self.engines.values() for r in (e.report,)]
        events = []
        for engine_id, pending in self._pending.items():
            drained = pending.drain()
            if drained:
                events.append(BlockEvent(engine_id, drained.stored, drained.removed, drained.cleared))
        self._pending.clear()
        self.urgent = False
        return CoordinatorUpdate(updated=time.time() if wall_time is None else wall_time, engines=engines,
                                 block_events=events)

    def stats(self, now: float, wall_time: float | None = None) -> dict[str, Any]:
        """`GET /stats` (DESIGN §5), with a few extra keys for people."""
        engines = []
        for engine in self.engines.values():
            r = engine.report
            engines.append({"id": r.id, "role": r.role, "address": r.address, "waiting": r.waiting,
                            "running": r.running, "kv_usage": r.kv_usage, "stale": engine.stale,
                            "dp_rank": r.dp_rank, "step": r.step, "wave": r.wave, "block_size": r.block_size,
                            "cached_blocks": len(engine.blocks), "age": round(now - engine.received, 3)})
        return {"updated": time.time() if wall_time is None else wall_time, "engines": engines}

    def blocks_hex(self) -> dict[str, list[str]]:
        return {engine_id: [h.hex() for h in engine.blocks] for engine_id, engine in self.engines.items()}
