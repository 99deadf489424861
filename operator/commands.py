"""Command lines of the pods, as argument lists.

These are the contract with the `pdserve serve|router|coordinator|kvstore` CLIs; the operator
never imports those packages (it renders strings), so the flags are spelled out here.
"""

from __future__ import annotations

import json
from typing import Any

from pdserve.operator.names import (COORDINATOR_HTTP_PORT, COORDINATOR_PUBLISH_PORT, COORDINATOR_STATS_PORT,
                                    ENGINE_PORT, KV_TRANSFER_PORT, KVSTORE_PORT, Names)
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
        *engine.extra_args,
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
