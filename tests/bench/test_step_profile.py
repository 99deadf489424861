"""pdserve.bench.step_profile: events to categories, shares of a step, roofline cost, and one real
profile of a tiny model's steps."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from pdserve.bench import step_profile as sp


@dataclass
class Ev:
    name: str
    cpu_time_total: float  # microseconds, as the profiler reports them
    self_cpu_time_total: float
    cpu_children: list = field(default_factory=list)
    cpu_parent: object = None


def test_names_map_to_categories():
    assert sp.categorize("pdserve::matmul") == "matmul"
    assert sp.categorize("aten::linear") == sp.categorize("mkldnn::_linear_pointwise") == "matmul"
    assert sp.categorize("aten::scaled_dot_product_attention") == "attention"
    assert sp.categorize("pdserve_cpu::decode_attention") == "attention"
    assert sp.categorize("pdserve_cpu::silu_and_mul") == "act"
    assert sp.categorize("pdserve_cpu::fused_add_rms_norm") == "norm"
    assert sp.categorize("aten::add") is None  # unknown: its children decide
    assert sp.categorize("pdserve::not-a-category") is None


def test_outermost_category_takes_its_children_and_unknown_ops_descend():
    mm = Ev("aten::mm", 300, 300)
    linear = Ev("pdserve::matmul", 400, 20, [Ev("aten::reshape", 80, 80), mm])
    attn = Ev("aten::scaled_dot_product_attention", 200, 200)
    wrapper = Ev("aten::to", 260, 60, [attn])
    inner = [Ev("aten::silu", 50, 50), Ev("aten::mul", 10, 10)]
    for child in [attn]:
        child.cpu_parent = wrapper
    totals = sp.attribute([linear, wrapper, *inner])
    assert totals["matmul"] == pytest.approx(400e-6)  # the reshape inside the label counts as matmul
    assert totals["attention"] == pytest.approx(200e-6)
    assert totals["other_ops"] == pytest.approx(70e-6)  # the wrapper's own time, and the mul
    assert totals["act"] == pytest.approx(50e-6)
    assert sp.attribute([attn])["attention"] == 0  # an event with a parent is counted through it


def test_shares_never_exceed_the_wall():
    s = sp.shares({"matmul": 0.6, "attention": 0.2}, wall_s=1.0)
    assert s["matmul"] == pytest.approx(0.6) and s["python"] == pytest.approx(0.2)
    over = sp.shares({"matmul": 0.9, "attention": 0.3}, wall_s=1.0)  # ops overlap the wall
    assert sum(over.values()) == pytest.approx(1.0) and over["python"] == 0.0
    with pytest.raises(ValueError):
        sp.shares({}, wall_s=0.0)


def test_step_cost_counts_weights_once_and_kv_per_request():
    dims = sp.ModelDims(hidden=8, layers=2, heads=2, kv_heads=1, head_dim=4, intermediate=16, vocab=10)
    # per layer: qkv 8*(8+2*4) + o 8*8 + mlp 3*8*16 = 128 + 64 + 384 = 576; x2 layers + head 80
    assert dims.linear_params == 2 * 576 + 80
    bytes1, flops1 = sp.step_cost(dims, 4, [1], [10])
    bytes2, flops2 = sp.step_cost(dims, 4, [1, 1], [10, 10])
    kv_per_request = 10 * 2 * 2 * 4 * 4  # tokens x (k, v) x layers x kv width x bytes
    assert bytes2 - bytes1 == kv_per_request
    assert flops2 == pytest.approx(2 * flops1)  # two identical decodes: twice the arithmetic
    prefill_bytes, prefill_flops = sp.step_cost(dims, 4, [10], [10])
    # 10 tokens through the 1152 body weights, the LM head for the last one only, and causal
    # attention over 1+2+...+10 = 55 query-key pairs in 2 layers x 2 heads x dim 4 (2 FLOPs each, twice)
    assert prefill_bytes == bytes1
    assert prefill_flops == 2 * 10 * 1152 + 2 * 80 + 4 * 55 * 2 * 2 * 4
    assert sp.roofline_s(100.0, 20.0, bandwidth=10.0, flops_rate=1.0) == (20.0, "compute")
    assert sp.roofline_s(100.0, 5.0, bandwidth=10.0, flops_rate=1.0) == (10.0, "memory")


def test_profile_of_a_tiny_model_finds_each_part(model_dir):
    from pdserve.engine import LLM

    llm = LLM(model_dir("llama"), dtype="float32", num_kv_blocks=64)
    runner = llm.engine.client.engine_core.executor.worker.runner
    sample_fn = runner.sample_fn
    kinds = [sp.StepKind("prefill 96", 1, 96, 0), sp.StepKind("decode b4", 4, 1, 40)]
    prefill, decode = sp.profile_step_kinds(runner, kinds, num_blocks=64, repeats=2, profiled=1)
    assert runner.sample_fn is sample_fn and not runner.requests  # labels undone, fake requests gone
    for p in (prefill, decode):
        assert p.ms_per_step > 0 and sum(p.shares.values()) == pytest.approx(1.0)
        assert p.shares["matmul"] > 0 and p.shares["attention"] > 0 and p.shares["norm"] > 0
        assert p.shares["kv_write"] > 0 and p.shares["sampler"] > 0
    assert prefill.flops > decode.flops
    rows = sp.report_rows([prefill, decode], bandwidth=1e10, flops_rate=1e10, dtype="float32")
    assert [r["step"] for r in rows] == ["prefill 96", "decode b4"]
    assert all(0 < r["roofline_fraction"] and r["dtype"] == "float32" for r in rows)
    # The engine still generates after being driven by hand.
    from pdserve.engine import SamplingParams

    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0.0, max_tokens=3))
    assert len(out[0].outputs[0].token_ids) == 3
    llm.shutdown()


def test_each_kinds_roofline_takes_the_read_rate_measured_next_to_its_steps(model_dir):
    """On a shared VM the bandwidth moves from minute to minute: a kind's roofline uses the best of the
    rates measured just before and just after its timed steps, and says which rate it used."""
    from pdserve.engine import LLM

    llm = LLM(model_dir("llama"), dtype="float32", num_kv_blocks=64)
    runner = llm.engine.client.engine_core.executor.worker.runner
    rates = iter([2e10, 3e10, 5e10, 4e10])
    calls = []

    def read_rate() -> float:
        calls.append(len(runner.requests))  # before the kind's requests start, and after they ran
        return next(rates)

    kinds = [sp.StepKind("decode b2", 2, 1, 20), sp.StepKind("decode b3", 3, 1, 20)]
    try:
        first, second = sp.profile_step_kinds(runner, kinds, num_blocks=64, repeats=2, profiled=1,
                                              read_rate=read_rate)
    finally:
        llm.shutdown()
    assert len(calls) == 4 and calls[0] == 0 and calls[2] == 0
    assert (first.read_rate, second.read_rate) == (3e10, 5e10)
    rows = sp.report_rows([first, second], bandwidth=1e9, flops_rate=1e15)
    assert [r["read_GB_s"] for r in rows] == [30.0, 50.0]
    assert all(r["matmul_GFLOP_s"] == 1e6 for r in rows)  # the rate each roofline was computed with
    for row, p, rate in zip(rows, (first, second), (3e10, 5e10)):
        assert row["roofline_ms"] == pytest.approx(1e3 * p.bytes_read / rate)
    # Without a measured rate the caller's bandwidth stands.
    first.read_rate = None
    assert sp.report_rows([first], bandwidth=1e9, flops_rate=1e15)[0]["read_GB_s"] == 1.0
    with pytest.raises(ValueError, match="decode b2: no read rate"):
        sp.report_rows([first], flops_rate=1e15)


def test_rounds_keep_the_fastest_round_and_the_best_read_rate():
    """A shared VM runs at two speeds for minutes at a time: of a kind's rounds the fastest one speaks
    for the step (its shares with it), against the highest read rate seen beside any round."""
    kind = sp.StepKind("decode b16", 16, 1, 256)

    def prof(ms: float, rate: float | None, matmul: float) -> sp.StepProfile:
        return sp.StepProfile(kind, ms, {"matmul": matmul, "python": 1 - matmul}, 0.1, 0.2, 1e8, 1e9,
                              samples=[ms / 1e3, ms / 1e3 + 0.001], read_rate=rate)

    slow, fast, middling = prof(45.0, 3e10, 0.7), prof(28.0, 2e10, 0.8), prof(30.0, None, 0.75)
    merged = sp.fastest_round([slow, fast, middling])
    assert merged.ms_per_step == 28.0 and merged.shares == fast.shares
    assert merged.read_rate == 3e10  # the slow round's rate was the machine's best: the roofline asks for it
    assert len(merged.samples) == 6
    assert sp.fastest_round([middling]).read_rate is None
    with pytest.raises(ValueError):
        sp.fastest_round([])


def test_kinds_are_profiled_in_interleaved_rounds(model_dir, monkeypatch):
    from pdserve.engine import LLM

    llm = LLM(model_dir("llama"), dtype="float32", num_kv_blocks=64)
    runner = llm.engine.client.engine_core.executor.worker.runner
    order = []
    real = sp.profile_step_kind

    def spy(runner, kind, *args):
        order.append(kind.name)
        return real(runner, kind, *args)

    monkeypatch.setattr(sp, "profile_step_kind", spy)
    kinds = [sp.StepKind("decode b2", 2, 1, 20), sp.StepKind("decode b3", 3, 1, 20)]
    try:
        first, second = sp.profile_step_kinds(runner, kinds, num_blocks=64, repeats=2, profiled=1, rounds=2)
    finally:
        llm.shutdown()
    assert order == ["decode b2", "decode b3", "decode b2", "decode b3"]
    assert (first.kind.name, second.kind.name) == ("decode b2", "decode b3")
    assert len(first.samples) == len(second.samples) == 4  # both rounds' timed steps
    assert first.ms_per_step == pytest.approx(1e3 * min(first.samples))
