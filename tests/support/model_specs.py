"""The tiny random-weight checkpoints tests build, by name. Plain data: conftest imports it, and
tests/gpu/gpu_checks.py loads it by path from child processes that have no pytest."""

from __future__ import annotations

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

# The llama checkpoint with room for requests long enough to still run, on any machine, when a
# test acts on them (kills a rank, disconnects): 900 tokens take under a second on a fast core.
MODEL_SPECS["llama_long"] = dict(MODEL_SPECS["llama"], max_position_embeddings=16384)
# Room for one request that must outlast several seconds of a test's actions: 8176 tokens of this
# model took under 7 s on a Zen 5 (test_held_kv's slot holder finished before its 6 s wait was over).
MODEL_SPECS["llama_64k"] = dict(MODEL_SPECS["llama"], max_position_embeddings=65536)

# The llama checkpoint's attention shapes (GQA group 2, head_dim 32) in two layers, for the Triton
# interpreter, where each layer's attention costs seconds: two layers still share one step's plan.
MODEL_SPECS["llama_2layers"] = dict(MODEL_SPECS["llama"], num_hidden_layers=2)
