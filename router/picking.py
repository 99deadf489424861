"""Choosing an endpoint of a pool from the coordinator feed: what the router's P/D flow and the
endpoint picker (`pdserve epp`) share. No I/O: the pool, the feed's latest counts and the balancer.

A pod whose data-parallel ranks the feed lists is offered rank by rank; engines the coordinator
marks stale (a frozen core) take no new work while a fresh one is left, and with none left a stale
one beats a failure.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from pdserve.router.balancer import Candidate, Policy
from pdserve.router.endpoints import Endpoint, Pool
from pdserve.router.feed import EngineReport, FeedState


class HasBlockHashes(Protocol):
    def block_hashes(self, block_size: int) -> list[bytes]: ...


class FeedPicker:
    def __init__(self, feed: FeedState | None) -> None:
        self.feed = feed

    def report(self, endpoint: Endpoint, pool: Pool) -> EngineReport | None:
        return self.feed.report(*pool.feed_key(endpoint)) if self.feed is not None else None

    def describe(self, endpoint: Endpoint, request: HasBlockHashes | None, pool: Pool) -> Candidate:
        # A data-parallel rank is an engine of its own: its own report, engine id and cached blocks.
        report = self.report(endpoint, pool)
        cached = 0
        if (report is not None and request is not None and report.block_size
                and pool.balancer.policy is Policy.PREFIX_AWARE):
            cached = self.feed.blocks.matches(report.engine_id, request.block_hashes(report.block_size))  # type: ignore[union-attr]
        return Candidate(pool.balance_key(endpoint), endpoint.in_flight, report.load if report is not None else None,
                         cached)

    def stale(self, endpoint: Endpoint, pool: Pool) -> bool:
        report = self.report(endpoint, pool)
        return report is not None and report.load.stale

    def candidates(self, pool: Pool, exclude: Sequence[str] = (), expand_ranks: bool = True) -> list[Endpoint]:
        """What a pick chooses from: fresh healthy endpoints, else the stale ones (`exclude` lists
        pod URLs). `expand_ranks` False offers each pod whole, whatever ranks the feed lists."""
        ranks_of = self.feed.ranks if self.feed is not None and expand_ranks else None
        offered = pool.candidates(exclude, ranks_of)
        fresh = [e for e in offered if not self.stale(e, pool)]
        return fresh or offered

    def pick(self, pool: Pool, request: HasBlockHashes | None, exclude: Sequence[str] = ()) -> Endpoint | None:
        candidates = self.candidates(pool, exclude)
        if not candidates:
            return None
        return pool.pick(candidates, lambda e: self.describe(e, request, pool))
