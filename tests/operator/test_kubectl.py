"""The real kubectl against kmock: apply the sample, and the operator reacts."""

from __future__ import annotations

import asyncio
import json

import yaml


async def kubectl(cluster, tmp_path, *args: str, stdin: bytes | None = None) -> str:
    # kmock serves from this test's event loop: kubectl must run without blocking it.
    proc = await asyncio.create_subprocess_exec(
        "kubectl", "--kubeconfig", str(cluster.kubeconfig), "--cache-dir", str(tmp_path / "kube-cache"), *args,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(stdin), timeout=60)
    assert proc.returncode == 0, f"kubectl {' '.join(args)}: {err.decode()}"
    return out.decode()


async def test_kubectl_apply_of_the_sample_is_served(cluster, repo, tmp_path):
    sample = repo / "crds" / "examples" / "demo.yaml"
    async with cluster.operator():
        out = await kubectl(cluster, tmp_path, "apply", "--validate=false", "-f", str(sample))
        assert out.strip() == "inferenceservice.pdserve.io/demo created"

        await cluster.wait_for(lambda: cluster.names("Deployment") == {
            "demo-prefill", "demo-decode", "demo-router", "demo-coordinator"}, "the pools")
        await cluster.wait_for(lambda: (cluster.get("InferenceService", "demo").get("status") or {}).get("phase"),
                               "a status")
        live = json.loads(await kubectl(cluster, tmp_path, "get", "inferenceservice", "demo", "-o", "json"))
        assert live["status"]["endpoint"] == "http://demo-router.default.svc:8000/v1"
        assert live["status"]["phase"] == "Pending"
        router = cluster.get("Deployment", "demo-router")
        assert router["metadata"]["ownerReferences"][0]["uid"] == live["metadata"]["uid"]

        # Edit the file and apply again: the decode pool follows.
        edited = yaml.safe_load(sample.read_text())
        edited["spec"]["decode"]["replicas"] = 3
        out = await kubectl(cluster, tmp_path, "apply", "--validate=false", "-f", "-",
                            stdin=yaml.safe_dump(edited).encode())
        assert out.strip() == "inferenceservice.pdserve.io/demo configured"
        await cluster.wait_for(lambda: cluster.get("Deployment", "demo-decode")["spec"]["replicas"] == 3,
                               "decode at 3 replicas")

        # The Deployment controller reports the pods ready; kubectl shows the status follow.
        await cluster.set_ready({"prefill": 1, "decode": 3, "router": 1, "coordinator": 1})
        await cluster.wait_for(lambda: cluster.get("InferenceService", "demo")["status"]["phase"] == "Ready", "Ready")
        shown = await kubectl(cluster, tmp_path, "get", "isvc", "demo", "-o", "jsonpath={.status.decode.ready}")
        assert shown == "3/3"

        out = await kubectl(cluster, tmp_path, "delete", "-f", str(sample))
        assert out.strip() == 'inferenceservice.pdserve.io "demo" deleted'
        assert cluster.get("InferenceService", "demo") is None
