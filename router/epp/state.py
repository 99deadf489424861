"""The pools the picker chooses from, kept current as the router keeps its own: static lists or
EndpointSlices (router/discovery.py), /health checks (router/endpoints.py), and the coordinator
feed (router/feed.py) whose counts the picks follow (router/picking.py).

The picker never sees a response, so it cannot count requests in flight the way the router does.
Its load signal is the feed (with the balancer's per-pick bumps, which the next report absorbs);
without a fresh feed every endpoint scores 0 and the balancer's rotation makes it round-robin
over the healthy endpoints. Counting picks instead would only ever grow (no completion is seen),
and decaying them would guess each request's length.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from dataclasses import dataclass
from typing import Awaitable, Callable, Collection, Sequence

import httpx

from pdserve.router.endpoints import Endpoint, Health, HealthChecker, Pool, Pools, RankEndpoint, health_client
from pdserve.router.epp.metrics import EppMetrics
from pdserve.router.epp.settings import EppSettings
from pdserve.router.feed import FeedState, FeedSubscriber
from pdserve.router.picking import FeedPicker, HasBlockHashes
from pdserve.router.background import restarting_task

log = logging.getLogger("pdserve.epp")

PoolTask = Callable[[Pools], Awaitable[None]]


@dataclass(frozen=True)
class Choice:
    """An answer's endpoints: the pick first, then its fallbacks; each with the address the
    gateway connects to (`ip:port`)."""

    endpoints: tuple[Endpoint, ...]
    destinations: tuple[str, ...]

    @property
    def header(self) -> str:
        return ",".join(self.destinations)


class PoolState:
    def __init__(self, settings: EppSettings, metrics: EppMetrics, static_prefill: Sequence[str] = (),
                 static_decode: Sequence[str] = (), discovery: Sequence[PoolTask] = ()) -> None:
        self.settings = settings
        self.metrics = metrics
        self.pools = Pools(settings.policy)
        self.health = Health()
        self.feed = FeedState() if settings.coordinator_address else None
        self.picker = FeedPicker(self.feed)
        self.discovery = list(discovery)
        # Made here (on the running loop): the prefill leg shares the client from the start.
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=settings.connect_timeout))
        self.health_client = health_client()
        self._tasks: list[asyncio.Task] = []
        self._turn = itertools.count()
        self.pools.prefill.replace(static_prefill)
        self.pools.decode.replace(static_decode)

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        checker = HealthChecker(self.pools, self.health, self.health_client, self.settings.health_interval)
        self._spawn(checker.run, "health checks")
        if self.feed is not None and self.settings.coordinator_address:
            host = self.settings.coordinator_address.rsplit(":", 1)[0]
            subscriber = FeedSubscriber(self.settings.coordinator_address, self.feed,
                                        seed_url=f"http://{host}:{self.settings.coordinator_http_port}/blocks",
                                        client=self.client)
            self._spawn(subscriber.run, "coordinator feed")
        for discover in self.discovery:
            self._spawn(lambda discover=discover: discover(self.pools), "endpoint discovery")
        self._spawn(self._watch_pool, "pool gauges")

    def _spawn(self, run: Callable[[], Awaitable[None]], what: str) -> None:
        """A background loop for the picker's lifetime, restarted if it crashes."""
        self._tasks.append(restarting_task(run, what, log))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(BaseException):
                await task
        self._tasks.clear()
        await self.client.aclose()
        await self.health_client.aclose()

    async def _watch_pool(self) -> None:
        while True:
            self.update_gauges()
            await asyncio.sleep(0.5)

    def update_gauges(self) -> None:
        m, name = self.metrics, self.settings.pool_name
        m.ready_pods.labels(name).set(self.ready())
        m.feed_alive.set(1 if self.feed is not None and self.feed.alive() else 0)
        reports = [r for r in (self.picker.report(e, self.pools.decode)
                               for e in self.picker.candidates(self.pools.decode)) if r is not None]
        if reports:
            m.kv_cache.labels(name).set(sum(r.kv_usage for r in reports) / len(reports))
            m.queue.labels(name).set(sum(r.load.waiting for r in reports) / len(reports))
        m.per_pod_queue.clear()
        for r in reports:
            m.per_pod_queue.labels(name, f"{r.address}#{r.dp_rank}" if r.dp_rank else r.address).set(r.load.waiting)

    # -- picks -----------------------------------------------------------------------------------

    def ready(self) -> int:
        """Admitted endpoints of the decode pool (the pool the gateway sends requests to)."""
        return len(self.pools.decode.healthy())

    def destination(self, endpoint: Endpoint) -> str:
        """Where the gateway connects for this endpoint: the pod's address, or its rank's own port."""
        if isinstance(endpoint, RankEndpoint) and self.settings.rank_port_base is not None:
            host = endpoint.address.rsplit(":", 1)[0]
            return f"{host}:{self.settings.rank_port_base + endpoint.dp_rank}"
        return endpoint.address

    def candidates(self, pool: Pool, subset: Collection[str] | None) -> list[Endpoint]:
        # Ranks are endpoints of their own only where the gateway can reach each rank (its port).
        offered = self.picker.candidates(pool, expand_ranks=self.settings.rank_port_base is not None)
        if subset is not None:
            offered = [e for e in offered if self.destination(e) in subset]
        return offered

    def saturated(self, candidates: Sequence[Endpoint], pool: Pool) -> bool:
        """Every candidate reports more waiting requests than --saturation-waiting (picks made
        since its report count as waiting too): only then are sheddable requests refused."""
        limit = self.settings.saturation_waiting
        if limit is None or not candidates:
            return False
        for endpoint in candidates:
            described = self.picker.describe(endpoint, None, pool)
            if described.load is None:
                return False  # no fresh count: nothing proves it busy
            waiting = described.load.waiting + pool.balancer.picks_since_report(described)
            if waiting <= limit:
                return False
        return True

    def choose(self, pool: Pool, candidates: Sequence[Endpoint], request: HasBlockHashes | None) -> Choice:
        """The balancer's pick (bumped), then the best of the other pods as fallbacks: a retry on
        another rank of a pod that just failed would most likely fail the same way."""
        describe = lambda e: self.picker.describe(e, request, pool)  # noqa: E731
        primary = pool.pick(list(candidates), describe)
        chosen = [primary]
        others = [e for e in candidates if e.url != primary.url]
        for index in pool.balancer.ranked([describe(e) for e in others]):
            if len(chosen) >= self.settings.destinations:
                break
            if all(e.url != others[index].url for e in chosen):
                chosen.append(others[index])
        return Choice(tuple(chosen), tuple(self.destination(e) for e in chosen))

    def any_of(self, candidates: Sequence[Endpoint]) -> Choice:
        """A bodiless request (GET /v1/models): no load to place, so a plain rotation, no bump."""
        start = next(self._turn) % len(candidates)
        chosen: list[Endpoint] = []
        for i in range(len(candidates)):
            endpoint = candidates[(start + i) % len(candidates)]
            if all(e.url != endpoint.url for e in chosen):
                chosen.append(endpoint)
            if len(chosen) >= self.settings.destinations:
                break
        return Choice(tuple(chosen), tuple(self.destination(e) for e in chosen))
