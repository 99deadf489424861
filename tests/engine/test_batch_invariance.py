"""A bfloat16 request decodes to the same tokens alone as in a batch, where its weights sit in pair
groups (AVX512-BF16 without AMX) or in AMX tiles: every matmul sums a row in one order whatever the
batch, and one row keeps that layout (linear_tuning.candidates). bf16 logits tie often, so a single
row summed in another order than the batch's changes greedy answers: with SmolLM2 on a Zen 5 EPYC, 5
of 16 answers decoded alone matched the same prompts sent 16 at once before; 16 of 16 after. On an AMX
Xeon through `pdserve serve`, 10 and 12 of 16 with the tuned single-row picks; 16 of 16 after.
"""

from __future__ import annotations

import random

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.model import layers

pytestmark = pytest.mark.skipif(not (layers.pair_groups_supported() or layers.amx_supported()),
                                reason="bfloat16 weights go in pair groups (AVX512-BF16) or AMX tiles (AMX) only")


def prompts(count: int) -> list[dict]:
    rng = random.Random(7)
    return [{"prompt_token_ids": [rng.randrange(3, 4000) for _ in range(rng.randrange(3, 60))]} for _ in range(count)]


@pytest.mark.parametrize("name", ["llama", "qwen2", "tied"])
def test_a_bfloat16_request_gets_the_same_tokens_alone_and_in_a_batch(model_dir, name):
    llm = LLM(model_dir(name), dtype="bfloat16", num_kv_blocks=256)
    try:
        greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
        batch = prompts(12)
        alone = [llm.generate([p], greedy)[0].outputs[0].token_ids for p in batch]
        together = [o.outputs[0].token_ids for o in llm.generate(batch, greedy)]
    finally:
        llm.shutdown()
    assert together == alone
