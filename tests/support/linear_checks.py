"""Checks shared by the tests of our matmul kernels (panels, AMX tiles, pair groups)."""

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


def assert_rounded_once(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """`got`, a bf16 kernel's x Wᵀ, is within one bf16 step (plus float32's summation error, where
    the sum cancels) of the exactly rounded product, equal to it on nearly every element, and as
    close to it as torch's own bf16 matmul: bf16 products summed in float32 and rounded once."""
    assert got.shape == (x.shape[0], weight.shape[0]) and got.dtype == torch.bfloat16
    rounded = (x.double() @ weight.double().T).to(torch.bfloat16).double()
    step = rounded.abs().clamp_min(1e-30) * 2.0 ** -7
    float32_error = x.shape[1] * torch.finfo(torch.float32).eps * (x.double().abs() @ weight.double().abs().T)
    assert ((got.double() - rounded).abs() <= step + float32_error).all()
    assert (got.double() == rounded).float().mean() > 0.9
    torch_agrees = (torch.nn.functional.linear(x, weight).double() == rounded).float().mean()
    assert (got.double() == rounded).float().mean() >= torch_agrees - 0.02
