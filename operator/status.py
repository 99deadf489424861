"""Pure status computation: the live Deployments of an InferenceService in, its status out.

Phases:
  Pending      nothing created yet, or no pod of any pool is ready yet;
  Progressing  some pools are still starting, scaling or rolling out;
  Ready        every pool has its desired number of ready, up-to-date pods;
  Degraded     a Deployment reports a failed rollout, or a pool lost ready pods after the service
               was Ready without anyone changing its size (crashes, evictions, lost nodes).
Telling "lost pods" from "still starting" needs the previous phase and sizes, so they are inputs.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any, Mapping

from pdserve.operator.names import Names
from pdserve.operator.spec import InferenceService

PHASES = ("Pending", "Progressing", "Ready", "Degraded")


@dataclass(frozen=True)
class DeploymentState:
    """What status needs from one live Deployment."""

    replicas: int
    ready: int
    updated: int
    observed: bool  # the controller has seen the Deployment's latest generation
    failure: str | None

    @classmethod
    def from_live(cls, deployment: Mapping[str, Any]) -> DeploymentState:
        status = deployment.get("status") or {}
        generation = (deployment.get("metadata") or {}).get("generation")
        observed_generation = status.get("observedGeneration")
        observed = generation is None or (observed_generation is not None and observed_generation >= generation)
        failure = None
        for condition in status.get("conditions") or []:
            stuck = condition.get("type") == "Progressing" and condition.get("reason") == "ProgressDeadlineExceeded"
            broken = condition.get("type") == "ReplicaFailure" and condition.get("status") == "True"
            if stuck or broken:
                failure = condition.get("message") or condition.get("reason") or condition["type"]
        return cls(replicas=status.get("replicas") or 0, ready=status.get("readyReplicas") or 0,
                   updated=status.get("updatedReplicas") or 0, observed=observed, failure=failure)

    def rolled_out(self, desired: int) -> bool:
        return self.observed and self.updated >= desired and self.replicas <= desired

    def complete(self, desired: int) -> bool:
        return self.rolled_out(desired) and self.ready >= desired


def desired_replicas(isvc: InferenceService) -> dict[str, int]:
    """Pods each role should run, in status order."""
    spec = isvc.spec
    desired = {"prefill": spec.prefill.replicas, "decode": spec.decode.replicas, "router": spec.router.replicas,
               "coordinator": 1}
    if spec.kv_transfer.connector == "kvstore":
        desired["kvstore"] = 1
    if spec.router.gateway is not None:
        desired["epp"] = spec.router.gateway.endpoint_picker.replicas
    return desired


def timestamp(now: dt.datetime) -> str:
    return now.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _condition(type_: str, ok: bool, reason: str, message: str, generation: int | None,
               previous: Mapping[str, Any], now: dt.datetime) -> dict[str, Any]:
    status = "True" if ok else "False"
    before = next((c for c in previous.get("conditions") or [] if c.get("type") == type_), None)
    # The transition time moves only when the status flips, not on every message change.
    since = before.get("lastTransitionTime") if before and before.get("status") == status else None
    condition = {"type": type_, "status": status, "reason": reason, "message": message,
                 "lastTransitionTime": since or timestamp(now)}
    if generation is not None:
        condition["observedGeneration"] = generation
    return condition


def _phase(desired: Mapping[str, int], states: Mapping[str, DeploymentState | None],
           previous: Mapping[str, Any]) -> str:
    if any(states.get(role) is None for role in desired):
        return "Pending"
    live = {role: states[role] for role in desired}
    if all(state.complete(desired[role]) for role, state in live.items()):
        return "Ready"
    if any(state.failure for state in live.values()):
        return "Degraded"
    if previous.get("phase") in ("Ready", "Degraded"):
        for role, state in live.items():
            unchanged = (previous.get(role) or {}).get("desiredReplicas") == desired[role]
            if unchanged and state.rolled_out(desired[role]) and state.ready < desired[role]:
                return "Degraded"
    if not any(state.ready for state in live.values()):
        return "Pending"
    return "Progressing"


def compute_status(isvc: InferenceService, deployments: Mapping[str, Mapping[str, Any] | None],
                   previous: Mapping[str, Any], now: dt.datetime,
                   gateway: GatewayOutcome | None = None) -> dict[str, Any]:
    """The full status of a valid InferenceService from its live Deployments (by role; None = absent).

    `gateway`: how applying the gateway objects went in this pass; None when nothing was applied
    (a status refresh), which keeps the previous Gateway condition.
    """
    names = Names(isvc.name)
    desired = desired_replicas(isvc)
    states = {role: DeploymentState.from_live(d) if d is not None else None for role, d in deployments.items()}
    phase = _phase(desired, states, previous)

    status: dict[str, Any] = {"phase": phase}
    if isvc.generation is not None:
        status["observedGeneration"] = isvc.generation
    status["endpoint"] = names.endpoint(isvc.namespace, isvc.spec.router.port)
    lagging, failures = [], []
    for role, want in desired.items():
        state = states.get(role)
        replicas, ready = (state.replicas, state.ready) if state else (0, 0)
        status[role] = {"replicas": replicas, "readyReplicas": ready, "desiredReplicas": want,
                        "ready": f"{ready}/{want}", "selector": names.selector_string(role)}
        if state is None:
            lagging.append(f"{role} not created yet")
        elif not state.complete(want):
            lagging.append(f"{role} {ready}/{want} ready")
        if state is not None and state.failure:
            failures.append(f"{role}: {state.failure}")

    if phase == "Ready":
        ready_message, ready_reason = "every pool has its desired ready replicas", "AllReplicasReady"
    else:
        ready_message, ready_reason = "; ".join(failures + lagging), phase
    ready_of = {role: status[role]["readyReplicas"] for role in desired}
    through_gateway = bool(ready_of.get("epp"))
    if not ready_of["router"] and not through_gateway:
        available = (False, "NoReadyRouter", "no router pod is ready")
    elif not ready_of["decode"]:
        available = (False, "NoReadyDecode", "no decode engine is ready; requests have nowhere to run")
    elif not ready_of["router"]:
        available = (True, "Serving", "serving through the inference gateway only (no router pod is ready)")
    else:
        available = (True, "Serving", f"serving at {status['endpoint']}")
    status["conditions"] = [
        _condition("Ready", phase == "Ready", ready_reason, ready_message, isvc.generation, previous, now),
        _condition("Available", *available, isvc.generation, previous, now),
    ]
    if isvc.spec.router.gateway is not None:
        if gateway is not None:
            status["conditions"].append(
                _condition("Gateway", gateway.applied, gateway.reason, gateway.message, isvc.generation, previous, now))
        else:
            status["conditions"] += [c for c in previous.get("conditions") or [] if c.get("type") == "Gateway"]
    return status


@dataclass(frozen=True)
class GatewayOutcome:
    """Whether the InferencePool (and HTTPRoute) could be applied, for the Gateway condition."""

    applied: bool
    reason: str  # Applied | CRDNotInstalled
    message: str


def invalid_status(generation: int | None, message: str, anything_running: bool,
                   previous: Mapping[str, Any], now: dt.datetime) -> dict[str, Any]:
    """Status of a resource whose spec cannot be rendered; nothing was applied for it.

    Pods from an earlier valid spec keep serving, so the resource is Degraded rather than Pending
    then, and the Available condition (about those pods) is left as it was.
    """
    status: dict[str, Any] = {"phase": "Degraded" if anything_running else "Pending"}
    if generation is not None:
        status["observedGeneration"] = generation
    ready = _condition("Ready", False, "InvalidSpec", message, generation, previous, now)
    others = [c for c in previous.get("conditions") or [] if c.get("type") != "Ready"]
    status["conditions"] = [ready, *others]
    return status


def status_patch(previous: Mapping[str, Any], new: Mapping[str, Any], partial: bool = False) -> dict[str, Any]:
    """The merge patch that turns `previous` into `new`; {} when nothing changes.

    With `partial`, keys absent from `new` are kept (an invalid-spec status does not know the pools).
    """
    patch = {key: value for key, value in new.items() if previous.get(key) != value}
    if not partial:
        patch.update({key: None for key in previous if key not in new})
    return patch
