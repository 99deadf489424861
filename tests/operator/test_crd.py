"""The CRD: generated files in step, a valid CustomResourceDefinition, samples valid, bad specs rejected."""

from __future__ import annotations

import copy

import jsonschema
import kubernetes_validate
import pytest
import yaml

from pdserve.operator import crd
from pdserve.operator.schema import apply_defaults, defaulted, schema_errors
from pdserve.operator.spec import CEL_TWINS, InvalidSpec, parse


def test_crd_files_are_generated_from_the_code(repo):
    generated = crd.crd_yaml()
    for path in ("crds/inferenceservice.yaml", "charts/pdserve/crds/inferenceservice.yaml"):
        assert (repo / path).read_text() == generated, f"{path} is stale: run `pdserve operator crd > {path}`"


def test_crd_is_a_valid_custom_resource_definition():
    build = crd.build_crd()
    kubernetes_validate.validate(build, "1.32", strict=True)
    version = build["spec"]["versions"][0]
    assert (build["spec"]["group"], version["name"], build["spec"]["scope"]) == ("pdserve.io", "v1alpha1", "Namespaced")
    assert build["spec"]["names"]["shortNames"] == ["isvc"]
    assert version["subresources"]["status"] == {}


def _schema_at(path: str) -> dict:
    node = crd.openapi_schema()
    for part in path.strip(".").split("."):
        node = node["properties"][part]
    return node


def test_scale_subresource_and_printer_columns_point_at_real_fields():
    version = crd.build_crd()["spec"]["versions"][0]
    scale = version["subresources"]["scale"]
    assert scale == {"specReplicasPath": ".spec.decode.replicas", "statusReplicasPath": ".status.decode.replicas",
                     "labelSelectorPath": ".status.decode.selector"}
    assert _schema_at(scale["specReplicasPath"])["type"] == "integer"
    assert _schema_at(scale["statusReplicasPath"])["type"] == "integer"
    assert _schema_at(scale["labelSelectorPath"])["type"] == "string"
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert list(columns) == ["Phase", "Prefill", "Decode", "Endpoint", "Age"]
    for name, path in columns.items():
        if name != "Age":
            _schema_at(path)  # raises KeyError for a column pointing nowhere


def _walk(schema: dict, path: str = ""):
    yield path, schema
    for key, child in (schema.get("properties") or {}).items():
        yield from _walk(child, f"{path}.{key}")
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            yield from _walk(schema[key], f"{path}[]")


def test_schema_is_structural():
    """The API server's rules for structural schemas that a test can check without it."""
    for path, node in _walk(crd.openapi_schema()):
        if node.get("x-kubernetes-int-or-string"):
            assert node["anyOf"] == [{"type": "integer"}, {"type": "string"}], path
            continue
        assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), f"{path} has no type"
        for branch in node.get("anyOf", []) + node.get("oneOf", []):
            assert set(branch) <= {"required"}, f"{path}: only `required` may vary inside anyOf/oneOf"
        if "default" in node:
            jsonschema.Draft4Validator({k: v for k, v in node.items() if k != "default"}).validate(node["default"])


def test_every_cel_rule_has_a_python_twin():
    assert {rule.id for rule in crd.RULES} == set(CEL_TWINS)
    for rule in crd.RULES:
        node = crd.openapi_schema()
        for part in [p for p in rule.path.split(".") if p]:
            node = node["properties"][part]
        assert {"rule": rule.cel, "message": rule.message} in node["x-kubernetes-validations"]


def test_samples_are_valid(repo):
    samples = sorted((repo / "crds" / "examples").glob("*.yaml"))
    assert samples
    for path in samples:
        for doc in yaml.safe_load_all(path.read_text()):
            assert schema_errors(defaulted(doc)) == [], path
            parse(doc)  # the Python-side rules as well


def test_defaults_come_from_the_schema_and_are_idempotent():
    minimal = {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "metadata": {"name": "m"},
               "spec": {"model": {"name": "m", "path": "demo"},
                        "decode": {"autoscaling": {"maxReplicas": 3, "targetKVUsage": 0.5}}}}
    once = defaulted(minimal)
    assert once["spec"]["router"] == {"replicas": 1, "port": 8000, "routingPolicy": "least-loaded",
                                      "serviceType": "ClusterIP"}
    assert once["spec"]["prefill"] == {"replicas": 1, "tensorParallelSize": 1, "dataParallelSize": 1, "gpu": False}
    assert once["spec"]["decode"]["autoscaling"] == {"maxReplicas": 3, "targetKVUsage": 0.5, "minReplicas": 1,
                                                     "scaleDownDelaySeconds": 300}
    assert once["spec"]["kvTransfer"] == {"connector": "p2p", "kvstore": {"capacity": "8Gi"}}
    assert once["spec"]["engine"] == {"maxModelLen": 4096, "blockSize": 16, "maxNumSeqs": 256,
                                      "enablePrefixCaching": True}
    assert once["spec"]["imagePullPolicy"] == "IfNotPresent"
    assert defaulted(once) == once
    assert "router" not in minimal["spec"]  # the input is left alone
    assert apply_defaults({"replicas": 3}, _schema_at("spec.prefill")) == {
        "replicas": 3, "tensorParallelSize": 1, "dataParallelSize": 1, "gpu": False}


def _cr(**spec) -> dict:
    base = {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "metadata": {"name": "bad", "namespace": "default"},
            "spec": {"model": {"name": "m", "path": "demo"}}}
    for key, value in spec.items():
        base["spec"][key] = value
    return base


