"""Decode steps replayed from CUDA graphs captured once at start-up.

On a GPU a decode step of a small model is a few hundred short kernels (about ten per layer); at a
few rows their launches from Python take longer than the kernels run, and the GPU waits on the
host. A graph captured once per batch size launches the whole step, logits included, at once.

- Batch sizes are bucketed (`capture_sizes`): a step of n decodes replays the smallest captured
  size >= n. Its extra rows are padding: token 0 at position 0, one key of context (block 0),
  no KV write (slot -1); their logits are dropped.
- Every size reads its inputs from one set of static device buffers (views of their first rows),
  which `run` fills before each replay.
- A size's attention metadata is fixed at capture: every row a decode, the key split planned for
  `max_model_len` (the kernels read each row's real length from `seq_lens`).
- After capturing, each size is replayed once against the same step run eagerly on the same
  inputs. A size whose capture fails or whose logits differ is dropped with a warning, and its
  steps run eagerly: a wrong graph is never used.

The runner replays only steps of decodes alone, on one tensor-parallel rank, without
`--enforce-eager`; everything else runs the modules.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Protocol

import numpy as np
import torch

from pdserve.engine.attention.metadata import AttentionMetadata

log = logging.getLogger("pdserve.engine.graphs")

# Past this many rows a decode step's kernels outlast their launches; vLLM stops at 512.
MAX_CAPTURE_SIZE = 256


def capture_sizes(max_num_seqs: int, limit: int = MAX_CAPTURE_SIZE) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every 8, up to min(max_num_seqs, limit); the cap
    itself is always one, so every batch up to it has a size."""
    top = max(1, min(max_num_seqs, limit))
    sizes = [s for s in (1, 2, 4) if s < top] + list(range(8, top, 8))
    return sizes + [top]


def bucket_of(n: int, sizes: list[int]) -> int | None:
    """The smallest size >= n, or None when n is past the largest (sizes ascending)."""
    for s in sizes:
        if s >= n:
            return s
    return None


class Graph(Protocol):
    """One captured computation: `capture(fn)` runs fn once under capture and keeps its output;
    `replay()` runs it again on whatever the static inputs now hold, into the same output."""

    output: torch.Tensor

    def capture(self, fn: Callable[[], torch.Tensor]) -> None: ...

    def replay(self) -> None: ...


class CudaGraph:
    def __init__(self, device: torch.device, pool: Any) -> None:
        self.device, self.pool = device, pool
        self.graph = torch.cuda.CUDAGraph()
        self.output: torch.Tensor | None = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> None:
        # Warm up on a side stream, as torch asks: first launches compile Triton kernels and
        # allocate workspaces, neither of which may happen under capture.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        # thread_local: a KV connector's thread touching CUDA meanwhile must not void this capture.
        with torch.cuda.graph(self.graph, pool=self.pool, capture_error_mode="thread_local"):
            self.output = fn()

    def replay(self) -> None:
        self.graph.replay()


def graph_factory(device: torch.device) -> Callable[[], Graph] | None:
    """What records a graph on `device`, or None where there is nothing to record (the CPU)."""
    if device.type != "cuda":
        return None
    pool = torch.cuda.graph_pool_handle()  # one pool: the sizes run one at a time, so they share it
    return lambda: CudaGraph(device, pool)


