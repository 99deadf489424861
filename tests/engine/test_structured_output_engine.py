"""Structured outputs inside the engine: grammars compiled off the busy loop, a token bitmask per
step, matchers advanced with each token.

Random weights under a grammar still give output in the grammar's language, as long as the
grammar can end within max_tokens: JSON runs here disable free whitespace (a random model
otherwise spends every token on it) and use small schemas.
"""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import numpy as np
import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.request import RequestStatus
from pdserve.engine.structured_output.bitmask import GrammarMask, apply_bitmask_torch
from pdserve.engine.structured_output.compiler import GrammarCompiler
from pdserve.engine.structured_output.params import StructuredOutputsParams, canonical_json

from support.hf_reference import load_hf_model

ENGINE_ARGS = dict(dtype="float32", num_kv_blocks=256)
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "kind": {"enum": ["alpha", "beta", "gamma"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3},
        "inner": {"type": "object", "properties": {"flag": {"type": "boolean"}}, "required": ["flag"]},
    },
    "required": ["ok", "kind", "count", "inner"],
}
JSON_SO = StructuredOutputsParams(json=canonical_json(SCHEMA), disable_any_whitespace=True)
CHOICES = ['say "yes"', "no\\way", "maybe | so", "(x)"]


def constrained(so: StructuredOutputsParams, **kw) -> SamplingParams:
    kw.setdefault("temperature", 0.0)
    kw.setdefault("max_tokens", 96)
    return SamplingParams(structured_outputs=so, **kw)


def prompts(n: int) -> list[str]:
    return [f"request {i}: write something" for i in range(n)]


@pytest.fixture(scope="module")
def llm(path):
    engine = LLM(path, **ENGINE_ARGS)
    yield engine
    engine.shutdown()


def manager_of(llm: LLM):
    return llm.engine.client.engine_core.scheduler.structured_output


def test_json_schema_outputs_validate_greedy_and_seeded(llm):
    params = [constrained(JSON_SO)] + [constrained(JSON_SO, temperature=1.0, seed=i) for i in range(7)]
    outputs = llm.generate(prompts(8), params)
    texts = []
    for out in outputs:
        c = out.outputs[0]
        assert c.finish_reason == "stop", c.text
        assert c.stop_reason is None  # ended by the model's EOS, which completed the grammar
        jsonschema.validate(json.loads(c.text), SCHEMA)
        texts.append(c.text)
    assert len(set(texts)) > 1  # sampling under the grammar, not one forced string
    # Seeded constrained sampling reproduces; greedy too.
    again = llm.generate(prompts(8)[:3], params[:3])
    assert [o.outputs[0].text for o in again] == texts[:3]


def test_regex_choice_grammar_and_json_object(llm):
    regex = StructuredOutputsParams(regex=r"[a-c]{2,4}-[0-9]{3}")
    choice = StructuredOutputsParams(choice=CHOICES)
    ebnf = StructuredOutputsParams(grammar='root ::= "(" item ("," item){0,2} ")"\nitem ::= "cat" | "dog" | [0-9]')
    json_object = StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
    sampled = dict(temperature=1.0, max_tokens=48)
    params = ([constrained(regex, seed=i, **sampled) for i in range(3)]
              + [constrained(choice, seed=i, **sampled) for i in range(12)]
              + [constrained(ebnf, seed=i, **sampled) for i in range(3)]
              + [constrained(json_object, max_tokens=200)])
    outputs = [o.outputs[0] for o in llm.generate(prompts(len(params)), params)]
    assert all(c.finish_reason == "stop" for c in outputs), [(c.finish_reason, c.text) for c in outputs]
    for c in outputs[:3]:
        assert re.fullmatch(r"[a-c]{2,4}-[0-9]{3}", c.text), c.text
    picked = [c.text for c in outputs[3:15]]
    assert set(picked) <= set(CHOICES), picked
    for c in outputs[15:18]:
        assert re.fullmatch(r"\((cat|dog|[0-9])(,(cat|dog|[0-9])){0,2}\)", c.text), c.text
    assert isinstance(json.loads(outputs[18].text), (dict, list))


