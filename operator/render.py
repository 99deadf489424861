"""Pure rendering: an InferenceService in, the Kubernetes objects that serve it out.

No I/O here. The operator applies exactly this list, and `pdserve operator render -f` prints it,
so reviewing the rendered YAML is reviewing what the cluster will get.
"""

from __future__ import annotations

import base64
import json
from typing import Any, Mapping

from pdserve.engine.internal_auth import ENV_KEY_FILE
from pdserve.operator import commands, crd, render_gateway
from pdserve.operator.names import (COORDINATOR_HTTP_PORT, COORDINATOR_PUBLISH_PORT, COORDINATOR_STATS_PORT,
                                    ENGINE_PORT, ENGINE_ROLES, KV_TRANSFER_PORT, KVSTORE_PORT, OPERATOR_POD_LABELS,
                                    ROLES, Names)
from pdserve.operator.spec import (GPU_RESOURCE, KV_SHARED_MOUNT, MODEL_MOUNT, InferenceService, Pool,
                                   VolumeSource, parse)

Manifest = dict[str, Any]

# The image's non-root user (Dockerfile `USER`); a test keeps the two in step.
RUN_AS_USER = 10001
CACHE_DIR = "/var/cache/pdserve"

# preStop sleeps keep a terminating pod serving until EndpointSlice watchers (routers, kube-proxy)
# have dropped it; the rest of the grace period lets in-flight generations finish (an engine
# drains on SIGTERM). Streams pass through the router, so it waits as long as the engines.
ENGINE_PRESTOP_SECONDS = 10
ENGINE_GRACE_SECONDS = 120
ROUTER_PRESTOP_SECONDS = 5
ROUTER_GRACE_SECONDS = 120
SUPPORT_PRESTOP_SECONDS = 5
SUPPORT_GRACE_SECONDS = 30

COORDINATOR_RESOURCES = {"requests": {"cpu": "100m", "memory": "256Mi"}}

# The internal key reaches every pod as a file of a read-only Secret volume, named by
# $PDSERVE_INTERNAL_KEY_FILE (which every pdserve command reads; no flag needed). A file rather than
# an env var with secretKeyRef: the value then never sits in the process environment, which every
# child inherits (compilers, tokenizer workers, a debugging shell's `env`) and which shows up in
# /proc/PID/environ, crash reports and environment dumps; only the file's path does.
INTERNAL_KEY_DATA_KEY = "key"
INTERNAL_KEY_DIR = "/var/run/secrets/pdserve.io/internal-key"
INTERNAL_KEY_PATH = f"{INTERNAL_KEY_DIR}/{INTERNAL_KEY_DATA_KEY}"
INTERNAL_KEY_VOLUME = "internal-key"
# Owner and the pod's fsGroup (the image's user, which the kubelet gives the files) may read; no one may write.
INTERNAL_KEY_MODE = 0o440


def render(obj: Mapping[str, Any], namespace: str | None = None, *, allow_host_path: bool = False) -> list[Manifest]:
    """Render a raw InferenceService (defaults applied here); raises spec.InvalidSpec."""
    return render_service(parse(obj, namespace, allow_host_path=allow_host_path))


def render_service(isvc: InferenceService) -> list[Manifest]:
    names = Names(isvc.name)
    kvstore = isvc.spec.kv_transfer.connector == "kvstore"
    manifests = [
        # First: the pods below mount it.
        internal_key_secret(isvc),
        *_router_rbac(isvc, names),
        _engine_config(isvc, names),
        _service(isvc, names, "coordinator", [("stats", COORDINATOR_STATS_PORT), ("publish", COORDINATOR_PUBLISH_PORT),
                                               ("http", COORDINATOR_HTTP_PORT)]),
        *([_service(isvc, names, "kvstore", [("kvstore", KVSTORE_PORT)])] if kvstore else []),
        _service(isvc, names, "prefill", [("http", ENGINE_PORT)], headless=True),
        _service(isvc, names, "decode", [("http", ENGINE_PORT)], headless=True),
        _service(isvc, names, "router", [("http", isvc.spec.router.port)], service_type=isvc.spec.router.service_type),
        _coordinator(isvc, names),
        *([_kvstore(isvc, names)] if kvstore else []),
        _engine(isvc, names, isvc.spec.prefill),
        _engine(isvc, names, isvc.spec.decode),
        _router(isvc, names),
        *(network_policies(isvc, names) if isvc.spec.network_policy.enabled else []),
        # Last: a cluster without the GIE CRDs refuses these, and everything above must be in place regardless.
        *(render_gateway.gateway_manifests(isvc, names) if isvc.spec.router.gateway is not None else []),
    ]
    return manifests


