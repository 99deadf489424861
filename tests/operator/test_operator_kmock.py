"""The operator (kopf, as an asyncio task) against kmock as the Kubernetes API server."""

from __future__ import annotations

import base64

from pdserve.engine.internal_auth import ENV_KEY_FILE, load_internal_key
from pdserve.operator import crd
from pdserve.operator.apply import LAST_APPLIED, matches
from pdserve.operator.render import render

ENGINE_ROLES = ("prefill", "decode", "router", "coordinator")


def status_of(cluster) -> dict:
    return (cluster.get("InferenceService", "demo") or {}).get("status") or {}


def condition(status: dict, type_: str) -> dict:
    return next(c for c in status.get("conditions", []) if c["type"] == type_)


async def test_create_makes_every_object_with_replicas_and_owner(cluster, make_isvc):
    isvc = make_isvc({"prefill": {"replicas": 2}, "decode": {"replicas": 3}, "kvTransfer": {"connector": "kvstore"}})
    async with cluster.operator():
        await cluster.create(isvc)
        await cluster.wait_for(lambda: status_of(cluster).get("phase"), "a status")

    expected = render(isvc)
    assert {m["kind"] for m in expected} == {"ServiceAccount", "Role", "RoleBinding", "ConfigMap", "Service",
                                             "Deployment", "Secret", "NetworkPolicy"}
    for manifest in expected:
        live = cluster.get(manifest["kind"], manifest["metadata"]["name"])
        assert live is not None, f"{manifest['kind']}/{manifest['metadata']['name']} was not created"
        assert matches(manifest, live)
        assert live["metadata"]["ownerReferences"] == [{
            "apiVersion": crd.API_VERSION, "kind": crd.KIND, "name": "demo", "uid": "uid-demo",
            "controller": True, "blockOwnerDeletion": True}]
    replicas = {name: cluster.get("Deployment", name)["spec"]["replicas"] for name in cluster.names("Deployment")}
    assert replicas == {"demo-prefill": 2, "demo-decode": 3, "demo-router": 1, "demo-coordinator": 1,
                        "demo-kvstore": 1}
    # Every object was created exactly once, and nothing was patched afterwards.
    writes = [(r.method.value, r.resource.plural) for r in cluster.writes() if r.resource.plural != crd.PLURAL]
    assert sorted(writes) == sorted(("POST", KIND_PLURALS[m["kind"]]) for m in expected)

    status = status_of(cluster)
    assert status["phase"] == "Pending"
    assert status["endpoint"] == "http://demo-router.default.svc:8000/v1"
    assert status["decode"] == {"replicas": 0, "readyReplicas": 0, "desiredReplicas": 3, "ready": "0/3",
                                "selector": "app.kubernetes.io/instance=demo,app.kubernetes.io/name=pdserve,"
                                            "pdserve.io/role=decode"}
    assert condition(status, "Ready")["status"] == "False"


KIND_PLURALS = {"ServiceAccount": "serviceaccounts", "Role": "roles", "RoleBinding": "rolebindings",
                "ConfigMap": "configmaps", "Service": "services", "Deployment": "deployments", "Secret": "secrets",
                "NetworkPolicy": "networkpolicies"}


async def test_changing_decode_replicas_patches_only_the_decode_deployment(cluster, make_isvc):
    async with cluster.operator():
        await cluster.create(make_isvc({"decode": {"replicas": 2}}))
        await cluster.wait_for(lambda: status_of(cluster).get("decode"), "the first status")
        await cluster.idle()
        before = len(cluster.requests())
        runs = cluster.calls("apply_spec")

        await cluster.patch("InferenceService", "demo", {"spec": {"decode": {"replicas": 5}}})
        await cluster.settle("apply_spec", runs)
        await cluster.wait_for(lambda: status_of(cluster)["decode"]["desiredReplicas"] == 5, "the new status")

    new = cluster.requests()[before:]
    child_writes = [r for r in new if r.method.value in ("POST", "PATCH", "DELETE") and r.resource.plural != crd.PLURAL]
    assert [(r.method.value, r.resource.plural, r.name) for r in child_writes] == [
        ("PATCH", "deployments", "demo-decode")]
    patch = child_writes[0].data
    assert patch["spec"] == {"replicas": 5}
    assert set(patch["metadata"]["annotations"]) == {LAST_APPLIED}
    assert cluster.get("Deployment", "demo-decode")["spec"]["replicas"] == 5
    assert cluster.get("Deployment", "demo-prefill")["spec"]["replicas"] == 1


