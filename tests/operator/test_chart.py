"""The Helm chart, rendered by a small stand-in for `helm template` (no helm binary here)."""

from __future__ import annotations

import kubernetes_validate
import pytest
import yaml

from pdserve.cli import build_parser
from pdserve.operator import crd
from pdserve.operator.render import RUN_AS_USER, optional_objects, render
from pdserve.operator.spec import parse

# Resource and API group of every kind the renderer produces.
RENDERED = {"Deployment": ("apps", "deployments"), "Service": ("", "services"), "ConfigMap": ("", "configmaps"),
            "ServiceAccount": ("", "serviceaccounts"), "Role": ("rbac.authorization.k8s.io", "roles"),
            "RoleBinding": ("rbac.authorization.k8s.io", "rolebindings"), "Secret": ("", "secrets"),
            "NetworkPolicy": ("networking.k8s.io", "networkpolicies"),
            "InferencePool": ("inference.networking.k8s.io", "inferencepools"),
            "HTTPRoute": ("gateway.networking.k8s.io", "httproutes")}


def kinds(manifests: list[dict]) -> dict[str, list[dict]]:
    found: dict[str, list[dict]] = {}
    for m in manifests:
        found.setdefault(m["kind"], []).append(m)
    return found


def operator_container(manifests: list[dict]) -> dict:
    return kinds(manifests)["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]


def test_chart_metadata(repo):
    chart = yaml.safe_load((repo / "charts" / "pdserve" / "Chart.yaml").read_text())
    assert (chart["apiVersion"], chart["name"], chart["type"]) == ("v2", "pdserve", "application")
    assert chart["version"] and chart["appVersion"]
    crds = list((repo / "charts" / "pdserve" / "crds").iterdir())
    assert [p.name for p in crds] == ["inferenceservice.yaml"]  # identical to crds/, see test_crd


@pytest.mark.parametrize("values", [{}, {"watchNamespaces": ["team-a", "team-b"]},
                                    {"image": {"repository": "ghcr.io/acme/pdserve", "tag": "1.2.3"},
                                     "imagePullSecrets": [{"name": "ghcr"}], "nodeSelector": {"pool": "system"},
                                     "tolerations": [{"key": "system", "operator": "Exists"}], "verbose": True}])
def test_templates_render_valid_kubernetes(helm, values):
    manifests = helm.manifests(values)
    for manifest in manifests:
        kubernetes_validate.validate(manifest, "1.32", strict=True)
    found = kinds(manifests)
    assert set(found) >= {"ServiceAccount", "ClusterRole", "Deployment"}
    account = found["ServiceAccount"][0]["metadata"]
    pod = found["Deployment"][0]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == account["name"]
    assert pod["securityContext"]["runAsUser"] == RUN_AS_USER and pod["securityContext"]["runAsNonRoot"]
    bindings = found.get("ClusterRoleBinding", []) + found.get("RoleBinding", [])
    for binding in bindings:
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                      "name": found["ClusterRole"][0]["metadata"]["name"]}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["name"],
                                        "namespace": account["namespace"]}]
    # The container's arguments are a valid `pdserve operator run` command line.
    args = build_parser(operator_container(manifests)["args"]).parse_args(operator_container(manifests)["args"])
    assert args.operator_command == "run" and args.liveness.endswith("/healthz")
    assert operator_container(manifests)["livenessProbe"]["httpGet"]["path"] == "/healthz"


def test_watched_namespaces_decide_the_binding_and_arguments(helm):
    everywhere = helm.manifests()
    assert [m["kind"] for m in everywhere if m["kind"].endswith("Binding")] == ["ClusterRoleBinding"]
    assert "--all-namespaces" in operator_container(everywhere)["args"]

    some = helm.manifests({"watchNamespaces": ["team-a", "team-b"]})
    bindings = [m for m in some if m["kind"].endswith("Binding")]
    assert [(b["kind"], b["metadata"]["namespace"]) for b in bindings] == [("RoleBinding", "team-a"),
                                                                         ("RoleBinding", "team-b")]
    args = operator_container(some)["args"]
    assert "--all-namespaces" not in args
    assert build_parser(args).parse_args(args).namespace == ["team-a", "team-b"]


