"""The prefill leg of a disaggregated request, run by the picker itself (llm-d's pattern).

The picker chooses a prefill engine, sends it the router's prefill body (router/pd.py's
prefill_body: max_tokens=1, stream=false, kv_transfer_params={"do_remote_decode": true}) with the
internal key, and hands the decode engine the client's body plus the `kv_transfer_params` it got
back. The same fallbacks as the router: a prefill that fails, is refused by the engine for the
picker's sake (401/403) or times out leaves the decode engine to compute the prompt; a 4xx about
the request itself is the client's answer; a hold whose answer never went out (the stream failed
between the prefill leg and the answer) is released at once (router/release.py); once the answer
is handed to gRPC the KV is the decode leg's, even if Envoy then resets the stream.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import httpx

from pdserve.engine.internal_auth import HEADER as INTERNAL_HEADER
from pdserve.router.endpoints import Endpoint, Health, error_text
from pdserve.router.legs import LegFailed
from pdserve.router.pd import Hold, RoutedRequest, prefill_body
from pdserve.router.release import HoldReleaser

log = logging.getLogger("pdserve.epp")


@dataclass(frozen=True)
class Refusal:
    """The prefill engine's 4xx about the request itself: passed to the client unchanged."""

    status: int
    body: bytes
    content_type: str


class PrefillLeg:
    def __init__(self, client: httpx.AsyncClient, health: Health, releaser: HoldReleaser, internal_key: bytes | None,
                 timeout: float, connect_timeout: float) -> None:
        self.client = client
        self.health = health
        self.releaser = releaser
        self.internal_key = internal_key
        self.timeout = timeout
        self.connect_timeout = connect_timeout

    def headers(self, request_id: str, authorization: str | None) -> dict[str, str]:
        # Built from scratch: nothing else the client sent reaches the prefill engine.
        headers = {"x-request-id": request_id}
        if authorization:
            headers["authorization"] = authorization
        if self.internal_key is not None:
            headers[INTERNAL_HEADER] = self.internal_key.decode()
        return headers

    async def run(self, endpoint: Endpoint, request: RoutedRequest) -> Hold | Refusal | None:
        """The hold (None when the engine answered no params); raises LegFailed when the decode
        engine should compute the prompt itself."""
        url = f"{endpoint.url}{request.path}"
        try:
            async with asyncio.timeout(self.timeout):
                response = await self.client.post(url, json=prefill_body(request),
                                                   headers=dict(request.headers, **endpoint.extra_headers),
                                                   timeout=httpx.Timeout(self.timeout, connect=self.connect_timeout))
        except TimeoutError:
            raise LegFailed(f"{endpoint.url}: no prefill answer within {self.timeout:g} s") from None
        except httpx.HTTPError as exc:
            if isinstance(exc, httpx.ConnectError):
                self.health.set(endpoint, False, f"connection failed: {error_text(exc)}")
            raise LegFailed(f"{endpoint.url}: {error_text(exc)}") from None
        if response.status_code in (401, 403):
            raise LegFailed(f"{endpoint.url} refused the picker ({response.status_code}): is the internal key the "
                            f"same on both?")
        if 400 <= response.status_code < 500:
            return Refusal(response.status_code, response.content,
                           response.headers.get("content-type", "application/json"))
        if response.status_code != 200:
            raise LegFailed(f"{endpoint.url} answered {response.status_code}: {response.text[:200]}")
        try:
            answer = response.json()
        except ValueError:
            raise LegFailed(f"{endpoint.url} answered with invalid JSON") from None
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        return Hold(endpoint, params) if isinstance(params, dict) else None

    def release(self, hold: Hold, request: RoutedRequest, why: str) -> None:
        self.releaser.release(hold.endpoint, hold.params, request.headers, why)


def decode_body(body: dict[str, Any], hold: Hold | None) -> dict[str, Any]:
    """What the decode engine gets: the client's body (never its own kv_transfer_params), plus the
    prefill's params when there is a hold."""
    clean = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    if hold is not None:
        clean["kv_transfer_params"] = hold.params
    return clean
