"""Engine endpoints grouped in pools, their in-flight counts and health (ejection and re-admission)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence
from urllib.parse import urlsplit

import httpx

from pdserve.engine.server.dp_rank import DP_RANK_HEADER
from pdserve.router.balancer import Balancer, Candidate, Policy

log = logging.getLogger("pdserve.router")

PREFILL = "prefill"
DECODE = "decode"


def endpoint_address(url: str) -> str:
    """host:port of an endpoint URL: the key the coordinator's feed uses for the same engine."""
    parts = urlsplit(url)
    if not parts.hostname or parts.scheme not in ("http", "https"):
        raise ValueError(f"not an http(s) URL with a host: {url!r}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{host}:{port}"


def error_text(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    endpoint_address(url)  # validates
    return url


@dataclass
class Endpoint:
    url: str
    pool: str
    address: str
    healthy: bool = True
    in_flight: int = 0
    last_error: str | None = None
    changed_at: float = field(default_factory=time.monotonic)
    # Sent with every leg to this endpoint (e.g. the data-parallel rank it stands for).
    extra_headers: dict[str, str] = field(default_factory=dict)


class _SharedWithPod:
    """An attribute a rank endpoint reads from and writes to its pod's endpoint: health is per pod
    (one server, one /health), so ejecting a rank ejects the pod and re-admitting the pod re-admits
    every rank."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: "RankEndpoint | None", owner: type | None = None) -> object:
        if obj is None:
            return self
        return getattr(obj.pod, self.name)

    def __set__(self, obj: "RankEndpoint", value: object) -> None:
        setattr(obj.pod, self.name, value)


class RankEndpoint(Endpoint):
    """One data-parallel rank of a pod, picked as an endpoint of its own: the pod's URL, its own
    in-flight count (added to the pod's too) and the header that puts a request on this rank."""

    healthy = _SharedWithPod()  # type: ignore[assignment]
    last_error = _SharedWithPod()  # type: ignore[assignment]
    changed_at = _SharedWithPod()  # type: ignore[assignment]

    def __init__(self, pod: Endpoint, dp_rank: int) -> None:
        self.pod = pod
        self.dp_rank = dp_rank
        self._in_flight = 0
        super().__init__(pod.url, pod.pool, pod.address, healthy=pod.healthy, last_error=pod.last_error,
                         changed_at=pod.changed_at, extra_headers={DP_RANK_HEADER: str(dp_rank)})

    @property  # type: ignore[override]
    def in_flight(self) -> int:
        return self._in_flight

    @in_flight.setter
    def in_flight(self, value: int) -> None:
        # The pod's count stays the sum over its ranks, for whoever reads it per pod.
        self.pod.in_flight += value - self._in_flight
        self._in_flight = value


class Pool:
    """The engines of one role; membership comes from discovery, health from the checker.

    `endpoints` holds one Endpoint per pod (server URL). A pod whose data-parallel ranks the
    coordinator's feed lists is offered for picks as one RankEndpoint per rank (`candidates`), so
    a busy rank and an idle one of the same pod are scored apart.
    """

    def __init__(self, name: str, policy: Policy | str, on_change: Callable[["Pool"], None] | None = None) -> None:
        self.name = name
        self.balancer = Balancer(policy)
        self.endpoints: dict[str, Endpoint] = {}
        self.ranks: dict[str, dict[int, RankEndpoint]] = {}  # url -> rank -> its endpoint, made on first offer
        self.on_change = on_change

    def replace(self, urls: Iterable[str]) -> None:
        wanted = {normalize_url(u) for u in urls}
        added = wanted - set(self.endpoints)
        removed = set(self.endpoints) - wanted
        for url in sorted(added):
            self.endpoints[url] = Endpoint(url, self.name, endpoint_address(url))
        for url in removed:
            gone = self.endpoints.pop(url)
            self.balancer.forget(gone.address)
            for rank in self.ranks.pop(url, {}).values():
                self.balancer.forget(self.balance_key(rank))
        if added or removed:
            log.info("pool %s: %d endpoints (+%s -%s)", self.name, len(self.endpoints), sorted(added), sorted(removed))
            if self.on_change is not None:
                self.on_change(self)

    def healthy(self, exclude: Iterable[str] = ()) -> list[Endpoint]:
        """The healthy pods, by URL (`exclude` lists URLs)."""
        skip = set(exclude)
        return [e for e in self.endpoints.values() if e.healthy and e.url not in skip]

    def candidates(self, exclude: Iterable[str] = (),
                   ranks_of: Callable[[str], Sequence[int]] | None = None) -> list[Endpoint]:
        """What a pick chooses from: each healthy pod, or one endpoint per rank where `ranks_of`
        (the feed's ranks for a pod's address) lists data-parallel ranks. A pod the feed lists
        as rank 0 alone, or not at all, is one endpoint, as without data parallelism."""
        offered: list[Endpoint] = []
        for pod in self.healthy(exclude):
            listed = ranks_of(pod.address) if ranks_of is not None else ()
            if len(listed) > 1 or any(listed):
                offered.extend(self.rank_endpoint(pod, rank) for rank in listed)
            else:
                offered.append(pod)
        return offered

    def rank_endpoint(self, pod: Endpoint, rank: int) -> RankEndpoint:
        ranks = self.ranks.setdefault(pod.url, {})
        endpoint = ranks.get(rank)
        if endpoint is None or endpoint.pod is not pod:
            endpoint = ranks[rank] = RankEndpoint(pod, rank)
        return endpoint

    @staticmethod
    def feed_key(endpoint: Endpoint) -> tuple[str, int]:
        """(address, data-parallel rank): the endpoint's entry in the coordinator's feed."""
        return endpoint.address, endpoint.dp_rank if isinstance(endpoint, RankEndpoint) else 0

    @staticmethod
    def balance_key(endpoint: Endpoint) -> str:
        """The balancer's key for an endpoint: its address, with the rank for a rank endpoint."""
        return f"{endpoint.address}#dp{endpoint.dp_rank}" if isinstance(endpoint, RankEndpoint) else endpoint.address

    def __len__(self) -> int:
        return len(self.endpoints)

    def pick(self, candidates: list[Endpoint], describe: Callable[[Endpoint], Candidate]) -> Endpoint:
        return candidates[self.balancer.pick([describe(e) for e in candidates])]


class Pools:
    def __init__(self, policy: Policy | str, on_change: Callable[[Pool], None] | None = None) -> None:
        self.prefill = Pool(PREFILL, policy, on_change)
        self.decode = Pool(DECODE, policy, on_change)

    def __iter__(self):
        return iter((self.prefill, self.decode))


class Health:
    """Marks endpoints down (ejected from picks) and up again; the only writer of `healthy`.

    Ejection listeners (`on_eject`) hear of every ejection as it happens: the P/D flow cuts the
    legs still waiting on that engine instead of letting them run into their time bounds.
    """

    def __init__(self, on_change: Callable[[Endpoint], None] | None = None) -> None:
        self.on_change = on_change
        self._eject_listeners: list[Callable[[Endpoint, str | None], None]] = []

    def on_eject(self, listener: Callable[[Endpoint, str | None], None]) -> None:
        self._eject_listeners.append(listener)

    def set(self, endpoint: Endpoint, healthy: bool, reason: str | None = None) -> None:
        if endpoint.healthy == healthy:
            return
        endpoint.healthy = healthy
        endpoint.last_error = None if healthy else reason
        endpoint.changed_at = time.monotonic()
        if healthy:
            log.info("endpoint %s (%s) re-admitted", endpoint.url, endpoint.pool)
        else:
            log.warning("endpoint %s (%s) ejected: %s", endpoint.url, endpoint.pool, reason)
        if self.on_change is not None:
            self.on_change(endpoint)
        if not healthy:
            for listener in self._eject_listeners:
                try:
                    listener(endpoint, reason)
                except Exception:  # a listener's bug must not stop health checking
                    log.exception("ejection listener failed for %s", endpoint.url)


# The health checker's own pool: one check per engine server at a time, so this many servers are
# checked at once (more queue for a connection, which does not count against their timeout).
HEALTH_CONNECTIONS = 64


def health_client() -> httpx.AsyncClient:
    """A client for health checks alone. Sharing the request pool, checks waited behind streams for
    a connection until they timed out, and a loaded router ejected every engine."""
    return httpx.AsyncClient(limits=httpx.Limits(max_connections=HEALTH_CONNECTIONS,
                                                 max_keepalive_connections=HEALTH_CONNECTIONS),
                             timeout=httpx.Timeout(3.0, pool=None))


class HealthChecker:
    """GET /health on every endpoint each `interval` seconds: a failure ejects, a success re-admits.

    `client` should be its own (`health_client`): then a failure means the engine server did not
    answer, never that the router's connections were all taken by streams."""

    def __init__(self, pools: Pools, health: Health, client: httpx.AsyncClient, interval: float,
                 timeout: float = 3.0) -> None:
        self.pools = pools
        self.health = health
        self.client = client
        self.interval = interval
        self.timeout = timeout

    async def check(self, endpoint: Endpoint) -> None:
        try:
            # No pool timeout: waiting for one of the checker's own connections is not the engine's fault.
            response = await self.client.get(f"{endpoint.url}/health",
                                             timeout=httpx.Timeout(self.timeout, pool=None))
        except httpx.HTTPError as exc:
            self.health.set(endpoint, False, f"/health: {error_text(exc)}")
            return
        if response.status_code == 200:
            self.health.set(endpoint, True)
        else:
            self.health.set(endpoint, False, f"/health answered {response.status_code}")

    async def check_all(self) -> None:
        endpoints = [e for pool in self.pools for e in list(pool.endpoints.values())]
        if endpoints:
            await asyncio.gather(*(self.check(e) for e in endpoints))

    async def run(self) -> None:
        while True:
            await self.check_all()
            await asyncio.sleep(self.interval)
