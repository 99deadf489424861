"""Data-parallel ranks as endpoints of their own in the router (issue 18, part 7), without I/O:
the feed keeps one entry per (address, rank), a pool offers a DP pod rank by rank with the header
that pins a request there, and health stays per pod."""

from __future__ import annotations

from collections import Counter

import pytest

from pdserve.engine.core.kv_cache_utils import hash_block_tokens
from pdserve.engine.internal_auth import HEADER as INTERNAL_HEADER
from pdserve.engine.server.dp_rank import DP_RANK_HEADER, requested_dp_rank
from pdserve.engine.server.errors import APIError
from pdserve.router.balancer import Policy
from pdserve.router.endpoints import Health, Pools, RankEndpoint
from pdserve.router.feed import FeedState
from pdserve.router.metrics import RouterMetrics
from pdserve.router.pd import FlowSettings, PDFlow, RoutedRequest

POD = "http://10.0.0.1:8000"  # a DP=2 pod
SINGLE = "http://10.0.0.2:8000"  # an engine without data parallelism


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def entry(address: str, rank: int, waiting: int, running: int, step: int = 1, engine_id: str | None = None,
          stale: bool = False) -> dict:
    return {"id": engine_id or f"{address}-dp{rank}", "role": "decode", "address": address, "dp_rank": rank,
            "waiting": waiting, "running": running, "kv_usage": 0.1, "step": step, "wave": 0, "block_size": 16,
            "stale": stale}


def flow(policy: Policy = Policy.LEAST_LOADED, urls=(POD, SINGLE)) -> tuple[PDFlow, FeedState]:
    feed = FeedState(clock=Clock())
    pools = Pools(policy)
    pools.decode.replace(urls)
    return PDFlow(pools, Health(), None, RouterMetrics(), FlowSettings(), feed), feed  # type: ignore[arg-type]


def picks(f: PDFlow, count: int, request: RoutedRequest | None = None) -> list[tuple[str, str | None]]:
    """(url, rank header) of `count` picks, each leg left open as a running request would be."""
    chosen = []
    for _ in range(count):
        endpoint = f.pick(f.pools.decode, request)
        assert endpoint is not None
        endpoint.in_flight += 1
        chosen.append((endpoint.url, endpoint.extra_headers.get(DP_RANK_HEADER)))
    return chosen


# -- the feed --------------------------------------------------------------------------------------

def test_feed_keeps_every_rank_of_a_pod_apart():
    feed = FeedState(clock=Clock())
    # The pod: ranks (waiting 6, running 8) and (0, 0) share one address.
    feed.apply({"engines": [entry("10.0.0.1:8000", 0, 6, 8), entry("10.0.0.1:8000", 1, 0, 0),
                            entry("10.0.0.2:8000", 0, 1, 2)]})
    busy, idle = feed.report("10.0.0.1:8000", 0), feed.report("10.0.0.1:8000", 1)
    assert (busy.load.waiting, busy.load.running, busy.engine_id, busy.dp_rank) == (6, 8, "10.0.0.1:8000-dp0", 0)
    assert (idle.load.waiting, idle.load.running, idle.engine_id, idle.dp_rank) == (0, 0, "10.0.0.1:8000-dp1", 1)
    assert feed.ranks("10.0.0.1:8000") == (0, 1) and feed.ranks("10.0.0.2:8000") == (0,)
    # Without a rank, an address means rank 0, as for an engine without data parallelism.
    assert feed.load("10.0.0.2:8000").running == 2 and feed.load("10.0.0.1:8000").waiting == 6
    assert feed.report("10.0.0.1:8000", 2) is None and feed.ranks("10.0.0.9:1") == ()


