"""One smollm2 float32 server shared by the server test modules that need the real model in float32.

Starting smollm2 costs ~12 s of the make-test budget each time; test_echo_logprobs,
test_structured_outputs and test_tool_calling only read from a server, so they share this one.
test_smollm2.py keeps its own: it runs dtype auto on purpose, as `make serve` does.
"""

from __future__ import annotations

import pytest

from pdserve.engine.demo import resolve_model

from support.server import run_server

# The union of what the sharing modules need:
#   float32         echo logprobs are compared with transformers in float32, and greedy structured
#                   and tool-calling answers then do not depend on whether the CPU has native bf16;
#   max-model-len   tool calling's prompts (tool schemas in the system turn) need 2048;
#   16-token steps  echo/prompt logprobs must hold across prompts computed in several chunks.
SMOLLM2_F32_ARGS = ("--dtype", "float32", "--max-model-len", "2048", "--max-num-batched-tokens", "16")


@pytest.fixture(scope="session")
def smollm2_f32_server(tmp_path_factory):
    resolve_model("smollm2")  # convert once, outside the server's start-up wait
    with run_server("smollm2", *SMOLLM2_F32_ARGS, tmp_path=tmp_path_factory.mktemp("smollm2-f32")) as s:
        yield s
