"""The autoscaler: the pure decision, then the kopf timer against a real HTTP stats server."""

from __future__ import annotations

import http.server
import json
import threading
import time
from typing import Any

import pytest

from pdserve.operator.autoscaler import (MEMORY_ANNOTATION, PoolLoad, PoolMemory, decide, parse_stats, read_memory,
                                         recommend)
from pdserve.operator.spec import parse

ISVC = "pdserve.io/v1alpha1/inferenceservices"


def spec(**fields) -> Any:
    obj = {"apiVersion": "pdserve.io/v1alpha1", "kind": "InferenceService", "metadata": {"name": "s"},
           "spec": {"model": {"name": "m", "path": "demo"}, **fields}}
    return parse(obj).spec


def waiting(total: int, engines: int = 1) -> PoolLoad:
    return PoolLoad(engines=engines, waiting=total, running=0, kv_usage=0.0)


DECODE_ONLY = spec(decode={"replicas": 2, "autoscaling": {"minReplicas": 1, "maxReplicas": 6,
                                                          "targetWaitingPerReplica": 4, "scaleDownDelaySeconds": 60}})
T0 = 1_000_000.0


def test_stats_are_summed_per_pool_without_stale_engines():
    payload = {"updated": T0, "engines": [
        {"id": "p0", "role": "prefill", "address": "10.0.0.1:8000", "waiting": 3, "running": 2, "kv_usage": 0.5,
         "stale": False},
        {"id": "p1", "role": "prefill", "address": "10.0.0.2:8000", "waiting": 5, "running": 1, "kv_usage": 0.25,
         "stale": False},
        {"id": "d0", "role": "decode", "address": "10.0.0.3:8000", "waiting": 0, "running": 9, "kv_usage": 0.9,
         "stale": False},
        {"id": "d1", "role": "decode", "address": "10.0.0.4:8000", "waiting": 50, "running": 0, "kv_usage": 1.0,
         "stale": True},
        {"id": "x", "role": "both", "address": "10.0.0.5:8000", "waiting": 7, "running": 0, "kv_usage": 0.1,
         "stale": False},
    ]}
    assert parse_stats(payload) == {"prefill": PoolLoad(2, 8, 3, 0.75), "decode": PoolLoad(1, 0, 9, 0.9)}
    assert parse_stats({"engines": []}) == {}


def test_recommendation_takes_the_larger_signal_within_bounds():
    both = spec(decode={"autoscaling": {"minReplicas": 2, "maxReplicas": 10, "targetWaitingPerReplica": 4,
                                        "targetKVUsage": 0.5}}).decode.autoscaling
    assert recommend(both, PoolLoad(3, waiting=12, running=0, kv_usage=1.2)) == 3  # waiting: 3, kv: 3
    assert recommend(both, PoolLoad(3, waiting=4, running=0, kv_usage=2.1)) == 5  # kv wins
    assert recommend(both, PoolLoad(3, waiting=0, running=0, kv_usage=0.0)) == 2  # min
    assert recommend(both, PoolLoad(3, waiting=400, running=0, kv_usage=0.0)) == 10  # max
    kv = spec(decode={"autoscaling": {"maxReplicas": 9, "targetKVUsage": 0.1}}).decode.autoscaling
    assert recommend(kv, PoolLoad(3, waiting=0, running=0, kv_usage=0.3)) == 3  # not 4 from 2.9999999999999996


def test_scales_up_at_once():
    decision = decide(DECODE_ONLY, {"prefill": 1, "decode": 2}, {"decode": waiting(17)}, {}, T0)
    assert decision.replicas == {"decode": 5}
    assert decision.scaled == {"decode": (2, 5)}
    assert decision.memory["decode"] == PoolMemory(replicas=5)


def test_scales_down_only_after_the_delay_to_the_window_peak():
    memory: dict = {}
    current = {"prefill": 1, "decode": 5}
    for t, total in ((0, 4), (20, 8), (59, 0)):  # recommendations 1, 2, 1 -- all below 5
        decision = decide(DECODE_ONLY, current, {"decode": waiting(total)}, memory, T0 + t)
        assert decision.replicas == {"decode": 5}, f"scaled down {t}s into the window"
        memory = decision.memory
    assert memory["decode"].low_since == T0 and memory["decode"].low_peak == 2
    decision = decide(DECODE_ONLY, current, {"decode": waiting(0)}, memory, T0 + 60)
    assert decision.replicas == {"decode": 2}  # the window's peak, not the last value
    assert decision.memory["decode"] == PoolMemory(replicas=2)


