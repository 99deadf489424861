"""Sampling: seeds, top-k/top-p/min-p, penalties and logprobs, checked against transformers' logits."""

from __future__ import annotations

import math
import random

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.worker.sampler import SamplingMetadata, greedy_argmax, sample

from support.hf_reference import hf_next_token_logits


@pytest.fixture(scope="module")
def llm(path):
    return LLM(path, dtype="float32")


def prompts(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 4096) for _ in range(rng.randrange(5, 40))]} for _ in range(n)]


def ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_seeded_requests_reproduce_and_seeds_differ(llm):
    ps = prompts(4, seed=1)
    params = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=20, ignore_eos=True) for i in range(4)]
    first, second = ids(llm.generate(ps, params)), ids(llm.generate(ps, params))
    assert first == second
    other = ids(llm.generate(ps, [p.clone(seed=p.seed + 50) for p in params]))
    assert other != first


def test_seeded_request_reproduces_in_a_different_batch(llm):
    target = prompts(1, seed=2)
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=16, ignore_eos=True)
    alone = ids(llm.generate(target, params))[0]
    crowd = target + prompts(5, seed=3)
    together = ids(llm.generate(crowd, [params] + [SamplingParams(temperature=1.0, max_tokens=16)] * 5))[0]
    assert alone == together


def test_top_k_one_equals_greedy(llm):
    ps = prompts(5, seed=4)
    greedy = ids(llm.generate(ps, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)))
    top1 = ids(llm.generate(ps, SamplingParams(temperature=1.3, top_k=1, max_tokens=20, ignore_eos=True)))
    assert top1 == greedy


def allowed_by(probs: torch.Tensor, top_p: float = 1.0, min_p: float = 0.0, tol: float = 1e-4) -> set[int]:
    order = probs.argsort(descending=True)
    mass_before = probs[order].cumsum(0) - probs[order]
    nucleus = set(order[mass_before < top_p + tol].tolist())
    floor = set(torch.nonzero(probs >= (min_p - tol) * probs.max()).flatten().tolist())
    return nucleus & floor


@pytest.mark.parametrize("setting", [{"top_p": 0.3}, {"min_p": 0.2}, {"top_p": 0.6, "min_p": 0.05}])
def test_top_p_and_min_p_never_leave_the_allowed_set(llm, hf, setting):
    ps = prompts(3, seed=5)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=12, ignore_eos=True, **setting) for s in range(3)]
    outs = llm.generate(ps, params)
    checked = 0
    for prompt, out in zip(ps, outs):
        context = list(prompt["prompt_token_ids"])
        for token in out.outputs[0].token_ids:
            probs = torch.softmax(hf_next_token_logits(hf, context), dim=-1)
            allowed = allowed_by(probs, setting.get("top_p", 1.0), setting.get("min_p", 0.0))
            assert token in allowed, f"token {token} (p={probs[token]:.4f}) outside the allowed set of {len(allowed)}"
            assert len(allowed) < probs.numel()  # the filter really removed something
            context.append(token)
            checked += 1
    assert checked == 36


def test_logprobs_match_transformers_log_softmax(llm, hf):
    ps = prompts(3, seed=6)
    outs = llm.generate(ps, SamplingParams(temperature=0.0, max_tokens=10, logprobs=5, ignore_eos=True))
    for prompt, out in zip(ps, outs):
        completion = out.outputs[0]
        assert len(completion.logprobs) == len(completion.token_ids) == 10
        context = list(prompt["prompt_token_ids"])
        total = 0.0
        for token, entry in zip(completion.token_ids, completion.logprobs):
            reference = torch.log_softmax(hf_next_token_logits(hf, context), dim=-1)
            top = reference.topk(5)
            assert set(entry) == {token} | set(top.indices.tolist())
            for tid, lp in entry.items():
                assert abs(lp.logprob - reference[tid].item()) < 1e-4
            assert entry[token].rank == 1  # greedy: the sampled token is the most likely
            assert [entry[t].rank for t in top.indices.tolist()] == [1, 2, 3, 4, 5]
            total += entry[token].logprob
            context.append(token)
        assert math.isclose(completion.cumulative_logprob, total, abs_tol=1e-4)


def test_sampled_token_rank_and_logprob_when_not_the_top(llm, hf):
    p = prompts(1, seed=7)
    out = llm.generate(p, SamplingParams(temperature=5.0, seed=3, max_tokens=8, logprobs=0, ignore_eos=True))[0]
    context = list(p[0]["prompt_token_ids"])
    for token, entry in zip(out.outputs[0].token_ids, out.outputs[0].logprobs):
        reference = torch.log_softmax(hf_next_token_logits(hf, context), dim=-1)
        assert list(entry) == [token]
        assert abs(entry[token].logprob - reference[token].item()) < 1e-4
        assert entry[token].rank == int((reference > reference[token]).sum()) + 1
        context.append(token)


