"""Per-step attention inputs, built once by the model runner and read by every layer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    """Layout of one step's flat token batch.

    Requests are ordered decodes first: requests [0, num_decodes) have exactly one query token.
    Request r's queries are tokens query_start_loc[r]:query_start_loc[r+1]; its context after this
    step is seq_lens[r] tokens, so query i of r sits at position seq_lens[r] - query_len + i and
    attends to positions 0..that position, read from the cache through block_tables[r].
    """

    num_reqs: int
    num_decodes: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    block_size: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, on the device
    seq_lens: torch.Tensor  # [num_reqs] int32, on the device
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int32, on the device
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot written by each token
    query_start_loc_np: np.ndarray  # host copies, for kernels that plan on the CPU
    seq_lens_np: np.ndarray
    block_tables_np: np.ndarray
    # Whatever a backend precomputes once per step and reuses in every layer.
    backend_plan: Any = field(default=None)
