"""The decode side of KV leases: keep a prefill engine's hold alive while a request means to pull.

A prefill engine keeps a finished prompt's blocks under a lease (kvstore.send_registry). A decode
worker rank renews the lease of every request it will pull for, from the moment the scheduler
learns of the request (it may wait in the queue for a free slot) until its pull ends: every third
of the lease, in one `renew` message per prefill rank for all of that rank's requests. When the
request will not pull after all (aborted while it waited, or its whole prompt was cached here),
one rank tells every prefill rank "done", so the blocks go at once rather than at the lease's end.

Everything here runs in one thread of its own, with its own connections: a slow or dead prefill
engine delays no step and no pull. A renewal that fails (the peer unreachable, or the hold already
gone) is counted; a hold that is gone is not asked for again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

from pdserve.kvstore.transport_tcp import MAX_LEASES_PER_RENEWAL, BlockClient, HeldKV, TransferError

log = logging.getLogger("pdserve.kvstore.lease")

MIN_PERIOD_S = 0.05  # renew no faster than this, whatever lease a peer claims
MAX_WAIT_S = 1.0  # the thread wakes at least this often (to notice close)


@dataclass(frozen=True)
class LeaseWatch:
    """A decode request that will pull a prompt's KV, and where that KV is held."""

    req_id: str  # the request's id in this (decode) engine
    remote_req_id: str  # its id in the prefill engine, which holds the blocks under it
    prompt_digest: str
    host: str
    ports: tuple[int, ...]  # one side-channel port per prefill TP rank; every rank holds its heads
    lease_s: float
    # The prefill ranks this decode rank renews: those its pull reads or releases (None: all).
    renew_ranks: tuple[int, ...] | None = None

    @property
    def held(self) -> HeldKV:
        return HeldKV(self.remote_req_id, self.prompt_digest)

    @property
    def peers(self) -> list[tuple[str, int]]:
        return [(self.host, port) for port in self.ports]

    @property
    def renewed_peers(self) -> list[tuple[str, int]]:
        ranks = range(len(self.ports)) if self.renew_ranks is None else self.renew_ranks
        return [(self.host, self.ports[q]) for q in ranks if 0 <= q < len(self.ports)]


@dataclass
class _Entry:
    watch: LeaseWatch
    next_at: float


class LeaseKeeper:
    """Renews the leases of one decode worker rank's waiting requests, and releases the holds of
    requests that will not pull. Thread-safe; the thread starts with the first watch."""

    def __init__(self, client: BlockClient, clock: Callable[[], float] = time.monotonic) -> None:
        self.client = client
        self._clock = clock
        self._cond = threading.Condition()
        self._entries: dict[str, _Entry] = {}
        self._releases: list[LeaseWatch] = []
        self._thread: threading.Thread | None = None
        self._closed = False
        self._failures = 0  # renewals that failed, since the last take_failures
        self.renewals = 0  # leases renewed, cumulative (for tests and logs)

    # -- what the connector tells it (from the step thread; never blocks on the network) ------

    def watch(self, watch: LeaseWatch) -> None:
        """Renew this request's lease until `stop` or `drop`; the first renewal goes at once (the
        request may have reached us late in its lease)."""
        with self._cond:
            self._entries[watch.req_id] = _Entry(watch, self._clock())
            self._ensure_thread()
            self._cond.notify()

    def stop(self, req_id: str) -> None:
        """The pull ended (its reader says "done" itself): renew no more."""
        with self._cond:
            self._entries.pop(req_id, None)

    def drop(self, req_id: str, release: bool) -> None:
        """The request will not pull: renew no more, and with `release` tell every prefill rank
        that holds its KV to let the blocks go now."""
        with self._cond:
            entry = self._entries.pop(req_id, None)
            if entry is not None and release:
                self._releases.append(entry.watch)
                self._ensure_thread()
                self._cond.notify()

    def take_failures(self) -> int:
        with self._cond:
            failures, self._failures = self._failures, 0
            return failures

    @property
    def num_watched(self) -> int:
        with self._cond:
            return len(self._entries)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    # -- the thread ----------------------------------------------------------------------------

    def _ensure_thread(self) -> None:
        if self._thread is None and not self._closed:
            self._thread = threading.Thread(target=self._run, name="kv-lease", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                due, releases = self._wait_for_work()
                if self._closed:
                    return
            for watch in releases:
                self._release(watch)
            if due:
                self._renew(due)

    def _wait_for_work(self) -> tuple[list[LeaseWatch], list[LeaseWatch]]:
        """Under the lock: wait until a renewal is due or a release is queued."""
        while not self._closed:
            now = self._clock()
            due = [e for e in self._entries.values() if e.next_at <= now]
            if due or self._releases:
                for entry in due:
                    entry.next_at = now + max(MIN_PERIOD_S, entry.watch.lease_s / 3)
                releases, self._releases = self._releases, []
                return [e.watch for e in due], releases
            soonest = min((e.next_at for e in self._entries.values()), default=now + MAX_WAIT_S)
            self._cond.wait(min(MAX_WAIT_S, max(0.0, soonest - now)))
        return [], []

    def _renew(self, due: list[LeaseWatch]) -> None:
        by_peer: dict[tuple[str, int], list[LeaseWatch]] = defaultdict(list)
        for watch in due:
            for peer in watch.renewed_peers:
                by_peer[peer].append(watch)
        batches = [(peer, watches[i:i + MAX_LEASES_PER_RENEWAL]) for peer, watches in by_peer.items()
                   for i in range(0, len(watches), MAX_LEASES_PER_RENEWAL)]
        failed: list[LeaseWatch] = []  # unreachable peer: asked again next period
        gone: list[LeaseWatch] = []  # the hold is no more: its pull will fail and recompute; never asked again
        for peer, watches in batches:
            try:
                missing = set(self.client.renew(peer, [w.held for w in watches]))
            except TransferError as exc:
                failed.extend(watches)
                log.warning("kv lease: could not renew %d leases at %s:%d: %s", len(watches), peer[0], peer[1], exc)
                continue
            gone.extend(w for w in watches if w.remote_req_id in missing)
            self.renewals += len(watches) - len(missing)
        with self._cond:
            # A pull that ended meanwhile said "done" itself, which is why its hold is gone: no failure.
            failed = [w for w in failed if self._is_watched(w)]
            gone = [w for w in gone if self._is_watched(w)]
            self._failures += len(failed) + len(gone)
            for watch in gone:
                del self._entries[watch.req_id]
        if gone:
            log.warning("kv lease: %d requests' KV is no longer held by the prefill engine; they will recompute",
                        len(gone))

    def _is_watched(self, watch: LeaseWatch) -> bool:
        entry = self._entries.get(watch.req_id)
        return entry is not None and entry.watch is watch

    def _release(self, watch: LeaseWatch) -> None:
        for peer in watch.peers:
            # One "done" is all a hold nobody reads waits for (kvstore.layout: a replicated head's rule).
            self.client.release(peer, watch.held, 1)  # best effort: the lease ends it anyway
