"""One reconciliation of an InferenceService: render, apply, and write status.

Plain functions over an API client, so the kopf handlers stay one-liners and this can be driven
directly. Every write is conditional: when the cluster already matches, a pass only reads.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Mapping

from pdserve.engine.internal_auth import generate_key
from pdserve.operator import crd
from pdserve.operator.apply import Client, Outcome, apply, create_once, plan
from pdserve.operator.kube import ApiError
from pdserve.operator.names import ROLES, Names
from pdserve.operator.render import internal_key_secret, optional_objects, render_service
from pdserve.operator.render_gateway import GATEWAY_KINDS, INFERENCE_POOL_API
from pdserve.operator.spec import InferenceService, InvalidSpec, parse
from pdserve.operator.status import GatewayOutcome, compute_status, invalid_status, status_patch

log = logging.getLogger(__name__)


@dataclass
class Locks:
    """One lock per InferenceService: handlers run in threads, and a reconcile racing a status
    refresh could otherwise write a status computed from Deployments it has just replaced."""

    _locks: dict[tuple[str, str], threading.Lock] = field(default_factory=dict)
    _guard: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, namespace: str, name: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault((namespace, name), threading.Lock())


@dataclass(frozen=True)
class Result:
    outcomes: list[Outcome]
    status_patch: dict[str, Any]
    invalid: str | None = None
    deleted: tuple[str, ...] = ()

    @property
    def changes(self) -> list[str]:
        """What this pass changed in the cluster, besides the status."""
        return [f"{o.action} {o.kind}/{o.name}" for o in self.outcomes if o.action != "unchanged"] + [
            f"deleted {name}" for name in self.deleted]


def _owned_by(obj: Mapping[str, Any], uid: str | None) -> bool:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return uid is None or any(ref.get("uid") == uid for ref in refs)


def live_deployments(client: Client, namespace: str, name: str, uid: str | None) -> dict[str, dict | None]:
    names = Names(name)
    found = {}
    for role in ROLES:
        deployment = client.get("apps/v1", "Deployment", namespace, names.deployment(role))
        found[role] = deployment if deployment is not None and _owned_by(deployment, uid) else None
    return found


def _write_status(client: Client, obj: Mapping[str, Any], patch: Mapping[str, Any]) -> None:
    meta = obj["metadata"]
    try:
        client.patch(crd.API_VERSION, crd.KIND, meta.get("namespace"), meta["name"], {"status": dict(patch)},
                     subresource="status")
    except ApiError as error:
        if error.status != 404:
            raise
        log.info("%s/%s was deleted before its status could be written", meta.get("namespace"), meta["name"])


def _ensure_internal_key(client: Client, isvc: InferenceService, skeleton: Mapping[str, Any]) -> Outcome:
    """The internal key: made here, once. A Secret that exists (ours, or one a person made with
    their own key before creating the resource) keeps its data, or running pods would lose the key
    they share."""
    outcome = create_once(client, skeleton, lambda: internal_key_secret(isvc, generate_key()))
    owner = owner_of(outcome.live)
    if owner is None or isvc.uid is None or owner[2] in (None, isvc.uid):
        return outcome
    # Made for an earlier resource of this name, deleted and created again before the garbage
    # collector came: adopt it (its key unchanged), or the collector deletes it under the new pods.
    meta = skeleton["metadata"]
    live = client.patch("v1", "Secret", isvc.namespace, meta["name"],
                        {"metadata": {"ownerReferences": meta["ownerReferences"]}})
    return Outcome("patched", "Secret", meta["name"], {"metadata": live.get("metadata") or {}})


def _apply_rendered(client: Client, isvc: InferenceService, manifest: Mapping[str, Any]) -> Outcome:
    if manifest["kind"] == "Secret":
        return _ensure_internal_key(client, isvc, manifest)
    return apply(client, manifest)


def reconcile(client: Client, namespace: str, name: str, now: dt.datetime, uid: str | None = None, *,
              allow_host_path: bool = False) -> Result | None:
    """Bring the cluster to what the InferenceService renders, then write its status.

    The resource is read afresh rather than taken from the triggering event: a status written
    since then by a refresh must be the baseline, or an identical status would be written again.
    Returns None when the resource is gone or being deleted (owner references clean up), or when
    `uid` names an older resource than the one now under that name. hostPath volumes make the spec
    invalid unless `allow_host_path` (the operator's --allow-host-path).
    """
    obj = client.get(crd.API_VERSION, crd.KIND, namespace, name)
    if obj is None or obj["metadata"].get("deletionTimestamp"):
        return None
    if uid is not None and obj["metadata"].get("uid") not in (None, uid):
        return None
    meta = obj["metadata"]
    uid = meta.get("uid")
    previous = obj.get("status") or {}
    try:
        isvc = parse(obj, allow_host_path=allow_host_path)
    except InvalidSpec as error:
        # Nothing is applied: a half-rendered service (say, engines without their router) is worse
        # than the previous, consistent one, which keeps running.
        running = any(d is not None for d in live_deployments(client, namespace, name, uid).values())
        status = invalid_status(meta.get("generation"), str(error), running, previous, now)
        patch = status_patch(previous, status, partial=True)
        if patch:
            _write_status(client, obj, patch)
        return Result([], patch, invalid=str(error))

    outcomes, missing = [], []
    for manifest in render_service(isvc):
        try:
            outcomes.append(_apply_rendered(client, isvc, manifest))
        except ApiError as error:
            # 404 on a GIE kind: its CRD is not installed. Everything else is applied and serves
            # through the router meanwhile; the Gateway condition says what is missing.
            if error.status != 404 or manifest["kind"] not in GATEWAY_KINDS:
                raise
            missing.append(f"{manifest['kind']} ({manifest['apiVersion']})")
    deleted = []
    for api_version, kind, stale_name in optional_objects(isvc):
        stale = client.get(api_version, kind, namespace, stale_name)
        if stale is not None and _owned_by(stale, uid):
            client.delete(api_version, kind, namespace, stale_name)
            deleted.append(f"{kind}/{stale_name}")
    names = Names(name)
    deployments = {role: next((o.live for o in outcomes if o.kind == "Deployment" and o.name == names.deployment(role)),
                              None) for role in ROLES}
    patch = _refresh(client, obj, isvc, deployments, now, _gateway_outcome(isvc, outcomes, missing))
    return Result(outcomes, patch, deleted=tuple(deleted))


def _gateway_outcome(isvc: InferenceService, outcomes: list[Outcome], missing: list[str]) -> GatewayOutcome | None:
    if isvc.spec.router.gateway is None:
        return None
    if missing:
        return GatewayOutcome(False, "CRDNotInstalled",
                              f"the cluster does not serve {', '.join(missing)}: install the Gateway API Inference "
                              "Extension CRDs (the gateway provider ships them); the router keeps serving meanwhile")
    applied = [f"{o.kind} {o.name}" for o in outcomes if o.kind in GATEWAY_KINDS]
    return GatewayOutcome(True, "Applied", f"applied {', '.join(applied)} ({INFERENCE_POOL_API})")


def _refresh(client: Client, obj: Mapping[str, Any], isvc: InferenceService,
             deployments: Mapping[str, Mapping[str, Any] | None], now: dt.datetime,
             gateway: GatewayOutcome | None = None) -> dict[str, Any]:
    previous = obj.get("status") or {}
    patch = status_patch(previous, compute_status(isvc, deployments, previous, now, gateway))
    if patch:
        _write_status(client, obj, patch)
    return patch


def owner_of(obj: Mapping[str, Any]) -> tuple[str, str, str] | None:
    """(namespace, name, uid) of the InferenceService controlling `obj`, if any."""
    meta = obj.get("metadata") or {}
    for ref in meta.get("ownerReferences") or []:
        if ref.get("apiVersion") == crd.API_VERSION and ref.get("kind") == crd.KIND and ref.get("controller"):
            return meta.get("namespace"), ref["name"], ref.get("uid")
    return None


def deployment_changed(client: Client, deployment: Mapping[str, Any], deleted: bool,
                       now: dt.datetime, *, allow_host_path: bool = False) -> Result | dict[str, Any] | None:
    """React to a watch event of a Deployment the operator made.

    Usually only readiness changed, and the owner's status is recomputed. When the Deployment was
    deleted or edited by hand away from what its owner renders (say `kubectl scale deployment`),
    the owner is reconciled, which restores it: the InferenceService is the source of truth.
    """
    owner = owner_of(deployment)
    if owner is None:
        return None
    namespace, name, uid = owner
    obj = client.get(crd.API_VERSION, crd.KIND, namespace, name)
    if obj is None or obj["metadata"].get("deletionTimestamp"):
        return None
    if uid is not None and obj["metadata"].get("uid") not in (None, uid):
        return None  # it belonged to an earlier resource of the same name
    try:
        isvc = parse(obj, allow_host_path=allow_host_path)
    except InvalidSpec:
        return None  # the reconcile has reported it; nothing here may change anything
    name_of_deployment = deployment["metadata"]["name"]
    desired = next((m for m in render_service(isvc)
                    if m["kind"] == "Deployment" and m["metadata"]["name"] == name_of_deployment), None)
    if deleted or desired is None or plan(desired, deployment) is not None:
        return reconcile(client, namespace, name, now, uid, allow_host_path=allow_host_path)
    return _refresh(client, obj, isvc, live_deployments(client, namespace, name, isvc.uid), now)
