"""Pure rendering of the Gateway API Inference Extension (GIE) objects of one InferenceService.

With `spec.router.gateway` on, a GIE gateway (Envoy Gateway, Istio, kgateway, GKE, ...) serves the
decode pool: an InferencePool selects the decode pods, one target port per data-parallel rank; the
gateway asks the endpoint picker (`pdserve epp`, its own Deployment and Service) over ext_proc which
pod and port serves each request; an optional HTTPRoute attaches the pool to a named Gateway. The
GIE CRDs belong to the gateway provider and are not installed by pdserve.

Builds on render.py's helpers (metadata, containers, pods, policies); each module imports the
other only as a module and uses it at call time, so either may be imported first.
"""

from __future__ import annotations

from typing import Any

from pdserve.operator import commands
from pdserve.operator import render as base
from pdserve.operator.names import ENGINE_PORT, RANK_PORT_BASE, Names
from pdserve.operator.spec import Gateway, InferenceService

Manifest = dict[str, Any]

INFERENCE_POOL_API = "inference.networking.k8s.io/v1"
HTTP_ROUTE_API = "gateway.networking.k8s.io/v1"
GATEWAY_KINDS = frozenset({"InferencePool", "HTTPRoute"})

EPP_PRESTOP_SECONDS = 5
# In-flight ext_proc streams end with their requests; a picker that stops early fails them (FailClose).
EPP_GRACE_SECONDS = 60


def _gateway(isvc: InferenceService) -> Gateway:
    gateway = isvc.spec.router.gateway
    assert gateway is not None, "only rendered with spec.router.gateway enabled"
    return gateway


def target_ports(isvc: InferenceService) -> list[int]:
    """The decode pods' ports the gateway sends requests to: the engine port, or one per DP rank."""
    ranks = isvc.spec.decode.data_parallel_size
    if ranks == 1:
        return [ENGINE_PORT]
    return [RANK_PORT_BASE + rank for rank in range(ranks)]


def pool_name(isvc: InferenceService) -> str:
    return Names(isvc.name).inference_pool(_gateway(isvc).pool_name)


def gateway_manifests(isvc: InferenceService, names: Names) -> list[Manifest]:
    gateway = _gateway(isvc)
    return [
        *base.discovery_rbac(isvc, names.epp_account, "epp"),
        epp_service(isvc, names),
        epp_deployment(isvc, names),
        inference_pool(isvc, names),
        *([http_route(isvc, names)] if gateway.http_route is not None else []),
    ]


def stale_objects(isvc: InferenceService, names: Names) -> list[tuple[str, str, str]]:
    """(apiVersion, kind, name) of gateway objects this spec does not render (the gateway or its
    route turned off): deleted by the operator, or they would keep routing to this service."""
    gateway = isvc.spec.router.gateway
    stale = []
    if gateway is None:
        stale += [("apps/v1", "Deployment", names.deployment("epp")), ("v1", "Service", names.service("epp")),
                  ("rbac.authorization.k8s.io/v1", "RoleBinding", names.epp_account),
                  ("rbac.authorization.k8s.io/v1", "Role", names.epp_account),
                  ("v1", "ServiceAccount", names.epp_account),
                  (INFERENCE_POOL_API, "InferencePool", names.inference_pool())]
    if gateway is None or gateway.http_route is None:
        stale.append((HTTP_ROUTE_API, "HTTPRoute", names.http_route))
    return stale


# --- the InferencePool and the HTTPRoute --------------------------------------------------------

def inference_pool(isvc: InferenceService, names: Names) -> Manifest:
    picker = _gateway(isvc).endpoint_picker
    return {
        "apiVersion": INFERENCE_POOL_API, "kind": "InferencePool",
        "metadata": base._metadata(isvc, pool_name(isvc), "inference-pool"),
        "spec": {
            # The decode pods serve the users' requests; prefill legs are the picker's own business.
            "selector": {"matchLabels": names.selector("decode")},
            "targetPorts": [{"number": port} for port in target_ports(isvc)],
            # group and kind as the API server defaults them, so the live object matches the rendered one.
            "endpointPickerRef": {"group": "", "kind": "Service", "name": names.service("epp"),
                                  "port": {"number": picker.port}, "failureMode": picker.failure_mode},
        },
    }