def test_n_greater_than_one_each_sample_follows_the_grammar(llm):
    out = llm.generate(prompts(1), constrained(JSON_SO, n=4, temperature=1.0, seed=7))[0]
    assert len(out.outputs) == 4
    for c in out.outputs:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert len({c.text for c in out.outputs}) > 1


def test_max_tokens_too_small_is_length_not_valid_json(llm):
    c = llm.generate(prompts(1), constrained(JSON_SO, max_tokens=5))[0].outputs[0]
    assert c.finish_reason == "length"
    assert len(c.token_ids) == 5
    with pytest.raises(ValueError):
        json.loads(c.text)
    assert c.text.startswith("{")


def test_a_grammar_that_does_not_compile_finishes_only_its_request(llm):
    plain = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    alone = llm.generate(prompts(1), plain)[0].outputs[0].token_ids
    bad = constrained(StructuredOutputsParams(regex="(unclosed"))
    out_bad, out_plain, out_json = llm.generate(prompts(3)[:1] * 3, [bad, plain, constrained(JSON_SO)])
    assert out_bad.outputs[0].finish_reason == "abort"
    assert str(out_bad.outputs[0].stop_reason).startswith("grammar_error: ")
    assert "parenthesis" in str(out_bad.outputs[0].stop_reason)
    assert out_bad.outputs[0].token_ids == []
    assert out_plain.outputs[0].token_ids == alone
    jsonschema.validate(json.loads(out_json.outputs[0].text), SCHEMA)


def test_rows_without_a_grammar_are_untouched_and_equal_an_unconstrained_run(llm):
    plain = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts(3), plain)]
    mixed = llm.generate(prompts(3) + prompts(3), [plain] * 3 + [constrained(JSON_SO)] * 3)
    assert [o.outputs[0].token_ids for o in mixed[:3]] == alone


def test_constrained_greedy_equals_transformers_with_the_same_mask(llm, path):
    """The reference: transformers' logits, masked by a separate xgrammar matcher, argmax."""
    import xgrammar as xgr

    tokenizer = llm.get_tokenizer()
    config = llm.engine.config.model
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=config.vocab_size,
                                              stop_token_ids=config.eos_token_ids)
    so = StructuredOutputsParams(regex=r"(ab|cd|[0-9]){3,8}x")
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_regex(so.regex))
    prompt = tokenizer.encode("constrain me")
    model = load_hf_model(path)
    bitmask = xgr.allocate_token_bitmask(1, config.vocab_size)
    ids, expected = list(prompt), []
    with torch.inference_mode():
        while not matcher.is_terminated() and len(expected) < 32:
            logits = model(torch.tensor([ids])).logits[0, -1:].float()
            matcher.fill_next_token_bitmask(bitmask, 0)
            xgr.apply_token_bitmask_inplace(logits, bitmask)
            token = int(logits.argmax())
            assert matcher.accept_token(token)
            expected.append(token)
            ids.append(token)
    got = llm.generate({"prompt_token_ids": prompt}, constrained(so, max_tokens=32))[0].outputs[0]
    assert got.token_ids == expected
    assert got.finish_reason == "stop"


def test_preemption_and_chunked_prefill_keep_the_grammar(path, llm):
    long_prompts = [" ".join(f"word{i}_{j}" for j in range(25)) for i in range(4)]
    # Greedy: a seeded request's draws restart from its seed when it is recomputed after preemption.
    params = [constrained(JSON_SO, max_tokens=80) for _ in range(4)]
    reference = [o.outputs[0].text for o in llm.generate(long_prompts, params)]
    # A pool too small for all four, and prefills split into chunks of 32 tokens.
    small = LLM(path, dtype="float32", num_kv_blocks=24, max_model_len=384, max_num_batched_tokens=32,
                enable_prefix_caching=False)
    try:
        texts = [o.outputs[0].text for o in small.generate(long_prompts, params)]
        assert small.stats()["num_preemptions"] > 0
    finally:
        small.shutdown()
    assert texts == reference
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)


