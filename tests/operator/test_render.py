"""Pure rendering: a table of specs, every manifest valid for Kubernetes 1.32, and what each must carry."""

from __future__ import annotations

import base64
import copy
import datetime as dt
import json

import kubernetes_validate
import pytest
import yaml

from pdserve.cli import build_parser
from pdserve.cli import main as pdserve_main
from pdserve.engine.internal_auth import ENV_KEY, ENV_KEY_FILE, generate_key, load_internal_key
from pdserve.engine.server.rank_ports import check_rank_ports
from pdserve.operator import crd
from pdserve.operator.names import Names
from pdserve.operator.render import (ENGINE_GRACE_SECONDS, ENGINE_PRESTOP_SECONDS, INTERNAL_KEY_PATH, RUN_AS_USER,
                                     internal_key_secret, optional_objects, render)
from pdserve.operator.schema import defaulted, schema_errors
from pdserve.operator.spec import InvalidSpec, parse
from pdserve.operator.status import GatewayOutcome, compute_status

LABEL_KEYS = {"app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/component",
              "app.kubernetes.io/managed-by", "app.kubernetes.io/part-of"}


def isvc(**spec) -> dict:
    obj = {"apiVersion": crd.API_VERSION, "kind": crd.KIND,
           "metadata": {"name": "llama", "namespace": "serving", "uid": "0f1e2d3c-uid"},
           "spec": {"model": {"name": "llama-3-8b", "path": "/models/llama"}}}
    obj["spec"].update(copy.deepcopy(spec))
    return obj


