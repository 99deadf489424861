"""Engine discovery from Kubernetes EndpointSlices against kmock, and the operator's rendered router
command started as a local process against the same mock API server."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import httpx
import kmock as km
import pytest
import yaml

from pdserve.router.balancer import Policy
from pdserve.router.discovery import DEFAULT_RELIST_S, kube_connection, kubernetes_discovery, slice_urls
from pdserve.router.endpoints import Pools

from support.server import free_port

REPO = Path(__file__).resolve().parents[2]
NAMESPACE = "default"
SLICES = km.resource("discovery.k8s.io", "v1", "endpointslices")
SLICES_PATH = f"/apis/discovery.k8s.io/v1/namespaces/{NAMESPACE}/endpointslices"


def endpoint_slice(name: str, service: str, endpoints: list[tuple[str, bool | None]]) -> dict:
    """An EndpointSlice of `service` with (address, ready) endpoints; ready None leaves the condition out."""
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
        "metadata": {"name": name, "namespace": NAMESPACE, "uid": f"uid-{name}",
                     "labels": {"kubernetes.io/service-name": service}},
        "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}],
        "endpoints": [{"addresses": [address], **({"conditions": {"ready": ready}} if ready is not None else {})}
                      for address, ready in endpoints],
    }


@pytest.fixture
def kubeconfig(kmock: km.KubernetesEmulator, tmp_path: Path) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # kmock 0.8 reads its bundle with a deprecated API
        kmock.resources.load_bundled()
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
        "clusters": [{"name": "kmock", "cluster": {"server": str(kmock.url).rstrip("/")}}],
        "users": [{"name": "kmock", "user": {}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock", "namespace": NAMESPACE}}],
    }))
    return path


async def api(kmock: km.KubernetesEmulator, method: str, path: str, body: dict | None = None) -> dict:
    headers = {"content-type": "application/merge-patch+json"} if method == "PATCH" else {}
    async with httpx.AsyncClient(base_url=str(kmock.url).rstrip("/"), timeout=10) as http:
        response = await http.request(method, path, json=body, headers=headers)
    assert response.status_code < 400, (method, path, response.status_code, response.text)
    return response.json()


async def eventually(predicate, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


def lists(kmock: km.KubernetesEmulator) -> int:
    """LIST requests the mock has answered for EndpointSlices."""
    return sum(1 for r in list(kmock) if r.resource == SLICES and r.action == km.action.LIST)


def test_ready_endpoints_of_the_right_service_become_urls():
    sliced = endpoint_slice("s", "demo-decode", [("10.0.0.1", True), ("10.0.0.2", False), ("10.0.0.3", None)])
    assert slice_urls(sliced, "demo-decode", 8000) == ["http://10.0.0.1:8000", "http://10.0.0.3:8000"]
    assert slice_urls(sliced, "demo-prefill", 8000) is None  # another Service's slice
    v6 = endpoint_slice("s6", "demo-decode", [("fd00::5", True)])
    assert slice_urls(v6, "demo-decode", 9000) == ["http://[fd00::5]:9000"]


async def test_endpoint_slices_added_unready_and_removed_change_the_pools(kmock, kubeconfig):
    pools = Pools(Policy.LEAST_LOADED)
    discover = kubernetes_discovery(kube_connection(str(kubeconfig)), NAMESPACE, "demo-prefill", "demo-decode", 8000)
    task = asyncio.create_task(discover(pools))
    try:
        await api(kmock, "POST", SLICES_PATH,
                  endpoint_slice("demo-decode-a", "demo-decode", [("10.0.0.1", True), ("10.0.0.2", None),
                                                                   ("10.0.0.9", False)]))
        # A slice of an unrelated Service in the same namespace (kmock ignores label selectors).
        await api(kmock, "POST", SLICES_PATH, endpoint_slice("other-x", "other", [("10.9.9.9", True)]))
        await eventually(lambda: set(pools.decode.endpoints) == {"http://10.0.0.1:8000", "http://10.0.0.2:8000"},
                         "the decode pool")
        assert len(pools.prefill) == 0

        await api(kmock, "POST", SLICES_PATH, endpoint_slice("demo-prefill-a", "demo-prefill", [("10.0.1.1", True)]))
        await api(kmock, "POST", SLICES_PATH, endpoint_slice("demo-decode-b", "demo-decode", [("10.0.0.3", True)]))
        await eventually(lambda: set(pools.prefill.endpoints) == {"http://10.0.1.1:8000"}, "the prefill pool")
        await eventually(lambda: len(pools.decode) == 3, "a second decode slice")

        # A pod going not-ready (terminating, failing its probe) leaves the pool.
        await api(kmock, "PATCH", f"{SLICES_PATH}/demo-decode-a",
                  {"endpoints": [{"addresses": ["10.0.0.1"], "conditions": {"ready": False}},
                                 {"addresses": ["10.0.0.2"], "conditions": {"ready": True}}]})
        await eventually(lambda: set(pools.decode.endpoints) == {"http://10.0.0.2:8000", "http://10.0.0.3:8000"},
                         "the not-ready endpoint's removal")

        await api(kmock, "DELETE", f"{SLICES_PATH}/demo-decode-a")
        await eventually(lambda: set(pools.decode.endpoints) == {"http://10.0.0.3:8000"}, "the slice's removal")
        await api(kmock, "DELETE", f"{SLICES_PATH}/demo-prefill-a")
        await eventually(lambda: len(pools.prefill) == 0, "an empty prefill pool")
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_a_missed_watch_event_is_repaired_by_the_relist(kmock, kubeconfig):
    pools = Pools(Policy.LEAST_LOADED)
    discover = kubernetes_discovery(kube_connection(str(kubeconfig)), NAMESPACE, None, "demo-decode", 8000,
                                    relist_interval=1.0)
    task = asyncio.create_task(discover(pools))
    try:
        await api(kmock, "POST", SLICES_PATH, endpoint_slice("demo-decode-a", "demo-decode", [("10.0.0.1", True)]))
        await eventually(lambda: set(pools.decode.endpoints) == {"http://10.0.0.1:8000"}, "the first endpoint")
        # Change the stored object behind the watch's back: no event is ever sent for this.
        kmock.objects[SLICES, NAMESPACE, "demo-decode-a"].patch(
            {"endpoints": [{"addresses": ["10.0.0.1"], "conditions": {"ready": False}},
                           {"addresses": ["10.0.0.7"], "conditions": {"ready": True}}]})
        lists_before = lists(kmock)
        await eventually(lambda: set(pools.decode.endpoints) == {"http://10.0.0.7:8000"}, "the relist's repair")
        assert lists(kmock) > lists_before  # it was a new LIST that saw it, not the watch
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert DEFAULT_RELIST_S == 30.0  # the production interval the issue asks for


def rendered_router_argv() -> list[str]:
    from pdserve.operator.render import render

    sample = yaml.safe_load((REPO / "crds" / "examples" / "demo.yaml").read_text())
    deployment = next(m for m in render(sample) if m["kind"] == "Deployment" and m["metadata"]["name"] == "demo-router")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return container["command"] + container["args"]


async def test_the_rendered_router_command_starts_and_serves_against_kmock(kmock, kubeconfig, tmp_path):
    argv = rendered_router_argv()
    assert argv[:2] == ["pdserve", "router"] and "--decode-service" in argv and "--coordinator-address" in argv
    # The exact rendered flags; only the listening port is swapped for a free one on this machine.
    port = free_port()
    argv[argv.index("--port") + 1] = str(port)
    log_path = tmp_path / "router.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", *argv], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True,
                                env=dict(os.environ, PYTHONSAFEPATH="1", KUBECONFIG=str(kubeconfig)))
    base = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=base, timeout=10) as http:
            deadline = time.monotonic() + 60
            while True:
                assert proc.poll() is None, log_path.read_text()
                try:
                    if (await http.get("/health")).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, log_path.read_text()
                await asyncio.sleep(0.2)
            health = (await http.get("/health")).json()
            assert health["pools"] == {"prefill": {"endpoints": 0, "healthy": 0}, "decode": {"endpoints": 0, "healthy": 0}}
            assert health["coordinator"] == "silent"  # demo-coordinator does not resolve here; the router runs on
            assert [m["id"] for m in (await http.get("/v1/models")).json()["data"]] == ["demo"]
            empty = await http.post("/v1/completions", json={"model": "demo", "prompt": "hi"})
            assert empty.status_code == 503 and empty.json()["error"]["code"] == "no_engines"

            # The decode Service gets a ready pod: the router's pool follows the EndpointSlice.
            await api(kmock, "POST", SLICES_PATH, endpoint_slice("demo-decode-x", "demo-decode", [("127.0.0.1", True)]))

            async def decode_endpoints() -> int:
                return (await http.get("/health")).json()["pools"]["decode"]["endpoints"]

            deadline = time.monotonic() + 15
            while await decode_endpoints() != 1:
                assert time.monotonic() < deadline, log_path.read_text()
                await asyncio.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        while proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.1)  # keep serving kmock while the router shuts down
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, log_path.read_text()