def test_a_load_spike_restarts_the_scale_down_window():
    memory = decide(DECODE_ONLY, {"prefill": 1, "decode": 5}, {"decode": waiting(0)}, {}, T0).memory
    memory = decide(DECODE_ONLY, {"prefill": 1, "decode": 5}, {"decode": waiting(20)}, memory, T0 + 30).memory
    assert memory["decode"].low_since is None
    decision = decide(DECODE_ONLY, {"prefill": 1, "decode": 5}, {"decode": waiting(0)}, memory, T0 + 61)
    assert decision.replicas == {"decode": 5}


def test_no_data_no_change_but_bounds_hold():
    assert decide(DECODE_ONLY, {"prefill": 1, "decode": 3}, {}, {}, T0).replicas == {"decode": 3}
    assert decide(DECODE_ONLY, {"prefill": 1, "decode": 9}, {}, {}, T0).replicas == {"decode": 6}
    assert decide(DECODE_ONLY, {"prefill": 1, "decode": 0}, {}, {}, T0).replicas == {"decode": 1}


def test_a_manual_edit_wins_for_one_window():
    memory = {"decode": PoolMemory(replicas=5)}
    # Someone set 2 while load wants 5: adopted, and left alone until the window ends.
    decision = decide(DECODE_ONLY, {"prefill": 1, "decode": 2}, {"decode": waiting(20)}, memory, T0)
    assert decision.replicas == {"decode": 2} and not decision.scaled
    assert decision.memory["decode"] == PoolMemory(replicas=2, hold_until=T0 + 60)
    assert "set to 2 by someone else" in decision.reasons[0]
    memory = decision.memory
    for t in (1, 30, 59):
        decision = decide(DECODE_ONLY, {"prefill": 1, "decode": 2}, {"decode": waiting(20)}, memory, T0 + t)
        assert decision.replicas == {"decode": 2}
        memory = decision.memory
    decision = decide(DECODE_ONLY, {"prefill": 1, "decode": 2}, {"decode": waiting(20)}, memory, T0 + 60)
    assert decision.replicas == {"decode": 5}
    assert decision.memory["decode"] == PoolMemory(replicas=5)


RATIO = spec(pdRatio="1:2",
             prefill={"autoscaling": {"minReplicas": 1, "maxReplicas": 3, "targetWaitingPerReplica": 2,
                                      "scaleDownDelaySeconds": 0}},
             decode={"autoscaling": {"minReplicas": 2, "maxReplicas": 8, "targetWaitingPerReplica": 2,
                                     "scaleDownDelaySeconds": 0}})


@pytest.mark.parametrize(("prefill_waiting", "decode_waiting", "expected"), [
    (0, 0, {"prefill": 1, "decode": 2}),  # both at their minimum
    (0, 9, {"prefill": 3, "decode": 5}),  # decode wants 5; prefill follows: ceil(5/2)
    (5, 0, {"prefill": 3, "decode": 6}),  # prefill wants 3: decode must be 6 to keep 1:2
    (40, 0, {"prefill": 3, "decode": 6}),  # prefill's max caps it; decode stays in ratio
    (0, 99, {"prefill": 3, "decode": 8}),  # decode's max; prefill's max caps the ratio
])
def test_pd_ratio_couples_the_pools(prefill_waiting, decode_waiting, expected):
    loads = {"prefill": waiting(prefill_waiting), "decode": waiting(decode_waiting)}
    assert decide(RATIO, {"prefill": 2, "decode": 4}, loads, {}, T0).replicas == expected


def test_with_a_ratio_a_follower_pool_without_autoscaling_is_managed_too():
    follower = spec(pdRatio="1:3", decode={"autoscaling": {"maxReplicas": 9, "targetWaitingPerReplica": 1,
                                                           "scaleDownDelaySeconds": 0}})
    decision = decide(follower, {"prefill": 1, "decode": 1}, {"decode": waiting(7)}, {}, T0)
    assert decision.replicas == {"prefill": 3, "decode": 7}


def test_with_a_ratio_a_manual_edit_pauses_both_pools():
    memory = {"prefill": PoolMemory(replicas=2), "decode": PoolMemory(replicas=4)}
    loads = {"prefill": waiting(0), "decode": waiting(99)}
    decision = decide(RATIO, {"prefill": 2, "decode": 3}, loads, memory, T0)
    assert decision.replicas == {"prefill": 2, "decode": 3}


# --- data-parallel pods: targets are per engine (rank), replicas are pods of ranks ----------------------