async def test_status_follows_the_deployments_readiness(cluster, make_isvc):
    async with cluster.operator():
        await cluster.create(make_isvc({"decode": {"replicas": 3}}))
        await cluster.wait_for(lambda: status_of(cluster).get("phase") == "Pending", "Pending")

        await cluster.set_ready({"router": 1, "coordinator": 1, "prefill": 1, "decode": 1})
        await cluster.wait_for(lambda: condition(status_of(cluster), "Ready")["message"] == "decode 1/3 ready",
                               "only decode short")
        status = status_of(cluster)
        assert status["phase"] == "Progressing"
        assert condition(status, "Available")["status"] == "True"
        assert status["decode"]["ready"] == "1/3"

        await cluster.set_ready({"decode": 3})
        await cluster.wait_for(lambda: status_of(cluster).get("phase") == "Ready", "Ready")
        ready = condition(status_of(cluster), "Ready")
        assert (ready["status"], ready["reason"]) == ("True", "AllReplicasReady")

        # Two decode pods crash: the pool is the size it should be, but only one pod is ready.
        await cluster.set_ready({"decode": 1}, pods=3)
        await cluster.wait_for(lambda: status_of(cluster).get("phase") == "Degraded", "Degraded")
        assert condition(status_of(cluster), "Ready")["message"] == "decode 1/3 ready"

        await cluster.set_ready({"decode": 3})
        await cluster.wait_for(lambda: status_of(cluster).get("phase") == "Ready", "Ready again")

        # A rollout that cannot finish is Degraded with the Deployment's own explanation.
        stuck = [{"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
                  "message": 'ReplicaSet "demo-prefill-x" has timed out progressing.'}]
        await cluster.set_ready({"prefill": 0}, pods=1, conditions=stuck)
        await cluster.wait_for(lambda: status_of(cluster).get("phase") == "Degraded", "Degraded by a stuck rollout")
        assert "timed out progressing" in condition(status_of(cluster), "Ready")["message"]

        # The router goes away: nothing can serve.
        await cluster.set_ready({"router": 0}, pods=1)
        await cluster.wait_for(lambda: condition(status_of(cluster), "Available")["status"] == "False", "unavailable")
        assert condition(status_of(cluster), "Available")["reason"] == "NoReadyRouter"


async def test_repeated_events_write_nothing(cluster, make_isvc):
    all_ready = {"router": 1, "coordinator": 1, "prefill": 1, "decode": 1}
    async with cluster.operator():
        await cluster.create(make_isvc())
        await cluster.wait_for(lambda: status_of(cluster).get("phase"), "the first status")
        await cluster.set_ready(all_ready)
        await cluster.wait_for(lambda: status_of(cluster).get("phase") == "Ready", "Ready")
        await cluster.idle()
        writes = len(cluster.writes())
        follows = cluster.calls("follow_deployment")

        # The same Deployment statuses again: four MODIFIED events that change nothing.
        await cluster.set_ready(all_ready)
        await cluster.settle("follow_deployment", follows, count=4)
        # A label on the resource is not part of what it renders: kopf calls no handler for it.
        await cluster.patch("InferenceService", "demo", {"metadata": {"labels": {"team": "search"}}})
        await cluster.idle()
        assert len(cluster.writes()) == writes

    # A restarted operator sees every object again (resume, plus ADDED for each Deployment).
    runs = cluster.calls("apply_spec")
    follows = cluster.calls("follow_deployment")
    async with cluster.operator():
        await cluster.settle("apply_spec", runs)
        await cluster.settle("follow_deployment", follows, count=4)
    assert len(cluster.writes()) == writes


async def test_invalid_spec_is_reported_and_nothing_is_applied(cluster, make_isvc):
    async with cluster.operator():
        # Valid for the OpenAPI schema, but pdRatio needs autoscaling (a CEL rule kmock cannot run).
        await cluster.create(make_isvc({"pdRatio": "1:2"}))
        await cluster.wait_for(lambda: status_of(cluster).get("conditions"), "a condition")
        ready = condition(status_of(cluster), "Ready")
        assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")
        assert "pdRatio only applies while autoscaling" in ready["message"]
        assert status_of(cluster)["phase"] == "Pending"
        assert [r.resource.plural for r in cluster.writes()] == [crd.PLURAL]  # the status, nothing else

        await cluster.patch("InferenceService", "demo", {"spec": {"pdRatio": None}})
        await cluster.wait_for(lambda: condition(status_of(cluster), "Ready")["reason"] != "InvalidSpec", "the fix")
        await cluster.idle()
        assert cluster.names("Deployment") == {"demo-prefill", "demo-decode", "demo-router", "demo-coordinator"}
        deployment_writes = len(cluster.writes("Deployment"))

        # Broken again while running: the old pods keep serving, nothing of the new spec is applied.
        runs = cluster.calls("apply_spec")
        await cluster.patch("InferenceService", "demo", {"spec": {"prefill": {
            "tensorParallelSize": 2, "resources": {"limits": {"nvidia.com/gpu": 1}}}}})
        await cluster.settle("apply_spec", runs)
        ready = condition(status_of(cluster), "Ready")
        assert ready["reason"] == "InvalidSpec" and "needs 2 per pod" in ready["message"], ready
        assert status_of(cluster)["phase"] == "Degraded"
        assert len(cluster.writes("Deployment")) == deployment_writes
        args = cluster.get("Deployment", "demo-prefill")["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--tensor-parallel-size") + 1] == "1"


