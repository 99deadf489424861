"""Engine endpoints grouped in pools, their in-flight counts and health (ejection and re-admission)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable
from urllib.parse import urlsplit

import httpx

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


class Pool:
    """The engines of one role; membership comes from discovery, health from the checker."""

    def __init__(self, name: str, policy: Policy | str, on_change: Callable[["Pool"], None] | None = None) -> None:
        self.name = name
        self.balancer = Balancer(policy)
        self.endpoints: dict[str, Endpoint] = {}
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
        if added or removed:
            log.info("pool %s: %d endpoints (+%s -%s)", self.name, len(self.endpoints), sorted(added), sorted(removed))
            if self.on_change is not None:
                self.on_change(self)

    def healthy(self, exclude: Iterable[str] = ()) -> list[Endpoint]:
        skip = set(exclude)
        return [e for e in self.endpoints.values() if e.healthy and e.url not in skip]

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
    """Marks endpoints down (ejected from picks) and up again; the only writer of `healthy`."""

    def __init__(self, on_change: Callable[[Endpoint], None] | None = None) -> None:
        self.on_change = on_change

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


class HealthChecker:
    """GET /health on every endpoint each `interval` seconds: a failure ejects, a success re-admits."""

    def __init__(self, pools: Pools, health: Health, client: httpx.AsyncClient, interval: float,
                 timeout: float = 3.0) -> None:
        self.pools = pools
        self.health = health
        self.client = client
        self.interval = interval
        self.timeout = timeout

    async def check(self, endpoint: Endpoint) -> None:
        try:
            response = await self.client.get(f"{endpoint.url}/health", timeout=self.timeout)
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