DP2 = spec(decode={"replicas": 1, "dataParallelSize": 2,
                   "autoscaling": {"minReplicas": 1, "maxReplicas": 8, "targetKVUsage": 0.8,
                                   "targetWaitingPerReplica": 4, "scaleDownDelaySeconds": 0}})


def dp_stats(*ranks: tuple[int, float]) -> dict:
    """/stats of one DP pod from (waiting, kv_usage) per rank: every rank reports the pod's address,
    under its own engine id."""
    return {"engines": [{"id": f"d-dp{r}", "role": "decode", "address": "10.0.0.1:8000", "dp_rank": r,
                         "waiting": waiting, "running": 0, "kv_usage": kv, "stale": False}
                        for r, (waiting, kv) in enumerate(ranks)]}


def test_a_dp2_pod_at_07_kv_usage_with_target_08_stays_one_pod():
    loads = parse_stats(dp_stats((0, 0.7), (0, 0.7)))
    assert loads == {"decode": PoolLoad(engines=2, waiting=0, running=0, kv_usage=1.4)}
    decision = decide(DP2, {"prefill": 1, "decode": 1}, loads, {}, T0)
    assert decision.replicas == {"decode": 1} and not decision.scaled  # 1.4 / 0.8 / 2 ranks = 0.875 pods


@pytest.mark.parametrize(("ranks", "pods"), [
    (((0, 0.9), (0, 0.95)), 2),  # both ranks above target: 1.85 / 0.8 / 2 = 1.16 pods
    (((10, 0.5), (9, 0.5)), 3),  # 19 queued at 4 per engine: 4.75 engines = 2.4 pods
    (((1, 0.8), (0, 0.8)), 1),  # exactly at target: stays
])
def test_busy_ranks_scale_a_dp_pool_in_pods(ranks, pods):
    decision = decide(DP2, {"prefill": 1, "decode": 1}, parse_stats(dp_stats(*ranks)), {}, T0)
    assert decision.replicas == {"decode": pods}


def test_dp_size_divides_the_engines_needed_into_pods():
    bounds = DP2.decode.autoscaling
    load = PoolLoad(engines=4, waiting=0, running=0, kv_usage=3.6)  # 4.5 engines' worth at 0.8
    assert [recommend(bounds, load, ranks) for ranks in (1, 2, 4)] == [5, 3, 2]


def test_memory_survives_the_annotation():
    from pdserve.operator.autoscaler import write_memory

    memory = {"decode": PoolMemory(replicas=3, low_since=T0, low_peak=2), "prefill": PoolMemory(replicas=1)}
    assert read_memory({MEMORY_ANNOTATION: write_memory(memory)}) == memory
    assert read_memory({MEMORY_ANNOTATION: "not json"}) == {}


# --- the timer against a real HTTP server ------------------------------------------------------------

class StatsServer:
    """A coordinator's `GET /stats` on 127.0.0.1, serving whatever load the test sets."""

    def __init__(self) -> None:
        self.payload: dict = {"updated": time.time(), "engines": []}
        self.hits = 0
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                owner.hits += 1
                if self.path != "/stats":
                    self.send_error(404)
                    return
                body = json.dumps(owner.payload).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/stats"

    def set_load(self, **waiting_by_role: list[int]) -> None:
        engines = [{"id": f"{role}-{i}", "role": role, "address": f"10.0.0.{i}:8000", "waiting": w, "running": 1,
                    "kv_usage": 0.1, "stale": False}
                   for role, values in waiting_by_role.items() for i, w in enumerate(values)]
        self.payload = {"updated": time.time(), "engines": engines}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stats():
    server = StatsServer()
    yield server
    server.close()


def replicas(cluster) -> dict[str, int]:
    spec = cluster.get("InferenceService", "demo")["spec"]
    return {pool: spec[pool]["replicas"] for pool in ("prefill", "decode")}


def deployment_replicas(cluster) -> dict[str, int]:
    return {pool: cluster.get("Deployment", f"demo-{pool}")["spec"]["replicas"] for pool in ("prefill", "decode")}


def autoscaler_spec_writes(cluster) -> list:
    """The autoscaler's attempts (a stale one the server refused with 409 included)."""
    return [r for r in cluster.writes("InferenceService") if r.subresource is None and "spec" in (r.data or {})]


