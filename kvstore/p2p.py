"""The p2p connector: a decode engine pulls a prompt's KV straight out of the prefill engine's cache.

Prefill side: a finished request marked `do_remote_decode` keeps its blocks under a lease of
`kv_lease_duration` seconds; its answer carries where they are (`remote_host`, one side-channel
port per TP rank, the block ids, the lease). Each prefill worker rank serves reads of held blocks
and frees them when every reader is done, when the router releases them (`release_held`: the
decode leg will not pull), or when the lease runs out with no read in progress.

Decode side: from the moment the scheduler learns of a request marked `do_remote_prefill` (it may
wait in the queue), every worker rank renews the prefill's lease (kvstore.lease_keeper) until its
pull ends. The request waits in WAITING_FOR_REMOTE_KVS while each worker rank pulls the heads it
owns from the prefill ranks that hold them (kvstore.layout), off the model's thread. Whatever goes
wrong (the prefill engine gone, blocks expired, a timeout), the request comes back with its local
prefix only and is recomputed. A request that will not pull after all (aborted while it waited,
or its whole prompt cached here) tells the prefill engine so, and the blocks go at once.

Nothing a peer sends is trusted: kv_transfer_params are checked here again (the scheduler must
never raise on them, whatever the HTTP edge let through) and must name this very prompt (its
digest, kvstore.binding); anything wrong means "compute the prompt here", with a warning. The side
channel authenticates both ends with the deployment's internal key and listens only on the
engine's own address.
"""

from __future__ import annotations

import logging
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from pdserve.kvstore.base import KVConnectorBase, KVConnectorRole, KVConnectorStats, LoadLog
from pdserve.kvstore.binding import digests_match, is_digest, prompt_digest
from pdserve.kvstore.config import KVTransferConfig
from pdserve.kvstore.layout import done_messages_expected, plan_head_reads, ranks_to_release, tp_size_problem
from pdserve.kvstore.lease_keeper import LeaseKeeper, LeaseWatch
from pdserve.kvstore.send_registry import SendRegistry

if TYPE_CHECKING:
    import torch

    from pdserve.engine.core.sched_output import SchedulerOutput
    from pdserve.engine.request import Request
    from pdserve.kvstore.layout import HeadRead
    from pdserve.kvstore.transport_tcp import HeldKV

log = logging.getLogger("pdserve.kvstore.p2p")

PARAM_KEYS = ("remote_engine_id", "remote_request_id", "remote_block_ids", "remote_host", "remote_tp_size",
              "prompt_digest")
MAX_TEXT = 256  # ids are uuids and request ids; anything longer is not ours
MAX_BLOCK_ID = 2**31 - 1
MAX_LEASE_S = 86400.0  # a lease a prefill engine claims in its params; longer is not ours
TRANSPORTS = ("tcp", "nixl")
_HOST = re.compile(r"[A-Za-z0-9._:-]{1,253}")  # a host name, an IPv4 or an IPv6 address


@dataclass(frozen=True)
class PullSource:
    """Where a prompt's KV waits, from checked kv_transfer_params."""

    engine_id: str
    request_id: str  # the request's id in the prefill engine, which holds the blocks under it
    block_ids: list[int]
    host: str
    ports: list[int]  # one side-channel port per prefill TP rank
    tp_size: int
    transport: str
    prompt_digest: str
    lease_s: float | None = None  # the prefill's lease (kv_lease_duration), when its params say


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
    prompt_digest: str = ""
    problem: str = ""  # set when the scheduler side could not describe the load: it fails at once


@dataclass
class SendSpec:
    req_id: str
    block_ids: list[int]
    timeout_s: float
    prompt_digest: str = ""


@dataclass
class P2PMetadata:
    recv: list[RecvSpec] = field(default_factory=list)
    send: list[SendSpec] = field(default_factory=list)
    watch: list[LeaseWatch] = field(default_factory=list)  # decode: will pull; renew until the pull ends
    drop: list[str] = field(default_factory=list)  # decode: will not pull after all; release the holds
    release: list[tuple[str, str]] = field(default_factory=list)  # prefill: (request id, digest) to free now


def _is_int(value: Any, low: int, high: int) -> bool:
    return type(value) is int and low <= value <= high


def _is_text(value: Any) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_TEXT and value.isprintable()


