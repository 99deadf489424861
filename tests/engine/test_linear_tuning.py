"""The per-shape choice of the single-row matmul path (engine/model/linear_tuning.py).

The choice itself is a timing on the machine, so the decision rule is tested with scripted
timings; each single-row path is tested for computing what F.linear computes; and a model loaded
with tuning on still matches transformers (the parity tests load that way).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.model import fused, linear_tuning
from pdserve.engine.model.layers import (ColumnParallelLinear, RowParallelLinear, pack_model_weights, packing_supported,
                                         pair_groups_supported)

needs_packing = pytest.mark.skipif(not packing_supported(torch.float32), reason="no oneDNN weight packing in this torch")
needs_kernels = pytest.mark.skipif(os.environ.get("PDSERVE_DISABLE_CPU_KERNELS") == "1",
                                   reason="CPU kernels disabled by PDSERVE_DISABLE_CPU_KERNELS=1")


class TwoShapes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.wide = nn.ModuleList(ColumnParallelLinear(52, 160, False, torch.float32) for _ in range(2))
        self.narrow = RowParallelLinear(52, 40, False, torch.float32)
        for module in (*self.wide, self.narrow):
            module.weight.data.copy_(torch.randn(module.weight.shape, generator=gen) / 7)


@needs_packing
@needs_kernels
def test_one_row_takes_the_fastest_path_only_where_it_beats_f_linear_by_the_margin(monkeypatch):
    model = TwoShapes()
    assert pack_model_weights(model) == 3 and fused.cpu_kernels_ready()
    # Per shape (in module order), twice (the tuning alternates): F.linear, packed, the kernel on all
    # threads, on one.
    script = iter([2.0, 1.5, 1.0, 1.2, 2.0, 1.6, 1.1, 1.3,        # 160x52: the kernel, 2x -> the kernel
                   1.0, 0.95, 0.97, 1.5, 1.0, 0.95, 0.97, 1.5])   # 40x52: packed only 5% faster -> F.linear
    monkeypatch.setattr(linear_tuning, "_median_s", lambda fn, rounds, before: (before(), fn(), next(script))[2])
    found = linear_tuning.tune_single_row(model)
    assert found["160x52"] == ("kernel", pytest.approx(2.0)) and found["40x52"] == ("packed", pytest.approx(1 / 0.95))
    assert [m.one_row for m in model.wide] == ["kernel", "kernel"] and model.narrow.one_row is None


@needs_packing
@needs_kernels
@pytest.mark.parametrize("path", ["packed", "kernel", "kernel_serial"])
def test_each_single_row_path_computes_f_linear(path):
    model = TwoShapes()
    pack_model_weights(model)
    gen = torch.Generator().manual_seed(1)
    for layer in (model.wide[0], model.narrow):
        rows = torch.randn(3, 52, generator=gen)
        default = layer(rows)
        layer.one_row = path
        x = torch.randn(1, 52, generator=gen)
        # A different summation order than MKL's: equal to float32 rounding, not bit for bit.
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-6)
        assert torch.equal(layer(rows), default)  # more than one row: the default rule, unchanged


def test_each_timed_pass_starts_with_its_weights_out_of_the_cache():
    """The eviction read runs before every timed run and is not part of its time: six layers of a
    small model fit in a server's last-level cache, where a real step never finds them."""
    events = []

    def evict() -> None:
        events.append("evict")
        time.sleep(0.05)

    def run() -> None:
        events.append("run")

    median = linear_tuning._median_s(run, 3, evict)
    assert events == ["run"] + ["evict", "run"] * 3  # the warm call, then each timed run after a read
    assert median < 0.01


def test_the_eviction_read_is_twice_the_last_level_cache(monkeypatch):
    monkeypatch.setattr(linear_tuning.cpu_info, "last_level_cache_bytes", lambda: 3 << 20)
    read = linear_tuning.evictor()
    buffer = read.__closure__[0].cell_contents
    assert buffer.numel() * buffer.element_size() == 6 << 20
    monkeypatch.setattr(linear_tuning.cpu_info, "last_level_cache_bytes", lambda: 1 << 30)
    buffer = linear_tuning.evictor().__closure__[0].cell_contents
    assert buffer.numel() * buffer.element_size() == linear_tuning.MAX_EVICT_BYTES


@pytest.mark.skipif(not pair_groups_supported(), reason="no AVX512-BF16 here: bfloat16 weights cannot go in pair groups")
def test_bfloat16_weights_in_pair_groups_keep_one_row_in_them_so_a_row_is_the_same_in_any_batch(monkeypatch):
    """Where bfloat16 weights sit in pair groups (AVX512-BF16 without AMX) a lone row is not handed to a
    row-major kernel that would sum it in another order: a request decoded alone gets the bits it
    gets in a batch."""
    monkeypatch.setenv("PDSERVE_BF16_PACKING", "pairs")
    model = TwoShapes().to(torch.bfloat16)
    assert pack_model_weights(model) == 3
    assert linear_tuning.candidates(list(model.wide), torch.ones(1, 52, dtype=torch.bfloat16)) == []
    assert linear_tuning.tune_single_row(model) == {}
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(9, 52, generator=gen).bfloat16()
    for layer in (*model.wide, model.narrow):
        assert layer.one_row is None
        batch = layer(rows)
        for i in range(len(rows)):
            assert torch.equal(layer(rows[i:i + 1]), batch[i:i + 1])