async def test_objects_changed_by_hand_are_restored(cluster, make_isvc):
    async with cluster.operator():
        await cluster.create(make_isvc({"decode": {"replicas": 3}}))
        await cluster.wait_for(lambda: status_of(cluster).get("phase"), "the first status")

        await cluster.patch("Deployment", "demo-decode", {"spec": {"replicas": 7}})  # `kubectl scale deployment`
        await cluster.wait_for(lambda: cluster.get("Deployment", "demo-decode")["spec"]["replicas"] == 3,
                               "decode scaled back to the resource's 3")

        await cluster.delete("Deployment", "demo-router")
        await cluster.wait_for(lambda: cluster.get("Deployment", "demo-router"), "the router Deployment back")


async def test_deleting_the_resource_leaves_cleanup_to_owner_references(cluster, make_isvc):
    async with cluster.operator():
        await cluster.create(make_isvc())
        await cluster.wait_for(lambda: status_of(cluster).get("phase"), "the first status")
        assert "finalizers" not in cluster.get("InferenceService", "demo")["metadata"]  # nothing blocks deletion
        await cluster.idle()
        writes = len(cluster.writes())
        follows = cluster.calls("follow_deployment")

        await cluster.delete("InferenceService", "demo")
        assert cluster.get("InferenceService", "demo") is None
        # Kubernetes' garbage collector would now delete the owned objects; kmock has none, so play it.
        for name in sorted(cluster.names("Deployment")):
            await cluster.delete("Deployment", name)
        await cluster.settle("follow_deployment", follows, count=4)

    assert cluster.names("Deployment") == set()  # nothing was put back for a deleted owner
    assert len(cluster.writes()) == writes


async def test_every_request_is_allowed_by_the_chart_rbac(cluster, make_isvc, chart_rbac):
    """Run a busy scenario, then check each API call the operator made against the chart's rules."""
    async with cluster.operator():
        await cluster.create(make_isvc({"kvTransfer": {"connector": "kvstore"}}))
        await cluster.wait_for(lambda: status_of(cluster).get("phase"), "the first status")
        await cluster.set_ready({"router": 1, "decode": 1})
        await cluster.patch("InferenceService", "demo", {"spec": {"kvTransfer": {"connector": "p2p"},
                                                                  "decode": {"replicas": 2}}})
        await cluster.wait_for(lambda: cluster.get("Deployment", "demo-kvstore") is None, "the KV store removed")
        await cluster.delete("Deployment", "demo-router")
        await cluster.wait_for(lambda: cluster.get("Deployment", "demo-router"), "the router restored")

    verbs = {"GET": "get", "POST": "create", "PATCH": "patch", "DELETE": "delete", "PUT": "update"}
    seen = set()
    for request in cluster.kmock:
        if request.resource is None or request.resource.plural is None:
            continue  # API discovery: every authenticated user may read it
        if request.headers.get("User-Agent", "").startswith("kmock"):
            continue  # the test's own calls
        if request.action.name == "WATCH":
            verb = "watch"
        elif request.action.name == "LIST":
            verb = "list"
        else:
            verb = verbs[request.method.value]
        resource = request.resource.plural + (f"/{request.subresource}" if request.subresource else "")
        seen.add((request.resource.group, resource, verb))
    assert {("apps", "deployments", "delete"), ("pdserve.io", "inferenceservices/status", "patch"),
            ("apps", "deployments", "watch")} <= seen
    missing = {needed for needed in seen if not chart_rbac(*needed)}
    assert not missing, f"the chart's ClusterRole does not allow: {sorted(missing)}"


def internal_key(cluster) -> bytes:
    return base64.b64decode(cluster.get("Secret", "demo-internal-key")["data"]["key"])


