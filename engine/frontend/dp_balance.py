"""Which data-parallel rank gets the next request: the lowest `waiting * 4 + running`.

Two sources of load, each right about something: the coordinator's feed knows how each rank's
requests split between running and waiting (its scheduler's view), but it is up to ~100 ms old;
the client knows exactly how many of its requests each rank holds right now (it is the only
frontend of its ranks). So a rank's in-flight count is its total, of which at most the feed's
`running` count are taken as running and the rest as waiting. A pick raises the chosen rank's
in-flight count at once (the local bump), so a burst between two feed updates spreads out; a
rank with no feed yet counts all its requests as waiting. The scan starts one rank further on
each pick, so ties rotate instead of always landing on rank 0.
"""

from __future__ import annotations

from dataclasses import dataclass

WAITING_WEIGHT = 4


@dataclass
class RankLoad:
    in_flight: int = 0  # this client's requests the rank holds
    feed_running: int = 0  # from the coordinator's latest update
    feed_waiting: int = 0
    picks: int = 0  # requests sent to this rank since start

    def score(self) -> int:
        running = min(self.feed_running, self.in_flight)
        return WAITING_WEIGHT * (self.in_flight - running) + running


class DPBalancer:
    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"need at least one rank, got {size}")
        self.ranks = [RankLoad() for _ in range(size)]
        self._next_start = 0

    def pick(self) -> int:
        n = len(self.ranks)
        start = self._next_start
        self._next_start = (start + 1) % n
        best, best_score = start, self.ranks[start].score()
        for offset in range(1, n):
            rank = (start + offset) % n
            score = self.ranks[rank].score()
            if score < best_score:
                best, best_score = rank, score
        return self.assign(best)

    def assign(self, rank: int) -> int:
        """Count a request placed on `rank` (by pick, or pinned there by the router)."""
        load = self.ranks[rank]
        load.in_flight += 1
        load.picks += 1
        return rank

    def finished(self, rank: int, count: int = 1) -> None:
        load = self.ranks[rank]
        load.in_flight = max(0, load.in_flight - count)

    def update_feed(self, rank: int, waiting: int, running: int) -> None:
        load = self.ranks[rank]
        load.feed_waiting, load.feed_running = waiting, running
