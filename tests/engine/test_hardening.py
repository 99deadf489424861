"""Engine hardening (issue 14): stale prefix-cache hashes after preemption, KV-capacity checks at
start-up and per request, safetensors index paths."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import EngineArgs
from pdserve.engine.frontend.llm_engine import LLMEngine

from support.hf_reference import hf_greedy, load_hf_model

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def random_prompt(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(3, 4096) for _ in range(n)]


def run_to_completion(engine: LLMEngine) -> dict[str, list[int]]:
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return done


def test_same_step_preemption_leaves_no_stale_prefix_hashes(path):
    """A low-priority request is scheduled (its new blocks hashed at allocation) and then preempted
    in the same step by a more important one: the KV of those blocks is never written, so neither
    its own recompute nor a later request with the same prompt may reuse them."""
    rng = random.Random(0)
    low, high = random_prompt(96, rng), random_prompt(40, rng)
    # 8 blocks of 16 tokens, prefill chunks of 32 tokens (two blocks) a step: on the third step `low`
    # takes the last two free blocks for its chunk, then `high` needs one and preempts `low`.
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=path, dtype="float32", num_kv_blocks=8, max_model_len=128, scheduling_policy="priority",
        enable_prefix_caching=True, long_prefill_token_threshold=32))
    engine.add_request("low", {"prompt_token_ids": low}, GREEDY, priority=5)
    engine.step()  # `low` runs first, so it sits ahead of `high` in the running list
    engine.add_request("high", {"prompt_token_ids": high}, GREEDY, priority=0)
    got = run_to_completion(engine)
    assert engine.get_stats()["num_preemptions"] >= 1
    engine.add_request("again", {"prompt_token_ids": low}, GREEDY)  # same prompt: reads the prefix cache
    got.update(run_to_completion(engine))
    assert engine.get_stats()["prefix_cache_hits"] > 0

    want_low, want_high = hf_greedy(load_hf_model(path), [low, high], MAX_NEW)
    assert got == {"low": want_low, "high": want_high, "again": want_low}


# -- 5. KV capacity --------------------------------------------------------------------------------------


def test_an_engine_whose_cache_cannot_hold_one_sequence_refuses_to_start(path):
    with pytest.raises(ValueError) as failed:
        LLM(path, dtype="float32", num_kv_blocks=4, max_model_len=256)
    message = str(failed.value)
    assert "64 tokens" in message and "max_model_len 256" in message
    assert "--max-model-len" in message and "--num-kv-blocks" in message
    # Exactly one sequence fits: that is enough.
    llm = LLM(path, dtype="float32", num_kv_blocks=4, max_model_len=64)
    out = llm.generate({"prompt_token_ids": list(range(10, 50))}, SamplingParams(temperature=0, max_tokens=100))[0]
    assert len(out.outputs[0].token_ids) == 24 and out.outputs[0].finish_reason == "length"


def test_the_frontend_refuses_a_request_the_cache_cannot_hold(path):
    """The core only learns of such a request after accepting it, and could only abort it; the
    frontend knows the cache's size from the core's handshake and answers at once."""
    engine = LLMEngine.from_engine_args(EngineArgs(model=path, dtype="float32", num_kv_blocks=8, max_model_len=128))
    processor = engine.input_processor
    assert processor.kv_capacity_tokens == 128  # learned from the core
    processor.kv_capacity_tokens = 64  # as a core with a smaller cache would report
    with pytest.raises(ValueError, match="may need 90 tokens of KV cache .* holds 64"):
        engine.add_request("big", {"prompt_token_ids": list(range(10, 50))}, SamplingParams(max_tokens=50))
    engine.add_request("fits", {"prompt_token_ids": list(range(10, 50))}, SamplingParams(max_tokens=24))
    assert set(run_to_completion(engine)) == {"fits"}


# -- 6. safetensors index entries ------------------------------------------------------------------------


def copy_with_index(src: str, dst: Path, entry_for) -> Path:
    """A copy of the checkpoint at `src` whose index maps every tensor to entry_for(dst)."""
    from safetensors import safe_open

    shutil.copytree(src, dst)
    with safe_open(str(dst / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    index = {"metadata": {}, "weight_map": {n: entry_for(dst) for n in names}}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


@pytest.mark.parametrize("entry_for", [
    lambda d: "../elsewhere/model.safetensors",
    lambda d: str(d.parent / "elsewhere" / "model.safetensors"),
    lambda d: "weights/../../elsewhere/model.safetensors",
    lambda d: None,
], ids=["dotdot", "absolute", "nested-dotdot", "not-a-string"])
def test_index_entries_outside_the_model_directory_are_refused(path, tmp_path, entry_for):
    # A real checkpoint sits next to the model directory: the crafted index would load it.
    shutil.copytree(path, tmp_path / "elsewhere")
    crafted = copy_with_index(path, tmp_path / "model", entry_for)
    (crafted / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="weight_map entry .* not a file name inside the model directory"):
        LLM(str(crafted), dtype="float32")


def test_index_entries_in_subfolders_still_load(path, tmp_path):
    crafted = copy_with_index(path, tmp_path / "model", lambda d: "weights/model.safetensors")
    (crafted / "weights").mkdir()
    (crafted / "model.safetensors").rename(crafted / "weights" / "model.safetensors")
    want = LLM(path, dtype="float32").generate({"prompt_token_ids": [5, 6, 7]}, GREEDY)[0].outputs[0].token_ids
    got = LLM(str(crafted), dtype="float32").generate({"prompt_token_ids": [5, 6, 7]}, GREEDY)[0].outputs[0].token_ids
    assert got == want
