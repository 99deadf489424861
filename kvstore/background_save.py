"""Saving KV blocks to a block store without ever holding up the engine's step.

The step hands copies of the blocks it wrote to a `BlockSaver`, whose own thread sends them. A
store that is down, slow or gone costs nothing but the dropped saves (counted as failures, one
per block): while a `Backoff` runs, saves are dropped before they are even copied, and the store
is tried again after 0.5 s, 1 s, 2 s ... up to `most` seconds, each failure doubling the wait.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from pdserve.kvstore.base import KVConnectorStats, LoadLog

log = logging.getLogger("pdserve.kvstore.storage")

WARN_EVERY_S = 30.0  # a store that stays down is reported this often, not once per step


class Backend(Protocol):
    def put(self, keys: Sequence[bytes], values: Sequence[Any]) -> None: ...
    def close(self) -> None: ...


class Backoff:
    """When to try a store again: `first` seconds after a failure, doubling on each further one up
    to `most`; a success resets. Read from several threads: plain float fields, each written whole."""

    def __init__(self, first: float, most: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.first, self.most, self.clock = first, most, clock
        self.delay = 0.0  # 0: the store answered last time
        self.until = 0.0

    def ready(self) -> bool:
        return self.clock() >= self.until

    @property
    def down(self) -> bool:
        return self.delay > 0

    def failed(self) -> float:
        self.delay = min(self.most, max(self.first, self.delay * 2))
        self.until = self.clock() + self.delay
        return self.delay

    def succeeded(self) -> bool:
        """Reset; True if the store had been down."""
        was_down, self.delay, self.until = self.delay > 0, 0.0, 0.0
        return was_down


@dataclass
class SaveBatch:
    keys: list[bytes]
    values: list[Any]  # CPU copies, owned by the batch: the engine may reuse the blocks at once
    nbytes: int
    done: threading.Event = field(default_factory=threading.Event)  # sent, or dropped


class BlockSaver:
    """A queue of save batches and the thread that sends them, in order, through its own backend
    (a store client serves one thread). At most `max_pending_bytes` wait: past that, new batches
    are dropped rather than the engine's memory growing behind a slow store."""

    def __init__(self, backend: Backend, stats: LoadLog, backoff: Backoff, max_pending_bytes: int) -> None:
        self._backend = backend  # used by the sending thread alone from now on
        self._stats = stats
        self.backoff = backoff
        self.max_pending_bytes = max_pending_bytes
        self.dropped = 0  # blocks, since start
        self.saved_batches = 0  # batches the store took, since start
        self._warned_at = -WARN_EVERY_S
        self._queue: deque[SaveBatch] = deque()
        self._pending_bytes = 0
        self._cond = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="kv-store-save", daemon=True)
        self._thread.start()

    def accepting(self) -> bool:
        """False while backing off: the caller drops its blocks without copying them."""
        return self.backoff.ready()

    def submit(self, keys: list[bytes], values: list[Any]) -> SaveBatch | None:
        """Queue a batch; None if it was dropped (too much already waiting)."""
        nbytes = sum(memoryview(v).nbytes for v in values)
        batch = SaveBatch(keys, values, nbytes)
        with self._cond:
            if not self._closing and self._pending_bytes + nbytes <= self.max_pending_bytes:
                self._queue.append(batch)
                self._pending_bytes += nbytes
                self._cond.notify()
                return batch
        self.drop(len(keys), "the save queue is full")
        return None

    def drop(self, blocks: int, why: str) -> None:
        """Count `blocks` saves as failed (the store just lacks them: engines compute them instead)."""
        if blocks <= 0:
            return
        with self._cond:
            self.dropped += blocks
            now = time.monotonic()
            quiet = now - self._warned_at < WARN_EVERY_S
            if not quiet:
                self._warned_at = now
        self._stats.count(KVConnectorStats(failures=blocks))
        if not quiet:
            log.warning("dropped KV block saves (%d so far; serving goes on): %s", self.dropped, why)

    def close(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout)

    # -- the sending thread -----------------------------------------------------------------------

    def _next(self) -> SaveBatch | None:
        with self._cond:
            while not self._queue and not self._closing:
                self._cond.wait()
            if not self._queue:
                return None
            batch = self._queue.popleft()
            self._pending_bytes -= batch.nbytes
            return batch

    def _drain(self, why: str) -> None:
        """Drop everything queued (it was copied before the store was known to be down)."""
        with self._cond:
            batches, self._queue, self._pending_bytes = list(self._queue), deque(), 0
        for batch in batches:
            self.drop(len(batch.keys), why)
            batch.done.set()

    def _run(self) -> None:
        backend = self._backend
        try:
            while (batch := self._next()) is not None:
                try:
                    self._send(backend, batch)
                finally:
                    batch.done.set()
        finally:
            self._drain("the engine is shutting down")
            backend.close()

    def _send(self, backend: Backend, batch: SaveBatch) -> None:
        if not self.backoff.ready():
            self.drop(len(batch.keys), "the KV store is down")
            return
        start = time.monotonic()
        try:
            backend.put(batch.keys, batch.values)
        except Exception as exc:
            delay = self.backoff.failed()
            why = f"{exc} (next try in {delay:.1f}s)"
            self.drop(len(batch.keys), why)
            self._drain(why)
            return
        self.saved_batches += 1
        if self.backoff.succeeded():
            log.info("KV store reachable again: block saves resume")
        self._stats.count(KVConnectorStats(bytes=batch.nbytes, seconds=time.monotonic() - start))