def optional_objects(isvc: InferenceService) -> list[tuple[str, str, str]]:
    """(apiVersion, kind, name) of objects some specs render and this one does not.

    They are left over from an earlier spec (the KV store after switching connectors) and the
    operator deletes them; owner references alone would keep them until the resource is deleted.
    """
    names = Names(isvc.name)
    stale = []
    if isvc.spec.kv_transfer.connector != "kvstore":
        stale += [("apps/v1", "Deployment", names.deployment("kvstore")), ("v1", "Service", names.service("kvstore"))]
    if isvc.spec.network_policy.enabled:
        rendered = {m["metadata"]["name"] for m in network_policies(isvc, names)}
    else:
        rendered = set()
    stale += [(NETWORK_POLICY_API, "NetworkPolicy", names.network_policy(role)) for role in ROLES
              if names.network_policy(role) not in rendered]
    return stale + render_gateway.stale_objects(isvc, names)


# --- metadata ----------------------------------------------------------------------------------------

def owner_reference(isvc: InferenceService) -> dict[str, Any]:
    return {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "name": isvc.name, "uid": isvc.uid,
            "controller": True, "blockOwnerDeletion": True}


def _metadata(isvc: InferenceService, name: str, component: str) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": isvc.namespace, "labels": Names(isvc.name).labels(component)}
    # A resource read from a file has no uid yet; its objects then render without an owner
    # (for review) and the operator, which always knows the uid, adds it.
    if isvc.uid:
        meta["ownerReferences"] = [owner_reference(isvc)]
    return meta


# --- the internal key --------------------------------------------------------------------------------

def internal_key_secret(isvc: InferenceService, key: str | None = None) -> Manifest:
    """The Secret holding the deployment's internal key; without `key`, its skeleton (no data).

    Rendering stays pure and never makes a key: the operator fills one in when it creates the Secret
    and never writes the data again (reconcile.py), so re-rendering cannot rotate the key under
    running pods. `pdserve operator render` shows the skeleton.
    """
    secret: Manifest = {"apiVersion": "v1", "kind": "Secret",
                        "metadata": _metadata(isvc, Names(isvc.name).internal_key_secret, "internal-key"),
                        "type": "Opaque"}
    if key is not None:
        secret["data"] = {INTERNAL_KEY_DATA_KEY: base64.b64encode(key.encode()).decode()}
    return secret


def _internal_key_volume(isvc: InferenceService) -> dict[str, Any]:
    return {"name": INTERNAL_KEY_VOLUME, "secret": {
        "secretName": Names(isvc.name).internal_key_secret, "defaultMode": INTERNAL_KEY_MODE,
        "items": [{"key": INTERNAL_KEY_DATA_KEY, "path": INTERNAL_KEY_DATA_KEY}]}}


# --- NetworkPolicies ----------------------------------------------------------------------------------

NETWORK_POLICY_API = "networking.k8s.io/v1"


def _tcp(port: int, last: int | None = None) -> dict[str, Any]:
    port_spec: dict[str, Any] = {"protocol": "TCP", "port": port}
    if last is not None and last > port:
        port_spec["endPort"] = last
    return port_spec


def _pods(labels: Mapping[str, str]) -> dict[str, Any]:
    # A podSelector without a namespaceSelector: pods of the policy's own namespace only.
    return {"podSelector": {"matchLabels": dict(labels)}}


