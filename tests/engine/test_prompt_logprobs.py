"""SamplingParams.prompt_logprobs: every prompt position's logprob, rank and top-k, as transformers
computes them from the full-sequence forward; through chunked prefill, prefix caching, batches,
preemption and tensor parallelism."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.frontend.output_processor import OutputProcessor
from pdserve.engine.protocol import EngineCoreOutput, EngineCoreRequest, FinishReason, PromptLogprobsLists

TOL = 1e-3


def random_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 4096) for _ in range(n)] for n in lengths]


def params(k: int | None, max_tokens: int = 4) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=k)


def run(llm: LLM, prompts: list[list[int]], p: SamplingParams):
    return llm.generate([{"prompt_token_ids": ids} for ids in prompts], p)


@pytest.fixture(scope="module")
def llm(path):
    # 16 tokens a step: a 50-token prompt runs in four chunks, and a batch splits the budget.
    engine = LLM(path, dtype="float32", max_num_batched_tokens=16, enable_prefix_caching=True)
    yield engine
    engine.shutdown()


@torch.inference_mode()
def reference(hf, ids: list[int]) -> torch.Tensor:
    """log P(token p | tokens < p) rows: row p - 1 predicts position p."""
    return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def check_against_transformers(hf, ids: list[int], got, k: int) -> None:
    assert got is not None and len(got) == len(ids)
    assert got[0] is None  # nothing comes before the first token
    ref = reference(hf, ids)
    for position in range(1, len(ids)):
        row, token, entry = ref[position - 1], ids[position], got[position]
        own = entry[token]
        assert abs(own.logprob - row[token].item()) < TOL, position
        # Its rank among the whole vocabulary (ties within the tolerance may go either way).
        assert int((row > row[token] + TOL).sum()) + 1 <= own.rank <= int((row > row[token] - TOL).sum()) + 1
        # Besides it, the k most likely tokens (it may be one of them): their values are
        # transformers' top-k values, and each is that token's logprob there.
        tops = {t: lp for t, lp in entry.items() if lp.rank <= k}
        assert set(entry) == set(tops) | {token}
        expected = row.topk(k).values.tolist() if k else []
        assert [lp.logprob for lp in sorted(tops.values(), key=lambda lp: lp.rank)] == pytest.approx(expected, abs=TOL)
        for t, lp in tops.items():
            assert abs(lp.logprob - row[t].item()) < TOL


def test_prompt_logprobs_equal_transformers_over_chunks_and_a_batch(llm, hf):
    prompts = random_prompts([50, 37, 9, 2, 17], seed=1)
    with_lps = run(llm, prompts, params(3))
    for ids, out in zip(prompts, with_lps):
        check_against_transformers(hf, ids, out.prompt_logprobs, 3)
    # Asking for them changes nothing that is generated.
    plain = run(llm, prompts, params(None))
    assert [o.outputs[0].token_ids for o in with_lps] == [o.outputs[0].token_ids for o in plain]
    assert all(o.prompt_logprobs is None for o in plain)


def test_logits_made_in_slices_give_the_same_logprobs(llm, hf, monkeypatch):
    from pdserve.engine.worker import prompt_logprobs

    # Three positions' logits at a time (the engine runs in this process): a 16-token chunk takes six slices.
    monkeypatch.setattr(prompt_logprobs, "SLICE_ELEMENTS", 3 * llm.engine.config.model.vocab_size)
    ids = random_prompts([40], seed=7)[0]
    check_against_transformers(hf, ids, run(llm, [ids], params(2))[0].prompt_logprobs, 2)


def test_zero_alternatives_gives_each_prompt_token_alone(llm, hf):
    ids = random_prompts([21], seed=2)[0]
    out = run(llm, [ids], params(0))[0]
    check_against_transformers(hf, ids, out.prompt_logprobs, 0)
    assert all(list(entry) == [token] for token, entry in zip(ids[1:], out.prompt_logprobs[1:]))


def test_a_cached_prompt_still_gets_every_position(llm, hf):
    ids = random_prompts([64], seed=3)[0]  # four full blocks
    run(llm, [ids], params(None))  # now cached
    hits = llm.stats()["prefix_cache_hits"]
    first, second = run(llm, [ids], params(2))[0], run(llm, [ids], params(2))[0]
    for out in (first, second):
        check_against_transformers(hf, ids, out.prompt_logprobs, 2)
        assert out.num_cached_tokens == 0
    assert llm.stats()["prefix_cache_hits"] == hits
    run(llm, [ids], params(None))
    assert llm.stats()["prefix_cache_hits"] > hits  # the cache was there to hit


def test_preempted_requests_report_each_position_once(path, hf):
    prompts = random_prompts([40, 33, 50, 29, 47, 38, 44, 36], seed=5)
    # Eight requests need ~5 blocks each at the end; 20 blocks cannot hold them all at once.
    engine = LLM(path, dtype="float32", num_kv_blocks=20, max_model_len=320, max_num_batched_tokens=48)
    try:
        outs = run(engine, prompts, params(1, max_tokens=24))
        assert engine.stats()["num_preemptions"] > 0
    finally:
        engine.shutdown()
    for ids, out in zip(prompts, outs):
        check_against_transformers(hf, ids, out.prompt_logprobs, 1)


def test_positions_sent_again_after_a_preemption_keep_their_first_copy(llm):
    """A request preempted in the middle of its prefill recomputes those chunks and sends their
    positions again; the frontend keeps one copy per position."""
    processor = OutputProcessor(llm.get_tokenizer())
    prompt = [5, 6, 7, 8, 9]
    request = EngineCoreRequest("r", prompt, params(0).clone(output_kind=2), None, 0.0)
    processor.add_request(request, None)

    def chunk(first: int, values: list[float]) -> EngineCoreOutput:
        rows = range(first, first + len(values))
        return EngineCoreOutput("r", [], prompt_logprobs=PromptLogprobsLists(
            first, [[prompt[p]] for p in rows], [[v] for v in values], [1] * len(values)))

    assert processor.process_outputs([chunk(1, [-1.0, -2.0])]).request_outputs == []
    processor.process_outputs([chunk(1, [-9.0, -9.0, -3.0])])  # recomputed from the start
    processor.process_outputs([chunk(4, [-4.0])])
    done = processor.process_outputs([EngineCoreOutput("r", [11], finish_reason=FinishReason.LENGTH)])
    got = done.request_outputs[0].prompt_logprobs
    assert got[0] is None
    assert [entry[token].logprob for token, entry in zip(prompt[1:], got[1:])] == [-1.0, -2.0, -3.0, -4.0]


def test_tensor_parallel_driver_returns_them(path, hf):
    prompts = random_prompts([30, 12], seed=6)
    engine = LLM(path, dtype="float32", tensor_parallel_size=2, num_kv_blocks=64, max_num_batched_tokens=16)
    try:
        outs = run(engine, prompts, params(2))
    finally:
        engine.shutdown()
    for ids, out in zip(prompts, outs):
        check_against_transformers(hf, ids, out.prompt_logprobs, 2)
