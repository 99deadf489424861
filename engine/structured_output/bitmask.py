"""Worker side: mask the logits of the rows that sample under a grammar, in one call per step.

The scheduler sends one int32 bitmask row per constrained request (bit t set: token t allowed)
and the request ids in row order. `GrammarMask.for_rows` lines them up with the step's sampling
rows; the sampler applies it (after taking the raw logprobs, so those stay what the model
computed and never hold -inf). Rows of unconstrained requests are left untouched.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

log = logging.getLogger("pdserve.engine.structured_output")
# (device type, dtype) pairs xgrammar's kernels failed on once: the torch path handles them.
_NO_KERNEL: set[tuple[str, torch.dtype]] = set()


@dataclass
class GrammarMask:
    bitmask: np.ndarray  # [num sampling rows, words]; all ones on rows without a grammar
    rows: list[int]  # the rows that have a grammar

    @classmethod
    def for_rows(cls, bitmask: np.ndarray, bitmask_req_ids: list[str], row_req_ids: list[str]) -> "GrammarMask | None":
        """Row i of the logits belongs to row_req_ids[i]; bitmask row k to bitmask_req_ids[k].
        Requests of the bitmask that do not sample this step are skipped; None when none does."""
        row_of = {req_id: i for i, req_id in enumerate(row_req_ids)}
        pairs = [(row_of[r], k) for k, r in enumerate(bitmask_req_ids) if r in row_of]
        if not pairs:
            return None
        full = np.full((len(row_req_ids), bitmask.shape[1]), -1, dtype=np.int32)
        rows = [p[0] for p in pairs]
        full[rows] = bitmask[[p[1] for p in pairs]]
        return cls(full, rows)

    def apply(self, logits: torch.Tensor) -> None:
        """Set every forbidden logit of the grammar rows to -inf, in place, in one kernel call."""
        mask = torch.from_numpy(self.bitmask).to(logits.device, non_blocking=True)
        vocab = min(logits.shape[-1], self.bitmask.shape[1] * 32)
        key = (logits.device.type, logits.dtype)
        if key not in _NO_KERNEL:
            try:
                import xgrammar as xgr

                xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=vocab, indices=self.rows)
                return
            except Exception as exc:  # noqa: BLE001 - e.g. no Triton on this GPU: torch does the same
                log.warning("xgrammar has no bitmask kernel for %s %s (%s); masking with torch ops", *key, exc)
                _NO_KERNEL.add(key)
        apply_bitmask_torch(logits, mask, vocab, self.rows)


def apply_bitmask_torch(logits: torch.Tensor, mask: torch.Tensor, vocab: int, rows: list[int]) -> None:
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    words = mask.index_select(0, index)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().reshape(len(rows), -1)[:, :vocab]
    selected = logits.index_select(0, index)
    selected[:, :vocab].masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, index, selected)