def _network_policy(isvc: InferenceService, names: Names, role: str,
                    ingress: list[dict[str, Any]]) -> Manifest:
    return {"apiVersion": NETWORK_POLICY_API, "kind": "NetworkPolicy",
            "metadata": _metadata(isvc, names.network_policy(role), role),
            # Ingress only: egress (to the API server, model registries, DNS) is the cluster's business.
            "spec": {"podSelector": {"matchLabels": names.selector(role)}, "policyTypes": ["Ingress"],
                     "ingress": ingress}}


def network_policies(isvc: InferenceService, names: Names) -> list[Manifest]:
    """Who may reach each pod. Kubelet probes come from the node and are not subject to these.

    Engines: the HTTP port from the routers and their peer engines; the KV side channel from peer
    engines only. Coordinator and KV store: their ports from this service's pods. Router: its port
    from anywhere (it is the public edge). Optionally metrics from the namespaces the spec names.
    The internal key still authenticates every hop; these keep strangers from reaching the
    endpoints at all.
    """
    spec = isvc.spec
    instance = _pods(names.instance_selector())
    engines = [_pods(names.selector(role)) for role in ENGINE_ROLES]
    metrics = spec.network_policy.metrics_namespace_selector
    scrapers = [] if metrics is None else [{"namespaceSelector": metrics}]
    policies = []
    for pool in (spec.prefill, spec.decode):
        ingress = [{"from": [_pods(names.selector("router")), *engines], "ports": [_tcp(ENGINE_PORT)]}]
        if spec.router.gateway is not None:
            ingress += render_gateway.engine_ingress(isvc, names, pool.role)
        side_port = commands.kv_transfer_config(isvc, pool.role)["kv_connector_extra_config"].get("side_channel_port")
        if side_port:
            # One port per worker: DP rank d's TP rank r listens on port + d * TP + r. (NIXL's UCX data
            # plane over RDMA is not IP traffic; over TCP it would need its own ports opened.)
            ingress.append({"from": engines, "ports": [_tcp(side_port, side_port + pool.gpus_per_pod - 1)]})
        if scrapers:
            ingress.append({"from": scrapers, "ports": [_tcp(ENGINE_PORT)]})
        policies.append(_network_policy(isvc, names, pool.role, ingress))
    policies.append(_network_policy(isvc, names, "router", [{"ports": [_tcp(spec.router.port)]}]))
    coordinator = [
        {"from": [instance], "ports": [_tcp(port) for port in (COORDINATOR_STATS_PORT, COORDINATOR_PUBLISH_PORT,
                                                               COORDINATOR_HTTP_PORT)]},
        # The operator's autoscaler reads /stats from wherever the operator is installed.
        {"from": [{"namespaceSelector": {}, "podSelector": {"matchLabels": dict(OPERATOR_POD_LABELS)}}, *scrapers],
         "ports": [_tcp(COORDINATOR_HTTP_PORT)]},
    ]
    policies.append(_network_policy(isvc, names, "coordinator", coordinator))
    if spec.kv_transfer.connector == "kvstore":
        policies.append(_network_policy(isvc, names, "kvstore", [{"from": [instance], "ports": [_tcp(KVSTORE_PORT)]}]))
    if spec.router.gateway is not None:
        policies.append(render_gateway.epp_network_policy(isvc, names))
    return policies


# --- RBAC for the router's endpoint discovery ---------------------------------------------------------

def _router_rbac(isvc: InferenceService, names: Names) -> list[Manifest]:
    return discovery_rbac(isvc, names.router_account, "router")


def discovery_rbac(isvc: InferenceService, account: str, component: str) -> list[Manifest]:
    """A ServiceAccount that may read the namespace's EndpointSlices (and nothing else), for a pod
    that finds engines the way the router does (router/discovery.py)."""
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _metadata(isvc, account, component)},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": _metadata(isvc, account, component),
            "rules": [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                       "verbs": ["get", "list", "watch"]}],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": _metadata(isvc, account, component),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": account},
            "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": isvc.namespace}],
        },
    ]