# -- scheduling around compiles: by events, never by time ---------------------------------------


class GatedCompiler(GrammarCompiler):
    """The real compiler, held at a gate the test opens: makes "still compiling" a fact, not a race."""

    def __init__(self, base: GrammarCompiler, gate: threading.Event) -> None:
        super().__init__(base.tokenizer_path, base.vocab_size, base.stop_token_ids, base.max_threads)
        self.gate = gate

    def compile(self, params):
        assert self.gate.wait(120), "the test never opened the gate"
        return super().compile(params)


@pytest.fixture
def gated(llm):
    manager = manager_of(llm)
    original, gate = manager.compiler, threading.Event()
    manager.compiler = GatedCompiler(original, gate)
    yield gate
    gate.set()
    manager.compiler = original


def run_until(engine, done, limit: int = 2000) -> dict[str, list]:
    """Step the engine until done(outputs_by_id) or the step limit; every output kept in order."""
    seen: dict[str, list] = {}
    for _ in range(limit):
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
        if done(seen):
            return seen
    raise AssertionError(f"not done after {limit} steps: {seen}")


def test_an_unconstrained_request_is_not_held_up_by_a_compiling_grammar(llm, gated):
    engine, core = llm.engine, llm.engine.client.engine_core
    # A new spec (not cached), queued first: a queue that waited on it would stall the second.
    so = StructuredOutputsParams(regex=r"held-[0-9]{2}")
    engine.add_request("held", "prompt one", constrained(so, max_tokens=16))
    engine.add_request("free", "prompt two", SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    seen = run_until(engine, lambda s: any(o.finished for o in s.get("free", [])))
    assert "held" not in seen
    assert core.scheduler.requests["held"].status == RequestStatus.WAITING_FOR_GRAMMAR
    assert len(seen["free"][-1].outputs[0].token_ids) == 6
    gated.set()
    seen = run_until(engine, lambda s: any(o.finished for o in s.get("held", [])))
    final = seen["held"][-1].outputs[0]
    assert final.finish_reason == "stop" and re.fullmatch(r"held-[0-9]{2}", final.text)


def test_aborting_a_request_that_waits_for_its_grammar(llm, gated):
    engine, core = llm.engine, llm.engine.client.engine_core
    engine.add_request("doomed", "prompt", constrained(StructuredOutputsParams(regex=r"doomed-[a-z]{3}")))
    engine.step()
    assert core.scheduler.requests["doomed"].status == RequestStatus.WAITING_FOR_GRAMMAR
    engine.abort_request("doomed")
    assert "doomed" not in core.scheduler.requests and not core.scheduler.waiting_for_grammar
    gated.set()
    engine.add_request("after", "prompt", SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    seen = run_until(engine, lambda s: any(o.finished for o in s.get("after", [])))
    assert "doomed" not in seen
    assert not core.has_unfinished_requests()


def test_pd_prefill_leg_compiles_nothing_and_decode_leg_is_constrained(llm):
    engine, manager = llm.engine, manager_of(llm)
    so = StructuredOutputsParams(regex=r"pd-leg-[0-9]{4}")
    before = manager.num_compiles + manager.num_cache_hits
    engine.add_request("prefill-leg", "a prompt", constrained(so, max_tokens=1),
                       kv_transfer_params={"do_remote_decode": True})
    seen = run_until(engine, lambda s: any(o.finished for o in s.get("prefill-leg", [])))
    assert manager.num_compiles + manager.num_cache_hits == before
    assert len(seen["prefill-leg"][-1].outputs[0].token_ids) == 1
    # The decode leg (no connector here: it computes the prompt itself) is constrained from its first token.
    engine.add_request("decode-leg", "a prompt", constrained(so, max_tokens=16),
                       kv_transfer_params={"do_remote_prefill": True})
    seen = run_until(engine, lambda s: any(o.finished for o in s.get("decode-leg", [])))
    assert re.fullmatch(r"pd-leg-[0-9]{4}", seen["decode-leg"][-1].outputs[0].text)
    assert manager.num_compiles + manager.num_cache_hits == before + 1


def test_compiled_grammars_are_cached_per_spec(llm):
    manager = manager_of(llm)
    so = StructuredOutputsParams(regex=r"cache-[xyz]{3}")
    llm.generate(prompts(1), constrained(so))
    compiles, hits = manager.num_compiles, manager.num_cache_hits
    llm.generate(prompts(2), [constrained(so), constrained(StructuredOutputsParams(regex=r"cache-[xyz]{3}"))])
    assert (manager.num_compiles, manager.num_cache_hits) == (compiles, hits + 2)


# -- the mask itself ----------------------------------------------------------------------------


def test_bitmask_applies_to_its_rows_only_and_matches_the_torch_path():
    vocab, rng = 100, np.random.default_rng(0)
    logits = torch.randn(4, vocab)
    bitmask = rng.integers(-2**31, 2**31 - 1, size=(3, 4), dtype=np.int64).astype(np.int32)
    # Bitmask rows for "d", "b" and "gone" (a request that does not sample this step).
    mask = GrammarMask.for_rows(bitmask, ["d", "b", "gone"], ["a", "b", "c", "d"])
    assert mask is not None and mask.rows == [3, 1]
    masked = logits.clone()
    mask.apply(masked)
    fallback = logits.clone()
    apply_bitmask_torch(fallback, torch.from_numpy(mask.bitmask), vocab, mask.rows)
    assert torch.equal(masked, fallback)
    assert torch.equal(masked[[0, 2]], logits[[0, 2]])
    for row, mask_row in ((3, bitmask[0]), (1, bitmask[1])):
        for t in range(vocab):
            allowed = (int(mask_row[t // 32]) >> (t % 32)) & 1
            assert (masked[row, t] == logits[row, t]) if allowed else masked[row, t] == float("-inf")
    assert GrammarMask.for_rows(bitmask[:1], ["gone"], ["a"]) is None


def test_logprobs_under_a_grammar_are_the_models_and_finite(llm):
    """The sampler takes logprobs before masking: what the model computed, never -inf."""
    so = StructuredOutputsParams(choice=["zebra", "quokka"])
    plain, constrained_out = llm.generate(prompts(1) * 2, [SamplingParams(temperature=0.0, max_tokens=1, logprobs=5),
                                                           constrained(so, logprobs=5)])
    first_plain, first_constrained = plain.outputs[0].logprobs[0], constrained_out.outputs[0].logprobs[0]
    assert all(np.isfinite(lp.logprob) for lp in first_constrained.values())
    top_plain = {t: lp.logprob for t, lp in first_plain.items() if lp.rank is not None and lp.rank <= 5}
    top_constrained = {t: lp.logprob for t, lp in first_constrained.items() if lp.rank is not None and lp.rank <= 5}
    assert top_constrained.keys() == top_plain.keys()
    assert all(abs(top_constrained[t] - top_plain[t]) < 1e-4 for t in top_plain)
    assert constrained_out.outputs[0].text in ("zebra", "quokka")


# -- the real model ---------------------------------------------------------------------------


def test_smollm2_json_schema_with_free_whitespace():
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "age": {"type": "integer"}, "city": {"enum": ["Paris", "Rome"]}},
              "required": ["name", "age", "city"]}
    llm = LLM("smollm2", dtype="float32", max_model_len=512, num_kv_blocks=64)
    try:
        messages = [{"role": "user", "content": "Describe a person as JSON with name, age and city."}]
        out = llm.chat(messages, constrained(StructuredOutputsParams(json=canonical_json(schema)), max_tokens=64))
    finally:
        llm.shutdown()
    c = out[0].outputs[0]
    assert c.finish_reason == "stop", c.text
    jsonschema.validate(json.loads(c.text), schema)
