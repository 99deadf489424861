"""engine/dtype_probe.py: bfloat16 against float32 matmuls on this CPU, timed once per machine."""

from __future__ import annotations

import json

import pytest
import torch

from pdserve.engine import cpu_info, dtype_probe

SHAPES = ((96, 64), (64, 64), (256, 64), (64, 128))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_HOME", str(tmp_path))
    dtype_probe.bf16_beats_float32.cache_clear()
    yield tmp_path
    dtype_probe.bf16_beats_float32.cache_clear()


def test_the_shapes_are_one_decoder_layers_matmuls():
    assert dtype_probe.shapes(hidden=64, intermediate=128, q_out=64, kv_out=32) == [(128, 64), (64, 64), (256, 64),
                                                                                     (64, 128)]


def test_the_verdict_is_bfloat16_faster_at_every_row_count_by_the_margin(monkeypatch):
    monkeypatch.setattr(dtype_probe, "STREAM_BYTES", 1 << 20)  # small: this test checks the verdict, not speed
    rng = torch.get_rng_state()
    verdict = dtype_probe.measure(list(SHAPES))
    assert torch.equal(torch.get_rng_state(), rng)  # a caller's seeded draws are left alone
    assert set(verdict.seconds) == {str(r) for r in dtype_probe.ROWS}
    assert all(f > 0 and b > 0 for f, b in verdict.seconds.values())
    assert set(verdict.ratios) == set(verdict.seconds) and all(r > 0 for r in verdict.ratios.values())
    assert verdict.bf16_faster == all(r > dtype_probe.MARGIN for r in verdict.ratios.values())
    assert "1 rows" in verdict.why() and "256 rows" in verdict.why()


def test_a_machine_slowing_down_while_it_times_does_not_decide_the_verdict(monkeypatch):
    """On a shared machine the rate moves while the probe runs (a server's other process starting):
    the dtypes are timed in alternation and compared round by round, so a slowdown that would have
    fallen on bfloat16's passes alone does not turn a 1.5x win into a loss."""
    passes = []

    def one_pass_s(fns, xs):  # float32 passes cost 1.5x bfloat16's; every pass 15% slower than the one before
        dtype = next(iter(xs.values())).dtype
        passes.append(dtype)
        return (1.5 if dtype == torch.float32 else 1.0) * 1.15 ** len(passes)

    monkeypatch.setattr(dtype_probe, "_one_pass_s", one_pass_s)
    contenders = [([(64, None)], torch.float32), ([(64, None)], torch.bfloat16)]
    seconds, ratio = dtype_probe._alternated_s(contenders, rows=16)
    assert 1.5 / 1.15 <= ratio <= 1.5 * 1.15 and ratio > dtype_probe.MARGIN
    # (Timed one dtype after the other, bfloat16's passes would have come 1.15^9 = 3.5x later: 0.43x.)
    assert passes.count(torch.float32) == passes.count(torch.bfloat16) == dtype_probe.ROUNDS + 1


def test_the_verdict_is_measured_once_and_read_back_after(cache, monkeypatch):
    calls = []

    def measure(shapes):
        calls.append(shapes)
        return dtype_probe.Verdict(True, {"1": [3.0, 1.0], "16": [2.0, 1.0], "256": [2.0, 1.5]})

    monkeypatch.setattr(dtype_probe, "measure", measure)
    first = dtype_probe.bf16_beats_float32(SHAPES)
    assert calls == [list(SHAPES)] and first.bf16_faster
    stored = list((cache / "dtype-probe").glob("*.json"))
    assert len(stored) == 1 and json.loads(stored[0].read_text())["bf16_faster"] is True
    dtype_probe.bf16_beats_float32.cache_clear()  # a new process: reads the file, times nothing
    assert dtype_probe.bf16_beats_float32(SHAPES) == first and len(calls) == 1
    # Other shapes are another question.
    dtype_probe.bf16_beats_float32(((32, 32),))
    assert len(calls) == 2


def test_a_verdict_timed_on_another_cpu_is_not_read_here(cache, monkeypatch):
    """A home folder moved to another machine (or a container image's cache) must not carry one
    CPU's verdict to another: the file is keyed by the CPU's model name and flags."""
    calls = []
    monkeypatch.setattr(dtype_probe, "measure", lambda shapes: calls.append(shapes) or dtype_probe.Verdict(
        len(calls) == 1, {"1": [2.0, 1.0]}))
    assert dtype_probe.bf16_beats_float32(SHAPES).bf16_faster is True
    monkeypatch.setattr(cpu_info, "identity", lambda: "Another CPU | avx2 fma")
    dtype_probe.bf16_beats_float32.cache_clear()
    assert dtype_probe.bf16_beats_float32(SHAPES).bf16_faster is False and len(calls) == 2
    assert len(list((cache / "dtype-probe").glob("*.json"))) == 2


def test_the_cpu_identity_names_the_model_and_flags():
    assert cpu_info.model_name() in cpu_info.identity()
    assert all(flag in cpu_info.identity().split() for flag in cpu_info.flags())


def test_the_last_level_cache_is_read_from_sysfs_sizes():
    """What linear_tuning reads twice over before each timed pass, so the pass finds its weights in memory."""
    assert [cpu_info._size_bytes(text) for text in ("32768K", "1M", "2G", "512")] == [32 << 20, 1 << 20, 2 << 30, 512]
    size = cpu_info.last_level_cache_bytes()
    assert size >= 1 << 20  # some megabytes on any server CPU, or the default where sysfs does not say


def test_a_damaged_verdict_file_is_measured_again(cache, monkeypatch):
    monkeypatch.setattr(dtype_probe, "measure", lambda shapes: dtype_probe.Verdict(False, {"1": [1.0, 2.0]}))
    dtype_probe.bf16_beats_float32(SHAPES)
    [stored] = (cache / "dtype-probe").glob("*.json")
    stored.write_text("{not json")
    dtype_probe.bf16_beats_float32.cache_clear()
    assert dtype_probe.bf16_beats_float32(SHAPES).bf16_faster is False
    assert json.loads(stored.read_text())["bf16_faster"] is False



def test_a_big_models_weights_are_timed_on_a_bounded_band_of_rows():
    # A 70B-class layer would be gigabytes: each weight is cut by its output rows, columns kept.
    big = dtype_probe.shapes(hidden=8192, intermediate=28672, q_out=8192, kv_out=1024)
    cut = dtype_probe.bounded(big)
    assert [i for _, i in cut] == [i for _, i in big]
    assert all(o * i <= dtype_probe.MAX_WEIGHT_ELEMENTS and o >= 1 for o, i in cut)
    assert dtype_probe.bounded([(96, 64)]) == [(96, 64)]  # small ones are timed whole


def test_a_verdict_file_of_the_wrong_form_is_measured_again(cache, monkeypatch):
    monkeypatch.setattr(dtype_probe, "measure", lambda shapes: dtype_probe.Verdict(False, {"1": [1.0, 2.0]}))
    dtype_probe.bf16_beats_float32(SHAPES)
    [stored] = (cache / "dtype-probe").glob("*.json")
    stored.write_text(json.dumps({"bf16_faster": "yes", "seconds": {}}))
    dtype_probe.bf16_beats_float32.cache_clear()
    assert dtype_probe.bf16_beats_float32(SHAPES).bf16_faster is False
