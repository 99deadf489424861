"""Every pod command the operator renders for the demo resource starts and serves (issue 11, test 6).

The commands come from the operator's pure rendering of crds/examples/demo.yaml (and a kvstore
variant of it) and run as local processes, changed only where a laptop differs from a cluster:
127.0.0.x instead of 0.0.0.0, free ports instead of the fixed ones, 127.0.0.1:port instead of
Service DNS names, the pod IP ($(POD_IP), which the kubelet expands) is the engine's own address.
The router keeps its Kubernetes discovery flags and finds the engines through EndpointSlices in
kmock; the prefill and decode engines listen on 127.0.0.2 and 127.0.0.3 with the same port, so the
router's single --engine-port holds as in a cluster. The internal key reaches every process as the
pods get it: a file of the rendered Secret (written here as the kubelet would), named by the env
var the container declares, and no key in the environment itself.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import json
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from pdserve.engine.internal_auth import ENV_KEY, ENV_KEY_FILE, generate_key
from pdserve.operator.commands import POD_IP_REFERENCE
from pdserve.operator.render import internal_key_secret, render
from pdserve.operator.spec import parse

ENGINE_HOSTS = {"prefill": "127.0.0.2", "decode": "127.0.0.3"}
LOCAL = "127.0.0.1"
SLICES = "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices"
# Long enough for the router's default --pd-min-prompt-tokens (256) under any counting rule.
LONG_PROMPT = " ".join(f"item{i}" for i in range(300))


def free_port(*hosts: str, consecutive: int = 1) -> int:
    """A port (and the `consecutive - 1` after it) free on every one of `hosts` right now."""
    for _ in range(200):
        with socket.socket() as probe:
            probe.bind((hosts[0], 0))
            base = probe.getsockname()[1]
        if base + consecutive > 65535:
            continue
        try:
            for host in hosts:
                for port in range(base, base + consecutive):
                    with socket.socket() as s:
                        s.bind((host, port))
            return base
        except OSError:
            continue
    raise RuntimeError("no free port")


def rendered_pods(sample: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """role -> the pod spec of that role's Deployment, as the operator renders it."""
    return {m["metadata"]["name"].removeprefix("demo-"): m["spec"]["template"]["spec"]
            for m in render(sample) if m["kind"] == "Deployment"}


class Rewriter:
    """Changes one rendered command for a local run, checking each value it replaces is as rendered."""

    def __init__(self, argv: list[str]) -> None:
        assert argv[0] == "pdserve", argv
        self.argv = list(argv[1:])

    def replace(self, flag: str, expected: str | None, value: str) -> "Rewriter":
        i = self.argv.index(flag) + 1
        assert expected is None or self.argv[i] == expected, (flag, self.argv[i], expected)
        self.argv[i] = value
        return self

    def value(self, flag: str) -> str:
        return self.argv[self.argv.index(flag) + 1]

    def command(self) -> list[str]:
        return [sys.executable, "-m", "pdserve", *self.argv]


@dataclass
class Running:
    role: str
    proc: subprocess.Popen
    log: Path

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:] if self.log.exists() else ""


