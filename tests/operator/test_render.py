"""Pure rendering: a table of specs, every manifest valid for Kubernetes 1.32, and what each must carry."""

from __future__ import annotations

import base64
import copy
import json

import kubernetes_validate
import pytest
import yaml

from pdserve.cli import main as pdserve_main
from pdserve.engine.internal_auth import ENV_KEY, ENV_KEY_FILE, generate_key, load_internal_key
from pdserve.operator import crd
from pdserve.operator.names import Names
from pdserve.operator.render import (ENGINE_GRACE_SECONDS, ENGINE_PRESTOP_SECONDS, RUN_AS_USER,
                                     internal_key_secret, optional_objects, render)
from pdserve.operator.spec import InvalidSpec, parse

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
def test_every_manifest_is_valid_kubernetes(case):
    manifests = render_case(case)
    for manifest in manifests:
        kubernetes_validate.validate(manifest, "1.32", strict=True)
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
            for role in ("prefill", "decode", "router", "coordinator", "kvstore")
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
    assert stale == {"llama-kvstore"}  # the KV store's, after a switch away from its connector
    assert not by_kind(render_case("network policies off"), "NetworkPolicy")
    off = {name for _, kind, name in optional_objects(parse(SPECS["network policies off"])) if kind == "NetworkPolicy"}
    assert off == {f"llama-{role}" for role in ("prefill", "decode", "router", "coordinator", "kvstore")}
    kvstore = parse(SPECS["kvstore connector"])
    assert not [o for o in optional_objects(kvstore) if o[1] == "NetworkPolicy"]


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