def test_feed_report_counters_move_per_rank_and_a_gone_rank_takes_its_blocks():
    feed = FeedState(clock=Clock())
    hashes = hash_block_tokens(list(range(32)), 16)
    feed.apply({"engines": [entry("h:1", 0, 0, 1, step=5), entry("h:1", 1, 0, 1, step=5)],
                "block_events": [{"id": "h:1-dp1", "stored": hashes, "removed": [], "cleared": False}]})
    first = [feed.load("h:1", r).report for r in (0, 1)]
    feed.apply({"engines": [entry("h:1", 0, 0, 1, step=5), entry("h:1", 1, 0, 2, step=6)]})
    assert [feed.load("h:1", r).report for r in (0, 1)] == [first[0], first[1] + 1]
    assert feed.blocks.matches("h:1-dp1", hashes) == 2
    feed.apply({"engines": [entry("h:1", 0, 0, 1, step=5)]})
    assert feed.ranks("h:1") == (0,) and feed.blocks.matches("h:1-dp1", hashes) == 0


def test_a_silent_feed_lists_no_ranks():
    clock = Clock()
    feed = FeedState(clock=clock, timeout=3.0)
    feed.apply({"engines": [entry("h:1", 0, 0, 0), entry("h:1", 1, 0, 0)]})
    clock.now += 3.1
    assert feed.ranks("h:1") == () and feed.report("h:1", 1) is None


# -- picks -----------------------------------------------------------------------------------------

def test_the_idle_rank_of_a_pod_with_a_busy_rank_gets_the_new_work():
    f, feed = flow()
    # Pod ranks (6, 8) -> 32 and (0, 0) -> 0; the single engine (2, 0) -> 8.
    feed.apply({"engines": [entry("10.0.0.1:8000", 0, 6, 8), entry("10.0.0.1:8000", 1, 0, 0),
                            entry("10.0.0.2:8000", 0, 2, 0)]})
    chosen = picks(f, 6)
    assert chosen[:2] == [(POD, "1"), (POD, "1")]  # scores 0, then 4 after the local bump
    assert (POD, "0") not in chosen, chosen  # 32 is never the least loaded within these picks
    assert Counter(chosen) == Counter({(POD, "1"): 4, (SINGLE, None): 2}), chosen


def test_a_pod_without_data_parallelism_is_one_endpoint_with_no_rank_header():
    f, feed = flow(urls=(SINGLE,))
    feed.apply({"engines": [entry("10.0.0.2:8000", 0, 0, 0)]})
    endpoint = f.pick(f.pools.decode, None)
    assert endpoint is f.pools.decode.endpoints[SINGLE] and DP_RANK_HEADER not in endpoint.extra_headers


def test_without_a_feed_a_pod_is_one_endpoint_again():
    clock = Clock()
    feed = FeedState(clock=clock, timeout=3.0)
    pools = Pools(Policy.LEAST_LOADED)
    pools.decode.replace([POD])
    f = PDFlow(pools, Health(), None, RouterMetrics(), FlowSettings(), feed)  # type: ignore[arg-type]
    feed.apply({"engines": [entry("10.0.0.1:8000", 0, 0, 0), entry("10.0.0.1:8000", 1, 0, 0)]})
    assert isinstance(f.pick(pools.decode, None), RankEndpoint)
    clock.now += 10  # the coordinator went silent: the pod balances its own ranks
    assert f.pick(pools.decode, None) is pools.decode.endpoints[POD]


def test_in_flight_counts_are_per_rank_and_add_up_on_the_pod():
    f, feed = flow(urls=(POD,))
    feed.apply({"engines": [entry("10.0.0.1:8000", 0, 0, 0), entry("10.0.0.1:8000", 1, 0, 0)]})
    pool = f.pools.decode
    rank0, rank1 = pool.rank_endpoint(pool.endpoints[POD], 0), pool.rank_endpoint(pool.endpoints[POD], 1)
    rank0.in_flight += 2
    rank1.in_flight += 1
    rank0.in_flight -= 1
    assert (rank0.in_flight, rank1.in_flight, pool.endpoints[POD].in_flight) == (1, 1, 2)
    # The same objects come back on every pick, so the counts persist between picks.
    offered = pool.candidates((), feed.ranks)
    assert len(offered) == 2 and offered[0] is rank0 and offered[1] is rank1


