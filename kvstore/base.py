"""The KV connector API: what the engine calls, and nothing about how blocks move.

One connector class has two sides, as in vLLM V1. The scheduler side lives in the EngineCore
process: it decides which requests load KV from elsewhere and which keep their blocks for a
remote decode, and describes that to the workers in per-step metadata. The worker side lives in
every tensor-parallel worker: it owns the transfers into and out of that rank's KV cache tensors
and reports which requests finished sending or receiving.

The engine calls the scheduler side when a request arrives (`request_added`), at admission
(`get_num_new_matched_tokens`), after allocation (`update_state_after_alloc`), when building a
step (`build_connector_meta`), when a request finishes (`request_finished`), and when the router
releases held KV (`release_held`); the worker side before the forward (`start_load_kv`), per
layer (`wait_for_layer_load`, `save_kv_layer`), after the forward (`wait_for_save`) and at the end
of the step (`get_finished`). Every transport, store and timeout lives behind these calls.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from pdserve.engine.core.sched_output import SchedulerOutput
    from pdserve.engine.request import Request


class KVConnectorRole(enum.Enum):
    SCHEDULER = "scheduler"
    WORKER = "worker"


@dataclass
class KVConnectorStats:
    """Counters a worker side accumulates between two `take_stats` calls."""

    transfers: int = 0  # requests whose KV finished moving (either direction)
    bytes: int = 0
    seconds: float = 0.0
    failures: int = 0
    expired: int = 0  # blocks held for a remote decode that never came, freed when their lease ran out
    lease_renewal_failures: int = 0  # a decode side's renewals of a prefill's hold that failed

    def add(self, other: "KVConnectorStats") -> None:
        self.transfers += other.transfers
        self.bytes += other.bytes
        self.seconds += other.seconds
        self.failures += other.failures
        self.expired += other.expired
        self.lease_renewal_failures += other.lease_renewal_failures

    def __bool__(self) -> bool:
        return bool(self.transfers or self.bytes or self.failures or self.expired or self.lease_renewal_failures)


@dataclass
class LoadLog:
    """What a worker side's transfer threads tell the step loop: loads that ended, the failed
    ones among them, and counters. Thread-safe; each `take_*` drains."""

    _lock: threading.Lock = field(default_factory=threading.Lock)
    _ended: set[str] = field(default_factory=set)
    _failed: set[str] = field(default_factory=set)
    _stats: KVConnectorStats = field(default_factory=KVConnectorStats)

    def ended(self, request_id: str, nbytes: int = 0, seconds: float = 0.0, failed: bool = False) -> None:
        with self._lock:
            self._ended.add(request_id)
            if failed:
                self._failed.add(request_id)
                self._stats.failures += 1
            else:
                self._stats.add(KVConnectorStats(transfers=1, bytes=nbytes, seconds=seconds))

    def count(self, stats: KVConnectorStats) -> None:
        with self._lock:
            self._stats.add(stats)

    def take_ended(self) -> set[str]:
        with self._lock:
            ended, self._ended = self._ended, set()
            return ended

    def take_failed(self) -> set[str]:
        with self._lock:
            failed, self._failed = self._failed, set()
            return failed

    def take_stats(self) -> KVConnectorStats:
        with self._lock:
            stats, self._stats = self._stats, KVConnectorStats()
            return stats


class KVConnectorBase:
    """Both sides of a connector; each process uses the side of its role."""

    def __init__(self, config: Any, role: KVConnectorRole) -> None:
        self.engine_config = config
        self.role = role

    # -- scheduler side ------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        """How many tokens past `num_computed_tokens` (the local prefix-cache hit) can be loaded
        from outside, and whether the load is asynchronous (the request then waits in
        WAITING_FOR_REMOTE_KVS while the rest of the batch runs)."""
        return 0, False

    def update_state_after_alloc(self, request: "Request", block_ids: list[int], num_external_tokens: int) -> None:
        """Blocks for the request are allocated; the last `num_external_tokens` worth of them are
        to be filled from outside."""

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> Any:
        """The metadata the worker sides need for this step (picklable)."""
        return None

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """The request is done. Returns (delay_free, kv_transfer_params): with delay_free the
        scheduler keeps its blocks until the workers report it as done sending."""
        return False, None

    def request_added(self, request: "Request") -> None:
        """A request entered the scheduler (it may wait in the queue a while before admission):
        a connector that keeps remote KV alive for it starts here."""

    def release_held(self, request: "Request", prompt_digest: str) -> bool:
        """The router says nobody will pull this finished request's KV: let its held blocks go
        now. False when the digest is not the request's prompt's. The scheduler frees the blocks
        once the workers report the request as done sending."""
        return False

    def set_worker_info(self, infos: list[dict[str, Any]]) -> None:
        """What each worker rank said about itself at start-up (e.g. its side-channel port)."""

    def has_pending_work(self) -> bool:
        """True while workers must keep stepping even with nothing scheduled (transfers in flight)."""
        return False

    # -- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: list["torch.Tensor"]) -> dict[str, Any]:
        """This rank's KV cache tensors, one per layer; returns what the scheduler side should know."""
        return {}

    def bind_connector_metadata(self, metadata: Any) -> None:
        self._metadata = metadata

    def start_load_kv(self) -> None:
        """Start the loads this step's metadata asks for; must not wait for them."""

    def wait_for_layer_load(self, layer: int) -> None:
        """Before layer `layer` runs (layer-wise loads). Our loads finish before the request is
        scheduled, so the connectors here return at once."""

    def save_kv_layer(self, layer: int, kv_cache: "torch.Tensor") -> None:
        """After the forward, once per layer: the layer's KV of this step is written."""

    def wait_for_save(self) -> None:
        """After the forward: saves of this step are done (or handed off safely)."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(done_sending, done_recving) since the last call: producer requests whose blocks no
        longer need to be kept, consumer requests whose load ended (successfully or not)."""
        return set(), set()

    def get_failed_loads(self) -> set[str]:
        """Of the requests reported in done_recving so far, those whose load failed (the
        scheduler recomputes them). Drained by the call."""
        return set()

    def take_stats(self) -> KVConnectorStats | None:
        return None

    def shutdown(self) -> None:
        pass