def test_values_reach_the_operator(helm):
    default = operator_container(helm.manifests())
    assert default["image"] == f"pdserve:{helm.builtins['Chart']['AppVersion']}"
    custom = helm.manifests({"image": {"repository": "ghcr.io/acme/pdserve", "tag": "1.2.3", "pullPolicy": "Always"},
                             "autoscaleInterval": 5, "verbose": True, "nodeSelector": {"pool": "system"}})
    container = operator_container(custom)
    assert (container["image"], container["imagePullPolicy"]) == ("ghcr.io/acme/pdserve:1.2.3", "Always")
    args = build_parser(container["args"]).parse_args(container["args"])
    assert args.autoscale_interval == 5 and args.verbose
    assert kinds(custom)["Deployment"][0]["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "system"}
    assert "pdserve-operator" in helm.render()["NOTES.txt"]


SPECS = [
    {"model": {"name": "m", "path": "demo"}},
    {"model": {"name": "m", "pvc": {"claimName": "models"}}, "kvTransfer": {"connector": "kvstore"},
     "router": {"apiKeySecret": {"name": "keys"}}},
    {"model": {"name": "m", "path": "demo"}, "kvTransfer": {"connector": "shared-storage",
                                                            "sharedStorage": {"claimName": "kv"}}},
    {"model": {"name": "m", "path": "demo"}, "router": {"gateway": {"httpRoute": {"gatewayName": "gw"}}}},
]


@pytest.mark.parametrize("spec", SPECS)
def test_rbac_covers_everything_the_operator_renders_and_grants(chart_rbac, spec):
    manifests = render({"apiVersion": crd.API_VERSION, "kind": crd.KIND,
                        "metadata": {"name": "x", "namespace": "ns", "uid": "u"}, "spec": spec})
    for manifest in manifests:
        group, resource = RENDERED[manifest["kind"]]
        for verb in ("get", "create", "patch"):  # apply: read, create or patch
            assert chart_rbac(group, resource, verb), f"cannot {verb} {resource}"
    # What a spec no longer renders is deleted (the KV store, policies, the gateway's objects).
    for api_version, kind, _ in optional_objects(parse({"apiVersion": crd.API_VERSION, "kind": crd.KIND,
                                                        "metadata": {"name": "x"}, "spec": spec})):
        group, resource = RENDERED[kind]
        assert chart_rbac(group, resource, "delete"), f"cannot delete {resource}"
        # Kubernetes refuses a Role granting more than its creator holds.
        for rule in manifest.get("rules", []):
            for group_ in rule["apiGroups"]:
                for res in rule["resources"]:
                    for verb in rule["verbs"]:
                        assert chart_rbac(group_, res, verb), f"the router's Role grants {verb} {res} beyond ours"
    for group, resource, verb in [("pdserve.io", "inferenceservices", "watch"), ("pdserve.io", "inferenceservices",
                                  "patch"), ("pdserve.io", "inferenceservices/status", "patch"),
                                  ("apps", "deployments", "watch"), ("apps", "deployments", "delete"),
                                  ("", "services", "delete"), ("", "events", "create"),
                                  ("networking.k8s.io", "networkpolicies", "delete"),
                                  # ownerReferences with blockOwnerDeletion under OwnerReferencesPermissionEnforcement
                                  ("pdserve.io", "inferenceservices/finalizers", "update")]:
        assert chart_rbac(group, resource, verb)


def test_rbac_grants_nothing_beyond_its_job(helm):
    role = next(m for m in helm.manifests() if m["kind"] == "ClusterRole")
    granted = {(g, r) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]}
    allowed = {("pdserve.io", "inferenceservices"), ("pdserve.io", "inferenceservices/status"),
               ("pdserve.io", "inferenceservices/finalizers"), ("discovery.k8s.io", "endpointslices"),
               ("", "events"), *RENDERED.values()}
    assert granted <= allowed
    assert not any("*" in rule["verbs"] or "*" in rule["resources"] for rule in role["rules"])
    # Secrets: only the internal keys it creates, read by name. No list/watch: that would read every
    # Secret of a namespace, the router's API keys among them.
    secrets = {verb for rule in role["rules"] if "secrets" in rule["resources"] for verb in rule["verbs"]}
    assert secrets == {"get", "create", "patch"}
    finalizers = [rule for rule in role["rules"] if "inferenceservices/finalizers" in rule["resources"]]
    assert [rule["verbs"] for rule in finalizers] == [["update"]]


def test_host_paths_are_allowed_only_by_the_chart_value(helm):
    args = operator_container(helm.manifests())["args"]
    assert not build_parser(args).parse_args(args).allow_host_path
    args = operator_container(helm.manifests({"allowHostPath": True}))["args"]
    assert build_parser(args).parse_args(args).allow_host_path


def test_the_coordinator_policy_admits_the_charts_operator_pods(helm):
    """The autoscaler reads each coordinator's /stats from the operator's pod: its labels must match."""
    from pdserve.operator.names import OPERATOR_POD_LABELS

    pod_labels = kinds(helm.manifests())["Deployment"][0]["spec"]["template"]["metadata"]["labels"]
    assert OPERATOR_POD_LABELS.items() <= pod_labels.items()


def test_the_template_stand_in_refuses_what_it_does_not_understand(helm):
    with pytest.raises(ValueError):
        helm._render_text("{{ include \"x\" . }}", {"Values": {}})
    with pytest.raises(ValueError):
        helm._render_text("{{ .Values.missing }}", {"Values": {}})
    with pytest.raises(ValueError):
        helm._render_text("{{ if .Values.x }}never closed", {"Values": {}})