def _engine_config(isvc: InferenceService, names: Names) -> Manifest:
    """The engine settings in one readable place; the pods get the same values as flags."""
    spec = isvc.spec
    settings = {
        "model": {"name": spec.model.name, "path": spec.model.container_path},
        "maxModelLen": spec.engine.max_model_len,
        "blockSize": spec.engine.block_size,
        "maxNumSeqs": spec.engine.max_num_seqs,
        "enablePrefixCaching": spec.engine.enable_prefix_caching,
        "extraArgs": list(spec.engine.extra_args),
        "kvConnector": spec.kv_transfer.connector,
        "pools": {pool.role: {"tensorParallelSize": pool.tensor_parallel_size,
                              "dataParallelSize": pool.data_parallel_size}
                  for pool in (spec.prefill, spec.decode)},
    }
    data = {"engine.json": json.dumps(settings, indent=2, sort_keys=True) + "\n"}
    for role in ("prefill", "decode"):
        data[f"{role}.kv-transfer-config.json"] = commands.compact_json(commands.kv_transfer_config(isvc, role))
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _metadata(isvc, names.engine_config, "engine"),
            "data": data}


# --- Services -----------------------------------------------------------------------------------------

def _service(isvc: InferenceService, names: Names, role: str, ports: list[tuple[str, int]], *,
             headless: bool = False, service_type: str = "ClusterIP") -> Manifest:
    spec: dict[str, Any] = {
        "selector": names.selector(role),
        "ports": [{"name": name, "port": port, "targetPort": name, "protocol": "TCP"} for name, port in ports],
    }
    if headless:
        # The router balances per engine itself, so it needs every pod address, not one virtual IP.
        spec["clusterIP"] = "None"
    else:
        spec["type"] = service_type
    return {"apiVersion": "v1", "kind": "Service", "metadata": _metadata(isvc, names.service(role), role),
            "spec": spec}


# --- pods ---------------------------------------------------------------------------------------------

def _http_probe(port: str, period: int, failures: int, timeout: int = 3) -> dict[str, Any]:
    return {"httpGet": {"path": "/health", "port": port}, "periodSeconds": period,
            "failureThreshold": failures, "timeoutSeconds": timeout}


def _tcp_probe(port: str, period: int, failures: int) -> dict[str, Any]:
    return {"tcpSocket": {"port": port}, "periodSeconds": period, "failureThreshold": failures, "timeoutSeconds": 3}


def _pre_stop(seconds: int) -> dict[str, Any]:
    return {"preStop": {"exec": {"command": ["sleep", str(seconds)]}}}


def _downward_env() -> list[dict[str, Any]]:
    # An engine advertises its pod IP to decode peers (p2p KV pulls go pod to pod).
    fields = {"POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace", "POD_IP": "status.podIP"}
    return [{"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}} for name, path in fields.items()]


def _volume(name: str, source: VolumeSource, read_only: bool, host_path_type: str) -> dict[str, Any]:
    if source.claim_name is not None:
        return {"name": name, "persistentVolumeClaim": {"claimName": source.claim_name, "readOnly": read_only}}
    return {"name": name, "hostPath": {"path": source.host_path, "type": host_path_type}}


def _container(isvc: InferenceService, role: str, argv: list[str], ports: list[tuple[str, int]],
               env: list[dict[str, Any]], resources: dict[str, Any], mounts: list[dict[str, Any]],
               probes: dict[str, Any], pre_stop_seconds: int) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": role,
        "image": isvc.spec.image,
        "imagePullPolicy": isvc.spec.image_pull_policy,
        "command": argv[:1],
        "args": argv[1:],
        "ports": [{"name": name, "containerPort": port, "protocol": "TCP"} for name, port in ports],
        # HOME on the writable /tmp: torch, triton and tokenizers write caches under it.
        "env": [*_downward_env(), {"name": "HOME", "value": "/tmp"},
                {"name": ENV_KEY_FILE, "value": INTERNAL_KEY_PATH}, *env],
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"},
                         {"name": INTERNAL_KEY_VOLUME, "mountPath": INTERNAL_KEY_DIR, "readOnly": True}, *mounts],
        **probes,
        "lifecycle": _pre_stop(pre_stop_seconds),
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"]}},
    }
    if resources:
        container["resources"] = resources
    return container


