"""Command lines of the pods, as argument lists.

These are the contract with the `pdserve serve|router|coordinator|kvstore` CLIs; the operator
never imports those packages (it renders strings), so the flags are spelled out here.
"""

from __future__ import annotations

import json
from typing import Any

from pdserve.operator.names import (COORDINATOR_HTTP_PORT, COORDINATOR_PUBLISH_PORT, COORDINATOR_STATS_PORT,
                                    ENGINE_PORT, KV_TRANSFER_PORT, KVSTORE_PORT, RANK_PORT_BASE, Names)
from pdserve.operator.spec import KV_SHARED_MOUNT, InferenceService

KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
# A Kubernetes dependent variable: `$(NAME)` in command/args is replaced with the container's env var.
POD_IP_REFERENCE = "$(POD_IP)"


def kv_transfer_config(isvc: InferenceService, role: str) -> dict[str, Any]:
    """The vLLM-style --kv-transfer-config of an engine in `role`."""
    kv = isvc.spec.kv_transfer
    extra: dict[str, Any] = {}
    if kv.connector == "kvstore":
        extra["kvstore_url"] = f"tcp://{Names(isvc.name).service('kvstore')}:{KVSTORE_PORT}"
    elif kv.connector == "shared-storage":
        extra["path"] = KV_SHARED_MOUNT
    elif kv.connector == "p2p" and role == "prefill":
        # The port the pod declares for the KV side channel (rank r of a TP group uses port + r).
        extra["side_channel_port"] = KV_TRANSFER_PORT
        # The pod IP, expanded by the kubelet from the container's POD_IP (downward API): the side
        # channel then serves on the pod network only, and decode engines are told exactly that address.
        extra["side_channel_host"] = POD_IP_REFERENCE
    return {"kv_connector": kv.connector, "kv_role": KV_ROLES[role], "kv_connector_extra_config": extra}


def compact_json(value: Any) -> str:
    # Sorted and compact so the same spec always renders the same bytes (no needless rollouts).
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def engine_command(isvc: InferenceService, role: str) -> list[str]:
    spec = isvc.spec
    pool, engine = spec.pool(role), spec.engine
    return [
        "pdserve", "serve",
        "--model", spec.model.container_path,
        "--served-model-name", spec.model.name,
        "--host", "0.0.0.0",
        "--port", str(ENGINE_PORT),
        "--tensor-parallel-size", str(pool.tensor_parallel_size),
        "--data-parallel-size", str(pool.data_parallel_size),
        "--max-model-len", str(engine.max_model_len),
        "--block-size", str(engine.block_size),
        "--max-num-seqs", str(engine.max_num_seqs),
        "--enable-prefix-caching" if engine.enable_prefix_caching else "--no-enable-prefix-caching",
        "--engine-role", role,
        "--kv-transfer-config", compact_json(kv_transfer_config(isvc, role)),
        "--coordinator-address", Names(isvc.name).coordinator_address(COORDINATOR_STATS_PORT),
        # Several DP ranks in one pod balance on the coordinator's feed of their loads.
        *(["--coordinator-publish-address", Names(isvc.name).coordinator_address(COORDINATOR_PUBLISH_PORT)]
          if pool.data_parallel_size > 1 else []),
        # The inference gateway addresses each DP rank of a decode pod on its own port (InferencePool targetPorts).
        *(["--rank-port-base", str(RANK_PORT_BASE)] if uses_rank_ports(isvc, role) else []),
        *engine.extra_args,
    ]


def uses_rank_ports(isvc: InferenceService, role: str) -> bool:
    return role == "decode" and isvc.spec.router.gateway is not None and isvc.spec.decode.data_parallel_size > 1


def epp_command(isvc: InferenceService, internal_key_file: str) -> list[str]:
    """`pdserve epp`: the endpoint picker a GIE gateway asks, over ext_proc, where each request goes."""
    names = Names(isvc.name)
    gateway = isvc.spec.router.gateway
    assert gateway is not None, "only rendered with spec.router.gateway enabled"
    return [
        "pdserve", "epp",
        "--host", "0.0.0.0",
        "--grpc-port", str(gateway.endpoint_picker.port),
        "--metrics-port", str(gateway.endpoint_picker.metrics_port),
        "--model", isvc.spec.model.name,
        # Decode pods serve the users' requests: they are the pool. The EPP runs the prefill leg itself.
        "--namespace", isvc.namespace,
        "--pool-service", names.service("decode"),
        "--pool-port", str(ENGINE_PORT),
        "--prefill-service", names.service("prefill"),
        "--prefill-port", str(ENGINE_PORT),
        *(["--rank-port-base", str(RANK_PORT_BASE)] if uses_rank_ports(isvc, "decode") else []),
        "--coordinator", f"tcp://{names.coordinator_address(COORDINATOR_PUBLISH_PORT)}",
        "--policy", isvc.spec.router.routing_policy,
        # Its inference_pool_* metrics then carry the InferencePool's name, as GIE dashboards expect.
        "--pool-name", names.inference_pool(gateway.pool_name),
        "--internal-key-file", internal_key_file,
    ]


def router_command(isvc: InferenceService) -> list[str]:
    names = Names(isvc.name)
    router = isvc.spec.router
    return [
        "pdserve", "router",
        "--host", "0.0.0.0",
        "--port", str(router.port),
        "--model", isvc.spec.model.name,
        "--prefill-service", names.service("prefill"),
        "--decode-service", names.service("decode"),
        "--namespace", isvc.namespace,
        "--engine-port", str(ENGINE_PORT),
        "--coordinator-address", names.coordinator_address(COORDINATOR_PUBLISH_PORT),
        "--routing-policy", router.routing_policy,
    ]


def coordinator_command() -> list[str]:
    return [
        "pdserve", "coordinator",
        "--host", "0.0.0.0",
        "--stats-port", str(COORDINATOR_STATS_PORT),
        "--publish-port", str(COORDINATOR_PUBLISH_PORT),
        "--http-port", str(COORDINATOR_HTTP_PORT),
    ]


def kvstore_command(isvc: InferenceService) -> list[str]:
    return [
        "pdserve", "kvstore",
        "--host", "0.0.0.0",
        "--port", str(KVSTORE_PORT),
        "--capacity", str(isvc.spec.kv_transfer.kvstore_capacity_bytes),
    ]
