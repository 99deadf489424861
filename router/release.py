"""Releasing a prefill engine's held KV blocks that no decode leg will pull.

A prefill leg that answered `kv_transfer_params` leaves the prompt's blocks held on its engine
until a decode engine pulls them. When the decode leg fails, is refused, or its client leaves
first, nobody will: the router says so at once (`POST /v1/kv/release` with those params) rather
than leaving the blocks pinned until their lease runs out. In the background: the client's
answer never waits on it, and a cancelled request still sends it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx

from pdserve.router import metrics as m
from pdserve.router.endpoints import Endpoint, error_text
from pdserve.router.metrics import RouterMetrics

log = logging.getLogger("pdserve.router")

RELEASE_PATH = "/v1/kv/release"


class HoldReleaser:
    def __init__(self, client: httpx.AsyncClient, metrics: RouterMetrics, timeout: float = 2.0,
                 connect_timeout: float = 2.0) -> None:
        self.client = client
        self.metrics = metrics
        self.timeout = timeout
        self.connect_timeout = min(connect_timeout, timeout)
        self._pending: set[asyncio.Task] = set()

    def release(self, endpoint: Endpoint, kv_params: dict[str, Any], headers: dict[str, str], why: str) -> None:
        """Send the release in a task of its own (kept referenced until it ends); never raises."""
        task = asyncio.get_running_loop().create_task(self._send(endpoint, kv_params, headers, why))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _send(self, endpoint: Endpoint, kv_params: dict[str, Any], headers: dict[str, str], why: str) -> None:
        url = f"{endpoint.url}{RELEASE_PATH}"
        try:
            async with asyncio.timeout(self.timeout):
                response = await self.client.post(
                    url, json={"kv_transfer_params": kv_params}, headers=dict(headers, **endpoint.extra_headers),
                    timeout=httpx.Timeout(self.timeout, connect=self.connect_timeout))
        except (httpx.HTTPError, TimeoutError) as exc:
            self.metrics.kv_releases.labels(m.RELEASE_FAILED).inc()
            log.warning("releasing the prefill hold on %s (%s) failed: %s; it expires by its lease", endpoint.url,
                        why, error_text(exc) if not isinstance(exc, TimeoutError) else f"no answer in {self.timeout:g} s")
            return
        released = None
        if response.status_code == 200:
            try:
                released = response.json().get("released")
            except (ValueError, AttributeError):
                pass
        if isinstance(released, bool):
            self.metrics.kv_releases.labels(m.RELEASED if released else m.NOT_HELD).inc()
            log.debug("prefill hold on %s released (%s): %s", endpoint.url, why, released)
        else:
            self.metrics.kv_releases.labels(m.RELEASE_FAILED).inc()
            log.warning("releasing the prefill hold on %s (%s): answered %d %s", endpoint.url, why,
                        response.status_code, response.text[:200])

    async def drain(self) -> None:
        """Wait for the releases under way (each is bounded by the timeout)."""
        while self._pending:
            await asyncio.gather(*list(self._pending), return_exceptions=True)