def decode_history(cluster) -> list[int]:
    """spec.decode.replicas through every stored version of the resource, repeats collapsed."""
    values: list[int] = []
    for version in cluster.kmock.objects[ISVC, "default", "demo"].history:
        if version is not None and (n := version["spec"]["decode"]["replicas"]) != (values[-1] if values else None):
            values.append(n)
    return values


async def test_timer_scales_with_load_within_bounds_and_ratio(cluster, make_isvc, stats):
    delay = 1
    isvc = make_isvc({
        "pdRatio": "1:2",
        "prefill": {"replicas": 1, "autoscaling": {"minReplicas": 1, "maxReplicas": 2, "targetWaitingPerReplica": 4,
                                                   "scaleDownDelaySeconds": delay}},
        "decode": {"replicas": 2, "autoscaling": {"minReplicas": 1, "maxReplicas": 4, "targetWaitingPerReplica": 4,
                                                  "scaleDownDelaySeconds": delay}},
    })
    stats.set_load(prefill=[0], decode=[0])
    async with cluster.operator(autoscale_interval=0.1, stats_url_template=stats.url):
        await cluster.create(isvc)
        await cluster.wait_for(lambda: cluster.get("Deployment", "demo-decode"), "the Deployments")
        await cluster.wait_for(lambda: stats.hits >= 2, "the timer to read the stats")
        # Idle, both pools sit at their minimum -- for decode, the 2 that one prefill implies at 1:2.
        assert replicas(cluster) == {"prefill": 1, "decode": 2}

        # Under load: 10 queued on decode wants 3; prefill follows 1:2 (ceil(3/2) = 2).
        stats.set_load(prefill=[0], decode=[6, 4])
        await cluster.wait_for(lambda: replicas(cluster) == {"prefill": 2, "decode": 3}, "scale up")
        await cluster.wait_for(lambda: deployment_replicas(cluster) == {"prefill": 2, "decode": 3},
                               "the Deployments to follow")

        # Far more load than allowed: capped at the maximum, still in ratio.
        stats.set_load(prefill=[0], decode=[100, 100, 100])
        await cluster.wait_for(lambda: replicas(cluster) == {"prefill": 2, "decode": 4}, "the maximum")

        # Load gone: nothing happens before the delay, then down to the minimum.
        stats.set_load(prefill=[0], decode=[0])
        low_since = time.monotonic()
        await cluster.wait_for(lambda: replicas(cluster) == {"prefill": 1, "decode": 2}, "scale down")
        assert time.monotonic() - low_since >= delay
        await cluster.wait_for(lambda: deployment_replicas(cluster) == {"prefill": 1, "decode": 2},
                               "the Deployments to follow down")

        # Every value it ever wrote was within bounds and in ratio.
        for request in autoscaler_spec_writes(cluster):
            written = request.data["spec"]
            assert 1 <= written.get("decode", {}).get("replicas", 1) <= 4
            assert 1 <= written.get("prefill", {}).get("replicas", 1) <= 2


class OperatorClock:
    """Stands in for the `time` module of the operator's handlers: it moves only when told."""

    def __init__(self, now: float) -> None:
        self.now = now

    def time(self) -> float:
        return self.now


async def test_timer_respects_a_manual_edit_for_one_window(cluster, make_isvc, stats, monkeypatch):
    from pdserve.operator import handlers

    # The autoscaler's clock is the test's, so "within the window" holds however slow the machine.
    clock = OperatorClock(time.time())
    monkeypatch.setattr(handlers, "time", clock)
    window = 60
    isvc = make_isvc({"decode": {"replicas": 1, "autoscaling": {
        "minReplicas": 1, "maxReplicas": 6, "targetWaitingPerReplica": 2, "scaleDownDelaySeconds": window}}})
    stats.set_load(decode=[8])  # wants 4
    async with cluster.operator(autoscale_interval=0.1, stats_url_template=stats.url):
        await cluster.create(isvc)
        await cluster.wait_for(lambda: cluster.get("Deployment", "demo-decode"), "the Deployments")
        await cluster.wait_for(lambda: deployment_replicas(cluster)["decode"] == 4, "scale up to 4")
        ticks = cluster.calls("autoscale")

        # A person scales to 2 (`kubectl scale isvc/demo --replicas=2` writes the same field).
        await cluster.patch("InferenceService", "demo", {"spec": {"decode": {"replicas": 2}}})
        await cluster.wait_for(lambda: deployment_replicas(cluster)["decode"] == 2, "the person's 2 applied")
        await cluster.wait_for(lambda: cluster.calls("autoscale") >= ticks + 5, "a few more decisions")
        assert replicas(cluster)["decode"] == 2, "the manual edit was overridden within its window"
        memory = read_memory(cluster.get("InferenceService", "demo")["metadata"]["annotations"])
        assert memory["decode"].replicas == 2 and memory["decode"].hold_until == clock.now + window

        # One second short of the window, the person's value still stands.
        clock.now += window - 1
        ticks = cluster.calls("autoscale")
        await cluster.wait_for(lambda: cluster.calls("autoscale") >= ticks + 5, "decisions late in the window")
        assert replicas(cluster)["decode"] == 2, "the manual edit was overridden within its window"

        # At the window's end the load decides again -- once, not in a loop.
        clock.now += 1
        await cluster.wait_for(lambda: replicas(cluster)["decode"] == 4, "the autoscaler's next decision")
        ticks = cluster.calls("autoscale")
        await cluster.wait_for(lambda: cluster.calls("autoscale") >= ticks + 5, "more decisions")
        # 1 -> 4 (load), 2 (the person), 4 (the next window): no back-and-forth.
        assert decode_history(cluster) == [1, 4, 2, 4]