async def test_the_internal_key_is_made_once_and_kept(cluster, make_isvc, tmp_path):
    async with cluster.operator():
        await cluster.create(make_isvc())
        await cluster.wait_for(lambda: status_of(cluster).get("phase"), "the first status")
        await cluster.idle()
        secret = cluster.get("Secret", "demo-internal-key")
        assert secret["type"] == "Opaque" and secret["metadata"]["ownerReferences"] == [{
            "apiVersion": crd.API_VERSION, "kind": crd.KIND, "name": "demo", "uid": "uid-demo",
            "controller": True, "blockOwnerDeletion": True}]
        key = internal_key(cluster)
        # What the pods get is a key the pdserve processes accept.
        (tmp_path / "key").write_bytes(key)
        assert load_internal_key({ENV_KEY_FILE: str(tmp_path / "key")}) == key.strip()

        # Reconciles of a changed spec, and of a hand-deleted Deployment, leave the key alone.
        runs = cluster.calls("apply_spec")
        await cluster.patch("InferenceService", "demo", {"spec": {"decode": {"replicas": 2}}})
        await cluster.settle("apply_spec", runs)
        await cluster.delete("Deployment", "demo-router")
        await cluster.wait_for(lambda: cluster.get("Deployment", "demo-router"), "the router restored")
        await cluster.idle()

    runs = cluster.calls("apply_spec")
    async with cluster.operator():  # a restarted operator resumes the resource
        await cluster.settle("apply_spec", runs)
    assert internal_key(cluster) == key
    assert [r.method.value for r in cluster.writes("Secret")] == ["POST"]


async def test_a_secret_made_beforehand_is_used_as_it_is(cluster, make_isvc):
    """Someone may bring their own key: a Secret of that name that exists is never written."""
    own = base64.b64encode(b"their-own-key-of-enough-bytes").decode()
    await cluster.create({"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                          "metadata": {"name": "demo-internal-key", "namespace": "default", "uid": "uid-secret"},
                          "data": {"key": own}})
    async with cluster.operator():
        await cluster.create(make_isvc())
        await cluster.wait_for(lambda: status_of(cluster).get("phase"), "the first status")
        await cluster.idle()
    assert cluster.get("Secret", "demo-internal-key")["data"] == {"key": own}
    assert not cluster.writes("Secret")
    assert cluster.names("Deployment") == {"demo-prefill", "demo-decode", "demo-router", "demo-coordinator"}


async def test_host_paths_are_refused_unless_the_operator_allows_them(cluster, make_isvc):
    host = {"model": {"name": "demo", "hostPath": "/mnt/models"}}
    async with cluster.operator():
        await cluster.create(make_isvc(host))
        await cluster.wait_for(lambda: status_of(cluster).get("conditions"), "a condition")
        ready = condition(status_of(cluster), "Ready")
        assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")
        assert "spec.model.hostPath" in ready["message"] and "--allow-host-path" in ready["message"]
        await cluster.wait_for(lambda: any(r.resource.plural == "events" and "hostPath" in str(r.data)
                                           for r in cluster.requests("POST")), "a warning event")
        await cluster.idle()
    assert [r.resource.plural for r in cluster.writes()] == [crd.PLURAL]  # the status, nothing else

    runs = cluster.calls("apply_spec")
    async with cluster.operator(allow_host_path=True):
        await cluster.settle("apply_spec", runs)
        await cluster.wait_for(lambda: condition(status_of(cluster), "Ready")["reason"] != "InvalidSpec",
                               "the refusal lifted")
    volumes = cluster.get("Deployment", "demo-prefill")["spec"]["template"]["spec"]["volumes"]
    assert {"name": "model", "hostPath": {"path": "/mnt/models", "type": "Directory"}} in volumes


async def test_the_key_of_an_earlier_resource_of_the_same_name_is_adopted(cluster, make_isvc):
    """Deleted and created again before the garbage collector came: the Secret still points to the
    old owner and would be collected under the new pods. It is adopted, its key unchanged."""
    old_key = base64.b64encode(b"the-key-of-the-earlier-resource").decode()
    await cluster.create({"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "data": {"key": old_key},
                          "metadata": {"name": "demo-internal-key", "namespace": "default", "uid": "uid-secret",
                                       "ownerReferences": [{"apiVersion": crd.API_VERSION, "kind": crd.KIND,
                                                            "name": "demo", "uid": "uid-earlier",
                                                            "controller": True, "blockOwnerDeletion": True}]}})
    async with cluster.operator():
        await cluster.create(make_isvc())
        await cluster.wait_for(lambda: status_of(cluster).get("phase"), "the first status")
        await cluster.idle()
    secret = cluster.get("Secret", "demo-internal-key")
    assert secret["data"] == {"key": old_key}
    assert [ref["uid"] for ref in secret["metadata"]["ownerReferences"]] == ["uid-demo"]
    assert [r.method.value for r in cluster.writes("Secret")] == ["PATCH"]
    assert set(cluster.writes("Secret")[0].data["metadata"]) == {"ownerReferences"}


