"""One request's legs on one endpoint: book-keeping, time bounds, connection slots, and ejection.

Every wait of a leg (for a connection slot, for an answer, for the next chunk) runs under a time
bound, and is cut at once when the endpoint is ejected: a frozen engine then costs its detection
time (a failed /health, a refused connection) rather than the leg's whole bound.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from typing import Awaitable, Callable, TypeVar

from pdserve.router.endpoints import Endpoint
from pdserve.router.metrics import RouterMetrics

log = logging.getLogger("pdserve.router")
T = TypeVar("T")


class LegFailed(Exception):
    """A leg that failed before sending the client anything: safe to fall back or retry."""


class LegTimedOut(LegFailed):
    """A leg's wait ran past its bound."""


class LegCut(LegFailed):
    """A leg's endpoint was ejected while the leg waited on it."""


class LegOverloaded(LegFailed):
    """The engine answered 503 with a Retry-After: it is up and full (its waiting queue at its limit)."""

    def __init__(self, message: str, retry_after: str) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Leg:
    """One request on one endpoint: its in-flight count, gauge, connection slot and leg time."""

    def __init__(self, legs: "Legs", endpoint: Endpoint, name: str) -> None:
        self.legs, self.endpoint, self.name = legs, endpoint, name
        self.started = time.perf_counter()
        self.open = True
        self.cut_reason: str | None = None
        self._bound: asyncio.Timeout | None = None
        self._slot: asyncio.Semaphore | None = None
        endpoint.in_flight += 1
        legs.metrics.in_flight.labels(endpoint.pool, endpoint.url).inc()
        legs.metrics.picks.labels(endpoint.pool, endpoint.url).inc()

    async def within(self, seconds: float | None, awaitable: Awaitable[T], what: str) -> T:
        """`awaitable`'s result, bounded by `seconds` (None: no bound) and by the endpoint's
        ejection; raises LegTimedOut or LegCut (the awaitable is cancelled then)."""
        if self.cut_reason is not None:
            close = getattr(awaitable, "close", None)
            if close is not None:
                close()  # a coroutine never awaited: no "never awaited" warning
            raise self._cut_error()
        bound = asyncio.timeout(seconds)
        try:
            async with bound:
                self._bound = bound
                return await awaitable
        except TimeoutError:
            if not bound.expired():
                raise  # the awaitable's own TimeoutError, not ours
            if self.cut_reason is not None:
                raise self._cut_error() from None
            self.legs.metrics.legs_interrupted.labels(self.name, "timeout").inc()
            raise LegTimedOut(f"{self.endpoint.url}: no {what} within {seconds:g} s") from None
        finally:
            self._bound = None

    async def take_slot(self) -> None:
        """One of the endpoint's connection slots, held until the leg finishes (call it under `within`)."""
        if self._slot is None:
            slot = self.legs.slot(self.endpoint)
            await slot.acquire()
            self._slot = slot

    def cut(self, reason: str) -> None:
        """End the leg's current wait now (and any later one): its endpoint was ejected."""
        if self.cut_reason is not None or not self.open:
            return
        self.cut_reason = reason
        self.legs.metrics.legs_interrupted.labels(self.name, "ejected").inc()
        if self._bound is not None:
            try:
                self._bound.reschedule(asyncio.get_running_loop().time())
            except RuntimeError:  # already expiring
                pass

    def _cut_error(self) -> LegCut:
        return LegCut(f"{self.endpoint.url} was ejected ({self.cut_reason})")

    def finish(self) -> None:
        if not self.open:
            return
        self.open = False
        if self._slot is not None:
            self._slot.release()
            self._slot = None
        self.legs.closed(self)
        self.endpoint.in_flight -= 1
        metrics = self.legs.metrics
        if self.legs.known(self.endpoint):
            metrics.in_flight.labels(self.endpoint.pool, self.endpoint.url).dec()
        metrics.leg_seconds.labels(self.name).observe(time.perf_counter() - self.started)


class Legs:
    """The open legs per endpoint URL and the endpoints' connection slots.

    Keyed by URL, not by Endpoint object: the ranks of a data-parallel pod are endpoints of their
    own for picks, yet share the pod's server, its health and its connections.
    """

    def __init__(self, metrics: RouterMetrics, max_per_endpoint: int,
                 known: Callable[[Endpoint], bool] = lambda e: True) -> None:
        self.metrics = metrics
        self.max_per_endpoint = max_per_endpoint
        self.known = known
        self._open: dict[str, set[Leg]] = defaultdict(set)
        self._slots: dict[str, asyncio.Semaphore] = {}

    def open(self, endpoint: Endpoint, name: str) -> Leg:
        leg = Leg(self, endpoint, name)
        self._open[endpoint.url].add(leg)
        return leg

    def closed(self, leg: Leg) -> None:
        legs = self._open.get(leg.endpoint.url)
        if legs is not None:
            legs.discard(leg)
            if not legs:
                # Slots are held and awaited only by open legs: with none left the slot is idle.
                del self._open[leg.endpoint.url]
                self._slots.pop(leg.endpoint.url, None)

    def slot(self, endpoint: Endpoint) -> asyncio.Semaphore:
        slot = self._slots.get(endpoint.url)
        if slot is None:
            slot = self._slots[endpoint.url] = asyncio.Semaphore(self.max_per_endpoint)
        return slot

    def open_on(self, url: str) -> int:
        return len(self._open.get(url, ()))

    def cut(self, endpoint: Endpoint, reason: str | None) -> None:
        """Health's ejection listener: every leg open on the endpoint's server stops waiting."""
        legs = list(self._open.get(endpoint.url, ()))
        if legs:
            log.warning("cutting %d open legs on ejected %s", len(legs), endpoint.url)
        for leg in legs:
            leg.cut(reason or "ejected")
