"""Tensor-parallel state of this process: its rank, the group size, and the collectives.

With one rank every collective is the identity, so models call them unconditionally.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class TensorParallelState:
    rank: int = 0
    world_size: int = 1
    group: "dist.ProcessGroup | None" = None


_TP = TensorParallelState()


def tp_state() -> TensorParallelState:
    return _TP


def tp_rank() -> int:
    return _TP.rank


def tp_size() -> int:
    return _TP.world_size


def init_tensor_parallel(rank: int, world_size: int, init_method: str, backend: str) -> None:
    global _TP
    if world_size == 1:
        _TP = TensorParallelState()
        return
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=world_size)
    _TP = TensorParallelState(rank=rank, world_size=world_size, group=dist.group.WORLD)


def destroy_tensor_parallel() -> None:
    global _TP
    if dist.is_initialized():
        dist.destroy_process_group()
    _TP = TensorParallelState()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _TP.world_size > 1:
        dist.all_reduce(x, group=_TP.group)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's `x` along the last dimension, in rank order."""
    if _TP.world_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP.world_size)]
    dist.all_gather(parts, x.contiguous(), group=_TP.group)
    return torch.cat(parts, dim=-1)