def local_commands(containers: dict[str, dict[str, Any]]) -> tuple[dict[str, list[str]], dict]:
    """role -> local argv, plus the addresses the test checks (health URLs, router URL, engine port)."""
    argv = {role: [*c["command"], *c["args"]] for role, c in containers.items()}
    stats, publish, coordinator_http, router_port = (free_port(LOCAL) for _ in range(4))
    engine_port = free_port(*ENGINE_HOSTS.values())
    commands: dict[str, list[str]] = {}
    probes: dict[str, tuple[str, Any]] = {}

    coordinator = Rewriter(argv["coordinator"])
    coordinator.replace("--host", "0.0.0.0", LOCAL).replace("--stats-port", "5557", str(stats))
    coordinator.replace("--publish-port", "5558", str(publish)).replace("--http-port", "8080", str(coordinator_http))
    commands["coordinator"] = coordinator.command()
    probes["coordinator"] = ("http", f"http://{LOCAL}:{coordinator_http}/health")

    store_address = None
    if "kvstore" in argv:
        # The store's HTTP side defaults to --port + 1: both must be free.
        store_port = free_port(LOCAL, consecutive=2)
        store = Rewriter(argv["kvstore"]).replace("--host", "0.0.0.0", LOCAL).replace("--port", "5700", str(store_port))
        commands["kvstore"] = store.command()
        probes["kvstore"] = ("tcp", (LOCAL, store_port))  # the rendered probe is a TCP connect
        store_address = f"{LOCAL}:{store_port}"

    for role, host in ENGINE_HOSTS.items():
        engine = Rewriter(argv[role]).replace("--host", "0.0.0.0", host).replace("--port", "8000", str(engine_port))
        engine.replace("--coordinator-address", "demo-coordinator:5557", f"{LOCAL}:{stats}")
        config = json.loads(engine.value("--kv-transfer-config"))
        extra = config["kv_connector_extra_config"]
        if "kvstore_url" in extra:
            assert extra["kvstore_url"] == "tcp://demo-kvstore:5700", extra
            extra["kvstore_url"] = f"tcp://{store_address}"
        if "side_channel_port" in extra:  # p2p: where decode engines pull this prefill engine's blocks
            assert extra["side_channel_port"] == 5600, extra
            extra["side_channel_port"] = free_port(host)
            assert extra["side_channel_host"] == POD_IP_REFERENCE, extra
            extra["side_channel_host"] = host
        engine.replace("--kv-transfer-config", None, json.dumps(config, separators=(",", ":")))
        commands[role] = engine.command()
        probes[role] = ("http", f"http://{host}:{engine_port}/health")

    router = Rewriter(argv["router"]).replace("--host", "0.0.0.0", LOCAL).replace("--port", "8000", str(router_port))
    router.replace("--engine-port", "8000", str(engine_port))
    router.replace("--coordinator-address", "demo-coordinator:5558", f"{LOCAL}:{publish}")
    commands["router"] = router.command()
    probes["router"] = ("http", f"http://{LOCAL}:{router_port}/health")
    return commands, {"probes": probes, "router": f"http://{LOCAL}:{router_port}", "engine_port": engine_port,
                      "model": router.value("--model")}


def key_files(resource: dict[str, Any], pods: dict[str, dict[str, Any]], key: str,
              root: Path) -> dict[str, dict[str, str]]:
    """role -> the env that carries the key: the file the container's env names, written where its
    Secret volume would put it (under `root` instead of the mount path)."""
    secret = internal_key_secret(parse(resource), key)
    envs = {}
    for role, pod in pods.items():
        c = pod["containers"][0]
        path = next(e["value"] for e in c["env"] if e["name"] == ENV_KEY_FILE)
        assert not any(e["name"] == ENV_KEY for e in c["env"]), "the key itself must not be in the pod spec"
        mount = next(m for m in c["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
        volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])["secret"]
        assert volume["secretName"] == secret["metadata"]["name"]
        item = next(i for i in volume["items"] if i["path"] == path.removeprefix(mount["mountPath"] + "/"))
        local = root / mount["name"] / item["path"]
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_bytes(base64.b64decode(secret["data"][item["key"]]))
        envs[role] = {ENV_KEY_FILE: str(local)}
    return envs


def endpoint_slice(service: str, address: str, port: int) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": f"{service}-abcde", "namespace": "default", "uid": f"uid-{service}",
                     "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "endpoints": [{"addresses": [address], "conditions": {"ready": True, "serving": True, "terminating": False}}],
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
    }


async def probe_ok(client: httpx.AsyncClient, kind: str, target: Any) -> bool:
    if kind == "tcp":
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(*target), timeout=2)
        except (OSError, asyncio.TimeoutError):
            return False
        writer.close()
        return True
    try:
        return (await client.get(target)).status_code == 200
    except httpx.HTTPError:
        return False


async def wait_serving(running: dict[str, Running], probes: dict[str, tuple[str, Any]], timeout: float) -> None:
    pending = dict(probes)
    deadline = asyncio.get_running_loop().time() + timeout
    async with httpx.AsyncClient(timeout=2, trust_env=False) as client:
        while pending:
            for role in list(pending):
                if running[role].proc.poll() is not None:
                    raise AssertionError(f"{role} exited with {running[role].proc.returncode}:\n{running[role].tail()}")
                if await probe_ok(client, *pending[role]):
                    del pending[role]
            if asyncio.get_running_loop().time() > deadline:
                logs = "\n".join(f"--- {r} ---\n{running[r].tail()}" for r in pending)
                raise AssertionError(f"not serving after {timeout}s: {sorted(pending)}\n{logs}")
            await asyncio.sleep(0.3)