def http_route(isvc: InferenceService, names: Names) -> Manifest:
    route = _gateway(isvc).http_route
    assert route is not None
    parent: dict[str, Any] = {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": route.gateway_name}
    if route.gateway_namespace is not None:
        parent["namespace"] = route.gateway_namespace
    if route.section_name is not None:
        parent["sectionName"] = route.section_name
    return {
        "apiVersion": HTTP_ROUTE_API, "kind": "HTTPRoute",
        "metadata": base._metadata(isvc, names.http_route, "http-route"),
        "spec": {
            "parentRefs": [parent],
            "rules": [{
                "matches": [{"path": {"type": "PathPrefix", "value": route.path_prefix}}],
                "backendRefs": [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                 "name": pool_name(isvc)}],
            }],
        },
    }


# --- the endpoint picker ------------------------------------------------------------------------

def epp_service(isvc: InferenceService, names: Names) -> Manifest:
    picker = _gateway(isvc).endpoint_picker
    return {
        "apiVersion": "v1", "kind": "Service", "metadata": base._metadata(isvc, names.service("epp"), "epp"),
        "spec": {
            "selector": names.selector("epp"),
            "type": "ClusterIP",
            "ports": [
                # ext_proc is gRPC: the gateway must speak HTTP/2 without TLS to it.
                {"name": "grpc", "port": picker.port, "targetPort": "grpc", "protocol": "TCP",
                 "appProtocol": "kubernetes.io/h2c"},
                {"name": "metrics", "port": picker.metrics_port, "targetPort": "metrics", "protocol": "TCP",
                 "appProtocol": "http"},
            ],
        },
    }


def epp_deployment(isvc: InferenceService, names: Names) -> Manifest:
    picker = _gateway(isvc).endpoint_picker
    probes = {
        # The gRPC health service on the port the gateway uses: ready means it can answer ext_proc.
        "startupProbe": {"grpc": {"port": picker.port}, "periodSeconds": 2, "failureThreshold": 60,
                         "timeoutSeconds": 3},
        "readinessProbe": {"grpc": {"port": picker.port}, "periodSeconds": 5, "failureThreshold": 3,
                           "timeoutSeconds": 3},
        "livenessProbe": base._http_probe("metrics", period=10, failures=3),
    }
    container = base._container(
        isvc, "epp", commands.epp_command(isvc, base.INTERNAL_KEY_PATH),
        [("grpc", picker.port), ("metrics", picker.metrics_port)], env=[], resources=dict(picker.resources),
        mounts=[], probes=probes, pre_stop_seconds=EPP_PRESTOP_SECONDS)
    template = base._pod_template(isvc, names, "epp", container, grace_seconds=EPP_GRACE_SECONDS,
                                  service_account=names.epp_account, metrics_port=picker.metrics_port)
    return base._deployment(isvc, names, "epp", picker.replicas, template)


# --- NetworkPolicies ----------------------------------------------------------------------------

def _proxies(gateway: Gateway) -> list[dict[str, Any]] | None:
    """`from` peers for the gateway's proxies; None: any source (no `from` at all)."""
    if gateway.proxy_namespace_selector is None:
        return None
    return [{"namespaceSelector": dict(gateway.proxy_namespace_selector)}]


def _rule(peers: list[dict[str, Any]] | None, ports: list[int]) -> dict[str, Any]:
    rule: dict[str, Any] = {"ports": [base._tcp(port) for port in ports]}
    if peers is not None:
        rule["from"] = peers
    return rule


def engine_ingress(isvc: InferenceService, names: Names, role: str) -> list[dict[str, Any]]:
    """What the gateway adds to an engine pool's policy: the proxies reach the decode pods' target
    ports; the picker reaches the engines it health-checks and the prefill engines it sends legs to."""
    gateway = _gateway(isvc)
    epp = [base._pods(names.selector("epp"))]
    if role == "decode":
        ports = sorted({ENGINE_PORT, *target_ports(isvc)})
        return [_rule(_proxies(gateway), target_ports(isvc)), _rule(epp, ports)]
    return [_rule(epp, [ENGINE_PORT])]


def epp_network_policy(isvc: InferenceService, names: Names) -> Manifest:
    gateway = _gateway(isvc)
    ingress = [_rule(_proxies(gateway), [gateway.endpoint_picker.port])]
    metrics = isvc.spec.network_policy.metrics_namespace_selector
    if metrics is not None:
        ingress.append(_rule([{"namespaceSelector": metrics}], [gateway.endpoint_picker.metrics_port]))
    return base._network_policy(isvc, names, "epp", ingress)
