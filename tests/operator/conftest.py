"""Fixtures for the operator tests: kmock as the API server, the operator as an asyncio task.

No `__init__.py` here on purpose: this folder must never become an importable package named
`operator` (the standard library's). Helpers live on fixtures for the same reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime as dt
import itertools
import logging
import re
import time
import uuid
import warnings
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import attrs
import jsonschema
import kmock as km
import kopf
import kubernetes_validate
import pytest
import yaml

from pdserve.operator import crd
from pdserve.operator.handlers import OperatorConfig, make_settings, register
from pdserve.operator.kube import REQUEST_TIMEOUT_S

REPO = Path(__file__).resolve().parents[2]
NAMESPACE = "default"
ISVC = km.resource(crd.GROUP, crd.VERSION, crd.PLURAL)
DEPLOYMENTS = km.resource("apps", "v1", "deployments")

# kind -> (kmock resource, URL prefix inside a namespace)
KINDS: dict[str, tuple[km.resource, str]] = {
    "InferenceService": (ISVC, f"/apis/{crd.GROUP}/{crd.VERSION}"),
    "Deployment": (DEPLOYMENTS, "/apis/apps/v1"),
    "Service": (km.resource("", "v1", "services"), "/api/v1"),
    "ConfigMap": (km.resource("", "v1", "configmaps"), "/api/v1"),
    "ServiceAccount": (km.resource("", "v1", "serviceaccounts"), "/api/v1"),
    "Role": (km.resource("rbac.authorization.k8s.io", "v1", "roles"), "/apis/rbac.authorization.k8s.io/v1"),
    "RoleBinding": (km.resource("rbac.authorization.k8s.io", "v1", "rolebindings"),
                    "/apis/rbac.authorization.k8s.io/v1"),
    "Secret": (km.resource("", "v1", "secrets"), "/api/v1"),
    "NetworkPolicy": (km.resource("networking.k8s.io", "v1", "networkpolicies"), "/apis/networking.k8s.io/v1"),
    # The Gateway API Inference Extension's kinds: served only once a test installs them (gie_crds).
    "InferencePool": (km.resource("inference.networking.k8s.io", "v1", "inferencepools"),
                      "/apis/inference.networking.k8s.io/v1"),
    "HTTPRoute": (km.resource("gateway.networking.k8s.io", "v1", "httproutes"), "/apis/gateway.networking.k8s.io/v1"),
}


def load_sample(name: str = "demo.yaml") -> dict[str, Any]:
    return yaml.safe_load((REPO / "crds" / "examples" / name).read_text())


def _make_isvc(spec_overrides: dict[str, Any] | None = None, name: str = "demo", uid: str = "uid-demo") -> dict:
    """The sample, with what kmock cannot add itself: a uid (for owner references), a namespace
    (namespaced watches drop objects without one) and a resourceVersion (kopf's finalizer patch
    tests it, and kmock never sets one)."""
    obj = load_sample()
    obj["metadata"].update({"name": name, "namespace": NAMESPACE, "uid": uid, "resourceVersion": "1"})
    for key, value in (spec_overrides or {}).items():
        obj["spec"][key] = copy.deepcopy(value)
    return obj


_versions = itertools.count(100)


@attrs.define(kw_only=True)
class VersioningEmulator(km.KubernetesEmulator):
    """kmock plus the bookkeeping every real API server does on writes: a new resourceVersion per
    write (and a 409 for a stale one in a patch), a uid, creationTimestamp and generateName'd name
    on create, and a generation that moves with the spec.

    Without resourceVersions kopf cannot tell its own patches' echoes from newer changes and runs
    handlers again on stale bodies; with them it behaves as against a cluster. Requests are logged
    as the client sent them.
    """

    async def _handle(self, request: km.Request):
        if request.resource is not None and request.action in (km.action.CREATE, km.action.UPDATE):
            data = copy.deepcopy(request.data)
            version = str(next(_versions))
            if request.action == km.action.CREATE and isinstance(data, dict):
                meta = data.setdefault("metadata", {})
                if not meta.get("name") and meta.get("generateName"):
                    meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
                meta.setdefault("uid", str(uuid.uuid4()))
                meta.setdefault("creationTimestamp", dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
                meta.setdefault("generation", 1)
                meta["resourceVersion"] = version
            elif request.action == km.action.UPDATE:
                key = (request.resource, request.namespace, request.name)
                current = self.objects[key].raw if key in self.objects and not self.objects[key].deleted else {}
                meta = current.get("metadata") or {}
                if isinstance(data, dict):
                    sent = (data.get("metadata") or {}).get("resourceVersion")
                    if sent is not None and sent != meta.get("resourceVersion"):
                        raise km.KubernetesError(status=409, reason="Conflict",
                                                 message="the object has been modified; please apply your changes "
                                                         "to the latest version and try again")
                    data.setdefault("metadata", {})["resourceVersion"] = version
                    if "spec" in data and request.subresource is None:
                        data["metadata"]["generation"] = (meta.get("generation") or 1) + 1
                elif isinstance(data, list):
                    data = [*data, {"op": "add", "path": "/metadata/resourceVersion", "value": version}]
            # kmock finds reactions by the logged request object itself, so the copy is swapped
            # in for the handling and the sent body put back for the log afterwards.
            sent = request.data
            object.__setattr__(request, "data", data)
            try:
                return await super()._handle(request)
            finally:
                object.__setattr__(request, "data", sent)
        return await super()._handle(request)


class Cluster:
    """kmock with the operator's view of it: objects by kind and name, the request log, waiting."""

    def __init__(self, kmock: km.KubernetesEmulator, kubeconfig: Path, caplog: pytest.LogCaptureFixture):
        self.kmock = kmock
        self.kubeconfig = kubeconfig
        self.caplog = caplog

    # --- objects ---
    def path(self, kind: str, name: str | None = None, subresource: str | None = None) -> str:
        _, prefix = KINDS[kind]
        plural = KINDS[kind][0].plural
        path = f"{prefix}/namespaces/{NAMESPACE}/{plural}"
        if name:
            path += f"/{name}"
        if subresource:
            path += f"/{subresource}"
        return path

    def get(self, kind: str, name: str) -> dict[str, Any] | None:
        key = (KINDS[kind][0], NAMESPACE, name)
        if key not in self.kmock.objects or self.kmock.objects[key].deleted:
            return None
        return copy.deepcopy(self.kmock.objects[key].raw)

    def names(self, kind: str) -> set[str]:
        resource = KINDS[kind][0]
        return {name for (res, _, name), obj in self.kmock.objects.items() if res == resource and not obj.deleted}

    async def request(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        headers = {"Content-Type": "application/merge-patch+json"} if method == "PATCH" else {}
        async with self.kmock.request(method, path, json=body, headers=headers) as response:
            assert response.status < 400, (method, path, response.status, await response.text())
            return await response.json()

    async def create(self, obj: dict[str, Any]) -> None:
        await self.request("POST", self.path(obj["kind"]), obj)

    async def patch(self, kind: str, name: str, body: dict[str, Any], subresource: str | None = None) -> None:
        await self.request("PATCH", self.path(kind, name, subresource), body)

    async def delete(self, kind: str, name: str) -> None:
        await self.request("DELETE", self.path(kind, name))

    async def set_ready(self, role_replicas: dict[str, int], name: str = "demo", pods: int | None = None,
                        conditions: list[dict[str, Any]] | None = None) -> None:
        """Play the Deployment controller: `pods` up-to-date pods per role (default: the ready
        count), of which the given number are ready."""
        for role, ready in role_replicas.items():
            total = ready if pods is None else pods
            generation = (self.get("Deployment", f"{name}-{role}") or {}).get("metadata", {}).get("generation", 1)
            status: dict[str, Any] = {"observedGeneration": generation, "replicas": total, "updatedReplicas": total,
                                      "readyReplicas": ready, "availableReplicas": ready}
            if conditions is not None:
                status["conditions"] = conditions
            await self.patch("Deployment", f"{name}-{role}", {"status": status}, subresource="status")

    def without_gie_crds(self) -> None:
        """A cluster whose gateway provider has not installed the GIE CRDs: the API server answers 404 for
        their resources (kmock would otherwise store any kind), until install_gie_crds()."""
        self.gie_installed = False
        kinds = {KINDS[kind][0] for kind in ("InferencePool", "HTTPRoute")}
        self.kmock[lambda request: not self.gie_installed and request.resource in kinds] << 404

    def install_gie_crds(self) -> None:
        self.gie_installed = True

    # --- request log ---
    def requests(self, method: str | None = None, kind: str | None = None, name: str | None = None,
                 subresource: str | None = "*") -> list[km.Request]:
        found = []
        for request in list(self.kmock):
            if request.resource is None or request.action == km.action.WATCH:
                continue
            if method is not None and request.method.value != method:
                continue
            if kind is not None and request.resource != KINDS[kind][0]:
                continue
            if name is not None and request.name != name:
                continue
            if subresource != "*" and request.subresource != subresource:
                continue
            found.append(request)
        return found

    def writes(self, kind: str | None = None, name: str | None = None) -> list[km.Request]:
        """Writes by the operator (kopf's own bookkeeping and test requests excluded)."""
        return [r for r in self.requests(kind=kind, name=name)
                if r.method.value in ("POST", "PATCH", "PUT", "DELETE")
                and r.headers.get("User-Agent", "").startswith("python-httpx")]

    # --- waiting ---
    async def wait_for(self, predicate: Callable[[], Any], message: str, timeout: float = 15.0) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            result = predicate()
            if result:
                return result
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout}s waiting for {message}")
            await asyncio.sleep(0.02)

    def _count(self, handler: str, outcome: str) -> int:
        # kopf logs "Handler 'ID' is invoked." / "... succeeded." / "... failed ..." per object;
        # ids are "register.<locals>.NAME" (plus "/FIELD" for field handlers).
        pattern = re.compile(rf"(Handler|Timer) 'register\.<locals>\.{handler}(/[\w.]+)?' {outcome}")
        return sum(1 for r in self.caplog.records if r.name == "kopf.objects" and pattern.match(r.getMessage()))

    def calls(self, handler: str = r"\w+") -> int:
        """How many calls of a handler have started."""
        return self._count(handler, "is invoked")

    def in_flight(self, handler: str = r"\w+") -> int:
        return self.calls(handler) - self._count(handler, "(succeeded|failed)")

    async def idle(self, timeout: float = 15.0) -> None:
        """Wait until no handler call is running (so counts and the request log are final)."""
        await self.wait_for(lambda: self.in_flight() == 0,
                            f"running handlers to finish ({self.calls()} calls, {self.in_flight()} running)", timeout)

    async def settle(self, handler: str, calls_before: int, count: int = 1, timeout: float = 15.0) -> None:
        """Wait for `count` more calls of `handler` to start and every handler call to finish."""
        await self.wait_for(lambda: self.calls(handler) >= calls_before + count,
                            f"{count} more call(s) of {handler} (had {calls_before}, now {self.calls(handler)})",
                            timeout)
        await self.idle(timeout)

    @contextlib.asynccontextmanager
    async def operator(self, **config: Any) -> AsyncIterator[None]:
        registry = register(OperatorConfig(kubeconfig=str(self.kubeconfig), **config))
        settings = make_settings()
        # kopf arms a SIGKILL of its own thread 10 minutes after it is cancelled, should its
        # shutdown hang: right for an operator process, but here that thread is the test runner's.
        # It killed whole test runs, long after the test whose timers outlived its operator.
        settings.process.ultimate_exiting_timeout = None
        before = asyncio.all_tasks()
        task = asyncio.create_task(kopf.operator(
            registry=registry, settings=settings, namespaces=[NAMESPACE], standalone=True,
            memo=kopf.Memo()))

        def watching() -> bool:
            if task.done():
                task.result()  # surfaces the operator's crash
            watches = [r for r in list(self.kmock) if r.action == km.action.WATCH]
            return {ISVC, DEPLOYMENTS} <= {r.resource for r in watches}

        try:
            # Objects created before the watch opens would reach the handlers twice (kmock's notes).
            await self.wait_for(watching, "the operator's watches")
            yield
        finally:
            await stop_operator(task, before)


