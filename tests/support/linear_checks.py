"""Checks shared by the tests of our matmul kernels (panels, AMX tiles)."""

from __future__ import annotations

from typing import Callable, Iterable

import torch


def assert_rows_independent(multiply: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                            rows: Iterable[int], window: int) -> None:
    """`multiply(x)` gives each row of x the same bits alone, inside a batch of `window` rows, and
    on one thread as on all of them: a request's logits do not change with who else is served."""
    batch = multiply(x)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        serial = multiply(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(batch, serial)
    for row in rows:
        assert torch.equal(multiply(x[row:row + 1]), batch[row:row + 1])
        assert torch.equal(multiply(x[row:row + window])[0], batch[row])