def stop_all(running: dict[str, Running]) -> None:
    for r in running.values():
        if r.proc.poll() is None:
            r.proc.send_signal(signal.SIGTERM)
    for r in running.values():
        try:
            r.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        try:  # the engine core and anything else left in the process group
            os.killpg(r.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        r.proc.wait()


async def metric(url: str, name: str) -> float:
    async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
        text = (await client.get(f"{url}/metrics")).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


VARIANTS = {
    "demo.yaml as written": None,
    "demo.yaml with the kvstore connector": {"connector": "kvstore", "kvstore": {"capacity": "256Mi"}},
}


# free_port binds a port and lets it go; with two test workers another process may take it before
# the command binds it. Such a start is retried on fresh ports; any other failure stands.
PORT_TAKEN = "Address already in use"
START_ATTEMPTS = 3


async def start_serving(containers: dict[str, dict[str, Any]], env: dict[str, str], key_env: dict[str, dict[str, str]],
                        tmp_path: Path) -> tuple[dict[str, Running], dict]:
    """Every pod's command started on free local ports, the backends serving (the router started too)."""
    for attempt in range(START_ATTEMPTS):
        commands, where = local_commands(containers)
        running: dict[str, Running] = {}
        try:
            for role, command in commands.items():
                log = tmp_path / f"{role}.log"
                with open(log, "wb") as out:
                    proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                            env={**env, **key_env[role]}, start_new_session=True)
                running[role] = Running(role, proc, log)
            backends = {role: probe for role, probe in where["probes"].items() if role != "router"}
            await wait_serving(running, backends, timeout=240)
            return running, where
        except BaseException as exc:
            await asyncio.to_thread(stop_all, running)
            if PORT_TAKEN not in str(exc) or attempt == START_ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


@pytest.mark.parametrize("variant", VARIANTS)
async def test_every_rendered_pod_command_starts_and_serves(variant, sample, cluster, kubeconfig, tmp_path,
                                                           monkeypatch):
    resource = copy.deepcopy(sample("demo.yaml"))
    if VARIANTS[variant] is not None:
        resource["spec"]["kvTransfer"] = VARIANTS[variant]
    pods = rendered_pods(resource)
    containers = {role: pod["containers"][0] for role, pod in pods.items()}
    expected_roles = {"coordinator", "prefill", "decode", "router"} | ({"kvstore"} if VARIANTS[variant] else set())
    assert set(containers) == expected_roles

    # One fresh key for this deployment; this test's own clients (the KV store check) hold it too.
    key = generate_key()
    monkeypatch.setenv(ENV_KEY, key)
    key_env = key_files(resource, pods, key, tmp_path / "secrets")
    env = dict(os.environ, PYTHONSAFEPATH="1", KUBECONFIG=str(kubeconfig))
    del env[ENV_KEY]  # the processes get the file only, as the pods do
    running: dict[str, Running] = {}
    try:
        running, where = await start_serving(containers, env, key_env, tmp_path)
        # As in a cluster, an engine enters its Service's EndpointSlice once its readiness probe passes.
        for role, host in ENGINE_HOSTS.items():
            await cluster.request("POST", SLICES, endpoint_slice(f"demo-{role}", host, where["engine_port"]))
        await wait_serving(running, {"router": where["probes"]["router"]}, timeout=120)

        if "kvstore" in running:
            from pdserve.kvstore.client import KVStoreClient

            store = KVStoreClient(f"tcp://{where['probes']['kvstore'][1][0]}:{where['probes']['kvstore'][1][1]}",
                                  namespace="test")
            try:
                assert isinstance(await asyncio.to_thread(store.stats), dict)
            finally:
                store.close()

        client = openai.AsyncOpenAI(base_url=f"{where['router']}/v1", api_key="none", max_retries=0, timeout=120)
        # The router finds the engines through kmock; give its first list a moment.
        for _ in range(60):
            models = await client.models.list()
            if [m.id for m in models.data] == [where["model"]]:
                break
            await asyncio.sleep(0.5)
        assert [m.id for m in models.data] == [where["model"]]
        response = None
        for _ in range(60):  # until discovery has filled both pools
            try:
                response = await client.completions.create(model=where["model"], prompt=LONG_PROMPT, max_tokens=8,
                                                           temperature=0, extra_body={"ignore_eos": True})
                break
            except openai.APIStatusError as exc:
                if exc.status_code != 503:
                    raise
                await asyncio.sleep(0.5)
        assert response is not None, "the router never found its engines in kmock"
        assert response.usage.completion_tokens == 8 and response.choices[0].text
        prefill_url = where["probes"]["prefill"][1].removesuffix("/health")
        decode_url = where["probes"]["decode"][1].removesuffix("/health")
        # A prompt over the router's default --pd-min-prompt-tokens goes through both pools.
        assert await metric(prefill_url, "vllm:prompt_tokens_total") > 0
        assert await metric(decode_url, "vllm:generation_tokens_total") >= 8
    finally:
        await asyncio.to_thread(stop_all, running)
