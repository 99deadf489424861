"""The model runner's reused step inputs and the sampler's argmax-only path.

The runner fills arrays allocated once (engine.worker.step_inputs) instead of building tensors
per step, and all-greedy batches skip the sampler's general path. What a user relies on: tokens
stay exactly transformers' greedy ones however the batch changes from step to step (requests
finishing, joining, being preempted and resumed with new blocks), and requests that sample or
want logprobs next to greedy ones get what they would alone.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.worker.sampler import SamplingMetadata, sample
from pdserve.engine.worker.step_inputs import StepInputs

from support.hf_reference import hf_greedy


def prompts_of(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 4096) for _ in range(n)] for n in lengths]


def test_batches_that_shrink_grow_and_preempt_stay_exact(path, hf):
    # 4 sequences at most, 12 requests of different lengths: the batch refills as requests finish,
    # so table rows change hands; 20 blocks of 16 cannot hold 4 long requests at once, so some
    # are preempted and come back (same id, new blocks); 40-token steps chunk the prompts.
    lengths = [5, 70, 17, 33, 90, 1, 48, 16, 120, 9, 64, 31]
    outputs_len = [30, 60, 41, 7, 45, 50, 3, 36, 40, 44, 18, 27]
    prompts = prompts_of(3, lengths)
    llm = LLM(path, dtype="float32", max_model_len=320, num_kv_blocks=20, max_num_seqs=4, max_num_batched_tokens=40)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in outputs_len]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert llm.engine.client.engine_core.scheduler.num_preemptions > 0, "the test meant to preempt"
    for prompt, n, out in zip(prompts, outputs_len, outputs):
        assert out.outputs[0].token_ids == hf_greedy(hf, [prompt], n)[0], f"prompt of {len(prompt)} tokens"
    llm.shutdown()


def test_greedy_next_to_sampled_and_logprob_requests(path, hf):
    prompts = prompts_of(4, [12, 40, 7, 25])
    expected = hf_greedy(hf, prompts, 16)
    llm = LLM(path, dtype="float32", num_kv_blocks=128)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    seeded = SamplingParams(temperature=0.9, top_k=50, seed=11, max_tokens=16, ignore_eos=True)
    alone = llm.generate({"prompt_token_ids": prompts[2]}, seeded)[0].outputs[0].token_ids
    mixed = llm.generate([{"prompt_token_ids": p} for p in prompts], [greedy, with_logprobs, seeded, greedy])
    assert mixed[0].outputs[0].token_ids == expected[0]
    assert mixed[3].outputs[0].token_ids == expected[3]
    lp = mixed[1].outputs[0]
    assert lp.token_ids == expected[1]
    assert len(lp.logprobs) == 16 and all(lp.token_ids[i] in lp.logprobs[i] for i in range(16))
    assert mixed[2].outputs[0].token_ids == alone  # a seeded draw does not depend on its neighbours
    llm.shutdown()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_only_path_equals_the_general_one(dtype):
    torch.manual_seed(0)
    logits = torch.randn(5, 301).to(dtype)
    logits[2, 7] = logits[2, 100] = logits[2].max() + 1  # a tie: the first index wins on both paths
    logits[3, 250] = float("nan")  # as torch.argmax: NaN counts as the largest
    fast = sample(logits, SamplingMetadata(all_greedy=True)).token_ids
    general = sample(logits, SamplingMetadata(all_greedy=True, max_num_logprobs=0))
    assert fast.dtype == torch.int64
    assert fast.tolist() == general.token_ids.tolist() == logits.argmax(-1).tolist()
    assert fast[2].item() == 7 and fast[3].item() == 250
    assert general.logprobs is not None  # asking for logprobs still gets them


def test_block_rows_rewrite_only_when_their_owner_changes():
    buf = StepInputs(max_tokens=8, max_reqs=2, max_blocks_per_req=6, device=torch.device("cpu"))
    a, b = object(), object()
    buf.set_blocks(0, a, [4, 5])
    buf.block_table[0, 0] = 99  # were the row written again, this would be undone
    buf.set_blocks(0, a, [4, 5, 6])
    assert buf.block_table[0, :3].tolist() == [99, 5, 6]
    buf.set_blocks(0, b, [1])  # another request takes the row: its whole list is written
    buf.set_blocks(0, a, [4, 5, 6])  # and the first one, back in it, too
    assert buf.block_table[0, :3].tolist() == [4, 5, 6]


def test_inputs_grow_past_their_start_up_size_and_keep_the_table():
    buf = StepInputs(max_tokens=4, max_reqs=2, max_blocks_per_req=3, device=torch.device("cpu"))
    owner = object()
    buf.set_blocks(1, owner, [7, 8])
    buf.reserve(num_tokens=9, num_reqs=5)
    assert buf.max_tokens >= 9 and buf.max_reqs >= 5 and buf.block_table.shape[0] >= 5
    assert buf.block_table[1, :2].tolist() == [7, 8]
    buf.set_blocks(1, owner, [7, 8, 2])  # still known as the owner of row 1 after growing
    assert buf.block_table[1].tolist() == [7, 8, 2]
    buf.input_ids[:9] = np.arange(9)
    assert buf.to_device(buf.input_ids_t, 9, "input_ids").tolist() == list(range(9))  # a view, no copy
