"""Create-or-patch decisions, pure: what counts as "already matches" and what a patch contains."""

from __future__ import annotations

import copy
import json

from pdserve.operator.apply import LAST_APPLIED, matches, merge_patch, plan
from pdserve.operator.render import render

ISVC = {"apiVersion": "pdserve.io/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": "demo", "namespace": "default", "uid": "u1"},
        "spec": {"model": {"name": "demo", "path": "demo"},
                 "decode": {"replicas": 2, "nodeSelector": {"pool": "gpu"},
                            "resources": {"requests": {"cpu": "1000m", "memory": "1Gi"}}}}}


def deployment(obj: dict, role: str) -> dict:
    return next(m for m in render(obj) if m["kind"] == "Deployment" and m["metadata"]["name"].endswith(role))


def as_stored(manifest: dict) -> dict:
    """What the API server hands back: our fields, its defaults and bookkeeping, quantities canonical."""
    live = copy.deepcopy(manifest)
    live["metadata"].update({"uid": "d1", "resourceVersion": "42", "generation": 3,
                             "annotations": {LAST_APPLIED: json.dumps(manifest),
                                             "deployment.kubernetes.io/revision": "1"}})
    spec = live["spec"]
    spec.update({"progressDeadlineSeconds": 600, "revisionHistoryLimit": 10,
                 "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": "25%", "maxUnavailable": "25%"}}})
    pod = spec["template"]["spec"]
    pod.update({"dnsPolicy": "ClusterFirst", "restartPolicy": "Always", "schedulerName": "default-scheduler"})
    for c in pod["containers"]:
        c.update({"terminationMessagePath": "/dev/termination-log", "terminationMessagePolicy": "File"})
        for port in c["ports"]:
            port.setdefault("protocol", "TCP")
        if "resources" in c:
            c["resources"]["requests"]["cpu"] = "1"  # 1000m comes back as 1
        c["readinessProbe"]["successThreshold"] = 1
    live["status"] = {"replicas": 2, "readyReplicas": 2}
    return live


def test_a_stored_object_with_server_defaults_matches():
    desired = deployment(ISVC, "decode")
    assert plan(desired, as_stored(desired)) is None


def test_replica_change_patches_only_replicas():
    live = as_stored(deployment(ISVC, "decode"))
    changed = copy.deepcopy(ISVC)
    changed["spec"]["decode"]["replicas"] = 5
    desired = deployment(changed, "decode")
    patch = plan(desired, live)
    assert set(patch) == {"spec", "metadata"}
    assert patch["spec"] == {"replicas": 5}
    assert json.loads(patch["metadata"]["annotations"][LAST_APPLIED]) == desired


def test_a_field_no_longer_rendered_is_removed():
    live = as_stored(deployment(ISVC, "decode"))
    without = copy.deepcopy(ISVC)
    del without["spec"]["decode"]["nodeSelector"]
    patch = plan(deployment(without, "decode"), live)
    assert patch["spec"]["template"]["spec"]["nodeSelector"] is None
    # ...but fields the server added, which were never ours, stay.
    assert "dnsPolicy" not in patch["spec"]["template"]["spec"]


def test_lists_are_replaced_whole_when_they_differ():
    live = as_stored(deployment(ISVC, "decode"))
    changed = copy.deepcopy(ISVC)
    changed["spec"]["engine"] = {"maxNumSeqs": 8}
    patch = plan(deployment(changed, "decode"), live)
    containers = patch["spec"]["template"]["spec"]["containers"]
    assert containers == deployment(changed, "decode")["spec"]["template"]["spec"]["containers"]


def test_matches():
    assert matches({"a": 1}, {"a": 1, "b": 2})
    assert not matches({"a": 1}, {"a": "1"})
    assert not matches({"a": True}, {"a": 1})
    assert matches([{"x": 1}], [{"x": 1, "y": 0}])
    assert not matches([{"x": 1}], [{"x": 1}, {"x": 2}])
    assert matches({"limits": {"memory": "1024Mi"}}, {"limits": {"memory": "1Gi"}})
    assert not matches({"limits": {"memory": "1Gi"}}, {"limits": {"memory": "2Gi"}})
    assert not matches({"name": "1Gi"}, {"name": "1024Mi"})  # quantities only where quantities live


def test_merge_patch_is_three_way():
    assert merge_patch({"a": {"b": 1}}, {"a": {"b": 1, "c": 2}}, {"a": {"b": 1, "c": 2}}) == {"a": {"c": None}}
    assert merge_patch({"a": 1}, {"a": 1, "z": 0}, {}) == {}
    assert merge_patch({"a": {"b": 2}}, {}, {}) == {"a": {"b": 2}}
