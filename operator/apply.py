"""Idempotent create-or-patch of rendered manifests.

A live object "matches" when every field the operator renders has the rendered value there; fields
the API server or other controllers add (defaults, clusterIP, status) are not ours and are left
alone. Removals need memory of what was rendered before, so each object carries the last rendered
manifest in an annotation (as `kubectl apply` does), and a field that was rendered then but not now
is set to null in the patch. Patches are JSON merge patches: dicts merge, lists are replaced whole.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any, Callable, Mapping, Protocol

from kubernetes.utils import parse_quantity

from pdserve.operator.kube import Conflict

LAST_APPLIED = "pdserve.io/last-applied"
_QUANTITY_MAPS = ("requests", "limits")


class Client(Protocol):
    def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None: ...

    def create(self, manifest: Mapping[str, Any]) -> dict[str, Any]: ...

    def patch(self, api_version: str, kind: str, namespace: str | None, name: str,
              patch: Mapping[str, Any], subresource: str | None = None) -> dict[str, Any]: ...

    def delete(self, api_version: str, kind: str, namespace: str | None, name: str) -> None: ...


@dataclass(frozen=True)
class Outcome:
    action: str  # "created" | "patched" | "unchanged"
    kind: str
    name: str
    live: dict[str, Any]
    patch: dict[str, Any] | None = None


def _quantity(value: Any) -> Decimal | None:
    try:
        return parse_quantity(value)
    except (ValueError, TypeError, InvalidOperation):
        return None


def matches(desired: Any, live: Any, parent_key: str = "") -> bool:
    """Whether `live` has every rendered field of `desired` with an equal value."""
    if isinstance(desired, dict):
        if not isinstance(live, dict):
            return False
        quantities = parent_key in _QUANTITY_MAPS
        for key, value in desired.items():
            if key not in live:
                return False
            if quantities and not isinstance(value, dict):
                # The API server canonicalises quantities ("1000m" is stored as "1").
                if value != live[key] and (_quantity(value) is None or _quantity(value) != _quantity(live[key])):
                    return False
            elif not matches(value, live[key], key):
                return False
        return True
    if isinstance(desired, list):
        return (isinstance(live, list) and len(desired) == len(live)
                and all(matches(d, lv, parent_key) for d, lv in zip(desired, live)))
    return desired == live and type(desired) is type(live)


def merge_patch(desired: Mapping[str, Any], live: Mapping[str, Any], last: Mapping[str, Any]) -> dict[str, Any]:
    """A three-way merge patch: set what differs from `desired`, null what only `last` had."""
    patch: dict[str, Any] = {}
    for key, value in desired.items():
        current = live.get(key)
        if isinstance(value, dict) and isinstance(current, dict):
            previous = last.get(key) if isinstance(last.get(key), dict) else {}
            sub = merge_patch(value, current, previous)
            if sub:
                patch[key] = sub
        elif key not in live or not matches({key: value}, {key: current}):
            patch[key] = copy.deepcopy(value)
    for key in last:
        if key not in desired and key in live:
            patch[key] = None
    return patch


def _last_applied(live: Mapping[str, Any]) -> dict[str, Any]:
    raw = ((live.get("metadata") or {}).get("annotations") or {}).get(LAST_APPLIED)
    try:
        return json.loads(raw) if raw else {}
    except ValueError:
        return {}


def _identity(manifest: Mapping[str, Any]) -> tuple[str, str, str | None, str]:
    meta = manifest["metadata"]
    return manifest["apiVersion"], manifest["kind"], meta.get("namespace"), meta["name"]


def _with_last_applied(manifest: Mapping[str, Any]) -> dict[str, Any]:
    body = copy.deepcopy(dict(manifest))
    record = json.dumps(manifest, sort_keys=True, separators=(",", ":"))
    body["metadata"].setdefault("annotations", {})[LAST_APPLIED] = record
    return body


def plan(desired: Mapping[str, Any], live: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The merge patch that brings `live` to `desired` (including the record annotation), or None."""
    if live is None:
        raise ValueError("nothing to patch: the object does not exist")
    patch = merge_patch(desired, live, _last_applied(live))
    if not patch:
        return None
    record = _with_last_applied(desired)["metadata"]["annotations"][LAST_APPLIED]
    patch.setdefault("metadata", {}).setdefault("annotations", {})[LAST_APPLIED] = record
    return patch


def apply(client: Client, desired: Mapping[str, Any]) -> Outcome:
    """Create the object, patch what differs, or do nothing when the live object matches."""
    api_version, kind, namespace, name = _identity(desired)
    live = client.get(api_version, kind, namespace, name)
    if live is None:
        try:
            return Outcome("created", kind, name, client.create(_with_last_applied(desired)))
        except Conflict:
            # Created by someone else between the read and the write: patch it instead.
            live = client.get(api_version, kind, namespace, name)
            if live is None:
                raise
    patch = plan(desired, live)
    if patch is None:
        return Outcome("unchanged", kind, name, live)
    return Outcome("patched", kind, name, client.patch(api_version, kind, namespace, name, patch), patch)


def create_once(client: Client, skeleton: Mapping[str, Any], fill: Callable[[], Mapping[str, Any]]) -> Outcome:
    """Create the object from `fill()` when it is missing, else leave it exactly as it is.

    For objects holding a value made once (a generated key): re-rendering must never replace it,
    so the live object is not compared with anything. `fill` runs only when a create is due.
    The outcome's `live` keeps metadata only, so no secret value travels on in results or logs.
    """
    api_version, kind, namespace, name = _identity(skeleton)
    live = client.get(api_version, kind, namespace, name)
    action = "unchanged"
    if live is None:
        try:
            live = client.create(fill())
            action = "created"
        except Conflict:
            # Created by someone else (another pass, a person) between the read and the write: theirs stands.
            live = client.get(api_version, kind, namespace, name)
            if live is None:
                raise
    return Outcome(action, kind, name, {"metadata": copy.deepcopy(live.get("metadata") or {})})
