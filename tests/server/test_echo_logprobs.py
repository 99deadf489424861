"""/v1/completions `echo` + `logprobs` (OpenAI's legacy prompt logprobs) and vLLM's `prompt_logprobs`,
with the real smollm2 weights, checked against transformers on the same converted checkpoint."""

from __future__ import annotations

import openai
import pytest
import torch

from pdserve.engine.demo import resolve_model


TOL = 1e-3
# Longer than the shared server's 64-token step budget, so every prompt is computed in chunks.
CONTEXT = ("The following is a question from a geography quiz for school children. Each question names a "
           "country in Europe and asks for its capital city; the answer is a single city name, spelled as "
           "it is in English, with no further explanation. The children write their answers on paper and the "
           "teacher marks them at the end of the lesson.\nQuestion: What is the capital of France?\nAnswer:")
CONTINUATIONS = [" Paris", " The capital of France is Berlin"]


@pytest.fixture(scope="module")
def model_path() -> str:
    return str(resolve_model("smollm2"))


@pytest.fixture(scope="module")
def server(smollm2_f32_server):
    # Shared (tests/server/conftest.py): float32, as transformers runs it below, and a 64-token step
    # budget that CONTEXT exceeds, so prompts run in chunks.
    return smollm2_f32_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def hf(model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.eval()
    return model, AutoTokenizer.from_pretrained(model_path)


@torch.inference_mode()
def reference(hf, ids: list[int]) -> torch.Tensor:
    """Row p - 1: log P(· | ids[:p]), from the full-sequence forward."""
    return torch.log_softmax(hf[0](torch.tensor([ids])).logits[0].float(), dim=-1)


def scoring_requests(hf) -> tuple[list[list[int]], list[int]]:
    """What lm-evaluation-harness's local-completions sends for loglikelihood: context and
    continuation tokenized together, and the context's length."""
    tokenizer = hf[1]
    context = tokenizer.encode(CONTEXT)
    return [context + tokenizer.encode(c) for c in CONTINUATIONS], [len(context)] * len(CONTINUATIONS)


def test_lm_eval_loglikelihood_request_equals_transformers(client, hf):
    prompts, ctxlens = scoring_requests(hf)
    # local-completions' loglikelihood payload, verbatim.
    resp = client.completions.create(model="smollm2", prompt=prompts, temperature=0, max_tokens=1, logprobs=1,
                                     seed=1234, echo=True)
    choices = sorted(resp.choices, key=lambda c: c.index)
    assert len(choices) == len(prompts)
    for ids, ctxlen, choice in zip(prompts, ctxlens, choices):
        lp = choice.logprobs
        ref = reference(hf, ids)
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for position in range(1, len(ids)):
            assert abs(lp.token_logprobs[position] - ref[position - 1, ids[position]].item()) < TOL, position
            assert max(lp.top_logprobs[position].values()) == pytest.approx(ref[position - 1].max().item(), abs=TOL)
        # The generated token follows, greedy, with its own logprob.
        generated = int(ref[-1].argmax())
        assert lp.token_logprobs[-1] == pytest.approx(ref[-1, generated].item(), abs=TOL)
        assert choice.text.endswith(lp.tokens[-1])
        # Offsets run on from the prompt's first token through the generated one.
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
        # What lm-eval computes from it: the continuation's loglikelihood and whether it is greedy.
        score = sum(lp.token_logprobs[ctxlen:-1])
        expected = sum(ref[p - 1, ids[p]].item() for p in range(ctxlen, len(ids)))
        assert score == pytest.approx(expected, abs=TOL * len(ids))
        greedy = all(t == max(top.values()) for t, top in zip(lp.token_logprobs[ctxlen:-1], lp.top_logprobs[ctxlen:-1]))
        assert greedy == all(int(ref[p - 1].argmax()) == ids[p] for p in range(ctxlen, len(ids)))
    assert resp.usage.completion_tokens == len(prompts)


def test_max_tokens_zero_with_echo_returns_only_the_prompt(client, hf):
    ids = scoring_requests(hf)[0][1]
    resp = client.completions.create(model="smollm2", prompt=ids, max_tokens=0, logprobs=2, echo=True, temperature=0)
    choice = resp.choices[0]
    ref = reference(hf, ids)
    assert len(choice.logprobs.token_logprobs) == len(ids)
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx([ref[p - 1, ids[p]].item() for p in range(1, len(ids))],
                                                               abs=TOL)
    # Each position shows its own token and the two most likely ones: at most three entries.
    assert all(1 <= len(top) <= 3 for top in choice.logprobs.top_logprobs[1:])
    assert choice.text == hf[1].decode(ids)
    assert choice.finish_reason == "length"
    assert resp.usage.completion_tokens == 0 and resp.usage.prompt_tokens == len(ids)


def test_max_tokens_zero_without_echo_is_refused(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="smollm2", prompt="Hello", max_tokens=0)
    assert err.value.param == "max_tokens"


def test_streamed_echo_sends_the_prompt_logprobs_first(client, hf):
    ids = scoring_requests(hf)[0][0]
    whole = client.completions.create(model="smollm2", prompt=ids, max_tokens=3, logprobs=1, echo=True,
                                      temperature=0).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(model="smollm2", prompt=ids, max_tokens=3, logprobs=1,
                                                              echo=True, temperature=0, stream=True) if c.choices]
    first = chunks[0].logprobs
    assert first.token_logprobs[0] is None and len(first.tokens) >= len(ids)
    assert "".join(c.text for c in chunks) == whole.text
    streamed = [x for c in chunks for x in c.logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(whole.logprobs.token_logprobs[1:], abs=1e-6)
    assert [o for c in chunks for o in c.logprobs.text_offset] == whole.logprobs.text_offset


def test_echo_without_logprobs_prepends_the_prompt(client):
    prompt = "The capital of France is"
    plain = client.completions.create(model="smollm2", prompt=prompt, max_tokens=4, temperature=0).choices[0]
    echoed = client.completions.create(model="smollm2", prompt=prompt, max_tokens=4, temperature=0,
                                       echo=True).choices[0]
    assert echoed.text == prompt + plain.text
    assert echoed.logprobs is None


def test_logprobs_without_echo_cover_only_the_generated_tokens(client):
    choice = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=3, logprobs=2,
                                       temperature=0).choices[0]
    assert len(choice.logprobs.tokens) == 3
    assert all(lp is not None for lp in choice.logprobs.token_logprobs)
    assert choice.logprobs.text_offset[0] == 0


