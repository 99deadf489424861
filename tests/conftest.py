"""Shared fixtures: tiny random-weight checkpoints built once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Tests must not depend on the machine's thread count, nor fight each other for the 2 cores.
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# name -> build_random_model arguments
MODEL_SPECS: dict[str, dict] = {
    "llama": dict(arch="llama", hidden_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=256, max_position_embeddings=1024),
    "qwen2": dict(arch="qwen2", hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=256, max_position_embeddings=1024),
    "tied": dict(arch="llama", hidden_size=96, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=3,
                 intermediate_size=192, max_position_embeddings=1024, tie_word_embeddings=True),
    "mistral": dict(arch="mistral", hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                    intermediate_size=256, max_position_embeddings=1024),
    "llama3_rope": dict(arch="llama", hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=256, max_position_embeddings=1024,
                        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 256}),
}


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