async def test_autoscaled_resource_can_still_be_deleted(cluster, make_isvc, stats):
    """Timers make kopf put a finalizer on the resource; it must come off on deletion."""
    isvc = make_isvc({"decode": {"autoscaling": {"maxReplicas": 2, "targetKVUsage": 0.8}}})
    async with cluster.operator(autoscale_interval=0.1, stats_url_template=stats.url):
        await cluster.create(isvc)
        await cluster.wait_for(lambda: (cluster.get("InferenceService", "demo") or {}).get("metadata", {})
                               .get("finalizers"), "kopf's finalizer")
        await cluster.delete("InferenceService", "demo")
        await cluster.wait_for(lambda: cluster.get("InferenceService", "demo") is None, "the resource gone")


# --- against the real coordinator --------------------------------------------------------------------

def test_decides_from_a_real_coordinators_stats(tmp_path):
    """`pdserve coordinator` fed with engine reports: its /stats is what the autoscaler reads."""
    from pdserve.operator.autoscaler import fetch_loads
    from support.coordinator import FakeEngine, run_coordinator, wait_for

    live = {("p0", "prefill"): dict(waiting=0, running=1, kv_usage=0.25),
            ("d0", "decode"): dict(waiting=6, running=2, kv_usage=0.5),
            ("d1", "decode"): dict(waiting=4, running=3, kv_usage=0.25)}
    with run_coordinator("--stale-after", "1", tmp_path=tmp_path) as coordinator:
        engines = {key: FakeEngine(coordinator.stats_address, key[0], role=key[1], address=f"10.0.0.{i}:8000")
                   for i, key in enumerate(live)}
        dead = FakeEngine(coordinator.stats_address, "d-dead", role="decode", address="10.0.0.9:8000")
        try:
            dead.report(waiting=100, running=8, kv_usage=1.0)  # and then never again

            def dead_is_stale() -> bool:
                for key, fields in live.items():
                    engines[key].report(**fields)  # the live ones keep reporting
                entry = coordinator.engine("d-dead")
                return bool(entry and entry["stale"])

            wait_for(dead_is_stale, "the silent engine marked stale", interval=0.2)
            for key, fields in live.items():
                engines[key].report(**fields)
            wait_for(lambda: {e["id"] for e in coordinator.stats()["engines"] if not e["stale"]} == {"p0", "d0", "d1"},
                     "the live engines")
            loads = fetch_loads(f"{coordinator.url}/stats", timeout=5)
        finally:
            for engine in [*engines.values(), dead]:
                engine.close()
    # The stale engine's 100 queued requests are not counted.
    assert loads == {"prefill": PoolLoad(1, 0, 1, 0.25), "decode": PoolLoad(2, 10, 5, 0.75)}
    coupled = spec(pdRatio="1:2",
                   prefill={"replicas": 1, "autoscaling": {"minReplicas": 1, "maxReplicas": 2,
                                                           "targetWaitingPerReplica": 4}},
                   decode={"replicas": 2, "autoscaling": {"minReplicas": 1, "maxReplicas": 4,
                                                          "targetWaitingPerReplica": 4}})
    # 10 queued on decode want 3 replicas; prefill follows 1:2 (ceil(3/2) = 2). Counting the stale
    # engine would have asked for the maximum, 4.
    decision = decide(coupled, {"prefill": 1, "decode": 2}, loads, {}, T0)
    assert decision.replicas == {"prefill": 2, "decode": 3}
