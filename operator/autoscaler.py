"""Replica autoscaling from the coordinator's load.

`decide` is pure: the spec, the current replicas, the load per pool, what the autoscaler remembers
and the time go in; the replicas to set and the new memory come out. `autoscale_once` is the glue
the kopf timer calls: it reads the coordinator's `GET /stats`, decides, and writes the decision
to the resource's own `spec.<pool>.replicas` (the reconcile then patches that pool's Deployment).

Rules:
- The targets are per engine, and an engine is one data-parallel rank (each rank reports on its
  own: its own queue and KV cache), while replicas are pods of `dataParallelSize` ranks. So a
  pool's recommendation in pods is the larger of ceil(queued requests / targetWaitingPerReplica /
  ranks per pod) and ceil(sum of KV usage / targetKVUsage / ranks per pod) over its live ranks,
  clamped to [min, max]. A pool no engine reports for gets no recommendation (missing data never
  scales anything).
- Up at once; down only after the recommendation stayed below the current size for
  scaleDownDelaySeconds, and then to the highest recommendation seen in that time.
- pdRatio "p:d" couples the pools: decode takes the larger of its own recommendation and what the
  prefill recommendation implies, prefill follows decode by the ratio, each within its bounds.
- The memory, an annotation on the resource, holds the replicas the autoscaler last wrote. Any
  other value in the spec was set by someone else: that value is adopted and the pool (with
  pdRatio, both pools) is left alone for one window (scaleDownDelaySeconds), then decisions start
  again from it. So a manual edit is never reverted in a tight loop.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass, replace
from typing import Any, Mapping

import httpx

from pdserve.operator import crd
from pdserve.operator.apply import Client
from pdserve.operator.kube import Conflict
from pdserve.operator.names import COORDINATOR_HTTP_PORT, Names
from pdserve.operator.spec import Autoscaling, InferenceServiceSpec, InvalidSpec, parse

log = logging.getLogger(__name__)

MEMORY_ANNOTATION = "pdserve.io/autoscaler"
POOLS = ("prefill", "decode")
DEFAULT_STATS_URL = "http://{name}-coordinator.{namespace}.svc:" + str(COORDINATOR_HTTP_PORT) + "/stats"


@dataclass(frozen=True)
class PoolLoad:
    engines: int  # live engines: data-parallel ranks, each counted on its own
    waiting: int
    running: int
    kv_usage: float  # summed over the engines (each in 0..1)


@dataclass(frozen=True)
class PoolMemory:
    replicas: int | None = None  # what the autoscaler last wrote or adopted
    low_since: float | None = None  # when the recommendation first fell below the current size
    low_peak: int | None = None  # the highest recommendation since then
    hold_until: float | None = None  # paused after a manual edit until then

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> PoolMemory:
        return cls(**{k: raw.get(k) for k in ("replicas", "low_since", "low_peak", "hold_until")})

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class Decision:
    replicas: dict[str, int]  # every managed pool's size after this decision
    memory: dict[str, PoolMemory]
    reasons: tuple[str, ...]
    scaled: dict[str, tuple[int, int]]  # pool -> (from, to), for the pools this decision resizes


def parse_stats(payload: Mapping[str, Any]) -> dict[str, PoolLoad]:
    """Load per role from the coordinator's /stats JSON (DESIGN §5); stale engines do not count."""
    loads: dict[str, PoolLoad] = {}
    for engine in payload.get("engines") or []:
        role = engine.get("role")
        if role not in POOLS or engine.get("stale"):
            continue
        before = loads.get(role, PoolLoad(0, 0, 0, 0.0))
        loads[role] = PoolLoad(before.engines + 1, before.waiting + int(engine.get("waiting") or 0),
                               before.running + int(engine.get("running") or 0),
                               before.kv_usage + float(engine.get("kv_usage") or 0.0))
    return loads