class StaticInputs:
    """The device buffers every captured size reads, for the largest size; size b uses rows [:b]."""

    def __init__(self, rows: int, max_blocks_per_req: int, device: torch.device) -> None:
        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.input_ids = zeros(rows, dtype=torch.int64)
        self.positions = zeros(rows, dtype=torch.int64)
        self.slots = torch.full((rows,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(rows, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=device)
        self.block_tables = zeros(rows, max_blocks_per_req, dtype=torch.int32)

    def fill(self, n: int, size: int, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
             seq_lens: torch.Tensor, block_table: np.ndarray) -> None:
        """Rows [:n] from the step's host inputs (the first n entries of each), rows [n:size] padding."""
        blocks = block_table.shape[1]
        self.input_ids[:n].copy_(input_ids[:n], non_blocking=True)
        self.positions[:n].copy_(positions[:n], non_blocking=True)
        self.slots[:n].copy_(slots[:n], non_blocking=True)
        self.seq_lens[:n].copy_(seq_lens[:n], non_blocking=True)
        # Only the columns this step reads: a row's later entries are never looked at.
        self.block_tables[:n, :blocks].copy_(torch.from_numpy(np.ascontiguousarray(block_table[:n])))
        if size > n:
            self.pad(n, size)

    def pad(self, start: int, end: int) -> None:
        self.input_ids[start:end] = 0
        self.positions[start:end] = 0
        self.slots[start:end] = -1
        self.seq_lens[start:end] = 1
        self.block_tables[start:end, 0] = 0


# Replayed logits may differ from the eager step's by reduction order alone (a library may choose
# another kernel under capture); past this share of the logits' range they are wrong.
REPLAY_TOLERANCE = 1e-3


def replay_agrees(replayed: torch.Tensor, eager: torch.Tensor) -> tuple[bool, str]:
    """Whether a replay computed the eager step's logits, and a note when not to the bit."""
    if replayed.shape != eager.shape or replayed.dtype != eager.dtype:
        return False, (f"replayed logits {tuple(replayed.shape)} {replayed.dtype}, "
                       f"eager {tuple(eager.shape)} {eager.dtype}")
    if torch.equal(replayed, eager):
        return True, ""
    if not (torch.isfinite(replayed).all() and torch.isfinite(eager).all()):
        return False, "replayed logits differ from the eager step's (non-finite values)"
    diff = (replayed.float() - eager.float()).abs().max().item()
    scale = max(eager.float().abs().max().item(), 1.0)
    if diff <= REPLAY_TOLERANCE * scale:
        return True, f"replays within {diff:.3g} of the eager step's logits (largest {scale:.3g}), not to the bit"
    return False, f"replayed logits differ from the eager step's by up to {diff:.3g} (largest {scale:.3g})"


class DecodeGraphs:
    """Captured decode steps of one model, one per batch size.

    `forward(input_ids, positions, meta)` is the step from token ids to logits as the runner runs
    it eagerly (the model, its KV caches and attention backend bound in)."""

    def __init__(self, forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor],
                 plan: Callable[[AttentionMetadata], Any], new_graph: Callable[[], Graph], sizes: list[int],
                 block_size: int, max_blocks_per_req: int, max_model_len: int, device: torch.device) -> None:
        self.forward, self.plan, self.new_graph = forward, plan, new_graph
        self.block_size, self.max_model_len = block_size, max_model_len
        self.static = StaticInputs(max(sizes), max_blocks_per_req, device)
        self.wanted = sorted(sizes)
        self.graphs: dict[int, Graph] = {}
        self.sizes: list[int] = []  # the captured ones that passed their check, ascending
        self.replays = 0

    def meta(self, size: int) -> AttentionMetadata:
        s = self.static
        qsl = np.arange(size + 1, dtype=np.int64)
        # Planned as if every row had the longest context: the plan's host-side choices (the
        # decode key split) must hold for whatever lengths later replays bring.
        seq_lens = np.full(size, self.max_model_len, dtype=np.int32)
        meta = AttentionMetadata(
            num_reqs=size, num_decodes=size, num_tokens=size, max_query_len=1, max_seq_len=self.max_model_len,
            block_size=self.block_size, query_start_loc=s.query_start_loc[:size + 1], seq_lens=s.seq_lens[:size],
            block_tables=s.block_tables[:size], slot_mapping=s.slots[:size], query_start_loc_np=qsl,
            seq_lens_np=seq_lens, block_tables_np=np.zeros((size, s.block_tables.shape[1]), dtype=np.int32))
        meta.backend_plan = self.plan(meta)
        return meta

    def _step(self, size: int, meta: AttentionMetadata) -> torch.Tensor:
        return self.forward(self.static.input_ids[:size], self.static.positions[:size], meta)

    def capture(self) -> None:
        """Capture every wanted size, largest first (the smaller ones then fit in the memory the
        largest took), and keep those whose replay matches the eager step."""
        began = time.perf_counter()
        dropped: list[str] = []
        for size in sorted(self.wanted, reverse=True):
            self.static.pad(0, size)  # padding only: nothing is written to the KV cache
            meta = self.meta(size)
            graph = self.new_graph()
            try:
                graph.capture(lambda size=size, meta=meta: self._step(size, meta))
                graph.replay()
                replayed = graph.output.clone()
                eager = self._step(size, meta)
            except Exception as exc:  # noqa: BLE001 -- any failure means: run this size eagerly
                dropped.append(f"{size} ({type(exc).__name__}: {exc})")
                continue
            agrees, how = replay_agrees(replayed, eager)
            if not agrees:
                dropped.append(f"{size} ({how})")
                continue
            if how:
                log.info("decode graphs: batch size %d %s", size, how)
            self.graphs[size] = graph
        self.sizes = sorted(self.graphs)
        if dropped:
            log.warning("decode graphs: these batch sizes run eagerly: %s", "; ".join(dropped))
        if self.sizes:
            log.info("decode graphs: captured %d batch sizes (%d-%d) in %.1fs", len(self.sizes), self.sizes[0],
                     self.sizes[-1], time.perf_counter() - began)

    def size_for(self, n: int) -> int | None:
        return bucket_of(n, self.sizes)

    def run(self, n: int, size: int, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
            seq_lens: torch.Tensor, block_table: np.ndarray) -> torch.Tensor:
        """Logits of a step of n decodes (rows [:n] of each host input), replayed at `size`."""
        graph = self.graphs[size]
        self.static.fill(n, size, input_ids, positions, slots, seq_lens, block_table)
        graph.replay()
        self.replays += 1
        return graph.output[:n]


__all__ = ["CudaGraph", "DecodeGraphs", "Graph", "MAX_CAPTURE_SIZE", "StaticInputs", "bucket_of",
           "capture_sizes", "graph_factory", "replay_agrees"]