async def cancel_until_done(tasks: set[asyncio.Task], within: float, every: float) -> set[asyncio.Task]:
    """Cancel `tasks`, and again every `every` seconds, until they end or `within` seconds pass;
    returns those still pending."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    pending = set(tasks)
    while pending and loop.time() < deadline:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=min(every, deadline - loop.time()))
    return pending


async def stop_operator(task: asyncio.Task, before: set[asyncio.Task], timeout: float = 30.0) -> None:
    """Stop the operator, then every task it left behind, while kmock still answers.

    kopf's shutdown cancels every task started after the operator, kmock's request handlers among
    them (they share the test's event loop). A timer's handler thread waiting on such a request
    waits out its client's timeout, and kopf's runner of that timer, which cannot cancel a thread,
    waits for it: that runner outlived the operator. Left to the event loop's teardown, after kmock
    was gone, it failed, slept 60 s before its retry, and held the test until the run's timeout
    (or, with kopf's SIGKILL armed, killed the run). Cancelled once, the runner still waits for its
    thread, then logs the failure and starts that 60 s sleep: the leftovers are cancelled again
    every second until they end."""
    # kopf waits, unbounded, for the tasks it cancels; a second cancel ends that.
    if await cancel_until_done({task}, within=2 * timeout, every=timeout):
        raise AssertionError(f"kopf did not stop within {2 * timeout:.0f}s of being cancelled")
    left = asyncio.all_tasks() - before - {asyncio.current_task()}
    pending = await cancel_until_done(left, within=REQUEST_TIMEOUT_S + 15, every=1.0)  # past a handler's request
    if pending:
        raise AssertionError(f"tasks the operator left would not stop: {sorted(t.get_name() for t in pending)}")
    if not task.cancelled():
        task.result()  # surfaces the operator's crash


@pytest.fixture
def kmock_options(kmock_options: dict[str, Any]) -> dict[str, Any]:
    return {**kmock_options, "cls": VersioningEmulator}


@pytest.fixture
def kubeconfig(kmock: km.KubernetesEmulator, tmp_path: Path) -> Path:
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
        "clusters": [{"name": "kmock", "cluster": {"server": str(kmock.url).rstrip("/")}}],
        "users": [{"name": "kmock", "user": {}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock", "namespace": NAMESPACE}}],
    }))
    return path


@pytest.fixture
def cluster(kmock: km.KubernetesEmulator, kubeconfig: Path, caplog: pytest.LogCaptureFixture) -> Cluster:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # kmock 0.8 reads its bundle with a deprecated API
        kmock.resources.load_bundled()
    kmock.resources[ISVC] = km.ResourceInfo(
        kind=crd.KIND, singular=crd.SINGULAR, namespaced=True, shortnames=set(crd.SHORT_NAMES),
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"}, subresources={"status", "scale"})
    caplog.set_level(logging.INFO, logger="kopf")
    # Handler calls are logged at DEBUG; set last, as set_level also lowers the capturing handler.
    caplog.set_level(logging.DEBUG, logger="kopf.objects")
    return Cluster(kmock, kubeconfig, caplog)


# --- the Gateway API Inference Extension's kinds -------------------------------------------------
# kubernetes-validate knows built-in kinds only; the GIE kinds are checked against their published
# schemas, vendored under data/ (each file names its source).

GIE_SCHEMAS = {("inference.networking.k8s.io/v1", "InferencePool"): "inferencepool-v1.schema.yaml",
               ("gateway.networking.k8s.io/v1", "HTTPRoute"): "httproute-v1.schema.yaml"}


def _pruned_fields(value: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """Fields of `value` a structural schema does not declare: the API server would silently drop
    them (pruning), so a misspelt field would vanish instead of failing."""
    found = []
    if isinstance(value, dict) and "properties" in schema:
        for key, child in value.items():
            if key not in schema["properties"]:
                found.append(f"{path}.{key}")
            elif path or key not in ("metadata", "apiVersion", "kind"):
                found += _pruned_fields(child, schema["properties"][key], f"{path}.{key}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            found += _pruned_fields(item, schema["items"], f"{path}[{i}]")
    return found


def _gie_cel_errors(manifest: dict[str, Any]) -> list[str]:
    """The CEL rules of the vendored InferencePool schema that concern what we render."""
    if manifest["kind"] != "InferencePool":
        return []
    spec, errors = manifest["spec"], []
    ref = spec["endpointPickerRef"]
    if ref.get("kind", "Service") == "Service" and "port" not in ref:
        errors.append("endpointPickerRef: port is required when kind is 'Service'")
    numbers = [p["number"] for p in spec["targetPorts"]]
    if len(numbers) != len(set(numbers)):
        errors.append("targetPorts: port number must be unique")
    return errors


def validate_manifest(manifest: dict[str, Any]) -> None:
    key = (manifest["apiVersion"], manifest["kind"])
    if key not in GIE_SCHEMAS:
        kubernetes_validate.validate(manifest, "1.32", strict=True)
        return
    schema = yaml.safe_load((REPO / "tests" / "operator" / "data" / GIE_SCHEMAS[key]).read_text())
    jsonschema.Draft4Validator(schema).validate(manifest)
    assert _pruned_fields(manifest, schema) == [], f"{key}: fields the schema does not know"
    assert _gie_cel_errors(manifest) == []
    kubernetes_validate.validate({"apiVersion": "v1", "kind": "ConfigMap", "metadata": manifest["metadata"]},
                                 "1.32", strict=True)  # the metadata, as for any object


@pytest.fixture(name="validate_manifest")
def validate_manifest_fixture() -> Callable[[dict[str, Any]], None]:
    """validate_manifest(m): raises unless `m` is valid for Kubernetes 1.32 (GIE kinds: their schemas)."""
    return validate_manifest


@pytest.fixture
def make_isvc() -> Callable[..., dict[str, Any]]:
    """make_isvc(spec_overrides=None, name="demo", uid=...) -> the sample CR, ready for kmock."""
    return _make_isvc


@pytest.fixture
def sample() -> Callable[[str], dict[str, Any]]:
    return load_sample


@pytest.fixture
def repo() -> Path:
    return REPO


# --- a tiny Helm template renderer --------------------------------------------------------------
# No helm binary here. The chart's templates keep to a small subset of Go templates (fields,
# `default`, `quote`, `toYaml`, `nindent`, `if`/`else`, `range`, `with`), and this renders exactly
# that subset; anything else raises, so the chart cannot quietly drift out of what is tested.

class _Missing:
    def __bool__(self) -> bool:
        return False


MISSING = _Missing()
_ACTION = re.compile(r"\{\{(-?)\s*(.*?)\s*(-?)\}\}", re.DOTALL)
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[^\s]+')


def _truthy(value: Any) -> bool:
    return not (value is None or value is MISSING or value is False or value == 0 and not isinstance(value, bool)
                or value in ("", [], {}))


def _to_yaml(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=False, sort_keys=False).rstrip("\n")


def _indent(n: int, text: str) -> str:
    return "\n".join(" " * n + line for line in str(text).split("\n"))


_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "default": lambda fallback, value=MISSING: value if _truthy(value) else fallback,
    "quote": lambda value: '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"',
    "toYaml": _to_yaml,
    "indent": _indent,
    "nindent": lambda n, text: "\n" + _indent(n, text),
}


def _deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Helm's values merge: maps merge key by key, anything else replaces."""
    for key, value in override.items():
        base[key] = _deep_merge(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) \
            else value
    return base


class HelmLite:
    def __init__(self, chart: Path, release: str = "pdserve", namespace: str = "pdserve-system"):
        meta = yaml.safe_load((chart / "Chart.yaml").read_text())
        self.chart = chart
        self.defaults = yaml.safe_load((chart / "values.yaml").read_text())
        self.builtins = {
            "Chart": {key[0].upper() + key[1:]: value for key, value in meta.items()},
            "Release": {"Name": release, "Namespace": namespace, "Service": "Helm"},
        }

    def render(self, values: dict[str, Any] | None = None) -> dict[str, str]:
        """template file name -> rendered text, with `values` merged over values.yaml."""
        merged = _deep_merge(copy.deepcopy(self.defaults), copy.deepcopy(values or {}))
        root = {**self.builtins, "Values": merged}
        return {path.name: self._render_text(path.read_text(), root)
                for path in sorted((self.chart / "templates").iterdir())}

    def manifests(self, values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        docs = []
        for name, text in self.render(values).items():
            if name.endswith((".yaml", ".yml")):
                docs += [doc for doc in yaml.safe_load_all(text) if doc]
        return docs

    # --- parsing ---
    def _tokens(self, text: str) -> list[tuple[str, str]]:
        tokens: list[tuple[str, str]] = []
        pos = 0
        trim_next = False
        for match in _ACTION.finditer(text):
            chunk = text[pos:match.start()]
            if trim_next:
                chunk = chunk.lstrip()
            if match.group(1):
                chunk = chunk.rstrip()
            tokens.append(("text", chunk))
            tokens.append(("action", match.group(2)))
            trim_next = bool(match.group(3))
            pos = match.end()
        tail = text[pos:]
        tokens.append(("text", tail.lstrip() if trim_next else tail))
        return tokens

    def _parse(self, tokens: list[tuple[str, str]], i: int = 0, stop: tuple[str, ...] = ()) -> tuple[list, int, str]:
        nodes: list = []
        while i < len(tokens):
            kind, value = tokens[i]
            i += 1
            if kind == "text":
                nodes.append(("text", value))
                continue
            word = value.split(None, 1)[0] if value else ""
            if word in stop:
                return nodes, i, word
            if word in ("if", "range", "with"):
                body, i, ended = self._parse(tokens, i, ("else", "end"))
                other: list = []
                if ended == "else":
                    other, i, _ = self._parse(tokens, i, ("end",))
                nodes.append((word, value.split(None, 1)[1], body, other))
            elif value.startswith("/*"):
                continue
            elif word in ("else", "end"):
                raise ValueError(f"unexpected {{{{ {value} }}}}")
            else:
                nodes.append(("expr", value))
        if stop:
            raise ValueError(f"missing {{{{ end }}}} (expected one of {stop})")
        return nodes, i, ""

    # --- evaluation ---
    def _term(self, token: str, dot: Any, root: dict[str, Any]) -> Any:
        if token.startswith('"'):
            return yaml.safe_load(token)
        if token.isdigit():
            return int(token)
        if token in ("true", "false"):
            return token == "true"
        if token == ".":
            return dot
        if token.startswith("$"):
            value, path = root, token[1:]
        elif token.startswith("."):
            value, path = dot, token
        else:
            raise ValueError(f"unsupported template term {token!r}")
        for part in [p for p in path.split(".") if p]:
            value = value.get(part, MISSING) if isinstance(value, dict) else MISSING
        return value

    def _pipeline(self, expr: str, dot: Any, root: dict[str, Any]) -> Any:
        result: Any = MISSING
        for n, command in enumerate(part.strip() for part in expr.split("|")):
            words = _TOKEN.findall(command)
            if words[0] in _FUNCTIONS:
                args = [self._term(w, dot, root) for w in words[1:]] + ([result] if n else [])
                result = _FUNCTIONS[words[0]](*args)
            elif n == 0 and len(words) == 1:
                result = self._term(words[0], dot, root)
            else:
                raise ValueError(f"unsupported template command {command!r}")
        return result

    def _emit(self, nodes: list, dot: Any, root: dict[str, Any]) -> str:
        out = []
        for node in nodes:
            if node[0] == "text":
                out.append(node[1])
            elif node[0] == "expr":
                value = self._pipeline(node[1], dot, root)
                if value is MISSING or isinstance(value, (dict, list)):
                    raise ValueError(f"{{{{ {node[1]} }}}} renders {value!r}; use a field that exists / toYaml")
                out.append(str(value).lower() if isinstance(value, bool) else str(value))
            else:
                word, expr, body, other = node
                value = self._pipeline(expr, dot, root)
                if word == "if":
                    out.append(self._emit(body if _truthy(value) else other, dot, root))
                elif word == "with":
                    out.append(self._emit(body, value, root) if _truthy(value) else self._emit(other, dot, root))
                elif _truthy(value):
                    out.extend(self._emit(body, item, root) for item in value)
                else:
                    out.append(self._emit(other, dot, root))
        return "".join(out)

    def _render_text(self, text: str, root: dict[str, Any]) -> str:
        nodes, _, _ = self._parse(self._tokens(text))
        return self._emit(nodes, root, root)


@pytest.fixture
def helm() -> HelmLite:
    return HelmLite(REPO / "charts" / "pdserve")


@pytest.fixture
def chart_rbac(helm: HelmLite) -> Callable[[str, str, str], bool]:
    """allowed(apiGroup, resource, verb) under the chart's ClusterRole (default values)."""
    role = next(m for m in helm.manifests() if m["kind"] == "ClusterRole")

    def allowed(group: str, resource: str, verb: str) -> bool:
        return any(group in rule["apiGroups"] and resource in rule["resources"] and verb in rule["verbs"]
                   for rule in role["rules"])

    return allowed
