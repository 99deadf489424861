"""Choosing one engine of a pool: the selection rules, with no I/O.

The score of an engine is `waiting * 4 + running` as its last coordinator report gave it, plus the
picks this router made since that report (each pick counts as one more waiting request: it sits in
the engine's queue until the engine reports again). The lowest score wins; the scan starts at a
rotating position, so ties spread instead of all landing on the first engine.

Without a usable coordinator report for every candidate (no coordinator, its feed silent, or an
engine marked stale by it) the pool is balanced on the router's own in-flight counts instead: one
consistent scale for the whole pool rather than feed scores compared with local counts.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence

from pdserve.router.prefix import apply_prefix_bonus

WAITING_WEIGHT = 4
# A pick is bumped into the local copy as a waiting request (see the module docstring).
PICK_WEIGHT = WAITING_WEIGHT


class Policy(str, enum.Enum):
    LEAST_LOADED = "least-loaded"
    PREFIX_AWARE = "prefix-aware"
    ROUND_ROBIN = "round-robin"


@dataclass(frozen=True)
class EngineLoad:
    """One engine's counts from the coordinator feed.

    `report` changes whenever the engine's reported counts change, which is how the balancer
    knows that its own picks since then are now part of `waiting`/`running`.
    """

    waiting: int
    running: int
    report: int = 0
    stale: bool = False


@dataclass(frozen=True)
class Candidate:
    address: str              # host:port, the key shared with the feed
    in_flight: int = 0        # requests this router has open on the engine now
    load: EngineLoad | None = None  # None: no fresh coordinator report for it
    cached_blocks: int = 0    # leading blocks of the prompt the engine holds (prefix-aware only)


class NoCandidates(Exception):
    pass


def feed_score(load: EngineLoad) -> int:
    return load.waiting * WAITING_WEIGHT + load.running


class Balancer:
    """Per-pool picker: the rotation and the picks made since each engine's last report."""

    def __init__(self, policy: Policy | str = Policy.LEAST_LOADED) -> None:
        self.policy = Policy(policy)
        self._rotation = 0
        self._bumps: dict[str, tuple[int, int]] = {}  # address -> (report the picks are on top of, picks)

    def uses_feed(self, candidates: Sequence[Candidate]) -> bool:
        return all(c.load is not None and not c.load.stale for c in candidates)

    def picks_since_report(self, candidate: Candidate) -> int:
        if candidate.load is None:
            return 0
        report, picks = self._bumps.get(candidate.address, (candidate.load.report, 0))
        return picks if report == candidate.load.report else 0

    def scores(self, candidates: Sequence[Candidate]) -> list[float]:
        if self.uses_feed(candidates):
            return [float(feed_score(c.load) + PICK_WEIGHT * self.picks_since_report(c))  # type: ignore[arg-type]
                    for c in candidates]
        return [float(c.in_flight) for c in candidates]

    def pick(self, candidates: Sequence[Candidate]) -> int:
        """Index of the chosen candidate; the local copy of its load is bumped."""
        n = len(candidates)
        if n == 0:
            raise NoCandidates
        start = self._rotation % n
        self._rotation += 1
        if self.policy is Policy.ROUND_ROBIN:
            chosen = start
        else:
            scores = self.policy_scores(candidates)
            chosen = min(((start + i) % n for i in range(n)), key=lambda i: scores[i])
        self._bump(candidates[chosen])
        return chosen

    def policy_scores(self, candidates: Sequence[Candidate]) -> list[float]:
        """What `pick` compares: the scores, with the prefix bonus under prefix-aware."""
        scores = self.scores(candidates)
        if self.policy is Policy.PREFIX_AWARE:
            scores = apply_prefix_bonus(scores, [c.cached_blocks for c in candidates])
        return scores

    def ranked(self, candidates: Sequence[Candidate]) -> list[int]:
        """Indices from the best candidate to the worst as `pick` would judge them now, with no
        bump and no turn of the rotation (an ordered fallback list; round-robin keeps the order)."""
        if self.policy is Policy.ROUND_ROBIN:
            return list(range(len(candidates)))
        scores = self.policy_scores(candidates)
        return sorted(range(len(candidates)), key=lambda i: scores[i])

    def _bump(self, candidate: Candidate) -> None:
        if candidate.load is None:
            return  # in-flight counts already move by themselves
        self._bumps[candidate.address] = (candidate.load.report, self.picks_since_report(candidate) + 1)

    def forget(self, address: str) -> None:
        self._bumps.pop(address, None)