def remote_ports(params: dict[str, Any], tp_size: int) -> list[int] | str:
    """One side-channel port per prefill rank (`remote_ports`, else `remote_port` + rank); or why not."""
    ports = params.get("remote_ports")
    if ports is not None:
        if not isinstance(ports, list) or len(ports) != tp_size:
            return f"remote_ports must list {tp_size} ports, one per prefill rank"
    else:
        first = params.get("remote_port")
        if not _is_int(first, 1, 65536 - tp_size):
            return f"remote_port must be a port with room for {tp_size} ranks, got {first!r}"
        ports = [first + r for r in range(tp_size)]
    if not all(_is_int(p, 1, 65535) for p in ports):
        return f"remote_ports must be ports in [1, 65535], got {ports!r}"
    return list(ports)


def parse_pull_params(params: dict[str, Any], prompt_token_ids: list[int], block_size: int, total_kv_heads: int
                      ) -> PullSource | str:
    """The pull described by a decode request's kv_transfer_params, or the first problem with
    them. Pure; never raises on any JSON value."""
    missing = [k for k in PARAM_KEYS if k not in params]
    if missing:
        return f"missing {', '.join(missing)}"
    tp = params["remote_tp_size"]
    problem = tp_size_problem(total_kv_heads, tp)
    if problem:
        return f"remote_tp_size: {problem}"
    ports = remote_ports(params, tp)
    if isinstance(ports, str):
        return ports
    for key in ("remote_engine_id", "remote_request_id"):
        if not _is_text(params[key]):
            return f"{key} must be a printable string of 1 to {MAX_TEXT} characters"
    host = params["remote_host"]
    if not isinstance(host, str) or not _HOST.fullmatch(host):
        return f"remote_host must be a host name or an IP address, got {str(host)[:64]!r}"
    transport = params.get("transport", "tcp")
    if transport not in TRANSPORTS:
        return f"transport must be one of {', '.join(TRANSPORTS)}"
    blocks = params["remote_block_ids"]
    n = len(prompt_token_ids)
    # The prefill's blocks of this prompt: all but the last token's, up to one more for the token it sampled.
    least, most = -(-max(n - 1, 0) // block_size), -(-(n + 1) // block_size)
    if not isinstance(blocks, list) or not least <= len(blocks) <= most:
        return f"remote_block_ids must list {least} to {most} blocks for a prompt of {n} tokens"
    if not all(_is_int(b, 0, MAX_BLOCK_ID) for b in blocks):
        return f"remote_block_ids must be block ids in [0, {MAX_BLOCK_ID}]"
    digest = params["prompt_digest"]
    if not is_digest(digest):
        return "prompt_digest must be 64 hex digits"
    lease = params.get("kv_lease_duration")
    if lease is not None and (type(lease) not in (int, float) or not 0 < lease <= MAX_LEASE_S):
        return f"kv_lease_duration must be a number of seconds in (0, {MAX_LEASE_S:g}]"
    if not digests_match(prompt_digest(prompt_token_ids), digest):
        return "they belong to another prompt (prompt_digest differs)"
    return PullSource(params["remote_engine_id"], params["remote_request_id"], list(blocks), host, ports, tp,
                      transport, digest, None if lease is None else float(lease))


class P2PConnector(KVConnectorBase):
    def __init__(self, config: Any, role: KVConnectorRole, kv_config: KVTransferConfig, rank: int = 0) -> None:
        super().__init__(config, role)
        self.kv = kv_config
        self.rank = rank
        self.tp_size = config.parallel.tensor_parallel_size
        self.total_kv_heads = config.model.num_key_value_heads
        self.block_size = config.cache.block_size
        # How long held blocks wait for their decode engine without a renewal (`abort_timeout_s`
        # is the name older configs use).
        self.lease_s = float(kv_config.extra.get("kv_lease_duration") or kv_config.extra["abort_timeout_s"])
        self.pull_timeout_s = float(kv_config.extra["pull_timeout_s"])
        # scheduler side
        self._recv: list[RecvSpec] = []
        self._send: list[SendSpec] = []
        self._watch: list[LeaseWatch] = []
        self._drop: list[str] = []
        self._to_release: list[tuple[str, str]] = []
        self._watched: set[str] = set()  # decode requests whose leases the workers renew, not yet pulling
        self._ports: list[int] = []
        self._transport = "tcp"
        self.host = side_channel_host(kv_config.extra["side_channel_host"], config.advertise_address)
        # worker side
        self.registry = SendRegistry()
        self.server = None
        self.client = None
        self.keeper: LeaseKeeper | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._to_load: list[RecvSpec] = []
        self.loads = LoadLog()
        self._expired_reported = 0
        self._sent_reported = 0

    # -- scheduler side ------------------------------------------------------------------------

    def set_worker_info(self, infos: list[dict[str, Any]]) -> None:
        self._ports = [int(i.get("port", 0)) for i in infos]
        self._transport = infos[0].get("transport", "tcp") if infos else "tcp"

    def _pull_source(self, request: "Request") -> PullSource | str | None:
        """The request's pull, a problem with its params, or None when it asks for no pull."""
        params = request.kv_transfer_params
        if not (self.kv.is_consumer and isinstance(params, dict) and params.get("do_remote_prefill")):
            return None
        return parse_pull_params(params, request.prompt_token_ids, self.block_size, self.total_kv_heads)

    def _compute_here(self, request: "Request", problem: str) -> None:
        log.warning("request %s: kv_transfer_params not used (%s); computing the prompt here", request.request_id,
                    problem)
        params = request.kv_transfer_params
        request.kv_transfer_params = dict(params if isinstance(params, dict) else {}, do_remote_prefill=False)

    def request_added(self, request: "Request") -> None:
        # Runs in the scheduler: nothing may escape. Bad params are dealt with at admission.
        try:
            source = self._pull_source(request)
        except Exception:
            return
        if not isinstance(source, PullSource):
            return
        lease = source.lease_s or self.lease_s
        self._watch.append(LeaseWatch(request.request_id, source.request_id, source.prompt_digest, source.host,
                                      tuple(source.ports), lease))
        self._watched.add(request.request_id)

    def _will_not_pull(self, request_id: str) -> None:
        """A watched request ends its wait without a pull: the prefill engine may free its KV now."""
        if request_id in self._watched:
            self._watched.discard(request_id)
            self._drop.append(request_id)

    def release_held(self, request: "Request", prompt_digest_: str) -> bool:
        if not self.kv.is_producer or not digests_match(prompt_digest(request.prompt_token_ids), prompt_digest_):
            return False
        self._to_release.append((request.request_id, prompt_digest_))
        return True

    def has_pending_work(self) -> bool:
        # Metadata waiting for the workers: a release on an idle engine must still reach them.
        return bool(self._recv or self._send or self._watch or self._drop or self._to_release)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        # Runs in the scheduler: a raise here would take the engine down, so nothing may escape.
        try:
            source = self._pull_source(request)
            if source is None:
                return 0, False
            if isinstance(source, str):
                self._compute_here(request, source)
                return 0, False
        except Exception as exc:
            self._compute_here(request, f"unexpected {exc!r}")
            return 0, False
        # Everything but the last prompt token: computing that one gives the first token's logits.
        return max(0, request.num_prompt_tokens - 1 - num_computed_tokens), True

    def update_state_after_alloc(self, request: "Request", block_ids: list[int], num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            if request.request_id in self._watched:
                # Admitted with nothing to pull (the whole prompt was cached here): never pull later.
                self._will_not_pull(request.request_id)
                params = request.kv_transfer_params
                request.kv_transfer_params = dict(params if isinstance(params, dict) else {}, do_remote_prefill=False)
            return
        # The pull takes over: the workers renew the lease until it ends, then say "done".
        self._watched.discard(request.request_id)
        # The request now waits for this load: whatever happens, a RecvSpec must go to the workers
        # (one with a problem fails at once), or it would wait forever.
        spec = RecvSpec(req_id=request.request_id, remote_req_id="", local_block_ids=[], remote_block_ids=[],
                        remote_host="", remote_ports=[], remote_tp_size=0, remote_engine_id="")
        try:
            source = self._pull_source(request)
            if not isinstance(source, PullSource):
                spec.problem = source or "no pull asked for"
            else:
                first = request.num_computed_tokens // self.block_size
                last = -(-(request.num_computed_tokens + num_external_tokens) // self.block_size)
                spec = RecvSpec(
                    req_id=request.request_id, remote_req_id=source.request_id,
                    local_block_ids=list(block_ids[first:last]), remote_block_ids=source.block_ids[first:last],
                    remote_host=source.host, remote_ports=source.ports, remote_tp_size=source.tp_size,
                    remote_engine_id=source.engine_id, transport=source.transport,
                    prompt_digest=source.prompt_digest)
                if len(spec.local_block_ids) != len(spec.remote_block_ids):
                    spec.problem = "fewer remote blocks than the load needs"
        except Exception as exc:
            spec.problem = f"unexpected {exc!r}"
        self._recv.append(spec)
        # One attempt: after a failure or a preemption the prompt is recomputed, since the
        # prefill engine frees its blocks once we are done with them.
        params = request.kv_transfer_params
        request.kv_transfer_params = dict(params if isinstance(params, dict) else {}, do_remote_prefill=False)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> P2PMetadata | None:
        if not self.has_pending_work():
            return None
        meta = P2PMetadata(self._recv, self._send, self._watch, self._drop, self._to_release)
        self._recv, self._send, self._watch, self._drop, self._to_release = [], [], [], [], []
        return meta

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from pdserve.engine.request import RequestStatus

        self._will_not_pull(request.request_id)  # aborted (or failed) while it waited in the queue
        params = request.kv_transfer_params
        if not (self.kv.is_producer and isinstance(params, dict) and params.get("do_remote_decode")) or not block_ids \
                or request.status == RequestStatus.FINISHED_ABORTED:
            return False, None
        # The KV belongs to this prompt: readers must name it, decode engines check it.
        digest = prompt_digest(request.prompt_token_ids)
        self._send.append(SendSpec(request.request_id, list(block_ids), self.lease_s, digest))
        return True, {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": self.engine_config.engine_id, "remote_request_id": request.request_id,
            "remote_block_ids": list(block_ids),
            "remote_host": self.host, "remote_port": self._ports[0] if self._ports else 0,
            "remote_ports": list(self._ports), "remote_tp_size": self.tp_size, "transport": self._transport,
            "prompt_digest": digest, "kv_lease_duration": self.lease_s,
        }

    # -- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: list["torch.Tensor"]) -> dict[str, Any]:
        from pdserve.engine.internal_auth import load_internal_key
        from pdserve.kvstore.transport_tcp import BlockClient, BlockServer

        self.kv_caches = kv_caches
        key = load_internal_key()
        if key is None:
            log.warning("kv transfer: no internal key; the side channel authenticates nobody (--insecure-kv-transfer)")
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
            # Our own address only (the one decode engines are told), never every interface.
            port = base + self.rank if base else 0
            try:
                self.server = BlockServer(kv_caches, self.registry, self.host, port, key=key)
            except OSError as exc:
                raise RuntimeError(f"kv transfer: cannot listen on {self.host}:{port} ({exc}); side_channel_host "
                                   f"must be an address of this machine") from exc
            self.server.nixl = self.nixl
            info["port"] = self.server.port
            log.info("kv transfer: rank %d serves blocks on %s:%d (%s)", self.rank, self.host, self.server.port,
                     transport)
        if self.kv.is_consumer:
            self.client = BlockClient(kv_caches, self.pull_timeout_s, self.nixl, key=key)
            self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-pull")
            # Connections of its own: a renewal never waits behind a pull from the same peer.
            self.keeper = LeaseKeeper(BlockClient(kv_caches, min(self.pull_timeout_s, 5.0), key=key))
        return info

    def bind_connector_metadata(self, metadata: P2PMetadata | None) -> None:
        if metadata is None:
            return
        for spec in metadata.send:
            self.registry.hold(spec.req_id, spec.block_ids, spec.timeout_s, spec.prompt_digest)
        for request_id, digest in metadata.release:
            self.registry.release(request_id, digest)
        if self.keeper is not None:
            for watch in metadata.watch:
                self._watch_lease(watch)
            for request_id in metadata.drop:
                # Rank 0 speaks for the engine: one "done" per prefill rank frees a hold nobody read.
                self.keeper.drop(request_id, release=self.rank == 0)
        self._to_load.extend(metadata.recv)

    def _watch_lease(self, watch: LeaseWatch) -> None:
        """Renew at the prefill ranks this rank's pull will read or release (the other decode
        ranks renew theirs), so one renewal reaches each rank that holds the request."""
        try:
            remote_tp = len(watch.ports)
            reads = plan_head_reads(self.total_kv_heads, self.tp_size, self.rank, remote_tp)
            ranks = {r.remote_rank for r in reads} | set(ranks_to_release(self.total_kv_heads, self.tp_size,
                                                                          self.rank, remote_tp))
        except ValueError:  # a plan the pull will refuse as well: renew nothing, it recomputes
            return
        self.keeper.watch(replace(watch, renew_ranks=tuple(sorted(ranks))))  # type: ignore[union-attr]

    def start_load_kv(self) -> None:
        if not self._to_load:
            return
        if self._pool is None:  # a producer-only engine was asked to load: it cannot
            for spec in self._to_load:
                self.loads.ended(spec.req_id, failed=True)
        else:
            for spec in self._to_load:
                self._pool.submit(self._load, spec)  # _load reports every outcome itself
        self._to_load = []

    def _load(self, spec: RecvSpec) -> None:
        """One pull, in a kv-pull thread. Every path ends the load (the scheduler then frees or
        keeps the blocks): a pull that raised and never reported would leave the request waiting
        and its blocks allocated forever."""
        from pdserve.kvstore.transport_tcp import HeldKV

        start = time.monotonic()
        moved, error, reads, failed = 0, None, [], True
        held = HeldKV(spec.remote_req_id, spec.prompt_digest)
        try:
            if spec.problem:
                raise ValueError(spec.problem)
            reads = plan_head_reads(self.total_kv_heads, self.tp_size, self.rank, spec.remote_tp_size)
            # NIXL moves whole blocks: equal TP sizes on both sides; a head slice goes over TCP.
            use_nixl = self.nixl is not None and spec.transport == "nixl" and spec.remote_tp_size == self.tp_size
            for r in reads:
                peer = (spec.remote_host, spec.remote_ports[r.remote_rank])
                if use_nixl:
                    moved += self.client.nixl_pull(peer, spec.remote_engine_id, held,  # type: ignore[union-attr]
                                                   spec.remote_block_ids, spec.local_block_ids,
                                                   start + self.pull_timeout_s)
                else:
                    moved += self.client.pull(peer, held, spec.remote_block_ids,  # type: ignore[union-attr]
                                              spec.local_block_ids, (r.remote_start, r.remote_end),
                                              (r.local_start, r.local_end), start + self.pull_timeout_s)
            failed = False
        except Exception as exc:  # any failure means: recompute
            error = exc
        finally:
            # Reported first: the request need not wait for the releases below.
            self.loads.ended(spec.req_id, moved, time.monotonic() - start, failed=failed)
            if self.keeper is not None:
                self.keeper.stop(spec.req_id)
        if error is not None:
            log.warning("kv transfer of %s failed, recomputing: %s", spec.req_id, error)
        if spec.problem:
            return  # nothing was asked of any prefill engine
        try:
            self._release(spec, held, reads)
        except Exception as exc:  # best effort: the prefill side frees the blocks at its timeout anyway
            log.warning("kv transfer of %s: could not release the prefill's blocks: %s", spec.req_id, exc)

    def _release(self, spec: RecvSpec, held: "HeldKV", reads: list["HeadRead"]) -> None:
        """Tell every prefill rank involved that this reader is done, so it frees the blocks now
        rather than at its abort timeout (also after a failure)."""
        touched = {r.remote_rank for r in reads} | set(ranks_to_release(self.total_kv_heads, self.tp_size, self.rank,
                                                                          spec.remote_tp_size))
        for q in sorted(touched):
            if q < len(spec.remote_ports):
                expected = done_messages_expected(self.total_kv_heads, self.tp_size, spec.remote_tp_size, q)
                peer = (spec.remote_host, spec.remote_ports[q])
                self.client.release(peer, held, expected)  # type: ignore[union-attr]

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        self.registry.expire()
        return self.registry.take_finished(), self.loads.take_ended()

    def get_failed_loads(self) -> set[str]:
        return self.loads.take_failed()

    def take_stats(self) -> KVConnectorStats | None:
        stats = self.loads.take_stats()
        stats.expired = self.registry.num_expired - self._expired_reported
        self._expired_reported = self.registry.num_expired
        if self.keeper is not None:
            stats.lease_renewal_failures = self.keeper.take_failures()
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
        if self.keeper is not None:
            self.keeper.close()
            self.keeper.client.close()
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


def side_channel_host(configured: str, advertise_address: str | None) -> str:
    """Where the side channel listens, and what decode engines are told: `side_channel_host` when
    set, else the host this engine advertises to routers (its pod IP in a cluster), else loopback.
    Never every interface unless a person asks for it: KV is a copy of users' prompts."""
    return configured or _host_of(advertise_address)


def _host_of(address: str | None) -> str:
    if not address:
        return "127.0.0.1"
    host = address.rsplit(":", 1)[0]
    return host.strip("[]") or "127.0.0.1"