def test_health_is_per_pod_a_refused_rank_ejects_the_pod_and_readmission_brings_back_every_rank():
    f, feed = flow()
    feed.apply({"engines": [entry("10.0.0.1:8000", 0, 0, 0), entry("10.0.0.1:8000", 1, 0, 0),
                            entry("10.0.0.2:8000", 0, 5, 5)]})
    pool = f.pools.decode
    rank1 = pool.rank_endpoint(pool.endpoints[POD], 1)
    f.health.set(rank1, False, "connection refused")  # what a failed leg to that rank does
    assert not pool.endpoints[POD].healthy and pool.endpoints[POD].last_error == "connection refused"
    assert [(e.url, e.extra_headers) for e in pool.candidates((), feed.ranks)] == [(SINGLE, {})]
    f.health.set(pool.endpoints[POD], True)  # the health checker, which probes pods
    assert {e.extra_headers.get(DP_RANK_HEADER) for e in pool.candidates((), feed.ranks)} == {"0", "1", None}
    assert [e.url for e in pool.candidates((POD,), feed.ranks)] == [SINGLE]  # excluding a pod skips its ranks


def test_prefix_aware_sends_a_prefix_to_the_rank_that_holds_its_blocks():
    f, feed = flow(Policy.PREFIX_AWARE, urls=(POD,))
    tokens = list(range(64))
    feed.apply({"engines": [entry("10.0.0.1:8000", 0, 0, 1), entry("10.0.0.1:8000", 1, 0, 1)],
                "block_events": [{"id": "10.0.0.1:8000-dp1", "stored": hash_block_tokens(tokens, 16),
                                  "removed": [], "cleared": False}]})
    request = RoutedRequest("completions", {}, {}, token_ids=tokens)
    assert [rank for _, rank in picks(f, 2, request)] == ["1", "1"]
    other = RoutedRequest("completions", {}, {}, token_ids=list(range(100, 164)))
    # Without cached blocks the (now busier) rank holding them is not preferred.
    assert picks(f, 1, other) == [(POD, "0")]


def test_a_removed_pod_forgets_its_ranks():
    f, feed = flow()
    feed.apply({"engines": [entry("10.0.0.1:8000", 0, 0, 0), entry("10.0.0.1:8000", 1, 0, 0)]})
    picks(f, 2)
    f.pools.decode.replace([SINGLE])
    assert POD not in f.pools.decode.ranks
    assert [e.url for e in f.pools.decode.candidates((), feed.ranks)] == [SINGLE]


# -- the header, as the engine reads it -----------------------------------------------------------

KEY = b"k" * 32


@pytest.mark.parametrize("headers, expected", [
    ({}, None),
    ({DP_RANK_HEADER: "1", INTERNAL_HEADER: KEY.decode()}, 1),
    ({DP_RANK_HEADER: " 0 ", INTERNAL_HEADER: KEY.decode()}, 0),
    ({DP_RANK_HEADER: "1"}, None),  # not from the router: ignored, the pod picks
    ({DP_RANK_HEADER: "banana", INTERNAL_HEADER: "wrong-key"}, None),
])
def test_the_rank_header_counts_only_with_the_internal_key(headers, expected):
    assert requested_dp_rank(headers, KEY, 2) == expected


@pytest.mark.parametrize("value", ["2", "-1", "1.0", "", "x", "\u0661", "9" * 5000])
def test_a_bad_rank_from_the_router_is_a_400(value):
    with pytest.raises(APIError) as caught:
        requested_dp_rank({DP_RANK_HEADER: value, INTERNAL_HEADER: KEY.decode()}, KEY, 2)
    assert caught.value.status == 400 and caught.value.code == "invalid_dp_rank"


def test_without_an_internal_key_configured_the_header_is_ignored():
    assert requested_dp_rank({DP_RANK_HEADER: "1", INTERNAL_HEADER: ""}, None, 2) is None