SCHEMA_REJECTS = {
    "negative replicas": _cr(decode={"replicas": -1}),
    "tensor parallel not a power of two": _cr(prefill={"tensorParallelSize": 3}),
    "tensor parallel too large": _cr(prefill={"tensorParallelSize": 128}),
    "unknown connector": _cr(kvTransfer={"connector": "nfs"}),
    "capacity not a quantity": _cr(kvTransfer={"connector": "kvstore", "kvstore": {"capacity": "8 GB"}}),
    "resource not a quantity": _cr(decode={"resources": {"limits": {"memory": "lots"}}}),
    "resource of the wrong type": _cr(decode={"resources": {"limits": {"cpu": True}}}),
    "autoscaling without a target": _cr(decode={"autoscaling": {"maxReplicas": 4}}),
    "autoscaling without a maximum": _cr(decode={"autoscaling": {"targetWaitingPerReplica": 2}}),
    "autoscaling to zero": _cr(decode={"autoscaling": {"minReplicas": 0, "maxReplicas": 4,
                                                       "targetWaitingPerReplica": 2}}),
    "kv usage above one": _cr(decode={"autoscaling": {"maxReplicas": 4, "targetKVUsage": 1.5}}),
    "zero waiting target": _cr(decode={"autoscaling": {"maxReplicas": 4, "targetWaitingPerReplica": 0}}),
    "bad pd ratio": _cr(pdRatio="0:2"),
    "pd ratio not a ratio": _cr(pdRatio="half"),
    "router port out of range": _cr(router={"port": 70000}),
    "unknown routing policy": _cr(router={"routingPolicy": "fastest"}),
    "block size not offered": _cr(engine={"blockSize": 12}),
    "zero max model len": _cr(engine={"maxModelLen": 0}),
    "extra args not strings": _cr(engine={"extraArgs": [1]}),
    "no model name": _cr(model={"path": "demo"}),
    "relative host path": _cr(model={"name": "m", "hostPath": "models"}),
    "toleration operator": _cr(decode={"tolerations": [{"key": "gpu", "operator": "Maybe"}]}),
    "env without a name": _cr(decode={"env": [{"value": "1"}]}),
    "no spec": {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "metadata": {"name": "bad"}},
}


@pytest.mark.parametrize("case", SCHEMA_REJECTS)
def test_schema_rejects(case):
    obj = defaulted(copy.deepcopy(SCHEMA_REJECTS[case]))
    assert schema_errors(obj), f"{case}: accepted by the schema"
    with pytest.raises(InvalidSpec):
        parse(SCHEMA_REJECTS[case])


# Valid for the OpenAPI part of the schema; only a CEL rule (and its Python twin) catches them.
CEL_REJECTS = {
    "name": (dict(_cr(), metadata={"name": "9-starts-with-a-digit"})),
    "model-one-volume": _cr(model={"name": "m", "pvc": {"claimName": "c"}, "hostPath": "/models"}),
    "model-path": _cr(model={"name": "m"}),
    "autoscaling-bounds": _cr(decode={"autoscaling": {"minReplicas": 5, "maxReplicas": 2,
                                                      "targetWaitingPerReplica": 2}}),
    "pd-ratio-needs-autoscaling": _cr(pdRatio="1:2"),
    "shared-storage-volume": _cr(kvTransfer={"connector": "shared-storage"}),
    "shared-storage-one-volume": _cr(kvTransfer={"connector": "shared-storage",
                                                 "sharedStorage": {"claimName": "c", "hostPath": "/kv"}}),
}


@pytest.mark.parametrize("rule_id", CEL_REJECTS)
def test_cel_rules_have_python_twins(rule_id):
    obj = CEL_REJECTS[rule_id]
    assert schema_errors(defaulted(obj)) == [], "should pass the OpenAPI part: it tests the CEL twin"
    with pytest.raises(InvalidSpec) as error:
        parse(obj)
    messages = {rule.message for rule in crd.RULES if rule.id == rule_id}
    assert set(error.value.messages) & messages, error.value.messages


def test_too_long_names_are_rejected():
    obj = dict(_cr(), metadata={"name": "x" * (crd.MAX_NAME_LENGTH + 1)})
    with pytest.raises(InvalidSpec, match="at most 51 characters"):
        parse(obj)
    parse(dict(_cr(), metadata={"name": "x" * crd.MAX_NAME_LENGTH}))


PYTHON_ONLY_REJECTS = {
    "too few GPUs for TP*DP": (
        _cr(prefill={"tensorParallelSize": 4, "dataParallelSize": 2, "resources": {"limits": {"nvidia.com/gpu": 4}}}),
        "prefill: resources ask for 4 nvidia.com/gpu but tensorParallelSize * dataParallelSize = 4 * 2 "
        "needs 8 per pod"),
    "extra args repeat a managed flag": (
        _cr(engine={"extraArgs": ["--enforce-eager", "--port=9000"]}),
        "engine.extraArgs must not set --port: the operator sets it from the spec"),
    "empty KV store": (_cr(kvTransfer={"connector": "kvstore", "kvstore": {"capacity": "0"}}),
                       "kvTransfer.kvstore.capacity must be more than zero bytes"),
}


@pytest.mark.parametrize("case", PYTHON_ONLY_REJECTS)
def test_checks_no_schema_expresses(case):
    obj, message = PYTHON_ONLY_REJECTS[case]
    assert schema_errors(defaulted(obj)) == []
    with pytest.raises(InvalidSpec) as error:
        parse(obj)
    assert message in error.value.messages


def test_all_problems_are_reported_together():
    obj = _cr(model={"name": "m"}, pdRatio="1:2", engine={"extraArgs": ["--model", "x"]})
    with pytest.raises(InvalidSpec) as error:
        parse(obj)
    assert len(error.value.messages) == 3
