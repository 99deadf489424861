"""The per-shape choice of the single-row matmul path (engine/model/linear_tuning.py).

The choice itself is a timing on the machine, so the decision rule is tested with scripted
timings; the packed single-row path is tested for computing what F.linear computes; and a model
loaded with tuning on still matches transformers (tests/engine/test_parity.py loads that way).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.model import linear_tuning
from pdserve.engine.model.layers import (PACKED_ROWS, ColumnParallelLinear, RowParallelLinear, linear,
                                         pack_model_weights, packing_supported)

pytestmark = pytest.mark.skipif(not packing_supported(torch.float32), reason="no oneDNN weight packing in this torch")


class TwoShapes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.wide = nn.ModuleList(ColumnParallelLinear(48, 160, False, torch.float32) for _ in range(2))
        self.narrow = RowParallelLinear(48, 40, False, torch.float32)
        for module in (*self.wide, self.narrow):
            module.weight.data.copy_(torch.randn(module.weight.shape, generator=gen) / 7)


def test_one_row_goes_packed_only_for_shapes_measured_faster(monkeypatch):
    model = TwoShapes()
    assert pack_model_weights(model) == 3
    # Per shape (in module order): F.linear's time, then packed's, twice (the tuning alternates).
    script = iter([2.0, 1.0, 2.0, 1.0,      # 160x48: packed twice as fast -> packed for one row
                   1.0, 0.95, 1.0, 0.95])   # 40x48: packed 5% faster, under the margin -> unchanged
    monkeypatch.setattr(linear_tuning, "_median_s", lambda fn, rounds: (fn(), next(script))[1])
    ratios = linear_tuning.tune_single_row(model)
    assert ratios == pytest.approx({"160x48": 2.0, "40x48": 1 / 0.95})
    assert all(m.packed_rows == (1, PACKED_ROWS[torch.float32][1]) for m in model.wide)
    assert model.narrow.packed_rows is None


def test_the_packed_single_row_path_computes_f_linear():
    model = TwoShapes()
    pack_model_weights(model)
    layer = model.wide[0]
    layer.packed_rows = (1, PACKED_ROWS[torch.float32][1])
    x = torch.randn(1, 48, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-6)
    assert torch.equal(linear(x, layer.weight, None, layer.packed_weight, packed_rows=(1, 384)), layer(x))


def test_tuning_can_be_turned_off_and_leaves_the_global_rng_alone(monkeypatch):
    model = TwoShapes()
    pack_model_weights(model)
    monkeypatch.setenv("PDSERVE_TUNE_LINEAR", "0")
    linear_tuning.maybe_tune(model)
    assert all(m.packed_rows is None for m in (*model.wide, model.narrow))
    monkeypatch.setenv("PDSERVE_TUNE_LINEAR", "1")
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    linear_tuning.maybe_tune(model)  # really timed: whichever it picks, seeded sampling must not shift
    assert torch.equal(torch.rand(3), expected)