def _pod_template(isvc: InferenceService, names: Names, role: str, container: dict[str, Any], *,
                  grace_seconds: int, volumes: list[dict[str, Any]] | None = None, pool: Pool | None = None,
                  service_account: str | None = None, metrics_port: int | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "automountServiceAccountToken": service_account is not None,
        # Dozens of services in a namespace would otherwise flood every pod's environment.
        "enableServiceLinks": False,
        "securityContext": {"runAsNonRoot": True, "runAsUser": RUN_AS_USER, "runAsGroup": RUN_AS_USER,
                            "fsGroup": RUN_AS_USER, "seccompProfile": {"type": "RuntimeDefault"}},
        "terminationGracePeriodSeconds": grace_seconds,
        "containers": [container],
        "volumes": [{"name": "tmp", "emptyDir": {}}, _internal_key_volume(isvc), *(volumes or [])],
    }
    if service_account is not None:
        spec["serviceAccountName"] = service_account
    if isvc.spec.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": secret} for secret in isvc.spec.image_pull_secrets]
    if pool is not None and pool.node_selector:
        spec["nodeSelector"] = dict(pool.node_selector)
    if pool is not None and pool.tolerations:
        spec["tolerations"] = [dict(t) for t in pool.tolerations]
    metadata: dict[str, Any] = {"labels": names.labels(role)}
    if metrics_port is not None:
        metadata["annotations"] = {"prometheus.io/scrape": "true", "prometheus.io/port": str(metrics_port),
                                   "prometheus.io/path": "/metrics"}
    return {"metadata": metadata, "spec": spec}


def _deployment(isvc: InferenceService, names: Names, role: str, replicas: int, template: dict[str, Any],
                strategy: dict[str, Any] | None = None) -> Manifest:
    spec: dict[str, Any] = {"replicas": replicas, "selector": {"matchLabels": names.selector(role)},
                            "template": template}
    if strategy is not None:
        spec["strategy"] = strategy
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": _metadata(isvc, names.deployment(role), role), "spec": spec}


def engine_resources(pool: Pool) -> dict[str, Any]:
    """The user's resources, plus one GPU per TP*DP worker when `gpu` asks and they name no count."""
    resources = {section: dict(values) for section, values in pool.resources.items()}
    if pool.gpu and pool.user_gpu_count is None:
        resources.setdefault("limits", {})[GPU_RESOURCE] = str(pool.gpus_per_pod)
    return resources


