from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.bench.metrics import distribution, percentile, rate, summarize
from pdserve.bench.openai_stream import RequestResult

FINITE = st.floats(min_value=-1e9, max_value=1e9, allow_nan=False, allow_infinity=False)


@settings(max_examples=300, deadline=None)
@given(values=st.lists(FINITE, min_size=1, max_size=60), q=st.floats(min_value=0, max_value=100))
def test_percentile_matches_numpy(values, q):
    expected = float(np.percentile(np.array(values), q))
    assert percentile(values, q) == pytest.approx(expected, rel=1e-9, abs=1e-6)


@pytest.mark.parametrize("q", [0, 1, 25, 50, 90, 99, 99.9, 100])
def test_percentile_fixed_points(q):
    values = [float(v) for v in np.random.default_rng(3).gamma(2.0, 10.0, size=1001)]
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12)


def test_percentile_edges():
    assert percentile([], 50) is None
    assert percentile([4.0], 99) == 4.0
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_distribution_scales_and_rate_handles_zero_duration():
    d = distribution([0.001, 0.002, 0.003], scale=1000.0)
    assert d["mean"] == pytest.approx(2.0)
    assert d["p50"] == pytest.approx(2.0)
    assert distribution([], 1000.0) == {"mean": None, "p50": None, "p90": None, "p99": None}
    assert rate(10, 0.0) is None
    assert rate(10, 4.0) == 2.5


def test_summarize_counts_only_successful_requests():
    results = [
        RequestResult(ok=True, prompt_tokens=10, output_tokens=4, ttft=0.1, itls=[0.01, 0.02, 0.03], e2e=0.16),
        RequestResult(ok=True, prompt_tokens=20, output_tokens=1, ttft=0.2, itls=[], e2e=0.2),
        RequestResult(ok=False, prompt_tokens=30, output_tokens=7, ttft=5.0, itls=[9.0], e2e=None, error="boom"),
    ]
    s = summarize(results, duration=2.0)
    assert (s["completed"], s["failed"]) == (2, 1)
    assert (s["input_tokens"], s["output_tokens"]) == (30, 5)
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_tokens_per_s"] == pytest.approx(2.5)
    assert s["total_tokens_per_s"] == pytest.approx(17.5)
    assert s["ttft_mean_ms"] == pytest.approx(150.0)
    assert s["itl_p50_ms"] == pytest.approx(20.0)
    assert s["itl_mean_ms"] == pytest.approx(20.0)
    # TPOT only exists for requests with 2+ tokens: (0.16 - 0.1) / 3.
    assert s["tpot_mean_ms"] == pytest.approx(20.0)
    assert s["e2e_p99_ms"] == pytest.approx(float(np.percentile([160.0, 200.0], 99)))
    assert all(not (isinstance(v, float) and math.isnan(v)) for v in s.values())