# Bounds for the gateway test, which reconciles four times; a loaded 2-core machine is slow, not wrong.
SLOW = 60.0


async def test_the_gateway_objects_follow_the_spec(cluster, make_isvc, chart_rbac):
    """spec.router.gateway on a cluster without the GIE CRDs, then with them, then turned off."""
    gateway = {"replicas": 1, "port": 8000, "gateway": {"httpRoute": {"gatewayName": "inference-gateway"}}}
    isvc = make_isvc({"router": gateway})
    cluster.without_gie_crds()
    async with cluster.operator():
        await cluster.create(isvc)
        await cluster.wait_for(lambda: any(c["type"] == "Gateway" for c in status_of(cluster).get("conditions", [])),
                               "the Gateway condition", timeout=SLOW)
        missing = condition(status_of(cluster), "Gateway")
        assert (missing["status"], missing["reason"]) == ("False", "CRDNotInstalled"), missing
        assert "InferencePool" in missing["message"]
        # Everything else is in place: the router serves meanwhile, and the picker is ready for the pool.
        assert cluster.names("Deployment") == {"demo-prefill", "demo-decode", "demo-router", "demo-coordinator",
                                               "demo-epp"}
        assert cluster.get("Service", "demo-epp") and cluster.get("NetworkPolicy", "demo-epp")

        cluster.install_gie_crds()
        runs = cluster.calls("apply_spec")
        await cluster.patch("InferenceService", "demo", {"spec": {"decode": {"replicas": 2}}})
        await cluster.settle("apply_spec", runs, timeout=SLOW)
        await cluster.wait_for(lambda: condition(status_of(cluster), "Gateway")["status"] == "True", "applied",
                               timeout=SLOW)
        expected = {m["kind"]: m for m in render(cluster.get("InferenceService", "demo"))
                    if m["kind"] in ("InferencePool", "HTTPRoute")}
        for kind, manifest in expected.items():
            live = cluster.get(kind, manifest["metadata"]["name"])
            assert live is not None and matches(manifest, live), kind
            assert live["metadata"]["ownerReferences"][0]["uid"] == "uid-demo"
        assert condition(status_of(cluster), "Gateway")["message"] == (
            "applied InferencePool demo-pool, HTTPRoute demo-route (inference.networking.k8s.io/v1)")
        assert status_of(cluster)["epp"]["desiredReplicas"] == 1

        # The route dropped, then the gateway: their objects go (kmock has no garbage collector to do it).
        runs = cluster.calls("apply_spec")
        await cluster.patch("InferenceService", "demo", {"spec": {"router": {"gateway": {"httpRoute": None}}}})
        await cluster.settle("apply_spec", runs, timeout=SLOW)
        await cluster.wait_for(lambda: cluster.get("HTTPRoute", "demo-route") is None, "the route deleted",
                               timeout=SLOW)
        assert cluster.get("InferencePool", "demo-pool") is not None
        runs = cluster.calls("apply_spec")
        await cluster.patch("InferenceService", "demo", {"spec": {"router": {"gateway": {"enabled": False}}}})
        await cluster.settle("apply_spec", runs, timeout=SLOW)
        await cluster.wait_for(lambda: cluster.get("InferencePool", "demo-pool") is None, "the pool deleted",
                               timeout=SLOW)
        assert "demo-epp" not in cluster.names("Deployment")
        assert all(cluster.get(kind, "demo-epp") is None
                   for kind in ("Service", "ServiceAccount", "Role", "RoleBinding", "NetworkPolicy"))
        # The status is written after the deletions, in the same pass.
        await cluster.wait_for(lambda: not any(c["type"] == "Gateway" for c in status_of(cluster)["conditions"]),
                               "the Gateway condition gone", timeout=SLOW)

    verbs = {"GET": "get", "POST": "create", "PATCH": "patch", "DELETE": "delete"}
    for request in cluster.requests(kind="InferencePool") + cluster.requests(kind="HTTPRoute"):
        if request.headers.get("User-Agent", "").startswith("python-httpx"):
            verb = verbs[request.method.value]
            assert chart_rbac(request.resource.group, request.resource.plural, verb), (verb, request.resource)