def _ceil(value: float) -> int:
    # 0.3 / 0.1 is 2.9999999999999996 in floats; decisions must not hinge on that.
    return math.ceil(round(value, 6))


def _clamp(value: int, autoscaling: Autoscaling | None) -> int:
    if autoscaling is None:
        return max(value, 1)
    return min(max(value, autoscaling.min_replicas), autoscaling.max_replicas)


def recommend(autoscaling: Autoscaling, load: PoolLoad, ranks_per_pod: int = 1) -> int:
    """Pods the load asks for: the engines (ranks) it needs at the per-engine targets, in pods."""
    if ranks_per_pod < 1:
        raise ValueError(f"ranks_per_pod must be at least 1, got {ranks_per_pod}")
    wants = []
    if autoscaling.target_waiting_per_replica:
        wants.append(_ceil(load.waiting / autoscaling.target_waiting_per_replica / ranks_per_pod))
    if autoscaling.target_kv_usage:
        wants.append(_ceil(load.kv_usage / autoscaling.target_kv_usage / ranks_per_pod))
    return _clamp(max(wants, default=0), autoscaling)


def _window(spec: InferenceServiceSpec, pool: str) -> int:
    own = spec.pool(pool).autoscaling
    if own is not None:
        return own.scale_down_delay_seconds
    other = spec.pool("decode" if pool == "prefill" else "prefill").autoscaling
    return other.scale_down_delay_seconds if other is not None else 0


def managed_pools(spec: InferenceServiceSpec) -> list[str]:
    if spec.pd_ratio is not None and spec.autoscaled:
        return list(POOLS)
    return [pool for pool in POOLS if spec.pool(pool).autoscaling is not None]


def decide(spec: InferenceServiceSpec, current: Mapping[str, int], loads: Mapping[str, PoolLoad],
           memory: Mapping[str, PoolMemory], now: float) -> Decision:
    pools = managed_pools(spec)
    mem = {pool: memory.get(pool, PoolMemory()) for pool in pools}
    reasons: list[str] = []

    for pool in pools:
        remembered = mem[pool].replicas
        if remembered is not None and remembered != current[pool]:
            window = _window(spec, pool)
            mem[pool] = PoolMemory(replicas=current[pool], hold_until=now + window)
            reasons.append(f"{pool}: replicas set to {current[pool]} by someone else; not autoscaling it for {window}s")
        elif mem[pool].hold_until is not None and now >= mem[pool].hold_until:
            mem[pool] = replace(mem[pool], hold_until=None)
    held = {pool for pool in pools if mem[pool].hold_until is not None}
    if spec.pd_ratio is not None and held:
        held = set(pools)  # coupled pools move together or not at all

    recommendations = {pool: recommend(spec.pool(pool).autoscaling, loads[pool], spec.pool(pool).data_parallel_size)
                       for pool in pools
                       if pool not in held and spec.pool(pool).autoscaling is not None and pool in loads}
    targets = dict(recommendations)
    ratio = spec.pd_ratio
    if ratio is not None and recommendations:
        decode_wants = []
        if "decode" in recommendations:
            decode_wants.append(recommendations["decode"])
        if "prefill" in recommendations:
            decode_wants.append(ratio.decode_for(recommendations["prefill"]))
        decode = _clamp(max(decode_wants), spec.decode.autoscaling)
        targets = {"decode": decode, "prefill": _clamp(ratio.prefill_for(decode), spec.prefill.autoscaling)}
    for pool in pools:
        bounds = spec.pool(pool).autoscaling
        # Out of bounds (a manual edit, or bounds just changed) and no load data: bounds still hold.
        if pool not in held and pool not in targets and bounds is not None:
            if not bounds.min_replicas <= current[pool] <= bounds.max_replicas:
                targets[pool] = _clamp(current[pool], bounds)

    replicas = {pool: current[pool] for pool in pools}
    for pool, target in targets.items():
        size, state = current[pool], mem[pool]
        bounds = spec.pool(pool).autoscaling
        above_max = bounds is not None and size > bounds.max_replicas
        if target >= size or above_max:
            replicas[pool] = target
            state = replace(state, low_since=None, low_peak=None)
        else:
            if state.low_since is None:
                state = replace(state, low_since=now, low_peak=target)
            else:
                state = replace(state, low_peak=max(state.low_peak or target, target))
            if now - state.low_since >= _window(spec, pool):
                replicas[pool] = state.low_peak
                state = replace(state, low_since=None, low_peak=None)
        mem[pool] = state
        if replicas[pool] != size:
            reasons.append(f"{pool}: {size} -> {replicas[pool]} replicas")
    mem = {pool: replace(state, replicas=replicas[pool]) for pool, state in mem.items()}
    scaled = {pool: (current[pool], n) for pool, n in replicas.items() if n != current[pool]}
    return Decision(replicas, mem, tuple(reasons), scaled)