SPECS = {
    "defaults": isvc(),
    "tensor and data parallel on GPUs": isvc(
        prefill={"replicas": 2, "tensorParallelSize": 2, "dataParallelSize": 2, "gpu": True},
        decode={"replicas": 4, "tensorParallelSize": 2, "gpu": True,
                "resources": {"requests": {"cpu": "8", "memory": "64Gi"}, "limits": {"memory": "64Gi"}}}),
    "kvstore connector": isvc(kvTransfer={"connector": "kvstore", "kvstore": {"capacity": "16Gi"}}),
    "autoscaling with a ratio": isvc(
        pdRatio="1:2",
        prefill={"autoscaling": {"minReplicas": 1, "maxReplicas": 4, "targetWaitingPerReplica": 4}},
        decode={"replicas": 2, "autoscaling": {"minReplicas": 2, "maxReplicas": 8, "targetKVUsage": 0.7,
                                               "scaleDownDelaySeconds": 120}}),
    "node selectors and tolerations": isvc(
        prefill={"nodeSelector": {"gpu.nvidia.com/class": "H100"},
                 "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]},
        decode={"nodeSelector": {"gpu.nvidia.com/class": "L4"},
                "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoExecute",
                                 "tolerationSeconds": 60}]}),
    "model and KV files on PVCs, API key, extras": isvc(
        model={"name": "llama-3-8b", "path": "llama-3-8b-instruct", "pvc": {"claimName": "models"}},
        kvTransfer={"connector": "shared-storage", "sharedStorage": {"claimName": "kv-cache"}},
        router={"replicas": 2, "port": 9000, "routingPolicy": "round-robin",
                "apiKeySecret": {"name": "llm-keys"}, "resources": {"requests": {"cpu": "500m"}}},
        engine={"maxModelLen": 8192, "blockSize": 32, "maxNumSeqs": 64, "enablePrefixCaching": False,
                "extraArgs": ["--long-prefill-token-threshold=512", "--seed=7"]},
        decode={"env": [{"name": "NCCL_DEBUG", "value": "INFO"},
                        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}]}),
    "host paths, load balancer, pull secrets": isvc(
        model={"name": "m", "hostPath": "/mnt/models"},
        kvTransfer={"connector": "shared-storage", "sharedStorage": {"hostPath": "/mnt/kv"}},
        router={"serviceType": "LoadBalancer"}, image="registry.example/pdserve:0.1",
        imagePullPolicy="Always", imagePullSecrets=["registry-creds"]),
    "prefill scaled to zero": isvc(prefill={"replicas": 0}),
    "metrics scraped from a namespace": isvc(
        kvTransfer={"connector": "kvstore"},
        networkPolicy={"metricsNamespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}),
    "network policies off": isvc(networkPolicy={"enabled": False}),
    "inference gateway, data-parallel decode": isvc(
        decode={"replicas": 2, "dataParallelSize": 4},
        router={"routingPolicy": "round-robin", "gateway": {
            "endpointPicker": {"replicas": 2, "failureMode": "FailOpen", "resources": {"requests": {"cpu": "1"}}},
            "httpRoute": {"gatewayName": "inference-gateway", "gatewayNamespace": "gateways",
                          "sectionName": "http", "pathPrefix": "/v1"},
            "proxyNamespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateways"}}}},
        networkPolicy={"metricsNamespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}),
}


def render_case(name: str) -> list[dict]:
    # The table is about rendering; the refusal of hostPath without the flag is tested on its own.
    return render(SPECS[name], allow_host_path=True)


def by_kind(manifests: list[dict], kind: str) -> dict[str, dict]:
    return {m["metadata"]["name"]: m for m in manifests if m["kind"] == kind}


def container(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]["containers"][0]


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


@pytest.mark.parametrize("case", SPECS)
def test_every_manifest_is_valid_kubernetes(case, validate_manifest):
    manifests = render_case(case)
    for manifest in manifests:
        validate_manifest(manifest)  # kubernetes-validate; the vendored GIE schemas for their kinds
    names = [(m["kind"], m["metadata"]["name"]) for m in manifests]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("case", SPECS)
def test_every_object_is_labelled_owned_and_namespaced(case):
    for manifest in render_case(case):
        meta = manifest["metadata"]
        assert meta["namespace"] == "serving"
        assert len(meta["name"]) <= 63
        assert LABEL_KEYS <= set(meta["labels"]), meta["name"]
        assert meta["labels"]["app.kubernetes.io/instance"] == "llama"
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "pdserve-operator"
        assert meta["ownerReferences"] == [{"apiVersion": "pdserve.io/v1alpha1", "kind": "InferenceService",
                                            "name": "llama", "uid": "0f1e2d3c-uid", "controller": True,
                                            "blockOwnerDeletion": True}]


@pytest.mark.parametrize("case", SPECS)
def test_pods_are_wired_consistently(case):
    manifests = render_case(case)
    deployments = by_kind(manifests, "Deployment")
    for name, deployment in deployments.items():
        template = deployment["spec"]["template"]
        labels = template["metadata"]["labels"]
        role = labels["pdserve.io/role"]
        assert name == f"llama-{role}"
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
        pod = template["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] == RUN_AS_USER
        main = container(deployment)
        assert main["securityContext"]["allowPrivilegeEscalation"] is False
        assert main["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        ports = {p["name"] for p in main["ports"]}
        for probe in ("readinessProbe", "livenessProbe"):
            if "grpc" in main[probe]:  # a gRPC probe takes a number, not a port name
                assert main[probe]["grpc"]["port"] in {p["containerPort"] for p in main["ports"]}, name
                continue
            action = main[probe].get("httpGet") or main[probe]["tcpSocket"]
            assert action["port"] in ports, f"{name} {probe} names a port the container lacks"
            if "httpGet" in main[probe]:
                assert main[probe]["httpGet"]["path"] == "/health"
        pre_stop = int(main["lifecycle"]["preStop"]["exec"]["command"][1])
        assert pod["terminationGracePeriodSeconds"] > pre_stop
        mounts = {m["name"] for m in main["volumeMounts"]}
        assert mounts <= {v["name"] for v in pod["volumes"]}
    for name, service in by_kind(manifests, "Service").items():
        selected = [d for d in deployments.values()
                    if service["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert len(selected) == 1, f"service {name} must select exactly one pool"
        ports = {p["name"] for p in container(selected[0])["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= ports


def test_engine_command_lines():
    manifests = render_case("defaults")
    deployments = by_kind(manifests, "Deployment")
    prefill = container(deployments["llama-prefill"])
    assert prefill["command"] == ["pdserve"]
    assert prefill["args"] == [
        "serve", "--model", "/models/llama", "--served-model-name", "llama-3-8b", "--host", "0.0.0.0",
        "--port", "8000", "--tensor-parallel-size", "1", "--data-parallel-size", "1", "--max-model-len", "4096",
        "--block-size", "16", "--max-num-seqs", "256", "--enable-prefix-caching", "--engine-role", "prefill",
        "--kv-transfer-config",
        '{"kv_connector":"p2p","kv_connector_extra_config":{"side_channel_host":"$(POD_IP)","side_channel_port":5600},'
        '"kv_role":"kv_producer"}',
        "--coordinator-address", "llama-coordinator:5557",
    ]
    decode = container(deployments["llama-decode"])["args"]
    assert flag(decode, "--engine-role") == "decode"
    assert json.loads(flag(decode, "--kv-transfer-config"))["kv_role"] == "kv_consumer"
    # p2p: the KV side channel is a declared port on every engine.
    assert {"name": "kv-transfer", "containerPort": 5600, "protocol": "TCP"} in prefill["ports"]


@pytest.mark.parametrize("name", list(SPECS))
def test_engine_command_lines_are_accepted_by_pdserve_serve(name):
    """The operator spells the engine's flags out by hand; the real CLI parser must take them."""
    from pdserve.cli import build_parser

    deployments = by_kind(render_case(name), "Deployment")
    for role in ("prefill", "decode"):
        args = container(deployments[f"llama-{role}"])["args"]
        parsed = build_parser(args).parse_args(args)
        assert parsed.engine_role == role
        assert parsed.port == int(flag(args, "--port"))
        assert parsed.kv_transfer_config == json.loads(flag(args, "--kv-transfer-config"))
        from pdserve.kvstore.config import parse_kv_transfer_config

        assert parse_kv_transfer_config(parsed.kv_transfer_config).connector == SPECS[name]["spec"].get(
            "kvTransfer", {}).get("connector", "p2p")


def test_engine_settings_and_extra_args():
    deployments = by_kind(render_case("model and KV files on PVCs, API key, extras"), "Deployment")
    args = container(deployments["llama-decode"])["args"]
    assert flag(args, "--model") == "/models/llama-3-8b-instruct"
    assert (flag(args, "--max-model-len"), flag(args, "--block-size"), flag(args, "--max-num-seqs")) == (
        "8192", "32", "64")
    assert "--no-enable-prefix-caching" in args and "--enable-prefix-caching" not in args
    assert args[-2:] == ["--long-prefill-token-threshold=512", "--seed=7"]
    assert json.loads(flag(args, "--kv-transfer-config")) == {
        "kv_connector": "shared-storage", "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"path": "/kv-shared"}}
    pod = deployments["llama-decode"]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    assert volumes["kv-shared"]["persistentVolumeClaim"] == {"claimName": "kv-cache", "readOnly": False}
    mounts = {m["mountPath"]: m for m in container(deployments["llama-decode"])["volumeMounts"]}
    assert mounts["/models"]["readOnly"] is True and "/kv-shared" in mounts
    env = {e["name"]: e for e in container(deployments["llama-decode"])["env"]}
    assert env["NCCL_DEBUG"]["value"] == "INFO" and "secretKeyRef" in env["HF_TOKEN"]["valueFrom"]
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    # The KV side channel exists only for p2p.
    assert "kv-transfer" not in {p["name"] for p in container(deployments["llama-decode"])["ports"]}


def test_host_path_volumes_and_images():
    deployments = by_kind(render_case("host paths, load balancer, pull secrets"), "Deployment")
    pod = deployments["llama-prefill"]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["model"]["hostPath"] == {"path": "/mnt/models", "type": "Directory"}
    assert volumes["kv-shared"]["hostPath"] == {"path": "/mnt/kv", "type": "DirectoryOrCreate"}
    assert flag(container(deployments["llama-prefill"])["args"], "--model") == "/models"
    for deployment in deployments.values():
        spec = deployment["spec"]["template"]["spec"]
        assert spec["imagePullSecrets"] == [{"name": "registry-creds"}]
        assert container(deployment)["image"] == "registry.example/pdserve:0.1"
        assert container(deployment)["imagePullPolicy"] == "Always"


def test_engines_get_shared_memory_gpus_and_graceful_shutdown():
    deployments = by_kind(render_case("tensor and data parallel on GPUs"), "Deployment")
    for role, gpus in (("prefill", "4"), ("decode", "2")):
        deployment = deployments[f"llama-{role}"]
        pod = deployment["spec"]["template"]["spec"]
        main = container(deployment)
        assert {"name": "shm", "emptyDir": {"medium": "Memory"}} in pod["volumes"]
        assert {"name": "shm", "mountPath": "/dev/shm"} in main["volumeMounts"]
        assert main["resources"]["limits"]["nvidia.com/gpu"] == gpus
        assert pod["terminationGracePeriodSeconds"] == ENGINE_GRACE_SECONDS
        assert main["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", str(ENGINE_PRESTOP_SECONDS)]
        assert main["startupProbe"]["failureThreshold"] * main["startupProbe"]["periodSeconds"] >= 600
    assert flag(container(deployments["llama-prefill"])["args"], "--tensor-parallel-size") == "2"
    assert flag(container(deployments["llama-prefill"])["args"], "--data-parallel-size") == "2"
    assert container(deployments["llama-decode"])["resources"]["requests"] == {"cpu": "8", "memory": "64Gi"}
    # Without gpu: true (or a count in resources) no GPU is requested.
    defaults = by_kind(render_case("defaults"), "Deployment")
    assert "resources" not in container(defaults["llama-decode"])


def test_a_gpu_count_in_resources_wins():
    obj = isvc(decode={"tensorParallelSize": 2, "gpu": True, "resources": {"limits": {"nvidia.com/gpu": 4}}})
    decode = container(by_kind(render(obj), "Deployment")["llama-decode"])
    assert decode["resources"]["limits"] == {"nvidia.com/gpu": "4"}


def test_node_selectors_and_tolerations_go_to_their_pool_only():
    deployments = by_kind(render_case("node selectors and tolerations"), "Deployment")
    prefill = deployments["llama-prefill"]["spec"]["template"]["spec"]
    decode = deployments["llama-decode"]["spec"]["template"]["spec"]
    assert prefill["nodeSelector"] == {"gpu.nvidia.com/class": "H100"}
    assert decode["nodeSelector"] == {"gpu.nvidia.com/class": "L4"}
    assert decode["tolerations"][0]["tolerationSeconds"] == 60
    for role in ("router", "coordinator"):
        assert "nodeSelector" not in deployments[f"llama-{role}"]["spec"]["template"]["spec"]


def test_kv_store_only_for_its_connector():
    manifests = render_case("kvstore connector")
    deployments = by_kind(manifests, "Deployment")
    kvstore = deployments["llama-kvstore"]
    assert container(kvstore)["args"] == ["kvstore", "--host", "0.0.0.0", "--port", "5700",
                                          "--capacity", str(16 * 2**30)]
    assert container(kvstore)["resources"] == {"requests": {"memory": "16Gi"}}
    assert container(kvstore)["readinessProbe"]["tcpSocket"] == {"port": "kvstore"}
    assert kvstore["spec"]["strategy"] == {"type": "Recreate"} and kvstore["spec"]["replicas"] == 1
    assert by_kind(manifests, "Service")["llama-kvstore"]["spec"]["ports"][0]["port"] == 5700
    config = json.loads(flag(container(deployments["llama-prefill"])["args"], "--kv-transfer-config"))
    assert config["kv_connector_extra_config"] == {"kvstore_url": "tcp://llama-kvstore:5700"}
    for case in ("defaults", "model and KV files on PVCs, API key, extras"):
        assert "llama-kvstore" not in by_kind(render_case(case), "Deployment")


def test_router_discovers_engines_through_its_own_account():
    manifests = render_case("model and KV files on PVCs, API key, extras")
    router = by_kind(manifests, "Deployment")["llama-router"]
    assert container(router)["args"] == [
        "router", "--host", "0.0.0.0", "--port", "9000", "--model", "llama-3-8b", "--prefill-service",
        "llama-prefill", "--decode-service", "llama-decode", "--namespace", "serving", "--engine-port", "8000",
        "--coordinator-address", "llama-coordinator:5558", "--routing-policy", "round-robin"]
    assert router["spec"]["replicas"] == 2
    env = {e["name"]: e for e in container(router)["env"]}
    assert env["PDSERVE_API_KEY"]["valueFrom"] == {"secretKeyRef": {"name": "llm-keys", "key": "api-key"}}
    pod = router["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "llama-router" and pod["automountServiceAccountToken"] is True
    role = by_kind(manifests, "Role")["llama-router"]
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["get", "list", "watch"]}]
    binding = by_kind(manifests, "RoleBinding")["llama-router"]
    assert binding["roleRef"]["name"] == "llama-router"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "llama-router", "namespace": "serving"}]
    assert "llama-router" in by_kind(manifests, "ServiceAccount")
    # Engines talk to no API: no token in their pods.
    engine = by_kind(manifests, "Deployment")["llama-decode"]["spec"]["template"]["spec"]
    assert engine["automountServiceAccountToken"] is False and "serviceAccountName" not in engine


def test_services():
    services = by_kind(render_case("host paths, load balancer, pull secrets"), "Service")
    for role in ("prefill", "decode"):
        assert services[f"llama-{role}"]["spec"]["clusterIP"] == "None"  # headless: the router sees each pod
    assert services["llama-router"]["spec"]["type"] == "LoadBalancer"
    assert services["llama-router"]["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http",
                                                         "protocol": "TCP"}]
    assert {p["name"]: p["port"] for p in services["llama-coordinator"]["spec"]["ports"]} == {
        "stats": 5557, "publish": 5558, "http": 8080}
    coordinator = container(by_kind(render_case("defaults"), "Deployment")["llama-coordinator"])
    assert coordinator["args"] == ["coordinator", "--host", "0.0.0.0", "--stats-port", "5557", "--publish-port",
                                   "5558", "--http-port", "8080"]


def test_engine_settings_config_map():
    config = by_kind(render_case("tensor and data parallel on GPUs"), "ConfigMap")["llama-engine"]
    settings = json.loads(config["data"]["engine.json"])
    assert settings["model"] == {"name": "llama-3-8b", "path": "/models/llama"}
    assert settings["pools"]["prefill"] == {"tensorParallelSize": 2, "dataParallelSize": 2}
    assert json.loads(config["data"]["decode.kv-transfer-config.json"])["kv_role"] == "kv_consumer"


def test_replicas_follow_the_spec():
    deployments = by_kind(render_case("prefill scaled to zero"), "Deployment")
    assert {n: d["spec"]["replicas"] for n, d in deployments.items()} == {
        "llama-prefill": 0, "llama-decode": 1, "llama-router": 1, "llama-coordinator": 1}


def test_rendering_is_deterministic_and_defaults_are_applied_once():
    obj = SPECS["autoscaling with a ratio"]
    from pdserve.operator.schema import defaulted

    assert render(obj) == render(copy.deepcopy(obj)) == render(defaulted(obj))


def test_without_a_uid_objects_render_without_owner():
    obj = isvc()
    del obj["metadata"]["uid"]
    assert all("ownerReferences" not in m["metadata"] for m in render(obj))


def test_cli_render_prints_a_yaml_stream(repo, capsys, tmp_path):
    sample = repo / "crds" / "examples" / "demo.yaml"
    assert pdserve_main(["operator", "render", "-f", str(sample)]) == 0
    out = capsys.readouterr().out
    docs = list(yaml.safe_load_all(out))
    assert docs == render(yaml.safe_load(sample.read_text()))
    assert out.count("\n---\n") == len(docs) - 1 and out.startswith("---\n")
    for doc in docs:
        kubernetes_validate.validate(doc, "1.32", strict=True)

    # A namespace for resources that name none.
    bare = yaml.safe_load(sample.read_text())
    del bare["metadata"]["namespace"]
    path = tmp_path / "bare.yaml"
    path.write_text(yaml.safe_dump(bare))
    assert pdserve_main(["operator", "render", "-f", str(path), "-n", "team-a"]) == 0
    assert {d["metadata"]["namespace"] for d in yaml.safe_load_all(capsys.readouterr().out)} == {"team-a"}


def test_cli_render_explains_an_invalid_resource(capsys, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(isvc(pdRatio="1:2", decode={"tensorParallelSize": 3})))
    assert pdserve_main(["operator", "render", "-f", str(path)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "InferenceService llama is invalid" in captured.err
    assert "spec.decode.tensorParallelSize: 3 is not one of [1, 2, 4, 8, 16, 32, 64]" in captured.err


def test_cli_crd_prints_the_crd(capsys):
    assert pdserve_main(["operator", "crd"]) == 0
    assert capsys.readouterr().out == crd.crd_yaml()


# --- the internal key ------------------------------------------------------------------------------

@pytest.mark.parametrize("case", SPECS)
def test_every_pod_reads_the_internal_key_from_its_secret(case):
    manifests = render_case(case)
    secret = by_kind(manifests, "Secret")["llama-internal-key"]
    # The skeleton: the operator fills the key in when it creates the Secret, never in rendering.
    assert secret["type"] == "Opaque" and "data" not in secret and "stringData" not in secret
    deployments = by_kind(manifests, "Deployment")
    assert set(deployments) >= {"llama-prefill", "llama-decode", "llama-router", "llama-coordinator"}
    for name, deployment in deployments.items():
        pod = deployment["spec"]["template"]["spec"]
        main = container(deployment)
        env = {e["name"]: e for e in main["env"]}
        assert ENV_KEY not in env, f"{name}: the key itself must not be in the pod spec"
        path = env[ENV_KEY_FILE]["value"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        mount = next(m for m in main["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
        assert mount["readOnly"] is True
        source = volumes[mount["name"]]["secret"]
        assert source["secretName"] == secret["metadata"]["name"]
        # The file the env names is the Secret's key, projected under the mount.
        assert {"key": "key", "path": path.removeprefix(mount["mountPath"] + "/")} in source["items"]
        assert source["defaultMode"] & 0o077 == 0o040  # group (the pod's fsGroup) may read; others nothing


def test_a_filled_secret_holds_a_usable_key(tmp_path):
    key = generate_key()
    secret = internal_key_secret(parse(isvc()), key)
    kubernetes_validate.validate(secret, "1.32", strict=True)
    # What the kubelet writes into the pod's file is the decoded value; the engines must accept it.
    (tmp_path / "key").write_bytes(base64.b64decode(secret["data"]["key"]))
    assert load_internal_key({ENV_KEY_FILE: str(tmp_path / "key")}) == key.encode()


# --- NetworkPolicies -------------------------------------------------------------------------------

def selects(selector: dict, labels: dict) -> bool:
    """A LabelSelector against labels, as the API server evaluates it."""
    if not set(selector) <= {"matchLabels", "matchExpressions"}:
        raise AssertionError(f"unexpected selector {selector}")
    if not (selector.get("matchLabels") or {}).items() <= labels.items():
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        if not {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
                "Exists": key in labels, "DoesNotExist": key not in labels}[op]:
            return False
    return True


def admits(policy: dict, port: int, labels: dict, namespace: str = "serving",
           namespace_labels: dict | None = None) -> bool:
    """Whether `policy` lets a pod (its labels, in `namespace`) reach `port` on the pods it selects."""
    namespace_labels = namespace_labels or {"kubernetes.io/metadata.name": namespace}
    own_namespace = policy["metadata"]["namespace"]
    for rule in policy["spec"].get("ingress") or []:
        ports = rule.get("ports")
        if ports and not any(p["protocol"] == "TCP" and p["port"] <= port <= p.get("endPort", p["port"])
                             for p in ports):
            continue
        peers = rule.get("from")
        if not peers:
            return True
        for peer in peers:
            assert "ipBlock" not in peer
            if "namespaceSelector" in peer:
                in_namespace = selects(peer["namespaceSelector"], namespace_labels)
            else:
                in_namespace = namespace == own_namespace
            if in_namespace and selects(peer.get("podSelector", {}), labels):
                return True
    return False


def pod_labels(manifests: list[dict]) -> dict[str, dict]:
    return {role: by_kind(manifests, "Deployment")[f"llama-{role}"]["spec"]["template"]["metadata"]["labels"]
            for role in ("prefill", "decode", "router", "coordinator", "kvstore", "epp")
            if f"llama-{role}" in by_kind(manifests, "Deployment")}


def policy_for(manifests: list[dict], role: str) -> dict:
    """The one policy selecting the pods of `role`; every pod is selected by exactly one."""
    labels = pod_labels(manifests)[role]
    selecting = [p for p in by_kind(manifests, "NetworkPolicy").values() if selects(p["spec"]["podSelector"], labels)]
    assert len(selecting) == 1, (role, [p["metadata"]["name"] for p in selecting])
    assert selecting[0]["spec"]["policyTypes"] == ["Ingress"]
    return selecting[0]


# Pods the policies must keep out: the same roles of another InferenceService in the namespace, and
# an unrelated workload.
STRANGERS = {"other service's router": Names("other").labels("router"),
             "other service's prefill": Names("other").labels("prefill"),
             "unrelated pod": {"app": "web", "pdserve.io/role": "router"}}


@pytest.mark.parametrize("case", [c for c in SPECS if c != "network policies off"])
def test_network_policies_admit_only_their_peers(case):
    manifests = render_case(case)
    spec = parse(SPECS[case], allow_host_path=True).spec
    pods = pod_labels(manifests)
    for role in pods:
        policy_for(manifests, role)  # every pod is covered
    for pool in (spec.prefill, spec.decode):
        policy = policy_for(manifests, pool.role)
        for peer in ("router", "prefill", "decode"):
            assert admits(policy, 8000, pods[peer]), f"{peer} cannot reach {pool.role}'s HTTP port"
        assert not admits(policy, 8000, pods["coordinator"])  # the coordinator never calls engines
        for stranger, labels in STRANGERS.items():
            assert not any(admits(policy, port, labels) for port in (8000, 5600)), stranger
        # A pod of the same name elsewhere is someone else's.
        assert not admits(policy, 8000, pods["router"], namespace="elsewhere")
        p2p_producer = spec.kv_transfer.connector == "p2p" and pool.role == "prefill"
        kv_ports = range(5600, 5600 + pool.gpus_per_pod)
        for port in kv_ports:
            assert admits(policy, port, pods["decode"]) is p2p_producer, (pool.role, port)
            assert not admits(policy, port, pods["router"]), "the router has no business on the KV side channel"
        assert not admits(policy, 5600 + pool.gpus_per_pod, pods["decode"])

    router = policy_for(manifests, "router")
    port = spec.router.port
    for labels in (*STRANGERS.values(), {}):
        assert admits(router, port, labels, namespace="anywhere")  # the public edge
    assert not admits(router, port + 1, {})

    support = {"coordinator": (5557, 5558, 8080), "kvstore": (5700,)}
    for role, ports in support.items():
        if role not in pods:
            continue
        policy = policy_for(manifests, role)
        for port in ports:
            assert all(admits(policy, port, labels) for labels in pods.values()), (role, port)
            for stranger, labels in STRANGERS.items():
                assert not admits(policy, port, labels), (role, stranger)
    # The operator's autoscaler reads the coordinator's /stats from its own namespace, and only that port.
    coordinator = policy_for(manifests, "coordinator")
    operator_pod = {"app.kubernetes.io/name": "pdserve-operator", "app.kubernetes.io/instance": "pdserve"}
    assert admits(coordinator, 8080, operator_pod, namespace="pdserve-system")
    assert not admits(coordinator, 5557, operator_pod, namespace="pdserve-system")


def test_metrics_are_open_only_to_the_namespaces_the_spec_names():
    manifests = render_case("metrics scraped from a namespace")
    prometheus = {"app.kubernetes.io/name": "prometheus"}
    monitoring = {"kubernetes.io/metadata.name": "monitoring"}
    for role, port in (("prefill", 8000), ("decode", 8000), ("coordinator", 8080)):
        policy = policy_for(manifests, role)
        assert admits(policy, port, prometheus, namespace="monitoring", namespace_labels=monitoring), role
        assert not admits(policy, port, prometheus, namespace="default"), role
    assert not admits(policy_for(manifests, "prefill"), 5600, prometheus, namespace="monitoring",
                      namespace_labels=monitoring)
    assert not admits(policy_for(manifests, "kvstore"), 5700, prometheus, namespace="monitoring",
                      namespace_labels=monitoring)
    # Without the field, no namespace scrapes the engines.
    assert not admits(policy_for(render_case("defaults"), "prefill"), 8000, prometheus, namespace="monitoring",
                      namespace_labels=monitoring)


def test_policies_that_are_not_rendered_are_deleted():
    stale = {name for _, kind, name in optional_objects(parse(SPECS["defaults"])) if kind == "NetworkPolicy"}
    # The KV store's after a switch away from its connector; the endpoint picker's after the gateway is turned off.
    assert stale == {"llama-kvstore", "llama-epp"}
    assert not by_kind(render_case("network policies off"), "NetworkPolicy")
    off = {name for _, kind, name in optional_objects(parse(SPECS["network policies off"])) if kind == "NetworkPolicy"}
    assert off == {f"llama-{role}" for role in ("prefill", "decode", "router", "coordinator", "kvstore", "epp")}
    kvstore = parse(SPECS["kvstore connector"])
    assert [o[2] for o in optional_objects(kvstore) if o[1] == "NetworkPolicy"] == ["llama-epp"]


# --- hostPath -------------------------------------------------------------------------------------

def test_host_paths_are_refused_unless_allowed():
    host_model = isvc(model={"name": "m", "hostPath": "/mnt/models"})
    with pytest.raises(InvalidSpec) as refused:
        render(host_model)
    assert refused.value.messages == [
        "spec.model.hostPath: hostPath volumes (/mnt/models) are refused: they expose the node's filesystem; use a "
        "PVC, or run the operator with --allow-host-path (chart value allowHostPath: true)"]
    host_kv = isvc(kvTransfer={"connector": "shared-storage", "sharedStorage": {"hostPath": "/mnt/kv"}})
    with pytest.raises(InvalidSpec, match=r"spec\.kvTransfer\.sharedStorage\.hostPath"):
        render(host_kv)
    for obj in (host_model, host_kv):
        assert render(obj, allow_host_path=True)
    # A hostPath the spec does not use (another connector) mounts nothing and is not refused.
    assert render(isvc(kvTransfer={"connector": "p2p", "sharedStorage": {"hostPath": "/mnt/kv"}}))


def test_cli_render_refuses_host_paths_without_the_flag(capsys, tmp_path):
    path = tmp_path / "host.yaml"
    path.write_text(yaml.safe_dump(isvc(model={"name": "m", "hostPath": "/mnt/models"})))
    assert pdserve_main(["operator", "render", "-f", str(path)]) == 1
    assert "--allow-host-path" in capsys.readouterr().err
    assert pdserve_main(["operator", "render", "-f", str(path), "--allow-host-path"]) == 0
    assert "/mnt/models" in capsys.readouterr().out


# --- the KV side channel --------------------------------------------------------------------------

def test_the_side_channel_serves_on_the_pod_ip():
    deployments = by_kind(render_case("tensor and data parallel on GPUs"), "Deployment")
    prefill = container(deployments["llama-prefill"])
    extra = json.loads(flag(prefill["args"], "--kv-transfer-config"))["kv_connector_extra_config"]
    # Kubernetes expands $(POD_IP) in args only from a variable the container defines.
    assert extra["side_channel_host"] == "$(POD_IP)"
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in prefill["env"]
    decode = container(deployments["llama-decode"])
    assert "side_channel_host" not in json.loads(flag(decode["args"], "--kv-transfer-config"))[
        "kv_connector_extra_config"]  # a consumer serves no side channel


# --- spec.router.gateway: the Gateway API Inference Extension objects (issue 22) --------------------
# Every object is also in the table above (the "inference gateway" case): valid for Kubernetes 1.32
# or the vendored GIE schemas, labelled, owned, its network policies admitting only peers.

GATEWAY = {"httpRoute": {"gatewayName": "inference-gateway"}}
NOW = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)


def gateway_isvc(gateway=None, **spec) -> dict:
    obj = isvc(**spec)
    obj["spec"].setdefault("router", {})["gateway"] = copy.deepcopy(GATEWAY if gateway is None else gateway)
    return obj


def one(manifests: list[dict], kind: str) -> dict:
    found = [m for m in manifests if m["kind"] == kind]
    assert len(found) == 1, (kind, [m["metadata"]["name"] for m in found])
    return found[0]


def role_labels(manifests: list[dict], role: str) -> dict:
    return by_kind(manifests, "Deployment")[f"llama-{role}"]["spec"]["template"]["metadata"]["labels"]


# --- gateway off: nothing changes -----------------------------------------------------------------

def test_a_disabled_or_absent_gateway_renders_nothing_of_it():
    plain = isvc(decode={"dataParallelSize": 4})
    disabled = gateway_isvc({"enabled": False, "httpRoute": {"gatewayName": "gw"}}, decode={"dataParallelSize": 4})
    assert render(disabled) == render(plain)
    kinds = {m["kind"] for m in render(plain)}
    assert not kinds & {"InferencePool", "HTTPRoute"}
    assert "llama-epp" not in by_kind(render(plain), "Deployment")
    # Rank ports are the gateway's business: without it a DP decode pod keeps its one port.
    decode = container(by_kind(render(plain), "Deployment")["llama-decode"])
    assert "--rank-port-base" not in decode["args"] and [p["name"] for p in decode["ports"]] == ["http", "kv-transfer"]


# --- the InferencePool ------------------------------------------------------------------------------

@pytest.mark.parametrize("ranks, ports", [(1, [8000]), (3, [8100, 8101, 8102]), (8, list(range(8100, 8108)))])
def test_the_pool_selects_the_decode_pods_on_one_port_per_rank(ranks, ports, validate_manifest):
    manifests = render(gateway_isvc(decode={"dataParallelSize": ranks, "replicas": 2}))
    pool = one(manifests, "InferencePool")
    validate_manifest(pool)
    assert pool["metadata"]["name"] == "llama-pool"
    selector = {"matchLabels": pool["spec"]["selector"]["matchLabels"]}
    assert selects(selector, role_labels(manifests, "decode"))
    for role in ("prefill", "router", "epp", "coordinator"):
        assert not selects(selector, role_labels(manifests, role)), role
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == ports

    # Every target port is a port the decode container declares and the engine is told to serve.
    decode = container(by_kind(manifests, "Deployment")["llama-decode"])
    assert set(ports) <= {p["containerPort"] for p in decode["ports"]}
    args = decode["args"]
    parsed = build_parser(args).parse_args(args)
    if ranks == 1:
        assert parsed.rank_port_base is None
    else:
        assert parsed.rank_port_base == 8100 and parsed.data_parallel_size == ranks
        # The engine's own check of its port layout (it refuses to start otherwise).
        assert check_rank_ports(parsed.rank_port_base, ranks, parsed.port) is None
        assert [parsed.rank_port_base + r for r in range(ranks)] == ports
    prefill = container(by_kind(manifests, "Deployment")["llama-prefill"])["args"]
    assert "--rank-port-base" not in prefill  # the gateway never sends requests to prefill pods


def test_the_pool_points_at_the_pickers_grpc_service():
    manifests = render(gateway_isvc({"inferencePool": {"name": "llama-3"},
                                     "endpointPicker": {"port": 9102, "metricsPort": 9190, "failureMode": "FailOpen"}}))
    pool = one(manifests, "InferencePool")
    assert pool["metadata"]["name"] == "llama-3"
    ref = pool["spec"]["endpointPickerRef"]
    service = by_kind(manifests, "Service")[ref["name"]]
    assert (ref["kind"], ref["group"], ref["failureMode"]) == ("Service", "", "FailOpen")
    grpc = next(p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"])
    assert grpc["appProtocol"] == "kubernetes.io/h2c"
    epp = by_kind(manifests, "Deployment")["llama-epp"]
    assert selects({"matchLabels": service["spec"]["selector"]}, epp["spec"]["template"]["metadata"]["labels"])
    assert grpc["targetPort"] in {p["name"] for p in container(epp)["ports"]}
    assert container(epp)["readinessProbe"]["grpc"] == {"port": 9102}
    # GIE's own default: a gateway whose picker is down refuses requests.
    assert one(render(gateway_isvc()), "InferencePool")["spec"]["endpointPickerRef"]["failureMode"] == "FailClose"


# --- the endpoint picker's pod --------------------------------------------------------------------

def test_the_picker_command_follows_the_flag_contract():
    obj = gateway_isvc({"endpointPicker": {"replicas": 3, "resources": {"limits": {"memory": "1Gi"}}}},
                       decode={"dataParallelSize": 2}, router={"routingPolicy": "round-robin"})
    manifests = render(obj)
    epp = by_kind(manifests, "Deployment")["llama-epp"]
    main = container(epp)
    assert epp["spec"]["replicas"] == 3 and main["resources"] == {"limits": {"memory": "1Gi"}}
    argv = [*main["command"], *main["args"]]
    assert argv[:2] == ["pdserve", "epp"]
    args = argv[2:]
    expected = {"--model": "llama-3-8b", "--pool-service": "llama-decode", "--pool-port": "8000",
                "--prefill-service": "llama-prefill", "--prefill-port": "8000", "--rank-port-base": "8100",
                "--coordinator": "tcp://llama-coordinator:5558", "--policy": "round-robin",
                "--grpc-port": "9002", "--metrics-port": "9090", "--host": "0.0.0.0",
                "--internal-key-file": INTERNAL_KEY_PATH, "--namespace": "serving", "--pool-name": "llama-pool"}
    assert {name: flag(args, name) for name in expected} == expected
    # The coordinator and both Services named exist in the same rendering.
    services = by_kind(manifests, "Service")
    assert {"llama-decode", "llama-prefill", "llama-coordinator"} <= set(services)
    # The key file it is told to read is the one its pod mounts from the internal-key Secret.
    env = {e["name"]: e.get("value") for e in main["env"]}
    assert env["PDSERVE_INTERNAL_KEY_FILE"] == INTERNAL_KEY_PATH
    # Its own account, allowed to read EndpointSlices and nothing else.
    pod = epp["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "llama-epp" and pod["automountServiceAccountToken"] is True
    role = by_kind(manifests, "Role")["llama-epp"]
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["get", "list", "watch"]}]
    binding = by_kind(manifests, "RoleBinding")["llama-epp"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "llama-epp", "namespace": "serving"}]
    # Without DP ranks there is no rank port base to pass.
    assert "--rank-port-base" not in container(by_kind(render(gateway_isvc()), "Deployment")["llama-epp"])["args"]


def test_the_picker_command_is_accepted_by_pdserve_epp():
    """The operator spells `pdserve epp`'s flags out by hand; the real parser must take them."""
    args = container(by_kind(render(gateway_isvc(decode={"dataParallelSize": 2})), "Deployment")["llama-epp"])["args"]
    parsed = build_parser(args).parse_args(args)
    assert parsed.command == "epp"
    values = vars(parsed)
    assert values["grpc_port"] == 9002 and values["metrics_port"] == 9090
    assert values["pool_service"] == "llama-decode" and values["prefill_service"] == "llama-prefill"
    assert values["rank_port_base"] == 8100 and values["namespace"] == "serving"
    assert values["pool_name"] == "llama-pool" and values["policy"] == "least-loaded"
    assert values["coordinator"] == "tcp://llama-coordinator:5558" and values["internal_key_file"] == INTERNAL_KEY_PATH


# --- the HTTPRoute ---------------------------------------------------------------------------------

def test_the_route_is_optional_and_leads_to_the_pool(validate_manifest):
    assert not [m for m in render(gateway_isvc({})) if m["kind"] == "HTTPRoute"]
    manifests = render(gateway_isvc({"httpRoute": {"gatewayName": "edge", "gatewayNamespace": "gateways",
                                                   "sectionName": "https", "pathPrefix": "/llama/v1"}}))
    route = one(manifests, "HTTPRoute")
    validate_manifest(route)
    assert route["spec"]["parentRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "edge",
                                            "namespace": "gateways", "sectionName": "https"}]
    (rule,) = route["spec"]["rules"]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/llama/v1"}}]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                    "name": one(manifests, "InferencePool")["metadata"]["name"]}]
    # Unset: the route's own namespace and every listener (the schema's meaning of absent fields).
    parent = one(render(gateway_isvc()), "HTTPRoute")["spec"]["parentRefs"][0]
    assert set(parent) == {"group", "kind", "name"}


def test_the_vendored_schemas_catch_what_they_should(validate_manifest):
    """The validation above can fail: a pool with too many ports, a misspelt field, a bad route."""
    pool = one(render(gateway_isvc(decode={"dataParallelSize": 8})), "InferencePool")
    too_many = copy.deepcopy(pool)
    too_many["spec"]["targetPorts"].append({"number": 9000})
    misspelt = copy.deepcopy(pool)
    misspelt["spec"]["endpointPickerRef"]["failuremode"] = "FailOpen"
    duplicate = copy.deepcopy(pool)
    duplicate["spec"]["targetPorts"][1] = {"number": 8100}
    route = one(render(gateway_isvc()), "HTTPRoute")
    bad_route = copy.deepcopy(route)
    bad_route["spec"]["parentRefs"][0]["namespace"] = "Not_A_Namespace"
    for broken in (too_many, misspelt, duplicate, bad_route):
        with pytest.raises(Exception):
            validate_manifest(broken)


# --- network policies ------------------------------------------------------------------------------

def test_policies_let_the_gateway_reach_decode_and_the_picker_reach_its_peers():
    proxies = {"matchLabels": {"kubernetes.io/metadata.name": "gateways"}}
    manifests = render(gateway_isvc({"proxyNamespaceSelector": proxies}, decode={"dataParallelSize": 2}))
    proxy = {"app": "envoy"}
    in_gateways = {"namespace": "gateways", "namespace_labels": {"kubernetes.io/metadata.name": "gateways"}}
    decode, prefill, epp = (policy_for(manifests, role) for role in ("decode", "prefill", "epp"))
    for port in (8100, 8101):
        assert admits(decode, port, proxy, **in_gateways)
        assert not admits(decode, port, proxy, namespace="elsewhere")
    assert not admits(decode, 8102, proxy, **in_gateways)
    assert not any(admits(prefill, port, proxy, **in_gateways) for port in (8000, 8100, 5600))
    assert admits(epp, 9002, proxy, **in_gateways) and not admits(epp, 9002, proxy, namespace="elsewhere")
    assert not admits(epp, 9090, proxy, **in_gateways)  # metrics only from the namespaces the spec names
    picker = role_labels(manifests, "epp")
    assert admits(prefill, 8000, picker)  # the prefill leg
    assert admits(decode, 8000, picker)
    assert not admits(prefill, 5600, picker)  # the KV side channel stays between engines
    assert admits(policy_for(manifests, "coordinator"), 5558, picker)  # the load feed

    # Without a selector the gateway's proxies may be anywhere (managed load balancers outside the cluster).
    anywhere = render(gateway_isvc())
    assert admits(policy_for(anywhere, "decode"), 8000, {}, namespace="elsewhere")
    assert admits(policy_for(anywhere, "epp"), 9002, {}, namespace="elsewhere")
    assert not admits(policy_for(anywhere, "prefill"), 8000, {}, namespace="elsewhere")


# --- spec validation -------------------------------------------------------------------------------

REFUSED = {
    "too many ranks for targetPorts": (gateway_isvc(decode={"dataParallelSize": 9}), "decode.dataParallelSize <= 8"),
    "one port for gRPC and metrics": (gateway_isvc({"endpointPicker": {"port": 9000, "metricsPort": 9000}}),
                                      "port (gRPC) and metricsPort must differ"),
    "dot segments in the path": (gateway_isvc({"httpRoute": {"gatewayName": "gw", "pathPrefix": "/a/../b"}}),
                                 "must not contain '.' or '..' segments"),
    "encoded slash in the path": (gateway_isvc({"httpRoute": {"gatewayName": "gw", "pathPrefix": "/a%2fb"}}),
                                  "must not contain '%2f'"),
}
SCHEMA_REFUSED = {
    "unknown failure mode": gateway_isvc({"endpointPicker": {"failureMode": "Retry"}}),
    "route without a gateway": gateway_isvc({"httpRoute": {"pathPrefix": "/"}}),
    "relative path": gateway_isvc({"httpRoute": {"gatewayName": "gw", "pathPrefix": "v1"}}),
    "path with a fragment": gateway_isvc({"httpRoute": {"gatewayName": "gw", "pathPrefix": "/v1#x"}}),
    "pool name not a DNS label": gateway_isvc({"inferencePool": {"name": "Pool_1"}}),
    "port out of range": gateway_isvc({"endpointPicker": {"port": 70000}}),
}


@pytest.mark.parametrize("case", REFUSED)
def test_gateway_specs_that_cannot_work_are_refused_clearly(case):
    obj, message = REFUSED[case]
    with pytest.raises(InvalidSpec) as refused:
        parse(obj)
    assert any(message in m for m in refused.value.messages), refused.value.messages


@pytest.mark.parametrize("case", SCHEMA_REFUSED)
def test_the_schema_refuses_bad_gateway_fields(case):
    assert schema_errors(defaulted(SCHEMA_REFUSED[case]))
    with pytest.raises(InvalidSpec):
        parse(SCHEMA_REFUSED[case])


def test_many_ranks_are_fine_while_the_gateway_is_off():
    parse(gateway_isvc({"enabled": False}, decode={"dataParallelSize": 16}))
    parse(isvc(decode={"dataParallelSize": 16}))


def test_gateway_defaults():
    spec = defaulted(gateway_isvc({}))["spec"]["router"]["gateway"]
    assert spec == {"enabled": True, "endpointPicker": {"replicas": 1, "port": 9002, "metricsPort": 9090,
                                                        "failureMode": "FailClose"}}
    assert "gateway" not in defaulted(isvc())["spec"]["router"]  # absent stays absent: off


# --- objects of an earlier spec, and status -------------------------------------------------------

def test_turning_the_gateway_or_its_route_off_deletes_their_objects():
    names = Names("llama")
    off = {(kind, name) for _, kind, name in optional_objects(parse(isvc()))}
    assert {("Deployment", "llama-epp"), ("Service", "llama-epp"), ("InferencePool", names.inference_pool()),
            ("HTTPRoute", names.http_route), ("NetworkPolicy", "llama-epp"), ("Role", "llama-epp"),
            ("RoleBinding", "llama-epp"), ("ServiceAccount", "llama-epp")} <= off
    no_route = {(kind, name) for _, kind, name in optional_objects(parse(gateway_isvc({})))}
    assert ("HTTPRoute", names.http_route) in no_route
    assert not {("Deployment", "llama-epp"), ("InferencePool", "llama-pool")} & no_route
    rendered = {(m["kind"], m["metadata"]["name"]) for m in render(gateway_isvc())}
    assert not rendered & {(kind, name) for _, kind, name in optional_objects(parse(gateway_isvc()))}


def _deployment(ready: int) -> dict:
    return {"metadata": {"generation": 1}, "status": {"observedGeneration": 1, "replicas": ready,
                                                      "updatedReplicas": ready, "readyReplicas": ready}}


def test_status_counts_the_picker_and_reports_the_gateway():
    service = parse(gateway_isvc({}, router={"replicas": 0}))
    roles = {"prefill": 1, "decode": 1, "router": 0, "coordinator": 1, "epp": 1}
    applied = GatewayOutcome(True, "Applied", "applied InferencePool llama-pool")
    status = compute_status(service, {role: _deployment(n) for role, n in roles.items()}, {}, NOW, applied)
    assert status["phase"] == "Ready" and status["epp"]["ready"] == "1/1"
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Gateway"]["status"] == "True" and conditions["Gateway"]["reason"] == "Applied"
    # No router at all, yet the gateway serves.
    assert conditions["Available"]["status"] == "True"
    waiting = compute_status(service, {**{role: _deployment(n) for role, n in roles.items()}, "epp": _deployment(0)},
                             status, NOW, applied)
    assert {c["type"]: c for c in waiting["conditions"]}["Available"]["status"] == "False"
    # A refresh that applied nothing keeps what the last reconcile found.
    missing = GatewayOutcome(False, "CRDNotInstalled", "the cluster does not serve InferencePool")
    found = compute_status(service, {role: _deployment(n) for role, n in roles.items()}, {}, NOW, missing)
    kept = compute_status(service, {role: _deployment(n) for role, n in roles.items()}, found, NOW)
    assert [c for c in kept["conditions"] if c["type"] == "Gateway"] == [
        c for c in found["conditions"] if c["type"] == "Gateway"]
    # Without a gateway, no such condition and no picker in status.
    plain = compute_status(parse(isvc()), {r: _deployment(1) for r in ("prefill", "decode", "router", "coordinator")},
                           {}, NOW)
    assert "epp" not in plain and {c["type"] for c in plain["conditions"]} == {"Ready", "Available"}


def test_the_crd_carries_the_gateway_fields(repo):
    gateway = crd.openapi_schema()["properties"]["spec"]["properties"]["router"]["properties"]["gateway"]
    assert set(gateway["properties"]) == {"enabled", "inferencePool", "endpointPicker", "httpRoute",
                                          "proxyNamespaceSelector"}
    assert gateway["properties"]["endpointPicker"]["properties"]["failureMode"]["enum"] == ["FailClose", "FailOpen"]
