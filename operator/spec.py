"""The InferenceService as typed, defaulted, validated dataclasses.

Everything downstream (rendering, status, autoscaling) works from these, never from raw dicts,
so a missing field is caught once here instead of as a KeyError deep inside a handler.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Callable, Mapping

from kubernetes.utils import parse_quantity

from pdserve.operator import crd
from pdserve.operator.schema import defaulted, schema_errors

GPU_RESOURCE = "nvidia.com/gpu"
MODEL_MOUNT = "/models"
KV_SHARED_MOUNT = "/kv-shared"


class InvalidSpec(ValueError):
    """The resource cannot be rendered; `messages` says why, one line per problem."""

    def __init__(self, messages: list[str]):
        self.messages = list(messages)
        super().__init__("; ".join(self.messages))


@dataclass(frozen=True)
class Autoscaling:
    min_replicas: int
    max_replicas: int
    target_waiting_per_replica: float | None
    target_kv_usage: float | None
    scale_down_delay_seconds: int


@dataclass(frozen=True)
class Pool:
    role: str
    replicas: int
    tensor_parallel_size: int
    data_parallel_size: int
    gpu: bool
    resources: dict[str, dict[str, str]]
    node_selector: dict[str, str]
    tolerations: list[dict[str, Any]]
    env: list[dict[str, Any]]
    autoscaling: Autoscaling | None

    @property
    def gpus_per_pod(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def user_gpu_count(self) -> Decimal | None:
        for section in ("limits", "requests"):
            value = self.resources.get(section, {}).get(GPU_RESOURCE)
            if value is not None:
                return parse_quantity(value)
        return None


@dataclass(frozen=True)
class Model:
    name: str
    path: str
    pvc_claim: str | None
    pvc_read_only: bool
    host_path: str | None

    @property
    def has_volume(self) -> bool:
        return self.pvc_claim is not None or self.host_path is not None

    @property
    def container_path(self) -> str:
        """What the engine gets as --model."""
        if not self.has_volume:
            return self.path
        relative = self.path.strip("/")
        return f"{MODEL_MOUNT}/{relative}" if relative else MODEL_MOUNT


@dataclass(frozen=True)
class SecretKey:
    name: str
    key: str


@dataclass(frozen=True)
class EndpointPicker:
    replicas: int
    port: int  # gRPC: ext_proc and grpc.health.v1
    metrics_port: int  # HTTP: /health and /metrics
    failure_mode: str  # FailClose | FailOpen
    resources: dict[str, dict[str, str]]


@dataclass(frozen=True)
class HTTPRoute:
    gateway_name: str
    gateway_namespace: str | None
    section_name: str | None
    path_prefix: str


@dataclass(frozen=True)
class Gateway:
    """spec.router.gateway, when enabled: the objects a Gateway API Inference Extension gateway needs."""

    pool_name: str | None  # None: the default name (names.Names.inference_pool)
    endpoint_picker: EndpointPicker
    http_route: HTTPRoute | None
    # Namespaces of the gateway's proxies; None: any source may reach what the gateway must reach.
    proxy_namespace_selector: dict[str, Any] | None


@dataclass(frozen=True)
class Router:
    replicas: int
    port: int
    routing_policy: str
    service_type: str
    api_key_secret: SecretKey | None
    resources: dict[str, dict[str, str]]
    gateway: Gateway | None = None  # None: absent or disabled


@dataclass(frozen=True)
class VolumeSource:
    claim_name: str | None
    host_path: str | None


@dataclass(frozen=True)
class KVTransfer:
    connector: str
    kvstore_capacity: str
    kvstore_resources: dict[str, dict[str, str]]
    shared_storage: VolumeSource | None

    @property
    def kvstore_capacity_bytes(self) -> int:
        return int(parse_quantity(self.kvstore_capacity))


@dataclass(frozen=True)
class Engine:
    max_model_len: int
    block_size: int
    max_num_seqs: int
    enable_prefix_caching: bool
    extra_args: tuple[str, ...]


@dataclass(frozen=True)
class NetworkPolicy:
    enabled: bool
    # Namespaces whose pods may scrape /metrics on the engines and the coordinator; None: none.
    metrics_namespace_selector: dict[str, Any] | None


@dataclass(frozen=True)
class PDRatio:
    prefill: int
    decode: int

    def prefill_for(self, decode: int) -> int:
        return math.ceil(decode * self.prefill / self.decode)

    def decode_for(self, prefill: int) -> int:
        return math.ceil(prefill * self.decode / self.prefill)


@dataclass(frozen=True)
class InferenceServiceSpec:
    model: Model
    image: str
    image_pull_policy: str
    image_pull_secrets: tuple[str, ...]
    prefill: Pool
    decode: Pool
    pd_ratio: PDRatio | None
    router: Router
    kv_transfer: KVTransfer
    engine: Engine
    network_policy: NetworkPolicy

    def pool(self, role: str) -> Pool:
        return {"prefill": self.prefill, "decode": self.decode}[role]

    @property
    def autoscaled(self) -> bool:
        return self.prefill.autoscaling is not None or self.decode.autoscaling is not None


@dataclass(frozen=True)
class InferenceService:
    name: str
    namespace: str
    uid: str | None
    generation: int | None
    spec: InferenceServiceSpec
    annotations: dict[str, str] = field(default_factory=dict)
    resource_version: str | None = None


def _quantities(resources: Mapping[str, Any] | None) -> dict[str, dict[str, str]]:
    """Quantities as strings: the API server stores them so, and equal manifests must compare equal."""
    return {section: {name: str(value) for name, value in values.items()}
            for section, values in (resources or {}).items() if values}


def _autoscaling(raw: Mapping[str, Any] | None) -> Autoscaling | None:
    if raw is None:
        return None
    return Autoscaling(
        min_replicas=raw["minReplicas"],
        max_replicas=raw["maxReplicas"],
        target_waiting_per_replica=raw.get("targetWaitingPerReplica"),
        target_kv_usage=raw.get("targetKVUsage"),
        scale_down_delay_seconds=raw["scaleDownDelaySeconds"],
    )


def _pool(role: str, raw: Mapping[str, Any]) -> Pool:
    return Pool(
        role=role,
        replicas=raw["replicas"],
        tensor_parallel_size=raw["tensorParallelSize"],
        data_parallel_size=raw["dataParallelSize"],
        gpu=raw["gpu"],
        resources=_quantities(raw.get("resources")),
        node_selector=dict(raw.get("nodeSelector") or {}),
        tolerations=[dict(t) for t in raw.get("tolerations") or []],
        env=[dict(e) for e in raw.get("env") or []],
        autoscaling=_autoscaling(raw.get("autoscaling")),
    )


def _gateway(raw: Mapping[str, Any] | None) -> Gateway | None:
    if raw is None or not raw["enabled"]:
        return None
    picker, route = raw["endpointPicker"], raw.get("httpRoute")
    proxies = raw.get("proxyNamespaceSelector")
    return Gateway(
        pool_name=(raw.get("inferencePool") or {}).get("name"),
        endpoint_picker=EndpointPicker(
            replicas=picker["replicas"], port=picker["port"], metrics_port=picker["metricsPort"],
            failure_mode=picker["failureMode"], resources=_quantities(picker.get("resources"))),
        http_route=None if route is None else HTTPRoute(
            gateway_name=route["gatewayName"], gateway_namespace=route.get("gatewayNamespace"),
            section_name=route.get("sectionName"), path_prefix=route["pathPrefix"]),
        proxy_namespace_selector=None if proxies is None else dict(proxies),
    )


def _spec(raw: Mapping[str, Any]) -> InferenceServiceSpec:
    model, router, kv, engine = raw["model"], raw["router"], raw["kvTransfer"], raw["engine"]
    secret = router.get("apiKeySecret")
    shared = kv.get("sharedStorage")
    ratio = raw.get("pdRatio")
    policy = raw["networkPolicy"]
    return InferenceServiceSpec(
        model=Model(
            name=model["name"],
            path=model["path"],
            pvc_claim=(model.get("pvc") or {}).get("claimName"),
            pvc_read_only=(model.get("pvc") or {}).get("readOnly", True),
            host_path=model.get("hostPath"),
        ),
        image=raw["image"],
        image_pull_policy=raw["imagePullPolicy"],
        image_pull_secrets=tuple(raw.get("imagePullSecrets") or ()),
        prefill=_pool("prefill", raw["prefill"]),
        decode=_pool("decode", raw["decode"]),
        pd_ratio=PDRatio(*(int(part) for part in ratio.split(":"))) if ratio else None,
        router=Router(
            replicas=router["replicas"],
            port=router["port"],
            routing_policy=router["routingPolicy"],
            service_type=router["serviceType"],
            api_key_secret=SecretKey(secret["name"], secret["key"]) if secret else None,
            resources=_quantities(router.get("resources")),
            gateway=_gateway(router.get("gateway")),
        ),
        kv_transfer=KVTransfer(
            connector=kv["connector"],
            kvstore_capacity=str(kv["kvstore"]["capacity"]),
            kvstore_resources=_quantities(kv["kvstore"].get("resources")),
            shared_storage=None if shared is None else VolumeSource(shared.get("claimName"), shared.get("hostPath")),
        ),
        engine=Engine(
            max_model_len=engine["maxModelLen"],
            block_size=engine["blockSize"],
            max_num_seqs=engine["maxNumSeqs"],
            enable_prefix_caching=engine["enablePrefixCaching"],
            extra_args=tuple(engine.get("extraArgs") or ()),
        ),
        network_policy=NetworkPolicy(
            enabled=policy["enabled"],
            metrics_namespace_selector=(None if policy.get("metricsNamespaceSelector") is None
                                        else dict(policy["metricsNamespaceSelector"])),
        ),
    )


# --- Python twins of the CRD's CEL rules (crd.RULES), by rule id --------------------------------

def _rule_name(isvc: InferenceService) -> list[str]:
    ok = len(isvc.name) <= crd.MAX_NAME_LENGTH and re.fullmatch(crd.NAME_PATTERN, isvc.name)
    return [] if ok else [_message("name")]


def _rule_model_one_volume(isvc: InferenceService) -> list[str]:
    model = isvc.spec.model
    return [_message("model-one-volume")] if model.pvc_claim and model.host_path else []


def _rule_model_path(isvc: InferenceService) -> list[str]:
    model = isvc.spec.model
    return [] if model.has_volume or model.path else [_message("model-path")]


def _rule_autoscaling_bounds(isvc: InferenceService) -> list[str]:
    return [_message("autoscaling-bounds", f"spec.{pool.role}.autoscaling")
            for pool in (isvc.spec.prefill, isvc.spec.decode)
            if pool.autoscaling and pool.autoscaling.min_replicas > pool.autoscaling.max_replicas]


def _rule_pd_ratio(isvc: InferenceService) -> list[str]:
    spec = isvc.spec
    return [_message("pd-ratio-needs-autoscaling")] if spec.pd_ratio and not spec.autoscaled else []


def _rule_shared_storage_volume(isvc: InferenceService) -> list[str]:
    kv = isvc.spec.kv_transfer
    return [_message("shared-storage-volume")] if kv.connector == "shared-storage" and not kv.shared_storage else []


def _rule_shared_storage_one_volume(isvc: InferenceService) -> list[str]:
    shared = isvc.spec.kv_transfer.shared_storage
    if shared is None or (shared.claim_name is None) != (shared.host_path is None):
        return []
    return [_message("shared-storage-one-volume")]


def _rule_gateway_data_parallel(isvc: InferenceService) -> list[str]:
    spec = isvc.spec
    if spec.router.gateway is None or spec.decode.data_parallel_size <= crd.MAX_GATEWAY_DATA_PARALLEL:
        return []
    return [_message("gateway-data-parallel")]


def _rule_gateway_ports(isvc: InferenceService) -> list[str]:
    gateway = isvc.spec.router.gateway
    if gateway is None or gateway.endpoint_picker.port != gateway.endpoint_picker.metrics_port:
        return []
    return [_message("gateway-ports")]


def _message(rule_id: str, path: str | None = None) -> str:
    return next(r.message for r in crd.RULES if r.id == rule_id and (path is None or r.path == path))


# rule id -> check; a test asserts this covers every id in crd.RULES.
CEL_TWINS: dict[str, Callable[[InferenceService], list[str]]] = {
    "name": _rule_name,
    "model-one-volume": _rule_model_one_volume,
    "model-path": _rule_model_path,
    "autoscaling-bounds": _rule_autoscaling_bounds,
    "pd-ratio-needs-autoscaling": _rule_pd_ratio,
    "shared-storage-volume": _rule_shared_storage_volume,
    "shared-storage-one-volume": _rule_shared_storage_one_volume,
    "gateway-data-parallel": _rule_gateway_data_parallel,
    "gateway-ports": _rule_gateway_ports,
}


# --- checks no schema expresses --------------------------------------------------------------------

# Flags the operator itself renders; repeating them in extraArgs would make the engine's
# behaviour depend on argparse's last-one-wins and break the pod's probes or P/D wiring.
MANAGED_ENGINE_FLAGS = frozenset({
    "--model", "--served-model-name", "--host", "--port", "--tensor-parallel-size",
    "--data-parallel-size", "--max-model-len", "--block-size", "--max-num-seqs",
    "--enable-prefix-caching", "--no-enable-prefix-caching", "--engine-role", "--kv-transfer-config",
    "--coordinator-address", "--coordinator-publish-address", "--rank-port-base",
})


def _semantic_errors(isvc: InferenceService) -> list[str]:
    spec = isvc.spec
    errors: list[str] = []
    for pool in (spec.prefill, spec.decode):
        count = pool.user_gpu_count
        if count is not None and count < pool.gpus_per_pod:
            errors.append(
                f"{pool.role}: resources ask for {count} {GPU_RESOURCE} but tensorParallelSize * "
                f"dataParallelSize = {pool.tensor_parallel_size} * {pool.data_parallel_size} needs "
                f"{pool.gpus_per_pod} per pod")
    for arg in spec.engine.extra_args:
        flag = arg.split("=", 1)[0]
        if flag in MANAGED_ENGINE_FLAGS:
            errors.append(f"engine.extraArgs must not set {flag}: the operator sets it from the spec")
    if spec.kv_transfer.connector == "kvstore" and spec.kv_transfer.kvstore_capacity_bytes <= 0:
        errors.append("kvTransfer.kvstore.capacity must be more than zero bytes")
    route = spec.router.gateway.http_route if spec.router.gateway else None
    if route is not None and {".", ".."} & set(route.path_prefix.split("/")):
        # Gateways refuse such a route (Gateway API path rules); say so here, before anything is applied.
        errors.append(f"router.gateway.httpRoute.pathPrefix {route.path_prefix!r} must not contain '.' or '..' "
                      "segments")
    for banned in ("//", "%2f", "%2F"):
        if route is not None and banned in route.path_prefix:
            errors.append(f"router.gateway.httpRoute.pathPrefix {route.path_prefix!r} must not contain {banned!r}")
    return errors


# --- what this operator installation allows ------------------------------------------------------

ALLOW_HOST_PATH_FLAG = "--allow-host-path"


def host_paths(isvc: InferenceService) -> list[tuple[str, str]]:
    """(field, path) of every hostPath volume the spec asks for."""
    spec = isvc.spec
    found = []
    if spec.model.host_path is not None:
        found.append(("spec.model.hostPath", spec.model.host_path))
    shared = spec.kv_transfer.shared_storage
    if spec.kv_transfer.connector == "shared-storage" and shared is not None and shared.host_path is not None:
        found.append(("spec.kvTransfer.sharedStorage.hostPath", shared.host_path))
    return found


def _host_path_errors(isvc: InferenceService) -> list[str]:
    # Anyone allowed to create an InferenceService would otherwise get the node's files mounted into
    # pods the operator creates (its rights, not theirs). The CRD cannot refuse this itself: whether
    # it is allowed is a choice of the installation, made by the operator's flag.
    return [f"{where}: hostPath volumes ({path}) are refused: they expose the node's filesystem; use a "
            f"PVC, or run the operator with {ALLOW_HOST_PATH_FLAG} (chart value allowHostPath: true)"
            for where, path in host_paths(isvc)]


def parse(obj: Mapping[str, Any], namespace: str | None = None, *,
          allow_host_path: bool = False) -> InferenceService:
    """Default, validate and type an InferenceService object; raises InvalidSpec.

    hostPath volumes are refused unless `allow_host_path` (the operator's --allow-host-path).
    """
    obj = defaulted(dict(obj))
    errors = schema_errors(obj)
    if errors:
        raise InvalidSpec(errors)
    meta = obj.get("metadata") or {}
    isvc = InferenceService(
        name=meta.get("name", ""),
        namespace=meta.get("namespace") or namespace or "default",
        uid=meta.get("uid"),
        generation=meta.get("generation"),
        spec=_spec(obj["spec"]),
        annotations=dict(meta.get("annotations") or {}),
        resource_version=meta.get("resourceVersion"),
    )
    for check in CEL_TWINS.values():
        errors += check(isvc)
    errors += _semantic_errors(isvc)
    if not allow_host_path:
        errors += _host_path_errors(isvc)
    if errors:
        raise InvalidSpec(errors)
    return isvc
