"""Which KV heads each tensor-parallel rank holds, and which remote rank a local rank reads from.

A rank's KV cache holds only its own heads (or, with fewer KV heads than ranks, one replicated
head). When the prefill and decode pools run different TP sizes, a decode rank's heads live on
one or several prefill ranks; each decode rank works out the same plan on its own, so the
prefill side only needs to know how many readers to wait for.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_TP_SIZE = 64  # the largest tensor-parallel size a peer may claim; plans are O(tp^2) at most


def tp_size_problem(total_kv_heads: int, tp_size: object) -> str | None:
    """None when `tp_size` ranks can split `total_kv_heads` KV heads the way engine.model.layers
    does (a power of two up to MAX_TP_SIZE that divides the heads or is divided by them); else
    why not. Checked before any plan is made from a peer's word."""
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or not 1 <= tp_size <= MAX_TP_SIZE:
        return f"a TP size must be an integer in [1, {MAX_TP_SIZE}], got {tp_size!r}"
    if tp_size & (tp_size - 1):
        return f"a TP size must be a power of two, got {tp_size}"
    if total_kv_heads % tp_size and tp_size % total_kv_heads:
        return f"{tp_size} ranks cannot split {total_kv_heads} KV heads"
    return None


def rank_heads(total_kv_heads: int, tp_size: int, rank: int) -> tuple[int, int]:
    """Global KV head range [start, end) held by `rank` (the split of engine.model.layers)."""
    if total_kv_heads >= tp_size:
        per = total_kv_heads // tp_size
        return rank * per, (rank + 1) * per
    head = rank // (tp_size // total_kv_heads)
    return head, head + 1


@dataclass(frozen=True)
class HeadRead:
    """Read heads [remote_start, remote_end) of remote rank `remote_rank` (in that rank's own
    numbering) into local heads [local_start, local_end)."""

    remote_rank: int
    remote_start: int
    remote_end: int
    local_start: int
    local_end: int

    @property
    def num_heads(self) -> int:
        return self.remote_end - self.remote_start


def plan_head_reads(total_kv_heads: int, local_tp: int, local_rank: int, remote_tp: int) -> list[HeadRead]:
    """The reads that fill every head of `local_rank` from a pool of `remote_tp` ranks.

    Where the remote side replicates a head on several ranks, the lowest such rank is read.
    """
    want_start, want_end = rank_heads(total_kv_heads, local_tp, local_rank)
    reads: list[HeadRead] = []
    covered = want_start
    for q in range(remote_tp):
        have_start, have_end = rank_heads(total_kv_heads, remote_tp, q)
        start, end = max(covered, have_start), min(want_end, have_end)
        if start >= end:
            continue
        reads.append(HeadRead(q, start - have_start, end - have_start, start - want_start, end - want_start))
        covered = end
        if covered == want_end:
            break
    if covered != want_end:
        raise ValueError(f"no remote rank of {remote_tp} holds KV heads [{covered}, {want_end})")
    return reads


def readers_of(total_kv_heads: int, local_tp: int, remote_tp: int, remote_rank: int) -> int:
    """How many local ranks read from `remote_rank`."""
    return sum(any(r.remote_rank == remote_rank for r in plan_head_reads(total_kv_heads, local_tp, lr, remote_tp))
               for lr in range(local_tp))


def done_messages_expected(total_kv_heads: int, local_tp: int, remote_tp: int, remote_rank: int) -> int:
    """How many "done" messages `remote_rank` waits for before it frees the blocks: one per
    reader, or one release from local rank 0 when nobody reads it (a replicated head)."""
    return max(1, readers_of(total_kv_heads, local_tp, remote_tp, remote_rank))


def ranks_to_release(total_kv_heads: int, local_tp: int, local_rank: int, remote_tp: int) -> list[int]:
    """Remote ranks nobody reads from; local rank 0 tells them to free the blocks."""
    if local_rank != 0:
        return []
    # One pass over every local rank's plan, not one per remote rank (that was quadratic in remote_tp).
    read = {r.remote_rank for lr in range(local_tp) for r in plan_head_reads(total_kv_heads, local_tp, lr, remote_tp)}
    return [q for q in range(remote_tp) if q not in read]
