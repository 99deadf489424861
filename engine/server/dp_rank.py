"""The data-parallel rank a router asks for: `X-PDServe-DP-Rank: <r>`.

A router that sees a pod's ranks in the coordinator's feed scores them as engines of their own
and tells the pod which rank it picked; the pod then puts the request on that rank instead of
its own balancer's pick. Only the deployment's router may pin a request (the header counts only
with a matching `X-PDServe-Internal-Key`): from anyone else it is ignored, not refused, since it
is a placement hint that asks for nothing the pod would not do anyway. A bad value from the
router is a bug worth seeing, so it gets a 400 rather than a silent re-pick.

Torch-free: the router imports the header name.
"""

from __future__ import annotations

from typing import Mapping

from pdserve.engine.internal_auth import HEADER as INTERNAL_HEADER, header_matches
from pdserve.engine.server.errors import APIError

DP_RANK_HEADER = "X-PDServe-DP-Rank"


def requested_dp_rank(headers: Mapping[str, str], internal_key: bytes | None, data_parallel_size: int) -> int | None:
    """The rank the request must run on, or None to let the pod choose; APIError(400) for a bad value."""
    raw = headers.get(DP_RANK_HEADER)
    if raw is None or not header_matches(headers.get(INTERNAL_HEADER), internal_key):
        return None
    text = raw.strip()
    if not (text.isascii() and text.isdigit() and len(text) <= 6) or int(text) >= data_parallel_size:
        raise APIError(400, f"{DP_RANK_HEADER} must be a data-parallel rank of this server, 0 to "
                            f"{data_parallel_size - 1}; got {raw[:32]!r}.", code="invalid_dp_rank")
    return int(text)
