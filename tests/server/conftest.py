"""One smollm2 float32 server shared by the server test modules that need the real model in float32.

Starting smollm2 costs ~12 s of the make-test budget each time; test_echo_logprobs,
test_structured_outputs and test_tool_calling only read from a server, so they share this one.
test_smollm2.py runs dtype auto on purpose, as `make serve` does: it shares this one where auto
means float32 (CPUs without native bfloat16), and starts its own elsewhere.
"""

from __future__ import annotations

import pytest

from pdserve.engine.demo import resolve_model

from support.server import run_server

# The union of what the sharing modules need:
#   float32         echo logprobs are compared with transformers in float32, and greedy structured
#                   and tool-calling answers then do not depend on whether the CPU has native bf16;
#   max-model-len   tool calling's prompts (tool schemas in the system turn) need 2048;
#   64-token steps  echo/prompt logprobs must hold across prompts computed in several chunks (their
#                   prompts are longer than 64 tokens); at 16, 20 concurrent requests could not even
#                   all decode in one step and tool prompts took ~30 steps to prefill;
#   512 MiB of KV   ~11k tokens, far more than these modules ever hold at once; the 4 GiB default
#                   cost ~14 s of start-up just to allocate.
SMOLLM2_F32_ARGS = ("--dtype", "float32", "--max-model-len", "2048", "--max-num-batched-tokens", "64",
                    "--kv-cache-memory-bytes", str(512 << 20))


@pytest.fixture(scope="session")
def smollm2_f32_server(tmp_path_factory):
    resolve_model("smollm2")  # convert once, outside the server's start-up wait
    with run_server("smollm2", *SMOLLM2_F32_ARGS, tmp_path=tmp_path_factory.mktemp("smollm2-f32")) as s:
        yield s


# One tiny-llama server for the modules that only send requests and read answers (bad input,
# hardening of the API, unsupported fields, token ids): a start-up each was ~10 s of make test.
# Its flags are the union of what they test; none of them changes another's answers:
#   --api-key sekret     the key checks (every sharing module sends "Authorization: Bearer sekret");
#   --max-model-len      the context-length errors are asserted at 256;
#   --max-request-body-bytes  the 413 is asserted over 1 MiB;
#   --max-logprobs       the logprobs caps are asserted at 5.
TINY_ARGS = ("--served-model-name", "tiny", "--max-model-len", "256", "--api-key", "sekret",
             "--max-request-body-bytes", str(1 << 20), "--max-logprobs", "5")


@pytest.fixture(scope="session")
def tiny_server(model_dir, tmp_path_factory):
    with run_server(model_dir("llama"), *TINY_ARGS, tmp_path=tmp_path_factory.mktemp("tiny-server")) as s:
        yield s