def test_vllm_prompt_logprobs_field(client, hf):
    ids = scoring_requests(hf)[0][1]
    resp = client.completions.create(model="smollm2", prompt=ids, max_tokens=1, temperature=0,
                                     extra_body={"prompt_logprobs": 2})
    choice = resp.choices[0]
    got = choice.model_extra["prompt_logprobs"]
    ref = reference(hf, ids)
    assert len(got) == len(ids) and got[0] is None
    for position in range(1, len(ids)):
        entry, row, token = got[position], ref[position - 1], ids[position]
        own = entry[str(token)]
        assert own["logprob"] == pytest.approx(row[token].item(), abs=TOL)
        assert own["decoded_token"] == hf[1].decode([token])
        # Its rank among the whole vocabulary (ties within the tolerance may go either way).
        assert int((row > row[token] + TOL).sum()) + 1 <= own["rank"] <= int((row > row[token] - TOL).sum()) + 1
        top = sorted((e for e in entry.values() if e["rank"] <= 2), key=lambda e: e["rank"])
        assert [e["logprob"] for e in top] == pytest.approx(row.topk(2).values.tolist(), abs=TOL)
    assert choice.text == hf[1].decode([int(ref[-1].argmax())])  # not echoed: the prompt stays out of the text


def test_prompt_logprobs_above_the_maximum_is_refused(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="smollm2", prompt="Hello", max_tokens=1, extra_body={"prompt_logprobs": 1000})
    assert err.value.param == "prompt_logprobs"
