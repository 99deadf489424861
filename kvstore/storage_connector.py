"""Connectors backed by a block store keyed by prefix hash: the KV store service, or files.

Producers write every full block they compute, keyed by the block's chained prefix hash; any
engine, before computing a prompt, asks the store how many of the blocks after its own prefix-
cache hit it holds, and loads those instead. So the store is the hand-off from prefill to decode
and, at the same time, a prefix cache shared by every engine.

A store that is down costs the step nothing. Saves are copied and sent by a background thread
(`BlockSaver`); while the store is down they are dropped and counted (kv_transfer_failures, one
per block), and it is tried again with exponential backoff. Lookups, the one call the step waits
for, are bounded by LOOKUP_TIMEOUT_S, fail at once on a store the client is not connected to, and
are skipped while their own backoff runs. Loads run on a worker thread; they fail into
recomputation, at once while the store is known to be down.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, Sequence

import torch

from pdserve.kvstore.background_save import Backoff, BlockSaver
from pdserve.kvstore.base import KVConnectorBase, KVConnectorRole, KVConnectorStats, LoadLog
from pdserve.kvstore.config import KVTransferConfig

if TYPE_CHECKING:
    from pdserve.engine.core.sched_output import SchedulerOutput
    from pdserve.engine.request import Request

log = logging.getLogger("pdserve.kvstore.storage")

STORE_DOWN_BACKOFF_S = 5.0  # the longest wait between tries of a store that is down
FIRST_BACKOFF_S = 0.5  # the first wait, doubled after each further failure
# The step waits for a lookup: a live store answers in milliseconds, so this only bounds a sick one.
LOOKUP_TIMEOUT_S = 0.5
# A prefill handed to a decode engine through the store: its step waits this long at most for
# its blocks to be stored, so that the decode engine's lookup, which follows the prefill's
# answer, finds them. Only while the store answers; never in backoff, never after one such wait
# ran out until a save succeeds again.
HANDOFF_WAIT_S = 1.0
MAX_PENDING_SAVE_BYTES = 256 * 2**20  # copied blocks waiting for the store; past this they are dropped
DEFAULT_FILE_CAPACITY_BYTES = 8 * 2**30


class BlockBackend(Protocol):
    def contains(self, keys: Sequence[bytes]) -> int: ...  # how many leading keys are present
    def put(self, keys: Sequence[bytes], values: Sequence[Any]) -> None: ...
    def get(self, keys: Sequence[bytes]) -> list[memoryview | None]: ...
    def close(self) -> None: ...


class FileBackend:
    """One file per block under a directory; written to a temporary name, then renamed, so a
    reader never sees a half-written block. The block files under `root` (every namespace) stay
    within `capacity_bytes`: a write that would exceed it first deletes the oldest files (mtime)."""

    def __init__(self, root: str, namespace: str, capacity_bytes: int = DEFAULT_FILE_CAPACITY_BYTES) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"shared-storage capacity_bytes must be positive, got {capacity_bytes}")
        self.root = Path(root)
        self.dir = self.root / _safe(namespace)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self.evictions = 0

    def _path(self, key: bytes) -> Path:
        return self.dir / f"{key.hex()}.kv"

    def contains(self, keys: Sequence[bytes]) -> int:
        for i, key in enumerate(keys):
            if not self._path(key).exists():
                return i
        return len(keys)

    def put(self, keys: Sequence[bytes], values: Sequence[Any]) -> None:
        pending = [(self._path(key), memoryview(value).cast("B")) for key, value in zip(keys, values)]
        pending = [(path, data) for path, data in pending if not path.exists() and data.nbytes <= self.capacity_bytes]
        if not pending:
            return
        self._make_room(sum(data.nbytes for _, data in pending))
        for path, data in pending:
            fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".tmp-")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)

    def _make_room(self, incoming: int) -> None:
        files = block_files(self.root)
        for path, _, size in evictable(files, incoming, self.capacity_bytes):
            try:
                path.unlink()
                self.evictions += 1
            except FileNotFoundError:
                pass  # another engine sharing the path evicted it first

    def get(self, keys: Sequence[bytes]) -> list[memoryview | None]:
        out: list[memoryview | None] = []
        for key in keys:
            try:
                out.append(memoryview(self._path(key).read_bytes()))
            except FileNotFoundError:
                out.append(None)
        return out

    def close(self) -> None:
        pass


def block_files(root: Path) -> list[tuple[Path, float, int]]:
    """(path, mtime, size) of every block file under `root`, one namespace folder deep."""
    found = []
    for path in root.glob("*/*.kv"):
        try:
            st = path.stat()
        except FileNotFoundError:
            continue
        found.append((path, st.st_mtime, st.st_size))
    return found


def evictable(files: list[tuple[Path, float, int]], incoming: int, capacity: int) -> list[tuple[Path, float, int]]:
    """The oldest files to delete so that `incoming` more bytes fit within `capacity`."""
    excess = sum(size for _, _, size in files) + incoming - capacity
    chosen = []
    for entry in sorted(files, key=lambda f: f[1]):
        if excess <= 0:
            break
        chosen.append(entry)
        excess -= entry[2]
    return chosen


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name).strip(".") or "model"


def make_backend(kv: KVTransferConfig, namespace: str, timeout_s: float | None = None) -> BlockBackend:
    """One backend per thread that uses it. `timeout_s` caps the configured timeout; a client
    also waits at most that long for its first connection, and not at all once it has had it."""
    if kv.connector == "shared-storage":
        return FileBackend(kv.extra["path"], namespace,
                           int(kv.extra.get("capacity_bytes") or DEFAULT_FILE_CAPACITY_BYTES))
    from pdserve.kvstore.client import KVStoreClient

    timeout = min(float(kv.extra["timeout_s"]), timeout_s or float("inf"))
    client = KVStoreClient(kv.extra["kvstore_url"], namespace, timeout, connect_timeout_s=timeout)
    client.connect()
    return client


def block_namespace(config: Any) -> str:
    """The store namespace of an engine's blocks. The served name alone is not enough: a new
    checkpoint deployed under the same name must never load KV computed by the old weights, so
    the weights' fingerprint is part of it, and so is a quantization (int8 weights compute other
    keys and values than the float ones they were rounded from; a GGUF's Q8_0 layers alone, kept
    as the file stores them, are another model than every layer rounded by `--quantization q8_0`)."""
    from pdserve.engine.model.fingerprint import checkpoint_fingerprint

    mc = config.model
    quantized = f"|q{mc.quantization}" if getattr(mc, "quantization", None) else ""
    if getattr(mc, "keep_gguf_q8_0", False):
        quantized += "-as-stored"
    return (f"{mc.served_model_name}|w{checkpoint_fingerprint(mc.path)}|{str(mc.dtype).removeprefix('torch.')}"
            f"{quantized}|bs{config.cache.block_size}|tp{config.parallel.tensor_parallel_size}")


@dataclass
class LoadSpec:
    req_id: str
    block_ids: list[int]
    hashes: list[bytes]


@dataclass
class StorageMetadata:
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[tuple[int, bytes]] = field(default_factory=list)  # (block id, prefix hash)
    handoff: bool = False  # some saves are a prefill's KV that a decode engine reads next


class StorageConnector(KVConnectorBase):
    def __init__(self, config: Any, role: KVConnectorRole, kv_config: KVTransferConfig, rank: int = 0) -> None:
        super().__init__(config, role)
        self.kv = kv_config
        self.rank = rank
        self.block_size = config.cache.block_size
        # Blocks are interchangeable only between engines of the same weights, dtype and head split.
        self.namespace = block_namespace(config)
        # scheduler side: lookups, from the engine core's step
        self.backend: BlockBackend | None = None
        self._loads: list[LoadSpec] = []
        self._saved_upto: dict[str, tuple["Request", int]] = {}  # request -> blocks already in the store
        self._lookup_backoff = Backoff(FIRST_BACKOFF_S, STORE_DOWN_BACKOFF_S)
        self._block_ids: dict[str, list[int]] = {}
        # worker side: loads on the load thread (its own backend), saves on the saver's thread
        self._metadata: StorageMetadata | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._load_backend: BlockBackend | None = None
        self._saver: BlockSaver | None = None
        self._store_backoff = Backoff(FIRST_BACKOFF_S, STORE_DOWN_BACKOFF_S)  # shared by loads and saves
        self._handoff_paused_at: int | None = None  # the saver's count of saved batches when a wait ran out
        self.loads = LoadLog()
        if role is KVConnectorRole.SCHEDULER and self.kv.is_consumer:
            self._backend()  # connects in the background now: the first lookup finds the store ready

    def _key(self, block_hash: bytes, rank: int) -> bytes:
        return b"r%d:" % rank + block_hash

    def _backend(self) -> BlockBackend:
        if self.backend is None:
            self.backend = make_backend(self.kv, self.namespace, LOOKUP_TIMEOUT_S)
        return self.backend

    # -- scheduler side ------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        if not self.kv.is_consumer or not self._lookup_backoff.ready():
            return 0, False
        first = num_computed_tokens // self.block_size
        if len(request.block_hashes) <= first:
            return 0, False
        try:
            found = self._backend().contains([self._key(h, 0) for h in request.block_hashes[first:]])
        except Exception as exc:
            was_down = self._lookup_backoff.down
            delay = self._lookup_backoff.failed()
            (log.debug if was_down else log.warning)("KV store lookup failed; computing locally, next try in "
                                                     "%.1fs: %s", delay, exc)
            return 0, False
        if self._lookup_backoff.succeeded():
            log.info("KV store reachable again: lookups resume")
        # The last token is always computed (its logits give the next token), even when its
        # block is loaded: recomputing it rewrites the same K and V.
        tokens = min(found * self.block_size, request.num_tokens - 1 - num_computed_tokens)
        return max(tokens, 0), tokens > 0

    def update_state_after_alloc(self, request: "Request", block_ids: list[int], num_external_tokens: int) -> None:
        first = request.num_computed_tokens // self.block_size
        count = -(-num_external_tokens // self.block_size)
        if count:
            self._loads.append(LoadSpec(request.request_id, list(block_ids[first:first + count]),
                                        list(request.block_hashes[first:first + count])))
        if self.kv.is_producer:
            self._saved_upto[request.request_id] = (request, first + count)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> StorageMetadata | None:
        meta = StorageMetadata(self._loads)
        self._loads = []
        # Follow each request's block list as the runner does: whole for new (or resumed)
        # requests, appended for the others.
        for new in scheduler_output.scheduled_new_reqs:
            self._block_ids[new.req_id] = list(new.block_ids)
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, new_blocks in zip(cached.req_ids, cached.new_block_ids):
            self._block_ids.setdefault(req_id, []).extend(new_blocks)
        for req_id in scheduler_output.num_scheduled_tokens:
            entry = self._saved_upto.get(req_id)
            if entry is None:
                continue
            request, saved = entry
            # num_computed_tokens already counts this step: its full blocks are written by it.
            full = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
            if full > saved:
                blocks = self._block_ids[req_id]
                meta.saves.extend((blocks[i], request.block_hashes[i]) for i in range(saved, full))
                self._saved_upto[req_id] = (request, full)
                params = request.kv_transfer_params
                meta.handoff = meta.handoff or bool(params and params.get("do_remote_decode"))
        return meta if meta.loads or meta.saves else None

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._saved_upto.pop(request.request_id, None)
        self._block_ids.pop(request.request_id, None)
        params = request.kv_transfer_params
        if self.kv.is_producer and params and params.get("do_remote_decode"):
            # Every full block is in the store already (saved in the step that computed it).
            return False, {"do_remote_prefill": True, "do_remote_decode": False, "kv_connector": self.kv.connector,
                           "remote_engine_id": self.engine_config.engine_id}
        return False, None

    # -- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> dict[str, Any]:
        self.kv_caches = kv_caches
        if self.kv.is_consumer:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-store-load")
        if self.kv.is_producer:
            self._saver = BlockSaver(make_backend(self.kv, self.namespace), self.loads, self._store_backoff,
                                     MAX_PENDING_SAVE_BYTES)
        return {"rank": self.rank}

    def bind_connector_metadata(self, metadata: StorageMetadata | None) -> None:
        self._metadata = metadata

    def start_load_kv(self) -> None:
        meta = self._metadata
        if meta is None or self._pool is None:
            return
        for spec in meta.loads:
            self._pool.submit(self._load, spec)

    def _load(self, spec: LoadSpec) -> None:
        """On the load thread: the request waits for it, the step does not."""
        if not self._store_backoff.ready():
            self.loads.ended(spec.req_id, failed=True)  # the store is down: recompute at once
            return
        start = time.monotonic()
        moved = 0
        try:
            if self._load_backend is None:
                self._load_backend = make_backend(self.kv, self.namespace)
            values = self._load_backend.get([self._key(h, self.rank) for h in spec.hashes])
        except Exception as exc:
            self._store_backoff.failed()
            log.warning("loading %s from the KV store failed, recomputing: %s", spec.req_id, exc)
            self.loads.ended(spec.req_id, failed=True)
            return
        self._store_backoff.succeeded()
        try:
            for block_id, value in zip(spec.block_ids, values):
                if value is None:
                    raise KeyError("a block left the store between lookup and load")
                self._write_block(block_id, value)
                moved += len(value)
        except Exception as exc:
            log.warning("loading %s from the KV store failed, recomputing: %s", spec.req_id, exc)
            self.loads.ended(spec.req_id, failed=True)
            return
        self.loads.ended(spec.req_id, moved, time.monotonic() - start)

    def _write_block(self, block_id: int, value: memoryview) -> None:
        first = self.kv_caches[0]
        shape = (len(self.kv_caches), 2, *first.shape[2:])
        data = torch.frombuffer(value, dtype=torch.uint8).view(first.dtype).view(shape)
        for layer, cache in enumerate(self.kv_caches):
            cache[:, block_id].copy_(data[layer])

    def _read_block(self, block_id: int) -> torch.Tensor:
        return torch.stack([cache[:, block_id] for cache in self.kv_caches]).cpu()

    def wait_for_save(self) -> None:
        """Hand this step's full blocks to the saver: copied now (the blocks may be reused as soon
        as the step goes on), sent by its thread. Never waits on the store, but for a hand-off."""
        meta, saver = self._metadata, self._saver
        if meta is None or not meta.saves or saver is None:
            return
        if not saver.accepting():
            saver.drop(len(meta.saves), "the KV store is down")
            return
        keys = [self._key(h, self.rank) for _, h in meta.saves]
        values = [self._read_block(b).view(torch.uint8).numpy() for b, _ in meta.saves]
        batch = saver.submit(keys, values)
        if batch is None or not meta.handoff:
            return
        if self._handoff_paused_at is not None:
            if saver.saved_batches == self._handoff_paused_at:
                return
            self._handoff_paused_at = None  # a save got through since: the store answers again
        if not batch.done.wait(HANDOFF_WAIT_S):
            self._handoff_paused_at = saver.saved_batches
            log.warning("the KV store is slow: prefill hand-offs stop waiting for their blocks to be stored")

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        return set(), self.loads.take_ended()

    def get_failed_loads(self) -> set[str]:
        return self.loads.take_failed()

    def take_stats(self) -> KVConnectorStats | None:
        stats = self.loads.take_stats()
        return stats if stats else None

    def shutdown(self) -> None:
        if self._pool is not None:
            # A load in flight ends within the store timeout; then its thread's client can close.
            self._pool.shutdown(wait=True, cancel_futures=True)
            if self._load_backend is not None:
                self._load_backend.close()
        if self._saver is not None:
            self._saver.close()
        if self.backend is not None:
            self.backend.close()
