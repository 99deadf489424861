"""Incremental detokenization and stop strings, on the demo tokenizer."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine.demo import resolve_model
from pdserve.engine.frontend.detokenizer import IncrementalDetokenizer
from pdserve.engine.frontend.output_processor import OutputProcessor
from pdserve.engine.frontend.tokenizer import load_tokenizer
from pdserve.engine.protocol import EngineCoreOutput, EngineCoreRequest, FinishReason
from pdserve.engine.sampling_params import RequestOutputKind, SamplingParams


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model("demo"))


@settings(max_examples=200, deadline=None)
@given(prompt=st.text(min_size=1, max_size=20), completion=st.text(max_size=60))
def test_incremental_text_equals_full_decode_and_never_breaks_a_character(tokenizer, prompt, completion):
    prompt_ids = tokenizer.encode(prompt)
    ids = tokenizer.encode(completion)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    pieces = [detok.push([t]) for t in ids]
    full = tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(pieces) == detok.output_text
    # Byte-level BPE of valid text decodes back to it; no piece ever holds half a character.
    assert detok.output_text == full
    assert not any("\ufffd" in p for p in pieces) or "\ufffd" in completion


def test_split_character_is_held_until_complete(tokenizer):
    ids = tokenizer.encode("日")
    assert len(ids) > 1  # the demo tokenizer spells this character in bytes
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("x"))
    assert [detok.push([t]) for t in ids] == [""] * (len(ids) - 1) + ["日"]


def make_request(rid: str, prompt_ids: list[int], **params) -> EngineCoreRequest:
    return EngineCoreRequest(rid, prompt_ids, SamplingParams(**params), eos_token_id=0, arrival_time=time.time())


def feed(processor: OutputProcessor, rid: str, ids: list[int], finish_last: FinishReason | None = None):
    results, aborted = [], []
    for i, t in enumerate(ids):
        reason = finish_last if i == len(ids) - 1 else None
        processed = processor.process_outputs([EngineCoreOutput(rid, [t], finish_reason=reason)])
        results += processed.request_outputs
        aborted += processed.reqs_to_abort
    return results, aborted


def test_stop_string_ends_the_request_and_is_never_streamed(tokenizer):
    ids = tokenizer.encode(" one two three four five")
    processor = OutputProcessor(tokenizer)
    processor.add_request(make_request("r", tokenizer.encode("count:"), stop=["three"],
                                       output_kind=RequestOutputKind.DELTA), "count:")
    results, aborted = feed(processor, "r", ids)
    streamed = "".join(r.outputs[0].text for r in results)
    assert streamed == " one two "
    assert aborted == ["r"]
    assert results[-1].finished and results[-1].outputs[0].finish_reason == "stop"
    assert results[-1].outputs[0].stop_reason == "three"
    assert not processor.has_unfinished_requests()


def test_include_stop_str_in_output(tokenizer):
    processor = OutputProcessor(tokenizer)
    processor.add_request(make_request("r", [5], stop="two", include_stop_str_in_output=True,
                                       output_kind=RequestOutputKind.FINAL_ONLY), None)
    results, _ = feed(processor, "r", tokenizer.encode(" one two three"))
    assert [r.outputs[0].text for r in results] == [" one two"]


def test_held_back_text_is_released_when_no_stop_string_appears(tokenizer):
    processor = OutputProcessor(tokenizer)
    processor.add_request(make_request("r", [5], stop=["zzzzzz"], output_kind=RequestOutputKind.DELTA), None)
    text = " plain words here"
    results, aborted = feed(processor, "r", tokenizer.encode(text), finish_last=FinishReason.LENGTH)
    assert "".join(r.outputs[0].text for r in results) == text and aborted == []
    assert results[-1].outputs[0].finish_reason == "length"


def test_cumulative_and_delta_outputs_agree(tokenizer):
    ids = tokenizer.encode(" the quick brown fox")
    texts = {}
    for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA):
        processor = OutputProcessor(tokenizer)
        processor.add_request(make_request("r", [5], output_kind=kind), None)
        results, _ = feed(processor, "r", ids, finish_last=FinishReason.LENGTH)
        texts[kind] = results[-1].outputs[0].text if kind == RequestOutputKind.CUMULATIVE else \
            "".join(r.outputs[0].text for r in results)
    assert texts[RequestOutputKind.CUMULATIVE] == texts[RequestOutputKind.DELTA] == " the quick brown fox"
