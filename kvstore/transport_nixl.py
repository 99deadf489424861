"""NIXL data plane for p2p transfers: the decode rank READs blocks out of the prefill rank's
registered KV cache memory (UCX: process_vm_readv on one host, RDMA across hosts, VRAM on GPUs).

Each side registers its whole cache once and prepares one descriptor list over every (layer,
K/V, block) of it; a peer's list is prepared once, when first seen. A transfer is then one
`make_prepped_xfer` with index lists, not a call per block. The control messages (agent metadata,
the lease that keeps blocks alive during a read, "done") still travel over the TCP side channel.
NIXL moves whole blocks only: a head slice (prefill and decode at different TP sizes) goes
through the TCP transport, which gathers the slice on the prefill side.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Any

import numpy as np
import torch

log = logging.getLogger("pdserve.kvstore.nixl")

POLL_S = 0.0002
_names = itertools.count()


def nixl_available() -> bool:
    try:
        from nixl._api import nixl_agent  # noqa: F401
    except Exception:  # ImportError, or a broken native library
        return False
    return True


def block_descriptors(kv_caches: list[torch.Tensor]) -> np.ndarray:
    """(address, bytes, device) of every (layer, K/V, block), in index order (layer*2 + kv)*N + b."""
    num_blocks = kv_caches[0].shape[1]
    block_bytes = kv_caches[0][0, 0].numel() * kv_caches[0].element_size()
    device = kv_caches[0].device.index or 0
    offsets = np.arange(2 * num_blocks, dtype=np.int64) * block_bytes  # K blocks, then V blocks
    rows = [np.stack([t.data_ptr() + offsets, np.full_like(offsets, block_bytes), np.full_like(offsets, device)],
                     axis=1) for t in kv_caches]
    return np.concatenate(rows)


def block_indices(block_ids: list[int], num_layers: int, num_blocks: int) -> np.ndarray:
    """Descriptor indices of the blocks in block_io's wire order (layer, K/V, block)."""
    ids = np.asarray(block_ids, dtype=np.int64)
    planes = np.arange(num_layers * 2, dtype=np.int64)[:, None] * num_blocks
    return (planes + ids[None, :]).reshape(-1).astype(np.int32)


class NixlEndpoint:
    """This rank's NIXL agent with its KV cache registered."""

    def __init__(self, name: str, kv_caches: list[torch.Tensor]) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        # No progress thread: on few cores it halves throughput; we poll transfer states instead.
        self.name = f"{name}-{next(_names)}"
        self.agent = nixl_agent(self.name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self.mem_type = "VRAM" if kv_caches[0].is_cuda else "DRAM"
        device = kv_caches[0].device.index or 0
        self.kv_caches = kv_caches
        self.num_layers = len(kv_caches)
        self.num_blocks = kv_caches[0].shape[1]
        self._registered = self.agent.register_memory(
            [(t.data_ptr(), t.numel() * t.element_size(), device, "") for t in kv_caches], self.mem_type)
        self.local_side = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", block_descriptors(kv_caches), self.mem_type)
        self._peers: dict[str, tuple[str, Any, int]] = {}  # peer key -> (agent name, prepped list, blocks)
        # One agent, several threads (two pull workers; a side-channel thread per reader on a prefill
        # engine): without the progress thread UCX runs single-threaded, and two threads inside it
        # at once crashed a decode engine (a segfault in libuct). Every agent call holds this lock.
        self._lock = threading.Lock()

    def metadata(self) -> dict[str, Any]:
        """What a reader needs to address our blocks."""
        with self._lock:
            agent_md = self.agent.get_agent_metadata()
        return {"agent": agent_md, "descs": block_descriptors(self.kv_caches).tobytes(),
                "num_blocks": self.num_blocks, "mem_type": self.mem_type}

    def add_peer(self, key: str, meta: dict[str, Any]) -> None:
        descs = np.frombuffer(meta["descs"], dtype=np.int64).reshape(-1, 3)
        with self._lock:
            if key in self._peers:  # another pull thread added it meanwhile
                return
            remote_name = self.agent.add_remote_agent(meta["agent"])
            if isinstance(remote_name, bytes):
                remote_name = remote_name.decode()
            prepped = self.agent.prep_xfer_dlist(remote_name, descs, meta["mem_type"])
            self._peers[key] = (remote_name, prepped, int(meta["num_blocks"]))

    def progress(self) -> None:
        """Let the agent make progress on transfers others run against our memory."""
        with self._lock:
            self.agent.get_new_notifs()

    def has_peer(self, key: str) -> bool:
        return key in self._peers

    def read(self, key: str, remote_blocks: list[int], local_blocks: list[int], deadline: float) -> int:
        """READ the remote blocks (all heads) into the local ones; returns bytes moved."""
        _, remote_side, remote_num_blocks = self._peers[key]
        remote_idx = block_indices(remote_blocks, self.num_layers, remote_num_blocks)
        local_idx = block_indices(local_blocks, self.num_layers, self.num_blocks)
        with self._lock:
            handle = self.agent.make_prepped_xfer("READ", self.local_side, local_idx, remote_side, remote_idx, b"")
        try:
            with self._lock:
                state = self.agent.transfer(handle)
            while state not in ("DONE", "ERR"):
                if time.monotonic() > deadline:
                    raise TimeoutError("the NIXL read did not finish in time")
                time.sleep(POLL_S)  # outside the lock: the other threads' calls go in between
                with self._lock:
                    state = self.agent.check_xfer_state(handle)
            if state == "ERR":
                raise ConnectionError("the NIXL read failed")
        finally:
            with self._lock:
                self.agent.release_xfer_handle(handle)
        block_bytes = self.kv_caches[0][0, 0].numel() * self.kv_caches[0].element_size()
        return len(remote_idx) * block_bytes

    def forget_peer(self, key: str) -> None:
        with self._lock:
            entry = self._peers.pop(key, None)
            if entry is not None:
                try:
                    self.agent.release_dlist_handle(entry[1])
                    self.agent.remove_remote_agent(entry[0])
                except Exception:  # the peer may be gone already
                    pass