# --- glue for the kopf timer ----------------------------------------------------------------------

def stats_url(template: str, namespace: str, name: str) -> str:
    return template.format(namespace=namespace, name=name, coordinator=Names(name).service("coordinator"))


def fetch_loads(url: str, timeout: float) -> dict[str, PoolLoad] | None:
    try:
        response = httpx.get(url, timeout=timeout)
        response.raise_for_status()
        return parse_stats(response.json())
    except (httpx.HTTPError, ValueError) as error:
        log.warning("cannot read load from %s: %s", url, error)
        return None


def read_memory(annotations: Mapping[str, str]) -> dict[str, PoolMemory]:
    try:
        raw = json.loads(annotations.get(MEMORY_ANNOTATION) or "{}")
        return {pool: PoolMemory.from_json(raw[pool]) for pool in POOLS if isinstance(raw.get(pool), dict)}
    except (ValueError, TypeError):
        return {}


def write_memory(memory: Mapping[str, PoolMemory]) -> str:
    return json.dumps({pool: state.to_json() for pool, state in sorted(memory.items())}, sort_keys=True)


def autoscale_once(client: Client, namespace: str, name: str, url_template: str, now: float,
                   timeout: float = 2.0, *, allow_host_path: bool = False) -> Decision | None:
    """Read the load, decide, and write the decision; None when there was nothing to decide on."""
    obj = client.get(crd.API_VERSION, crd.KIND, namespace, name)
    if obj is None or obj["metadata"].get("deletionTimestamp"):
        return None
    try:
        isvc = parse(obj, allow_host_path=allow_host_path)
    except InvalidSpec:
        return None  # the reconcile reports it; scaling an unrenderable spec helps nobody
    if not managed_pools(isvc.spec):
        return None
    # Without load data the decision still notices manual edits and keeps the bounds.
    loads = fetch_loads(stats_url(url_template, namespace, name), timeout) or {}
    current = {pool: isvc.spec.pool(pool).replicas for pool in POOLS}
    decision = decide(isvc.spec, current, loads, read_memory(isvc.annotations), now)
    changes = {pool: to for pool, (_, to) in decision.scaled.items()}
    memory = write_memory(decision.memory)
    if not changes and memory == isvc.annotations.get(MEMORY_ANNOTATION):
        return decision
    # One patch for both: the remembered value and the spec can never disagree after a crash.
    patch: dict[str, Any] = {"metadata": {"annotations": {MEMORY_ANNOTATION: memory}}}
    if isvc.resource_version:
        patch["metadata"]["resourceVersion"] = isvc.resource_version  # lose to a concurrent edit
    if changes:
        patch["spec"] = {pool: {"replicas": n} for pool, n in changes.items()}
    try:
        client.patch(crd.API_VERSION, crd.KIND, namespace, name, patch)
    except Conflict:
        log.info("%s/%s changed while deciding; deciding again next time", namespace, name)
        return None
    for reason in decision.reasons:
        log.info("%s/%s autoscaler: %s", namespace, name, reason)
    return decision
