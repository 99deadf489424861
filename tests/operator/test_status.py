"""Phase and conditions from Deployment states, pure."""

from __future__ import annotations

import datetime as dt

import pytest

from pdserve.operator.spec import parse
from pdserve.operator.status import compute_status, invalid_status, status_patch

NOW = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)
LATER = NOW + dt.timedelta(minutes=5)
ISVC = parse({"apiVersion": "pdserve.io/v1alpha1", "kind": "InferenceService",
              "metadata": {"name": "demo", "namespace": "ns", "generation": 4},
              "spec": {"model": {"name": "demo", "path": "demo"}, "decode": {"replicas": 3}}})
DESIRED = {"prefill": 1, "decode": 3, "router": 1, "coordinator": 1}


def deployment(ready: int, pods: int | None = None, updated: int | None = None, generation: int = 2,
               observed: int = 2, conditions: list | None = None) -> dict:
    pods = ready if pods is None else pods
    return {"metadata": {"generation": generation},
            "status": {"observedGeneration": observed, "replicas": pods, "readyReplicas": ready,
                       "updatedReplicas": pods if updated is None else updated, "conditions": conditions or []}}


def all_ready(**overrides) -> dict:
    deployments = {role: deployment(n) for role, n in DESIRED.items()}
    deployments.update(overrides)
    deployments.setdefault("kvstore", None)
    return deployments


def phase(deployments: dict, previous: dict | None = None) -> str:
    return compute_status(ISVC, deployments, previous or {}, NOW)["phase"]


def test_ready():
    status = compute_status(ISVC, all_ready(), {}, NOW)
    assert status["phase"] == "Ready"
    assert status["observedGeneration"] == 4
    assert status["endpoint"] == "http://demo-router.ns.svc:8000/v1"
    assert status["decode"] == {"replicas": 3, "readyReplicas": 3, "desiredReplicas": 3, "ready": "3/3",
                                "selector": "app.kubernetes.io/instance=demo,app.kubernetes.io/name=pdserve,"
                                            "pdserve.io/role=decode"}
    assert "kvstore" not in status
    ready, available = status["conditions"]
    assert ready == {"type": "Ready", "status": "True", "reason": "AllReplicasReady",
                     "message": "every pool has its desired ready replicas",
                     "lastTransitionTime": "2026-01-02T03:04:05Z", "observedGeneration": 4}
    assert (available["status"], available["reason"]) == ("True", "Serving")


@pytest.mark.parametrize(("deployments", "previous_phase", "expected"), [
    ({"prefill": None, "decode": None, "router": None, "coordinator": None}, None, "Pending"),
    (all_ready(decode=None), None, "Pending"),
    ({role: deployment(0, pods=n) for role, n in DESIRED.items()}, None, "Pending"),
    (all_ready(decode=deployment(1, pods=3)), None, "Progressing"),
    # The controller has not seen the latest Deployment spec yet: still rolling out, even if ready.
    (all_ready(decode=deployment(3, generation=3, observed=2)), "Ready", "Progressing"),
    # Old pods still around during a rollout.
    (all_ready(decode=deployment(3, pods=4, updated=3)), "Ready", "Progressing"),
    # Ready before, same size, pods gone unready: lost, not starting.
    (all_ready(decode=deployment(1, pods=3)), "Ready", "Degraded"),
    (all_ready(decode=deployment(1, pods=3)), "Degraded", "Degraded"),
    # Ready before, but scaled since (desired changed): starting, not lost.
    (all_ready(decode=deployment(1, pods=3)), "Ready-scaled", "Progressing"),
    (all_ready(prefill=deployment(0, pods=1, conditions=[
        {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded", "message": "stuck"}])),
     None, "Degraded"),
    (all_ready(router=deployment(0, pods=1, conditions=[
        {"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate", "message": "quota exceeded"}])),
     None, "Degraded"),
])
def test_phases(deployments, previous_phase, expected):
    previous = {}
    if previous_phase == "Ready-scaled":
        previous = {"phase": "Ready", "decode": {"desiredReplicas": 1}}
    elif previous_phase:
        previous = {"phase": previous_phase, **{role: {"desiredReplicas": n} for role, n in DESIRED.items()}}
    assert phase(deployments, previous) == expected


def test_messages_say_what_is_missing():
    status = compute_status(ISVC, all_ready(decode=deployment(1, pods=3), router=None), {}, NOW)
    ready, available = status["conditions"]
    assert ready["message"] == "decode 1/3 ready; router not created yet"
    assert (available["status"], available["reason"]) == ("False", "NoReadyRouter")
    stuck = all_ready(decode=deployment(0, pods=3, conditions=[
        {"type": "ReplicaFailure", "status": "True", "message": "pods \"x\" is forbidden: quota"}]))
    status = compute_status(ISVC, stuck, {}, NOW)
    assert status["conditions"][0]["message"].startswith('decode: pods "x" is forbidden: quota; decode 0/3 ready')
    assert status["conditions"][1]["reason"] == "NoReadyDecode"


def test_transition_time_moves_only_when_the_status_flips():
    first = compute_status(ISVC, all_ready(decode=deployment(1, pods=3)), {}, NOW)
    second = compute_status(ISVC, all_ready(decode=deployment(2, pods=3)), first, LATER)
    assert second["conditions"][0]["lastTransitionTime"] == "2026-01-02T03:04:05Z"  # still False
    assert second["conditions"][0]["message"] == "decode 2/3 ready"
    third = compute_status(ISVC, all_ready(), second, LATER)
    assert third["conditions"][0]["lastTransitionTime"] == "2026-01-02T03:09:05Z"


def test_unchanged_status_needs_no_write():
    status = compute_status(ISVC, all_ready(), {}, NOW)
    assert status_patch(status, compute_status(ISVC, all_ready(), status, LATER)) == {}
    with_store = {**status, "kvstore": {"replicas": 1}}
    assert status_patch(with_store, status) == {"kvstore": None}  # a pool that is gone is removed


def test_invalid_spec_status():
    before = compute_status(ISVC, all_ready(), {}, NOW)
    status = invalid_status(5, "pdRatio only applies while autoscaling", True, before, LATER)
    assert status["phase"] == "Degraded" and status["observedGeneration"] == 5
    ready = status["conditions"][0]
    assert (ready["status"], ready["reason"], ready["message"]) == ("False", "InvalidSpec",
                                                                   "pdRatio only applies while autoscaling")
    assert status["conditions"][1] == before["conditions"][1]  # what is running still serves
    assert invalid_status(1, "bad", False, {}, NOW)["phase"] == "Pending"
    patch = status_patch(before, status, partial=True)
    assert "decode" not in patch and set(patch) == {"phase", "observedGeneration", "conditions"}