def test_min_tokens_holds_back_eos_and_stop_tokens(llm):
    p = prompts(1, seed=8)
    greedy = ids(llm.generate(p, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)))[0]
    stop_at = greedy[1]
    stopped = llm.generate(p, SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=[stop_at]))[0].outputs[0]
    assert stopped.token_ids == greedy[:2] and stopped.finish_reason == "stop" and stopped.stop_reason == stop_at
    held = llm.generate(p, SamplingParams(temperature=0.0, max_tokens=6, min_tokens=4,
                                          stop_token_ids=[stop_at]))[0].outputs[0]
    assert stop_at not in held.token_ids[:4] and len(held.token_ids) >= 4


def test_penalties_follow_their_definitions():
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0]])
    md = SamplingMetadata(temperature=torch.ones(1), greedy=torch.ones(1, dtype=torch.bool), all_greedy=True,
                          max_num_logprobs=None, prompt_token_ids=[[0]], output_token_ids=[[1, 1, 2]],
                          presence_penalty=torch.tensor([0.5]), frequency_penalty=torch.tensor([0.25]),
                          repetition_penalty=torch.tensor([2.0]))
    from pdserve.engine.worker.sampler import _apply_penalties

    out = _apply_penalties(logits, md)[0].tolist()
    # token 0: prompt only -> 2.0 / 2; token 1: -1*2 - 0.25*2 - 0.5; token 2: 0.5/2 - 0.25 - 0.5; token 3 untouched
    assert out == pytest.approx([1.0, -3.0, -0.5, 0.0])
    assert sample(logits, md).token_ids.tolist() == [0]


def test_repetition_penalty_changes_greedy_output(llm):
    p = prompts(2, seed=9)
    plain = ids(llm.generate(p, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)))
    penalised = ids(llm.generate(p, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                   repetition_penalty=3.0)))
    assert plain != penalised
    for prompt, out in zip(p, penalised):
        # A strong repetition penalty keeps greedy output from looping on one token.
        assert max(out.count(t) for t in set(out)) < 12


def test_n_returns_distinct_samples(llm):
    out = llm.generate(prompts(1, seed=10), SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=10,
                                                           ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_argmax_is_torchs_first_maximum_with_nan_above_all(dtype):
    """The all-greedy sampler's argmax (our kernel on the CPU, rows read as stored) picks what
    torch.argmax picks: the first of tied maxima, -0 tied with +0, a NaN above every number (the
    first NaN), infinities, rows of -inf, odd widths and rows that sit apart in memory."""
    gen = torch.Generator().manual_seed(0)
    cases = []
    for n in (1, 3, 63, 64, 65, 130, 32000):
        x = (torch.randn(9, n, generator=gen) * 2).round()  # whole numbers: ties everywhere
        x[1] = -float("inf")
        x[2, n // 2] = float("nan")
        x[2, -1] = float("nan")
        x[3] = -float("nan")
        x[4] = 0.0
        x[4, ::2] = -0.0
        x[5, -1] = float("inf")
        x[6, 0] = -float("inf")
        cases.append(x.to(dtype))
    wide = torch.randn(5, 200, generator=gen).to(dtype)
    cases.append(wide[:, 10:150])  # rows 200 apart
    for x in cases:
        assert torch.equal(greedy_argmax(x), x.float().argmax(dim=-1)), x.shape
        assert greedy_argmax(x).dtype == torch.int64


def test_every_64_bit_seed_is_taken_and_repeats_and_a_bigger_one_is_refused(llm):
    """Seeds cross to the engine as msgpack int64/uint64: both ends of that range sample repeatably, and
    one past it is a ValueError naming the field (the server's 400), not a failure to encode later."""
    for seed in (-(1 << 63), (1 << 64) - 1):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=8, ignore_eos=True)
        first, again = (ids(llm.generate(prompts(1, seed=3), params))[0] for _ in range(2))
        assert first == again and len(first) == 8
    for seed in (-(1 << 63) - 1, 1 << 64):
        with pytest.raises(ValueError, match="seed must be"):
            SamplingParams(seed=seed)


@pytest.mark.parametrize("field", ["temperature", "repetition_penalty"])
def test_an_infinite_temperature_or_penalty_is_refused_also_from_the_wire(field):
    """inf / inf and -inf / inf are NaN: a grammar's masked logits became NaN and the sampler picked
    token 0 against the mask. Refused where the params are built and where the engine decodes them."""
    import msgspec

    with pytest.raises(ValueError, match=f"{field} must be .*finite"):
        SamplingParams(**{field: math.inf})
    with pytest.raises(msgspec.ValidationError, match="finite"):
        msgspec.msgpack.decode(msgspec.msgpack.encode({field: math.inf}), type=SamplingParams)
