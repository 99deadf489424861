"""kopf handlers: they only translate kopf's calls into `reconcile`, `deployment_changed` and
`autoscale_once`, which do the work with a plain API client.

Handlers are registered on an explicit registry by `register(config)` (not on import) so that the
intervals and URLs they use are arguments: the CLI and the tests build their own.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from dataclasses import dataclass
from typing import Any

import kopf

from pdserve.operator import crd
from pdserve.operator.autoscaler import DEFAULT_STATS_URL, autoscale_once
from pdserve.operator.kube import ApiError, Credentials, KubeClient
from pdserve.operator.names import MANAGED_BY, MANAGED_BY_LABEL
from pdserve.operator.reconcile import Locks, Result, deployment_changed, owner_of, reconcile

ISVC = (crd.GROUP, crd.VERSION, crd.PLURAL)
ANNOTATION_PREFIX = "pdserve.io"


@dataclass(frozen=True)
class OperatorConfig:
    kubeconfig: str | None = None  # None: in-cluster service account, else the default kubeconfig
    context: str | None = None
    autoscale_interval: float = 15.0
    stats_url_template: str = DEFAULT_STATS_URL  # {namespace}, {name}, {coordinator}
    stats_timeout: float = 2.0
    allow_host_path: bool = False  # --allow-host-path: serve specs with hostPath volumes


def make_settings() -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    # kopf's bookkeeping goes into our annotations, not into status, whose schema has no room for
    # it. (kopf adds its finalizer only while a timer runs for the resource, i.e. with autoscaling:
    # deletion itself is left to owner references.)
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
    # Only the spec decides what is rendered; labels and annotations (the autoscaler's memory
    # among them) must not count as changes.
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration",
        ignored_fields=["metadata.labels", "metadata.annotations"])
    settings.persistence.finalizer = f"{ANNOTATION_PREFIX}/operator"
    settings.posting.reporting_component = MANAGED_BY
    # Handler chatter stays in the log; Kubernetes events are for warnings and real changes.
    settings.posting.level = logging.WARNING
    # The resource and its namespaces are known up front: no CRD or namespace scanning (and no
    # RBAC for it); one operator replica, no peering objects.
    settings.scanning.disabled = True
    settings.peering.standalone = True
    # Sync handlers wait on per-resource locks; leave threads for other resources meanwhile.
    settings.execution.max_workers = 16
    # A timer caught mid-call when its resource is deleted is re-checked this often; kopf's 60 s
    # default would hold the deletion (through the timer's finalizer) for a minute.
    settings.background.cancellation_polling = 1.0
    return settings


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _client(memo: Any, config: OperatorConfig) -> KubeClient:
    if getattr(memo, "client", None) is None:
        memo.credentials = Credentials.load(config.kubeconfig, config.context)
        memo.client = KubeClient(memo.credentials)
        memo.locks = Locks()
    return memo.client


def _report(result: Result | None, body: Any, logger: logging.Logger) -> None:
    if result is None:
        return
    if result.invalid is not None:
        if result.status_patch:  # newly invalid (or a new message): say it once, not on every pass
            kopf.warn(body, reason="InvalidSpec", message=result.invalid)
        logger.warning("invalid spec, nothing applied: %s", result.invalid)
        return
    if result.changes:
        kopf.info(body, reason="Applied", message=", ".join(result.changes))
        logger.info("applied: %s", ", ".join(result.changes))


def register(config: OperatorConfig | None = None,
             registry: kopf.OperatorRegistry | None = None) -> kopf.OperatorRegistry:
    config = config or OperatorConfig()
    registry = registry if registry is not None else kopf.OperatorRegistry()

    @kopf.on.startup(registry=registry)
    def connect(memo: kopf.Memo, **_: Any) -> None:
        _client(memo, config)

    @kopf.on.login(registry=registry)
    def login(memo: kopf.Memo, **_: Any) -> kopf.ConnectionInfo:
        _client(memo, config)
        return memo.credentials.connection_info()

    @kopf.on.resume(*ISVC, registry=registry)
    @kopf.on.create(*ISVC, registry=registry)
    @kopf.on.update(*ISVC, field="spec", registry=registry)
    def apply_spec(namespace: str, name: str, uid: str, body: Any, memo: kopf.Memo,
                   logger: logging.Logger, **_: Any) -> None:
        client = _client(memo, config)
        try:
            with memo.locks(namespace, name):
                result = reconcile(client, namespace, name, _now(), uid, allow_host_path=config.allow_host_path)
        except ApiError as error:
            raise kopf.TemporaryError(str(error), delay=5) from error
        _report(result, body, logger)

    @kopf.on.event("apps", "v1", "deployments", labels={MANAGED_BY_LABEL: MANAGED_BY}, registry=registry)
    def follow_deployment(type: str | None, body: Any, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
        owner = owner_of(body)
        if owner is None:
            return
        namespace, name, _ = owner
        with memo.locks(namespace, name):
            outcome = deployment_changed(_client(memo, config), body, type == "DELETED", _now(),
                                         allow_host_path=config.allow_host_path)
        if isinstance(outcome, Result) and outcome.changes:
            logger.info("deployment %s had drifted from %s/%s: %s", body["metadata"]["name"], namespace, name,
                        ", ".join(outcome.changes))

    def autoscaled(spec: Any, **_: Any) -> bool:
        return any((spec.get(pool) or {}).get("autoscaling") for pool in ("prefill", "decode"))

    @kopf.timer(*ISVC, interval=config.autoscale_interval, when=autoscaled, registry=registry)
    def autoscale(namespace: str, name: str, body: Any, memo: kopf.Memo, **_: Any) -> None:
        decision = autoscale_once(_client(memo, config), namespace, name, config.stats_url_template, time.time(),
                                  config.stats_timeout, allow_host_path=config.allow_host_path)
        if decision is not None and decision.scaled:
            kopf.info(body, reason="Autoscaled", message="; ".join(decision.reasons))

    return registry
