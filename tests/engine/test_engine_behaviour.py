"""Prefix caching, chunked prefill, preemption, aborts and bad input, on a real tiny model."""

from __future__ import annotations

import random

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import EngineArgs
from pdserve.engine.frontend.llm_engine import LLMEngine

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def prompts_of(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 4096) for _ in range(n)] for n in lengths]


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def generate(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


@pytest.fixture(scope="module")
def reference(path):
    """Outputs of an unconstrained engine with prefix caching off: what every variant must equal."""
    llm = LLM(path, dtype="float32", enable_prefix_caching=False)
    cache: dict[tuple, list[int]] = {}

    def outputs_for(prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
        missing = [p for p in prompts if (tuple(p), params.max_tokens) not in cache]
        if missing:
            for p, ids in zip(missing, token_ids(generate(llm, missing, params))):
                cache[(tuple(p), params.max_tokens)] = ids
        return [cache[(tuple(p), params.max_tokens)] for p in prompts]

    return outputs_for


def test_shared_prefix_hits_the_cache_and_output_is_unchanged(path, reference):
    prefix = prompts_of([64], seed=1)[0]  # four full blocks of 16
    first, second = prefix + [11, 12, 13], prefix + [21, 22, 23, 24, 25]
    llm = LLM(path, dtype="float32", enable_prefix_caching=True)
    assert token_ids(generate(llm, [first])) == reference([first])
    before = llm.stats()
    assert token_ids(generate(llm, [second])) == reference([second])
    after = llm.stats()
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] >= 64
    assert after["prefix_cache_queries"] - before["prefix_cache_queries"] == len(second)


def test_prefix_cache_serves_requests_in_the_same_batch_and_reset_clears_it(path, reference):
    prefix = prompts_of([48], seed=2)[0]
    batch = [prefix + [i, i + 1] for i in range(100, 106)]
    llm = LLM(path, dtype="float32")
    assert token_ids(generate(llm, batch)) == reference(batch)
    assert llm.stats()["prefix_cache_hits"] > 0
    assert llm.reset_prefix_cache() is True
    hits = llm.stats()["prefix_cache_hits"]
    generate(llm, [batch[0]])
    assert llm.stats()["prefix_cache_hits"] == hits  # nothing cached survived the reset


def test_chunked_prefill_equals_unchunked(path, reference):
    prompts = prompts_of([300, 45, 200], seed=3)
    llm = LLM(path, dtype="float32", max_num_batched_tokens=64, enable_prefix_caching=False)
    assert token_ids(generate(llm, prompts)) == reference(prompts)
    # Each step computes at most 64 tokens: a 300-token prompt needs at least five prefill steps.
    assert llm.stats()["step_counter"] >= 5 + 23


def test_long_prefill_threshold_equals_unchunked(path, reference):
    prompts = prompts_of([150, 10, 10, 10], seed=4)
    llm = LLM(path, dtype="float32", long_prefill_token_threshold=32)
    assert token_ids(generate(llm, prompts)) == reference(prompts)


def test_preemption_recomputes_and_loses_nothing(path, reference):
    prompts = prompts_of([40, 33, 50, 29, 47, 38, 44, 36], seed=5)
    # Eight requests need ~5 blocks each at the end; 20 blocks cannot hold them all at once.
    # (The cache must still hold one max_model_len sequence: 20 x 16 = 320 tokens.)
    llm = LLM(path, dtype="float32", num_kv_blocks=20, max_model_len=320, enable_prefix_caching=False)
    outputs = generate(llm, prompts)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    assert [o.prompt_token_ids for o in outputs] == prompts
    assert token_ids(outputs) == reference(prompts)
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] == 20


def test_priority_policy_preempts_the_least_important(path, reference):
    prompts = prompts_of([40, 40, 40, 40, 40, 40], seed=6)
    llm = LLM(path, dtype="float32", num_kv_blocks=16, max_model_len=256, enable_prefix_caching=False,
              scheduling_policy="priority")
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, priority=[5, 0, 5, 0, 5, 0])
    assert token_ids(outputs) == reference(prompts)
    assert llm.stats()["num_preemptions"] > 0


def blocks_accounted(engine: LLMEngine) -> tuple[int, int, int]:
    pool = engine.client.engine_core.scheduler.kv_cache_manager.pool
    used = sum(1 for b in pool.blocks if b.ref_cnt > 0)
    return used, pool.num_free_blocks, pool.num_blocks


def test_abort_frees_every_block(path):
    engine = LLMEngine.from_engine_args(EngineArgs(model=path, dtype="float32", num_kv_blocks=64))
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i, p in enumerate(prompts_of([70, 20, 35, 90], seed=7)):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    for _ in range(3):
        engine.step()
        used, free, total = blocks_accounted(engine)
        assert used + free == total and used > 0
    engine.abort_request(["r0", "r3"])
    used_after, free_after, total = blocks_accounted(engine)
    assert used_after + free_after == total
    assert used_after < used
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert set(finished) == {"r1", "r2"}  # aborted ones report nothing more
    assert blocks_accounted(engine) == (0, 64, 64)


@pytest.mark.parametrize("prompt, sampling, message", [
    ({"prompt_token_ids": [5] * 1024}, {}, "maximum context length"),
    ("hello", {"temperature": -0.5}, "temperature"),
    ("hello", {"top_p": 1.5}, "top_p"),
    ("hello", {"top_p": 0.0}, "top_p"),
    ("hello", {"max_tokens": 0}, "max_tokens"),
    ("", {}, "empty"),
    ({"prompt_token_ids": [5, 99999]}, {}, "token ids"),
])
def test_bad_input_is_rejected_and_others_keep_running(path, reference, prompt, sampling, message):
    good = prompts_of([30, 12], seed=8)
    engine = LLMEngine.from_engine_args(EngineArgs(model=path, dtype="float32"))
    engine.add_request("good-0", {"prompt_token_ids": good[0]}, GREEDY)
    engine.step()
    with pytest.raises(ValueError, match=message):
        # Invalid sampling values fail as the params are built, before reaching the engine.
        engine.add_request("bad", prompt, SamplingParams(**sampling))
    engine.add_request("good-1", {"prompt_token_ids": good[1]}, GREEDY)
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
    assert results == {"good-0": reference(good)[0], "good-1": reference(good)[1]}


def test_request_id_reuse_is_rejected(path):
    engine = LLMEngine.from_engine_args(EngineArgs(model=path, dtype="float32"))
    engine.add_request("same", "hello", GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("same", "hello again", GREEDY)


def test_max_model_len_caps_generation(path):
    llm = LLM(path, dtype="float32", max_model_len=40)
    out = llm.generate({"prompt_token_ids": list(range(10, 40))}, SamplingParams(temperature=0, max_tokens=100,
                                                                                  ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 10 and out.outputs[0].finish_reason == "length"
