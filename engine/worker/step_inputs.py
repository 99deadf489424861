"""The host-side inputs of one step, in arrays allocated once and reused by every step.

A step fills a prefix of each array; the tensors it hands the model are views of that prefix
(torch.from_numpy shares the memory), so on CPU building a step's inputs allocates nothing and
copies nothing twice. On CUDA the host arrays are pinned and copied into device buffers of the
same size without blocking: the runner synchronizes before the next step refills them.

The block table keeps each row's owner between steps, so a request that stays in the same row
(the usual case while a batch decodes) writes only its new blocks.
"""

from __future__ import annotations

import numpy as np
import torch


def _host(n: int, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    return torch.zeros(n, dtype=dtype, pin_memory=pinned)


class StepInputs:
    def __init__(self, max_tokens: int, max_reqs: int, max_blocks_per_req: int, device: torch.device) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self.max_blocks_per_req = max_blocks_per_req
        self.block_table = np.zeros((max_reqs, max_blocks_per_req), dtype=np.int32)
        self.block_table_t = torch.from_numpy(self.block_table)
        self._row_owner: list[object | None] = [None] * max_reqs
        self._row_len = [0] * max_reqs
        self._allocate_tokens(max_tokens)
        self._allocate_reqs(max_reqs)

    # -- capacity -----------------------------------------------------------------------------

    def _allocate_tokens(self, n: int) -> None:
        self.max_tokens = n
        self.input_ids_t = _host(n, torch.int64, self.pinned)
        self.positions_t = _host(n, torch.int64, self.pinned)
        self.slots_t = _host(n, torch.int64, self.pinned)
        self.input_ids, self.positions, self.slots = (t.numpy() for t in (self.input_ids_t, self.positions_t, self.slots_t))
        self.arange = np.arange(n, dtype=np.int64)
        if self.pinned:
            self.input_ids_dev = torch.empty(n, dtype=torch.int64, device=self.device)
            self.positions_dev = torch.empty(n, dtype=torch.int64, device=self.device)
            self.slots_dev = torch.empty(n, dtype=torch.int64, device=self.device)

    def _allocate_reqs(self, n: int) -> None:
        self.max_reqs = n
        self.query_start_loc_t = _host(n + 1, torch.int32, self.pinned)
        self.seq_lens_t = _host(n, torch.int32, self.pinned)
        self.query_start_loc, self.seq_lens = self.query_start_loc_t.numpy(), self.seq_lens_t.numpy()
        self.query_lens = np.zeros(n, dtype=np.int64)
        self.starts = np.zeros(n, dtype=np.int64)
        self.cu = np.zeros(n + 1, dtype=np.int64)
        if self.pinned:
            self.query_start_loc_dev = torch.empty(n + 1, dtype=torch.int32, device=self.device)
            self.seq_lens_dev = torch.empty(n, dtype=torch.int32, device=self.device)
        if n > self.block_table.shape[0]:
            grown = np.zeros((n, self.max_blocks_per_req), dtype=np.int32)
            grown[:self.block_table.shape[0]] = self.block_table
            self._row_owner += [None] * (n - self.block_table.shape[0])
            self._row_len += [0] * (n - self.block_table.shape[0])
            self.block_table, self.block_table_t = grown, torch.from_numpy(grown)

    def reserve(self, num_tokens: int, num_reqs: int) -> None:
        """Grow (to at least double) when a step is larger than any before; never shrinks."""
        if num_tokens > self.max_tokens:
            self._allocate_tokens(max(num_tokens, 2 * self.max_tokens))
        if num_reqs > self.max_reqs:
            self._allocate_reqs(max(num_reqs, 2 * self.max_reqs))

    # -- filling ------------------------------------------------------------------------------

    def set_blocks(self, row: int, owner: object, block_ids: list[int]) -> None:
        """Put `owner`'s blocks in table row `row`, writing only what the row does not hold yet."""
        done = self._row_len[row] if self._row_owner[row] is owner else 0
        n = len(block_ids)
        if n > done:
            self.block_table[row, done:n] = block_ids[done:] if done else block_ids
        self._row_owner[row], self._row_len[row] = owner, n

    def to_device(self, host: torch.Tensor, n: int, name: str) -> torch.Tensor:
        """The first n entries of a host buffer, as the model's device sees them."""
        if not self.pinned:
            return host[:n]
        dev = getattr(self, f"{name}_dev")[:n]
        dev.copy_(host[:n], non_blocking=True)
        return dev

    def block_tables(self, num_reqs: int, max_blocks: int) -> torch.Tensor:
        """Rows of this step's requests. On CPU whole rows, a contiguous view (kernels step by the
        row length and read only a request's own blocks); on CUDA only the columns in use, so a
        long max_model_len does not mean a large copy."""
        if not self.pinned:
            return self.block_table_t[:num_reqs]
        narrow = np.ascontiguousarray(self.block_table[:num_reqs, :max_blocks])
        return torch.from_numpy(narrow).to(self.device, non_blocking=False)
