"""Settings for the gateway end-to-end tests (`make e2e-gateway`): as tests/conftest.py, which does
not apply outside tests/. `support` is importable through pytest's pythonpath (pyproject)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Every engine, EPP and router of a deployment holds the same internal key: engines with a KV
# connector refuse to start without one, and accept kv_transfer_params only from its holders.
os.environ.setdefault("PDSERVE_INTERNAL_KEY", "e2e-gateway-key-" + os.urandom(16).hex())


@pytest.fixture(scope="session")
def model(tmp_path_factory) -> str:
    """The tests' tiny random-weight llama checkpoint (tests/support/model_specs.py)."""
    from pdserve.engine.demo import build_random_model
    from support.model_specs import MODEL_SPECS

    return str(build_random_model(tmp_path_factory.mktemp("models") / "llama", **MODEL_SPECS["llama"]))


@pytest.fixture(scope="module")
def tmp(tmp_path_factory, request) -> Path:
    """A folder per test module for its engines', EPPs' and Envoys' logs."""
    return tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_"))


@pytest.fixture(scope="module")
def pool(model, tmp) -> Iterator[list]:
    """Two engines serving the same model (role both), for the module's gateways."""
    from support.gateway import engines

    with engines(model, tmp, ["both", "both"]) as started:
        yield started