def test_tuning_can_be_turned_off_and_leaves_the_global_rng_alone(monkeypatch):
    model = TwoShapes()
    pack_model_weights(model)
    monkeypatch.setenv("PDSERVE_TUNE_LINEAR", "0")
    linear_tuning.maybe_tune(model)
    assert all(m.one_row is None for m in (*model.wide, model.narrow))
    monkeypatch.setenv("PDSERVE_TUNE_LINEAR", "1")
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    linear_tuning.maybe_tune(model)  # really timed: whichever it picks, seeded sampling must not shift
    assert torch.equal(torch.rand(3), expected)


def test_engines_on_one_machine_time_their_matmuls_one_at_a_time(monkeypatch, tmp_path):
    """Two engines starting together (pdserve up) take turns: one times while the other waits, so
    neither chooses from timings taken while the other competed for the cores."""
    monkeypatch.setattr(linear_tuning.tempfile, "gettempdir", lambda: str(tmp_path))
    # Another process (as another engine would) holds the turn for a second.
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, sys, time; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); "
        "print('held', flush=True); time.sleep(1.0)"), str(tmp_path / "pdserve-linear-tuning.lock")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        began = time.monotonic()
        with linear_tuning.machine_wide_turn():
            waited = time.monotonic() - began  # the turn came only once the other let go (by exiting)
    finally:
        holder.kill()
        holder.wait()
    assert waited > 0.5


@needs_kernels
@pytest.mark.parametrize("out_features, in_features", [(7, 13), (33, 77), (5, 16), (9, 48), (1001, 577), (64, 1536)])
@pytest.mark.parametrize("serial", [False, True])
def test_the_float32_kernel_at_one_row_sums_every_product(out_features, in_features, serial):
    """float32 weights at one row of x (a lone decode), through our kernel: each output is the
    float32 sum of its products, whatever the reduction's tail (not a multiple of 16 or 64)."""
    assert fused.cpu_kernels_ready()
    gen = torch.Generator().manual_seed(out_features * in_features)
    x = torch.randn(1, in_features, generator=gen)
    weight = torch.randn(out_features, in_features, generator=gen)
    got = torch.ops.pdserve_cpu.float_linear(x, weight, serial)
    exact = x.double() @ weight.double().t()
    bound = 1e-5 * (x.double().abs() @ weight.double().abs().t()) + 1e-6
    assert got.shape == (1, out_features) and torch.all((got.double() - exact).abs() <= bound)


@needs_kernels
@pytest.mark.parametrize("rows, out_features, in_features", [(1, 160, 52), (1, 7, 33), (1, 64, 576), (2, 37, 100),
                                                             (1, 1536, 576), (3, 5, 31)])
@pytest.mark.parametrize("serial", [False, True])
def test_the_bfloat16_kernel_sums_in_float32_and_rounds_once(rows, out_features, in_features, serial):
    """bfloat16 weights through our single-row kernel (AVX512-BF16, or AVX2 widening each weight to
    float32): every output is the float32 sum
    of the exact bf16 products, rounded to bf16 once; its summation order differs from oneDNN's, so
    an output may sit one bf16 step from the exactly rounded sum. Shapes cover the row tails (not a
    multiple of 32 columns) and the tile tails (not a multiple of 4 or 16 output rows). Without the
    instructions the kernel is not offered, and asked anyway it says why."""
    assert fused.cpu_kernels_ready()
    gen = torch.Generator().manual_seed(rows * out_features + in_features)
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    weight = (torch.randn(out_features, in_features, generator=gen) / 7).bfloat16()
    module = ColumnParallelLinear(in_features, out_features, False, torch.bfloat16)
    module.weight.data.copy_(weight)
    if not linear_tuning.bf16_kernel_available():
        assert "kernel" not in linear_tuning.candidates([module], x[:1])
        with pytest.raises(RuntimeError, match="AVX512-BF16"):
            torch.ops.pdserve_cpu.float_linear(x, weight, serial)
        return
    assert "kernel" in linear_tuning.candidates([module], x[:1])
    got = torch.ops.pdserve_cpu.float_linear(x, weight, serial)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    exact = x.double() @ weight.double().t()
    rounded = exact.to(torch.bfloat16).double()
    step = rounded.abs().clamp_min(1e-30) * 2.0 ** -7  # one bf16 step (8 significant bits)
    assert ((got.double() - rounded).abs() <= step).all()
    assert (got.double() == rounded).float().mean() > 0.9  # one step away only where the sum sits near a tie
    module.one_row = "kernel_serial" if serial else "kernel"
    assert torch.equal(module(x[:1]), got[:1])  # the layer's one-row path is this kernel
