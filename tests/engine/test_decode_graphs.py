"""Decode steps replayed from captured graphs (engine/worker/decode_graphs.py).

A CUDA graph replays the kernels it recorded on whatever its static input buffers hold. What the
runner adds around the graph runs the same on the CPU: bucketing a batch to a captured size,
filling the static buffers and padding the extra rows so they write no KV, metadata fixed at
capture, the check of each capture against the eager step, and the choice of which steps may
replay. Here a stand-in records the step as a closure over those same static buffers and metadata
and replays it by calling it again, so the whole engine runs through that path on the CPU and its
tokens are checked against transformers and against the eager engine. Recording real graphs is
tests/gpu/test_gpu.py's job.
"""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.worker import decode_graphs
from pdserve.engine.worker.decode_graphs import bucket_of, capture_sizes, replay_agrees
from gpu.gpu_checks import ReplayGraph
from support.hf_reference import hf_greedy


class Broken(ReplayGraph):
    """Replays the wrong thing: what the check after capture must catch."""

    def replay(self) -> None:
        self.output = self.fn() + 1.0


@pytest.fixture
def replayed_on_cpu(monkeypatch):
    def use(kind=ReplayGraph) -> None:
        monkeypatch.setattr(decode_graphs, "graph_factory", lambda device: kind)

    return use


def runner_of(llm: LLM):
    return llm.engine.client.engine_core.executor.worker.runner


def prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 4000) for _ in range(n)] for n in lengths]


# -- the sizes -----------------------------------------------------------------------------------

def test_capture_sizes_cover_every_batch_up_to_the_cap():
    assert capture_sizes(256) == [1, 2, 4, *range(8, 257, 8)]
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(1000) == capture_sizes(256)
    for top in (1, 3, 20, 256, 1000):
        sizes = capture_sizes(top)
        assert sizes == sorted(set(sizes))
        for n in range(1, min(top, 256) + 1):
            size = bucket_of(n, sizes)
            assert size is not None and size >= n
            assert all(s < n for s in sizes if s < size)  # the smallest that fits
    assert bucket_of(257, capture_sizes(1000)) is None


def test_replay_agrees_only_with_the_eager_logits():
    eager = torch.randn(4, 50) * 10
    assert replay_agrees(eager.clone(), eager) == (True, "")
    ok, note = replay_agrees(eager + 1e-5, eager)
    assert ok and "not to the bit" in note
    assert not replay_agrees(eager + 1.0, eager)[0]
    assert not replay_agrees(eager[:2], eager)[0]
    nan = eager.clone()
    nan[1, 3] = float("nan")
    assert not replay_agrees(nan, eager)[0]


def test_rows_past_the_batch_are_padding_every_step():
    """A step of 3 decodes replayed at size 4 after a step of 4: row 3 still holds the finished
    request's slot, which may now belong to another request. Each fill must make it padding again:
    no KV write (slot -1), one key of context in block 0, token 0 at position 0."""
    import numpy as np

    static = decode_graphs.StaticInputs(rows=8, max_blocks_per_req=6, device=torch.device("cpu"))
    ids = torch.tensor([11, 12, 13, 14])
    positions = torch.tensor([40, 41, 42, 43])
    slots = torch.tensor([100, 201, 302, 403])
    seq_lens = torch.tensor([41, 42, 43, 44], dtype=torch.int32)
    table = np.arange(4 * 3, dtype=np.int32).reshape(4, 3) + 5
    static.fill(4, 4, ids, positions, slots, seq_lens, table)
    assert static.slots[:4].tolist() == [100, 201, 302, 403]
    assert static.block_tables[:4, :3].tolist() == table.tolist()

    static.fill(3, 4, ids[1:], positions[1:], slots[1:], seq_lens[1:], table[1:])
    assert static.input_ids[:4].tolist() == [12, 13, 14, 0]
    assert static.positions[:4].tolist() == [41, 42, 43, 0]
    assert static.slots[:4].tolist() == [201, 302, 403, -1]
    assert static.seq_lens[:4].tolist() == [42, 43, 44, 1]
    assert static.block_tables[:3, :3].tolist() == table[1:].tolist() and static.block_tables[3, 0] == 0


# -- the engine through the replay path ----------------------------------------------------------

def test_no_graphs_on_the_cpu_by_default(path):
    with LLM(path, dtype="float32", num_kv_blocks=64) as llm:
        assert runner_of(llm).decode_graphs is None


def test_replayed_decodes_match_transformers_and_the_eager_engine(path, hf, replayed_on_cpu):
    """Three requests ending at different lengths: the batch decodes at 3 (padded to the size 4),
    then 2, then 1, and a fourth request arriving later shares steps with them. Prompts longer
    than a block make the padded rows' block 0 a live request's block: a write there would show."""
    batch = prompts([37, 5, 21, 12], seed=1)
    budgets = [9, 4, 14, 6]
    expected = [hf_greedy(hf, [p], n)[0] for p, n in zip(batch, budgets)]
    requests = [{"prompt_token_ids": p} for p in batch]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in budgets]

    with LLM(path, dtype="float32", num_kv_blocks=64, max_num_seqs=4, enforce_eager=True) as llm:
        assert runner_of(llm).decode_graphs is None
        eager = [o.outputs[0].token_ids for o in llm.generate(requests, params)]
    replayed_on_cpu()
    with LLM(path, dtype="float32", num_kv_blocks=64, max_num_seqs=4) as llm:
        graphs = runner_of(llm).decode_graphs
        assert graphs is not None and graphs.sizes == [1, 2, 4]
        got = [o.outputs[0].token_ids for o in llm.generate(requests, params)]
        assert graphs.replays >= max(budgets) - 3, "decode steps did not replay"
    assert got == expected
    assert eager == expected


def test_sampled_tokens_and_logprobs_are_the_eager_engines(path, replayed_on_cpu):
    """Seeded sampling and logprobs read the replayed logits as they read the eager ones."""
    batch = [{"prompt_token_ids": p} for p in prompts([9, 30, 17], seed=2)]
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=7 + i, max_tokens=8, logprobs=3, ignore_eos=True)
              for i in range(3)]

    def run(**kw):
        with LLM(path, dtype="float32", num_kv_blocks=64, max_num_seqs=8, **kw) as llm:
            outs = llm.generate(batch, params)
            replays = runner_of(llm).decode_graphs.replays if runner_of(llm).decode_graphs else 0
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], replays

    eager, _ = run(enforce_eager=True)
    replayed_on_cpu()
    got, replays = run()
    assert replays > 0
    assert [t for t, _ in got] == [t for t, _ in eager]
    assert [lp for _, lp in got] == [lp for _, lp in eager]


def test_a_capture_that_replays_wrong_is_never_used(path, hf, replayed_on_cpu, caplog):
    replayed_on_cpu(Broken)
    prompt = prompts([11], seed=3)[0]
    with caplog.at_level("WARNING", logger="pdserve.engine.graphs"):
        with LLM(path, dtype="float32", num_kv_blocks=64, max_num_seqs=2) as llm:
            assert runner_of(llm).decode_graphs is None
            out = llm.generate([{"prompt_token_ids": prompt}],
                               SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert out[0].outputs[0].token_ids == hf_greedy(hf, [prompt], 6)[0]
    assert "run eagerly" in caplog.text and "differ" in caplog.text


def test_enforce_eager_captures_nothing(path, replayed_on_cpu):
    replayed_on_cpu()
    with LLM(path, dtype="float32", num_kv_blocks=64, max_num_seqs=2, enforce_eager=True) as llm:
        assert runner_of(llm).decode_graphs is None
