"""The InferenceService CustomResourceDefinition, built in Python.

The CRD is the one place where defaults and validation live. It is written here rather than
as a YAML file because the operator needs it at run time (to default and validate a resource
exactly as the API server would, for `pdserve operator render` and for clusters that skip
validation) and an installed wheel carries Python modules, not the repository's `crds/` folder.
`crds/inferenceservice.yaml` and the chart's copy are generated from `build_crd()`
(`pdserve operator crd`), and a test keeps them byte-identical.

Rules that need more than one field are CEL `x-kubernetes-validations`. `jsonschema` cannot
evaluate CEL, so every rule here has a Python twin in `spec.py` under the same id and message.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import yaml

GROUP = "pdserve.io"
VERSION = "v1alpha1"
KIND = "InferenceService"
PLURAL = "inferenceservices"
SINGULAR = "inferenceservice"
SHORT_NAMES = ["isvc"]
API_VERSION = f"{GROUP}/{VERSION}"
CRD_NAME = f"{PLURAL}.{GROUP}"

POOLS = ("prefill", "decode")
CONNECTORS = ("p2p", "kvstore", "shared-storage")
ROUTING_POLICIES = ("least-loaded", "round-robin")
TENSOR_PARALLEL_SIZES = (1, 2, 4, 8, 16, 32, 64)
BLOCK_SIZES = (8, 16, 32, 64, 128)
FAILURE_MODES = ("FailClose", "FailOpen")
# The InferencePool API's limit on targetPorts, which get one port per decode data-parallel rank.
MAX_GATEWAY_DATA_PARALLEL = 8
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
# HTTPRoute path values (Gateway API): absolute, URL path characters or %-escapes only.
PATH_PREFIX_PATTERN = r"^/(?:[-A-Za-z0-9/._~!$&'()*+,;=:@]|%[0-9a-fA-F]{2})*$"
# Services carry the resource's name plus a suffix ("-coordinator" is the longest, 12 characters)
# and must stay DNS-1035 labels of at most 63 characters.
MAX_NAME_LENGTH = 51
NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"

# The API server's own pattern for resource.Quantity strings.
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)


@dataclass(frozen=True)
class Rule:
    """A cross-field rule: a CEL expression at `path` (a dotted path into the schema, "" is the
    root) and the message both the API server and `spec.py` report when it fails."""

    id: str
    path: str
    cel: str
    message: str


RULES: tuple[Rule, ...] = (
    Rule("name", "",
         f"self.metadata.name.size() <= {MAX_NAME_LENGTH} && self.metadata.name.matches('{NAME_PATTERN}')",
         f"metadata.name must be a DNS-1035 label of at most {MAX_NAME_LENGTH} characters (lower-case letters, "
         "digits and '-', starting with a letter): the operator appends suffixes such as '-coordinator' to it"),
    Rule("model-one-volume", "spec.model",
         "!(has(self.pvc) && has(self.hostPath))",
         "model: set at most one of pvc and hostPath"),
    Rule("model-path", "spec.model",
         "has(self.pvc) || has(self.hostPath) || self.path != ''",
         "model.path is required unless the model comes from a pvc or hostPath volume"),
    Rule("autoscaling-bounds", "spec.prefill.autoscaling",
         "self.minReplicas <= self.maxReplicas",
         "prefill.autoscaling.minReplicas must not exceed maxReplicas"),
    Rule("autoscaling-bounds", "spec.decode.autoscaling",
         "self.minReplicas <= self.maxReplicas",
         "decode.autoscaling.minReplicas must not exceed maxReplicas"),
    Rule("pd-ratio-needs-autoscaling", "spec",
         "!has(self.pdRatio) || (has(self.prefill) && has(self.prefill.autoscaling))"
         " || (has(self.decode) && has(self.decode.autoscaling))",
         "pdRatio only applies while autoscaling: set autoscaling on prefill or decode, or drop pdRatio"),
    Rule("shared-storage-volume", "spec.kvTransfer",
         "self.connector != 'shared-storage' || has(self.sharedStorage)",
         "kvTransfer.sharedStorage (claimName or hostPath) is required for the shared-storage connector: "
         "prefill and decode pods must see the same files"),
    Rule("shared-storage-one-volume", "spec.kvTransfer.sharedStorage",
         "has(self.claimName) != has(self.hostPath)",
         "kvTransfer.sharedStorage: set exactly one of claimName and hostPath"),
    Rule("gateway-data-parallel", "spec",
         "!has(self.router) || !has(self.router.gateway) || !self.router.gateway.enabled"
         f" || !has(self.decode) || self.decode.dataParallelSize <= {MAX_GATEWAY_DATA_PARALLEL}",
         f"router.gateway needs decode.dataParallelSize <= {MAX_GATEWAY_DATA_PARALLEL}: the InferencePool lists one "
         f"target port per data-parallel rank and allows at most {MAX_GATEWAY_DATA_PARALLEL}"),
    Rule("gateway-ports", "spec.router.gateway",
         "!self.enabled || self.endpointPicker.port != self.endpointPicker.metricsPort",
         "router.gateway.endpointPicker: port (gRPC) and metricsPort must differ"),
)


def _quantity() -> dict[str, Any]:
    return {
        "anyOf": [{"type": "integer"}, {"type": "string"}],
        "pattern": QUANTITY_PATTERN,
        "x-kubernetes-int-or-string": True,
    }


def _resources(description: str) -> dict[str, Any]:
    return {
        "type": "object",
        "description": description,
        "properties": {section: {"type": "object", "additionalProperties": _quantity()}
                       for section in ("requests", "limits")},
    }


def _int(minimum: int | None = None, maximum: int | None = None, default: int | None = None,
          description: str = "") -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer", "format": "int32"}
    if description:
        schema["description"] = description
    if minimum is not None:
        schema["minimum"] = minimum
    if maximum is not None:
        schema["maximum"] = maximum
    if default is not None:
        schema["default"] = default
    return schema


def _toleration() -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "key": {"type": "string"},
            "operator": {"type": "string", "enum": ["Exists", "Equal"]},
            "value": {"type": "string"},
            "effect": {"type": "string", "enum": ["", "NoSchedule", "PreferNoSchedule", "NoExecute"]},
            "tolerationSeconds": {"type": "integer", "format": "int64"},
        },
    }


def _env_var() -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["name"],
        "properties": {
            "name": {"type": "string", "minLength": 1},
            "value": {"type": "string"},
            # Passed through to the pod unchanged; the API server validates it on the Deployment.
            "valueFrom": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
        },
    }


def _autoscaling() -> dict[str, Any]:
    return {
        "type": "object",
        "description": "Scale this pool from the coordinator's load. Present means enabled.",
        "required": ["maxReplicas"],
        # Either signal (or both: the larger recommendation wins).
        "anyOf": [{"required": ["targetWaitingPerReplica"]}, {"required": ["targetKVUsage"]}],
        "properties": {
            # Zero would leave no engine to report load, and nothing could scale the pool back up.
            "minReplicas": _int(minimum=1, default=1),
            "maxReplicas": _int(minimum=1),
            "targetWaitingPerReplica": {
                "type": "number", "minimum": 0, "exclusiveMinimum": True,
                "description": "Queued requests per engine the pool should run at.",
            },
            "targetKVUsage": {
                "type": "number", "minimum": 0, "exclusiveMinimum": True, "maximum": 1,
                "description": "KV cache usage (0-1] per engine the pool should run at.",
            },
            "scaleDownDelaySeconds": _int(
                minimum=0, default=300,
                description="Load must stay low this long before the pool shrinks; a manual replica "
                            "edit also pauses the autoscaler for this long."),
        },
    }


def _pool(role: str) -> dict[str, Any]:
    return {
        "type": "object",
        "description": f"The {role} engine pool.",
        "default": {},
        "properties": {
            "replicas": _int(minimum=0, default=1),
            "tensorParallelSize": {"type": "integer", "format": "int32", "default": 1,
                                   "enum": list(TENSOR_PARALLEL_SIZES)},
            "dataParallelSize": _int(minimum=1, maximum=64, default=1),
            "gpu": {"type": "boolean", "default": False,
                    "description": "Request nvidia.com/gpu = tensorParallelSize * dataParallelSize per pod "
                                   "(a count given in resources wins)."},
            "resources": _resources("Requests and limits for each engine container."),
            "nodeSelector": {"type": "object", "additionalProperties": {"type": "string"}},
            "tolerations": {"type": "array", "items": _toleration()},
            "env": {"type": "array", "items": _env_var()},
            "autoscaling": _autoscaling(),
        },
    }


def _host_path() -> dict[str, Any]:
    # Not refused here: whether hostPath is allowed is the installation's choice (the operator's
    # --allow-host-path), and a CRD is one for every installation in the cluster.
    return {"type": "string", "pattern": "^/",
            "description": "A directory on the node. Refused unless the operator runs with --allow-host-path."}


def _label_selector(description: str) -> dict[str, Any]:
    return {"type": "object", "description": description,
            "properties": {"matchLabels": {"type": "object", "additionalProperties": {"type": "string"}}}}


def _gateway() -> dict[str, Any]:
    return {
        "type": "object",
        "description": "Serve the decode pool behind a Gateway API Inference Extension gateway: an InferencePool "
                       "(inference.networking.k8s.io/v1) selecting the decode pods, an endpoint picker (`pdserve "
                       "epp`) the gateway asks over ext_proc, and optionally an HTTPRoute. The GIE CRDs come "
                       "with the cluster's gateway provider. Present means enabled unless enabled is false.",
        "properties": {
            "enabled": {"type": "boolean", "default": True},
            "inferencePool": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 63, "pattern": DNS_LABEL_PATTERN,
                             "description": "Name of the InferencePool (default: <name>-pool)."},
                },
            },
            "endpointPicker": {
                "type": "object",
                "default": {},
                "properties": {
                    "replicas": _int(minimum=0, default=1),
                    "port": _int(minimum=1, maximum=65535, default=9002,
                                 description="gRPC port: ext_proc and grpc.health.v1."),
                    "metricsPort": _int(minimum=1, maximum=65535, default=9090,
                                        description="HTTP port: /health and Prometheus /metrics."),
                    "failureMode": {"type": "string", "enum": list(FAILURE_MODES), "default": "FailClose",
                                    "description": "What the gateway does when the picker does not answer: "
                                                   "FailClose refuses the request, FailOpen picks an endpoint "
                                                   "itself."},
                    "resources": _resources("Requests and limits of each endpoint picker container."),
                },
            },
            "httpRoute": {
                "type": "object",
                "description": "Render an HTTPRoute from this Gateway to the InferencePool. Absent: none (bring "
                               "your own route).",
                "required": ["gatewayName"],
                "properties": {
                    "gatewayName": {"type": "string", "minLength": 1, "maxLength": 253,
                                    "pattern": DNS_SUBDOMAIN_PATTERN},
                    "gatewayNamespace": {"type": "string", "maxLength": 63, "pattern": DNS_LABEL_PATTERN,
                                         "description": "Default: this resource's namespace. Another namespace "
                                                        "must allow routes from this one (listener allowedRoutes)."},
                    "sectionName": {"type": "string", "minLength": 1, "maxLength": 253,
                                    "pattern": DNS_SUBDOMAIN_PATTERN,
                                    "description": "The Gateway listener to attach to (default: all)."},
                    "pathPrefix": {"type": "string", "maxLength": 1024, "default": "/",
                                   "pattern": PATH_PREFIX_PATTERN},
                },
            },
            "proxyNamespaceSelector": _label_selector(
                "With network policies on: only pods in namespaces matching this (the gateway's proxies) may "
                "reach the decode engines' target ports and the endpoint picker's gRPC port. Absent: any source "
                "(needed for proxies outside the cluster, e.g. managed load balancers)."),
        },
    }


def _volume_source(mount: str) -> dict[str, Any]:
    return {
        "type": "object",
        "description": f"A volume mounted at {mount} in every engine pod.",
        "properties": {
            "claimName": {"type": "string", "minLength": 1},
            "hostPath": _host_path(),
        },
    }


def _spec_schema() -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["model"],
        "properties": {
            "model": {
                "type": "object",
                "required": ["name"],
                "properties": {
                    "name": {"type": "string", "minLength": 1,
                             "description": "The model name clients send (served-model-name)."},
                    "path": {"type": "string", "default": "",
                             "description": "The model directory: inside the image without a volume "
                                            "(or 'demo'), else relative to the volume's mount /models."},
                    "pvc": {
                        "type": "object",
                        "required": ["claimName"],
                        "properties": {
                            "claimName": {"type": "string", "minLength": 1},
                            "readOnly": {"type": "boolean", "default": True},
                        },
                    },
                    "hostPath": _host_path(),
                },
            },
            "image": {"type": "string", "minLength": 1, "default": "pdserve:latest"},
            "imagePullPolicy": {"type": "string", "enum": ["Always", "IfNotPresent", "Never"],
                                "default": "IfNotPresent"},
            "imagePullSecrets": {"type": "array", "items": {"type": "string", "minLength": 1}},
            "prefill": _pool("prefill"),
            "decode": _pool("decode"),
            "pdRatio": {"type": "string", "pattern": "^[1-9][0-9]*:[1-9][0-9]*$",
                        "description": "prefill:decode replicas to keep while autoscaling, e.g. '1:2'."},
            "router": {
                "type": "object",
                "default": {},
                "properties": {
                    "replicas": _int(minimum=0, default=1),
                    "port": _int(minimum=1, maximum=65535, default=8000),
                    "routingPolicy": {"type": "string", "enum": list(ROUTING_POLICIES),
                                      "default": "least-loaded"},
                    "serviceType": {"type": "string", "enum": ["ClusterIP", "NodePort", "LoadBalancer"],
                                    "default": "ClusterIP"},
                    "apiKeySecret": {
                        "type": "object",
                        "description": "A Secret holding the API key clients must send as a Bearer token.",
                        "required": ["name"],
                        "properties": {
                            "name": {"type": "string", "minLength": 1},
                            "key": {"type": "string", "minLength": 1, "default": "api-key"},
                        },
                    },
                    "resources": _resources("Requests and limits for each router container."),
                    "gateway": _gateway(),
                },
            },
            "kvTransfer": {
                "type": "object",
                "default": {},
                "properties": {
                    "connector": {"type": "string", "enum": list(CONNECTORS), "default": "p2p"},
                    "kvstore": {
                        "type": "object",
                        "default": {},
                        "properties": {
                            "capacity": {**_quantity(), "default": "8Gi",
                                         "description": "Bytes of KV blocks the store keeps."},
                            "resources": _resources("Requests and limits of the KV store; without them "
                                                    "the store requests its capacity in memory."),
                        },
                    },
                    "sharedStorage": _volume_source("/kv-shared"),
                },
            },
            "networkPolicy": {
                "type": "object",
                "default": {},
                "description": "NetworkPolicies limiting who reaches each pod: engines only from the router and "
                               "each other, coordinator and KV store only from this service's pods, the router "
                               "from anywhere.",
                "properties": {
                    "enabled": {"type": "boolean", "default": True},
                    "metricsNamespaceSelector": _label_selector(
                        "Pods in namespaces matching this may scrape the engines' and coordinator's /metrics "
                        "(e.g. Prometheus). {} matches every namespace; absent: none."),
                },
            },
            "engine": {
                "type": "object",
                "default": {},
                "properties": {
                    "maxModelLen": _int(minimum=1, default=4096),
                    "blockSize": {"type": "integer", "format": "int32", "default": 16,
                                  "enum": list(BLOCK_SIZES)},
                    "maxNumSeqs": _int(minimum=1, default=256),
                    "enablePrefixCaching": {"type": "boolean", "default": True},
                    "extraArgs": {"type": "array", "items": {"type": "string"},
                                  "description": "Appended verbatim to every engine's command line."},
                },
            },
        },
    }


def _pool_status() -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "replicas": {"type": "integer", "format": "int32", "description": "Pods that exist."},
            "readyReplicas": {"type": "integer", "format": "int32"},
            "desiredReplicas": {"type": "integer", "format": "int32"},
            "ready": {"type": "string", "description": "ready/desired, for printing."},
            "selector": {"type": "string", "description": "Label selector of the pool's pods."},
        },
    }


def _status_schema() -> dict[str, Any]:
    pools = {role: _pool_status() for role in ("prefill", "decode", "router", "coordinator", "kvstore", "epp")}
    return {
        "type": "object",
        "properties": {
            "phase": {"type": "string", "enum": ["Pending", "Progressing", "Ready", "Degraded"]},
            "observedGeneration": {"type": "integer", "format": "int64"},
            "endpoint": {"type": "string"},
            **pools,
            "conditions": {
                "type": "array",
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["type"],
                "items": {
                    "type": "object",
                    "required": ["type", "status"],
                    "properties": {
                        "type": {"type": "string"},
                        "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
                        "reason": {"type": "string"},
                        "message": {"type": "string"},
                        "lastTransitionTime": {"type": "string", "format": "date-time"},
                        "observedGeneration": {"type": "integer", "format": "int64"},
                    },
                },
            },
        },
    }


def _attach_rules(schema: dict[str, Any]) -> None:
    for rule in RULES:
        node = schema
        for part in [p for p in rule.path.split(".") if p]:
            node = node["properties"][part]
        node.setdefault("x-kubernetes-validations", []).append({"rule": rule.cel, "message": rule.message})


def openapi_schema() -> dict[str, Any]:
    """The openAPIV3Schema of the served version."""
    schema: dict[str, Any] = {
        "type": "object",
        "description": "A model served with disaggregated prefill and decode pools behind a router.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": _spec_schema(),
            "status": _status_schema(),
        },
    }
    _attach_rules(schema)
    return schema


PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Prefill", "type": "string", "jsonPath": ".status.prefill.ready",
     "description": "ready/desired prefill engines"},
    {"name": "Decode", "type": "string", "jsonPath": ".status.decode.ready",
     "description": "ready/desired decode engines"},
    {"name": "Endpoint", "type": "string", "jsonPath": ".status.endpoint"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def build_crd() -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME, "labels": {"app.kubernetes.io/part-of": "pdserve"}},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"kind": KIND, "plural": PLURAL, "singular": SINGULAR, "shortNames": list(SHORT_NAMES),
                      "listKind": f"{KIND}List", "categories": ["pdserve"]},
            "versions": [{
                "name": VERSION,
                "served": True,
                "storage": True,
                "schema": {"openAPIV3Schema": openapi_schema()},
                "subresources": {
                    "status": {},
                    # `kubectl scale isvc/NAME --replicas=N` (and an HPA) drive the decode pool.
                    "scale": {
                        "specReplicasPath": ".spec.decode.replicas",
                        "statusReplicasPath": ".status.decode.replicas",
                        "labelSelectorPath": ".status.decode.selector",
                    },
                },
                "additionalPrinterColumns": copy.deepcopy(PRINTER_COLUMNS),
            }],
        },
    }


class _PlainDumper(yaml.SafeDumper):
    """Never writes YAML anchors: repeated sub-schemas stay readable (and diffable) in full."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def to_yaml(documents: list[dict[str, Any]]) -> str:
    """A YAML stream, one `---` document per object, keys in the order they were built."""
    return yaml.dump_all(documents, Dumper=_PlainDumper, sort_keys=False, explicit_start=True, width=120)


HEADER = "# Generated by `pdserve operator crd` from operator/crd.py; edit that file, not this one.\n"


def crd_yaml() -> str:
    return HEADER + to_yaml([build_crd()])