def _engine(isvc: InferenceService, names: Names, pool: Pool) -> Manifest:
    spec = isvc.spec
    ports = [("http", ENGINE_PORT)]
    if spec.kv_transfer.connector == "p2p":
        ports.append(("kv-transfer", KV_TRANSFER_PORT))
    if commands.uses_rank_ports(isvc, pool.role):
        ports += [(f"rank-{rank}", port) for rank, port in enumerate(render_gateway.target_ports(isvc))]
    volumes: list[dict[str, Any]] = [
        # Tensor-parallel workers exchange tensors through /dev/shm; the runtime's 64 MiB default is too small.
        {"name": "shm", "emptyDir": {"medium": "Memory"}},
        {"name": "cache", "emptyDir": {}},
    ]
    mounts: list[dict[str, Any]] = [{"name": "shm", "mountPath": "/dev/shm"}, {"name": "cache", "mountPath": CACHE_DIR}]
    model = spec.model
    if model.has_volume:
        source = VolumeSource(model.pvc_claim, model.host_path)
        volumes.append(_volume("model", source, read_only=model.pvc_read_only, host_path_type="Directory"))
        mounts.append({"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True})
    shared = spec.kv_transfer.shared_storage
    if spec.kv_transfer.connector == "shared-storage" and shared is not None:
        volumes.append(_volume("kv-shared", shared, read_only=False, host_path_type="DirectoryOrCreate"))
        mounts.append({"name": "kv-shared", "mountPath": KV_SHARED_MOUNT})
    probes = {
        # Loading a large model can take many minutes; liveness must not kill it meanwhile.
        "startupProbe": _http_probe("http", period=10, failures=180),
        "readinessProbe": _http_probe("http", period=5, failures=3),
        "livenessProbe": _http_probe("http", period=15, failures=4, timeout=5),
    }
    container = _container(
        isvc, pool.role, commands.engine_command(isvc, pool.role), ports,
        env=[{"name": "PDSERVE_HOME", "value": CACHE_DIR}, *pool.env],
        resources=engine_resources(pool), mounts=mounts, probes=probes, pre_stop_seconds=ENGINE_PRESTOP_SECONDS)
    template = _pod_template(isvc, names, pool.role, container, grace_seconds=ENGINE_GRACE_SECONDS,
                             volumes=volumes, pool=pool, metrics_port=ENGINE_PORT)
    return _deployment(isvc, names, pool.role, pool.replicas, template)


def _router(isvc: InferenceService, names: Names) -> Manifest:
    router = isvc.spec.router
    env: list[dict[str, Any]] = []
    if router.api_key_secret is not None:
        env.append({"name": "PDSERVE_API_KEY", "valueFrom": {"secretKeyRef": {
            "name": router.api_key_secret.name, "key": router.api_key_secret.key}}})
    probes = {
        "startupProbe": _http_probe("http", period=2, failures=60),
        "readinessProbe": _http_probe("http", period=5, failures=3),
        "livenessProbe": _http_probe("http", period=10, failures=3),
    }
    container = _container(isvc, "router", commands.router_command(isvc), [("http", router.port)], env=env,
                           resources=dict(router.resources), mounts=[], probes=probes,
                           pre_stop_seconds=ROUTER_PRESTOP_SECONDS)
    template = _pod_template(isvc, names, "router", container, grace_seconds=ROUTER_GRACE_SECONDS,
                             service_account=names.router_account, metrics_port=router.port)
    return _deployment(isvc, names, "router", router.replicas, template)


def _coordinator(isvc: InferenceService, names: Names) -> Manifest:
    ports = [("stats", COORDINATOR_STATS_PORT), ("publish", COORDINATOR_PUBLISH_PORT), ("http", COORDINATOR_HTTP_PORT)]
    probes = {"readinessProbe": _http_probe("http", period=5, failures=3),
              "livenessProbe": _http_probe("http", period=10, failures=3)}
    container = _container(isvc, "coordinator", commands.coordinator_command(), ports, env=[],
                           resources=COORDINATOR_RESOURCES, mounts=[], probes=probes,
                           pre_stop_seconds=SUPPORT_PRESTOP_SECONDS)
    template = _pod_template(isvc, names, "coordinator", container, grace_seconds=SUPPORT_GRACE_SECONDS,
                             metrics_port=COORDINATOR_HTTP_PORT)
    return _deployment(isvc, names, "coordinator", 1, template)


def _kvstore(isvc: InferenceService, names: Names) -> Manifest:
    kv = isvc.spec.kv_transfer
    # Without explicit resources, reserve the store's capacity so the scheduler places it on a
    # node that can hold it.
    resources = dict(kv.kvstore_resources) or {"requests": {"memory": kv.kvstore_capacity}}
    probes = {"readinessProbe": _tcp_probe("kvstore", period=5, failures=3),
              "livenessProbe": _tcp_probe("kvstore", period=10, failures=3)}
    container = _container(isvc, "kvstore", commands.kvstore_command(isvc), [("kvstore", KVSTORE_PORT)], env=[],
                           resources=resources, mounts=[], probes=probes, pre_stop_seconds=SUPPORT_PRESTOP_SECONDS)
    template = _pod_template(isvc, names, "kvstore", container, grace_seconds=SUPPORT_GRACE_SECONDS)
    # One store: two during a rolling update would split the cache between them.
    return _deployment(isvc, names, "kvstore", 1, template, strategy={"type": "Recreate"})
