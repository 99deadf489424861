"""The p2p connector: a decode engine pulls a prompt's KV straight out of the prefill engine's cache.

Prefill side: a finished request marked `do_remote_decode` keeps its blocks; its answer carries
where they are (`remote_host`, one side-channel port per TP rank, the block ids). Each prefill
worker rank serves reads of held blocks and frees them when every reader is done, or after
`abort_timeout_s` with no read in progress.

Decode side: a request marked `do_remote_prefill` waits in WAITING_FOR_REMOTE_KVS while each
worker rank pulls the heads it owns from the prefill ranks that hold them (kvstore.layout), off
the model's thread. Whatever goes wrong (the prefill engine gone, blocks expired, a timeout),
the request comes back with its local prefix only and is recomputed.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdserve.kvstore.base import KVConnectorBase, KVConnectorRole, KVConnectorStats, LoadLog
from pdserve.kvstore.config import KVTransferConfig
from pdserve.kvstore.layout import done_messages_expected, plan_head_reads, ranks_to_release
from pdserve.kvstore.send_registry import SendRegistry

if TYPE_CHECKING:
    import torch

    from pdserve.engine.core.sched_output import SchedulerOutput
    from pdserve.engine.request import Request

log = logging.getLogger("pdserve.kvstore.p2p")

PARAM_KEYS = ("remote_engine_id", "remote_request_id", "remote_block_ids", "remote_host", "remote_port",
              "remote_tp_size")


@dataclass
class RecvSpec:
    req_id: str
    remote_req_id: str  # the request's id in the prefill engine, which holds the blocks under it
    local_block_ids: list[int]
    remote_block_ids: list[int]
    remote_host: str
    remote_ports: list[int]
    remote_tp_size: int
    remote_engine_id: str
    transport: str = "tcp"


@dataclass
class SendSpec:
    req_id: str
    block_ids: list[int]
    timeout_s: float


@dataclass
class P2PMetadata:
    recv: list[RecvSpec] = field(default_factory=list)
    send: list[SendSpec] = field(default_factory=list)


def remote_ports(params: dict[str, Any]) -> list[int]:
    ports = params.get("remote_ports")
    if ports:
        return [int(p) for p in ports]
    tp = int(params.get("remote_tp_size", 1))
    return [int(params["remote_port"]) + r for r in range(tp)]


class P2PConnector(KVConnectorBase):
    def __init__(self, config: Any, role: KVConnectorRole, kv_config: KVTransferConfig, rank: int = 0) -> None:
        super().__init__(config, role)
        self.kv = kv_config
        self.rank = rank
        self.tp_size = config.parallel.tensor_parallel_size
        self.total_kv_heads = config.model.num_key_value_heads
        self.block_size = config.cache.block_size
        self.abort_timeout_s = float(kv_config.extra["abort_timeout_s"])
        self.pull_timeout_s = float(kv_config.extra["pull_timeout_s"])
        # scheduler side
        self._recv: list[RecvSpec] = []
        self._send: list[SendSpec] = []
        self._ports: list[int] = []
        self._transport = "tcp"
        self.host = kv_config.extra["side_channel_host"] or _host_of(config.advertise_address)
        # worker side
        self.registry = SendRegistry()
        self.server = None
        self.client = None
        self._pool: ThreadPoolExecutor | None = None
        self._to_load: list[RecvSpec] = []
        self.loads = LoadLog()
        self._expired_reported = 0
        self._sent_reported = 0

    # -- scheduler side ------------------------------------------------------------------------

    def set_worker_info(self, infos: list[dict[str, Any]]) -> None:
        self._ports = [int(i.get("port", 0)) for i in infos]
        self._transport = infos[0].get("transport", "tcp") if infos else "tcp"

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not (self.kv.is_consumer and params and params.get("do_remote_prefill")):
            return 0, False
        missing = [k for k in PARAM_KEYS if k not in params]
        needed_blocks = -(-(request.num_prompt_tokens - 1) // self.block_size)
        if missing or len(params.get("remote_block_ids") or ()) < needed_blocks:
            log.warning("request %s: kv_transfer_params lack %s; computing the prompt here", request.request_id,
                        ", ".join(missing) or f"{needed_blocks} remote blocks")
            request.kv_transfer_params = dict(params, do_remote_prefill=False)
            return 0, False
        # Everything but the last prompt token: computing that one gives the first token's logits.
        return max(0, request.num_prompt_tokens - 1 - num_computed_tokens), True

    def update_state_after_alloc(self, request: "Request", block_ids: list[int], num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if num_external_tokens <= 0 or not params or not params.get("do_remote_prefill"):
            return
        first = request.num_computed_tokens // self.block_size
        last = -(-(request.num_computed_tokens + num_external_tokens) // self.block_size)
        self._recv.append(RecvSpec(
            req_id=request.request_id, remote_req_id=str(params["remote_request_id"]),
            local_block_ids=list(block_ids[first:last]),
            remote_block_ids=[int(b) for b in params["remote_block_ids"][first:last]],
            remote_host=str(params["remote_host"]), remote_ports=remote_ports(params),
            remote_tp_size=int(params["remote_tp_size"]), remote_engine_id=str(params["remote_engine_id"]),
            transport=str(params.get("transport", "tcp"))))
        # One attempt: after a failure or a preemption the prompt is recomputed, since the
        # prefill engine frees its blocks once we are done with them.
        request.kv_transfer_params = dict(params, do_remote_prefill=False)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> P2PMetadata | None:
        if not self._recv and not self._send:
            return None
        meta = P2PMetadata(self._recv, self._send)
        self._recv, self._send = [], []
        return meta

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from pdserve.engine.request import RequestStatus

        params = request.kv_transfer_params
        if not (self.kv.is_producer and params and params.get("do_remote_decode")) or not block_ids \
                or request.status == RequestStatus.FINISHED_ABORTED:
            return False, None
        self._send.append(SendSpec(request.request_id, list(block_ids), self.abort_timeout_s))
        return True, {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": self.engine_config.engine_id, "remote_request_id": request.request_id,
            "remote_block_ids": list(block_ids),
            "remote_host": self.host, "remote_port": self._ports[0] if self._ports else 0,
            "remote_ports": list(self._ports), "remote_tp_size": self.tp_size, "transport": self._transport,
        }

    # -- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: list["torch.Tensor"]) -> dict[str, Any]:
        from pdserve.kvstore.transport_tcp import BlockClient, BlockServer

        self.kv_caches = kv_caches
        transport = resolve_transport(self.kv.extra["transport"])
        self.nixl = None
        if transport == "nixl":
            from pdserve.kvstore.transport_nixl import NixlEndpoint

            self.nixl = NixlEndpoint(f"{self.engine_config.engine_id}-r{self.rank}", kv_caches)
        info: dict[str, Any] = {"rank": self.rank, "port": 0, "transport": transport}
        if self.kv.is_producer:
            base = int(self.kv.extra["side_channel_port"])
            # Data-parallel ranks of one pod each run TP workers: rank d's workers take the ports after rank d-1's.
            if base:
                base += self.engine_config.parallel.data_parallel_rank * self.tp_size
            self.server = BlockServer(kv_caches, self.registry, "0.0.0.0", base + self.rank if base else 0)
            self.server.nixl = self.nixl
            info["port"] = self.server.port
            log.info("kv transfer: rank %d serves blocks on port %d (%s)", self.rank, self.server.port, transport)
        if self.kv.is_consumer:
            self.client = BlockClient(kv_caches, self.pull_timeout_s, self.nixl)
            self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-pull")
        return info

    def bind_connector_metadata(self, metadata: P2PMetadata | None) -> None:
        if metadata is None:
            return
        for spec in metadata.send:
            self.registry.hold(spec.req_id, spec.block_ids, spec.timeout_s)
        self._to_load.extend(metadata.recv)

    def start_load_kv(self) -> None:
        if not self._to_load:
            return
        if self._pool is None:  # a producer-only engine was asked to load: it cannot
            for spec in self._to_load:
                self.loads.ended(spec.req_id, failed=True)
        else:
            for spec in self._to_load:
                self._pool.submit(self._load, spec)
        self._to_load = []

    def _load(self, spec: RecvSpec) -> None:
        start = time.monotonic()
        reads = plan_head_reads(self.total_kv_heads, self.tp_size, self.rank, spec.remote_tp_size)
        moved, error = 0, None
        try:
            # NIXL moves whole blocks: equal TP sizes on both sides; a head slice goes over TCP.
            use_nixl = self.nixl is not None and spec.transport == "nixl" and spec.remote_tp_size == self.tp_size
            for r in reads:
                peer = (spec.remote_host, spec.remote_ports[r.remote_rank])
                if use_nixl:
                    moved += self.client.nixl_pull(peer, spec.remote_engine_id, spec.remote_req_id,  # type: ignore[union-attr]
                                                   spec.remote_block_ids, spec.local_block_ids,
                                                   start + self.pull_timeout_s)
                else:
                    moved += self.client.pull(peer, spec.remote_req_id, spec.remote_block_ids,  # type: ignore[union-attr]
                                              spec.local_block_ids, (r.remote_start, r.remote_end),
                                              (r.local_start, r.local_end), start + self.pull_timeout_s)
        except Exception as exc:  # any failure means: recompute
            error = exc
        if error is not None:
            log.warning("kv transfer of %s failed, recomputing: %s", spec.req_id, error)
        # Reported first: the request need not wait for the releases below.
        self.loads.ended(spec.req_id, moved, time.monotonic() - start, failed=error is not None)
        # Tell every prefill rank involved that this reader is done, so it frees the blocks now
        # rather than at its abort timeout (also after a failure).
        touched = {r.remote_rank for r in reads} | set(ranks_to_release(self.total_kv_heads, self.tp_size, self.rank,
                                                                          spec.remote_tp_size))
        for q in sorted(touched):
            if q < len(spec.remote_ports):
                expected = done_messages_expected(self.total_kv_heads, self.tp_size, spec.remote_tp_size, q)
                self.client.release((spec.remote_host, spec.remote_ports[q]), spec.remote_req_id, expected)  # type: ignore[union-attr]

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        self.registry.expire()
        return self.registry.take_finished(), self.loads.take_ended()

    def get_failed_loads(self) -> set[str]:
        return self.loads.take_failed()

    def take_stats(self) -> KVConnectorStats | None:
        stats = self.loads.take_stats()
        stats.expired = self.registry.num_expired - self._expired_reported
        self._expired_reported = self.registry.num_expired
        if self.server is not None:
            sent = self.server.bytes_sent
            stats.bytes += sent - self._sent_reported
            self._sent_reported = sent
        return stats if stats else None

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.client is not None:
            self.client.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def resolve_transport(wanted: str) -> str:
    """auto: NIXL when it imports, else our TCP transport. nixl: NIXL or a start-up error."""
    if wanted == "tcp":
        return "tcp"
    from pdserve.kvstore.transport_nixl import nixl_available

    if nixl_available():
        return "nixl"
    if wanted == "nixl":
        raise RuntimeError("the p2p connector was asked for transport 'nixl', but the nixl package does not "
                           "import here (install nixl-cu12==1.5.1 with --no-deps); use 'tcp' or 'auto'")
    return "tcp"


def _host_of(address: str | None) -> str:
    if not address:
        return "127.0.0.1"
    host = address.rsplit(":", 1)[0]
    return host.strip("[]") or "127.0.0.1"
