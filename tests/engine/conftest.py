"""Fixtures the engine tests share: the tiny random-weight llama checkpoint (tests/support) and
transformers' model on the same weights, the reference every greedy output is checked against."""

from __future__ import annotations

import pytest

from support.hf_reference import load_hf_model


@pytest.fixture(scope="module")
def path(model_dir) -> str:
    return model_dir("llama")


@pytest.fixture(scope="module")
def hf(path):
    return load_hf_model(path)
