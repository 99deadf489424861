"""Shared fixtures: tiny random-weight checkpoints built once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Tests must not depend on the machine's thread count, nor fight each other for the 2 cores.
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Every process a test starts (engines with KV connectors, routers, coordinators, KV stores) holds
# the same internal key, as one deployment's pods do; tests of the refusals unset or change it.
os.environ.setdefault("PDSERVE_INTERNAL_KEY", "test-internal-key-" + os.urandom(16).hex())

from support.model_specs import MODEL_SPECS  # noqa: E402


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """model_dir(name) -> path of a checkpoint from MODEL_SPECS, built on first use."""
    from pdserve.engine.demo import build_random_model

    root = tmp_path_factory.mktemp("models")
    built: dict[str, Path] = {}

    def get(name: str) -> str:
        if name not in built:
            built[name] = build_random_model(root / name, **MODEL_SPECS[name])
        return str(built[name])

    return get
