"""The pieces between frontend and EngineCore: wire encoding, output merging, the background core."""

from __future__ import annotations

import asyncio
import os
import time

import numpy as np
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.frontend.async_llm import RequestOutputCollector
from pdserve.engine.outputs import CompletionOutput, RequestOutput
from pdserve.engine.protocol import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, LogprobsLists
from pdserve.engine.sampling_params import RequestOutputKind
from pdserve.engine.serial import INLINE_LIMIT, MsgpackDecoder, MsgpackEncoder


def test_wire_structs_round_trip():
    enc = MsgpackEncoder()
    request = EngineCoreRequest("r1", [1, 2, 3], SamplingParams(temperature=0.5, stop=["x"], seed=3), 0, 12.5,
                                kv_transfer_params={"do_remote_decode": True})
    assert MsgpackDecoder(EngineCoreRequest).decode(enc.encode(request)) == request
    outputs = EngineCoreOutputs(outputs=[EngineCoreOutput("r1", [7], LogprobsLists([[7, 8]], [[-0.1, -2.0]], [1]))])
    assert MsgpackDecoder(EngineCoreOutputs).decode(enc.encode(outputs)) == outputs


def test_large_arrays_travel_as_extra_frames_and_small_ones_inline():
    enc, dec = MsgpackEncoder(), MsgpackDecoder()
    small = torch.arange(INLINE_LIMIT // 8, dtype=torch.int64)  # exactly the limit: inline
    big = torch.randn(64, 33).to(torch.bfloat16)
    arr = np.arange(1000, dtype=np.float32)
    frames = enc.encode({"small": small, "big": big, "arr": arr})
    assert len(frames) == 3  # the body, then one frame per large array
    assert {len(bytes(f)) for f in frames[1:]} == {big.numel() * 2, arr.nbytes}
    assert len(bytes(frames[0])) < 600  # the large payloads are not in the body
    back = dec.decode([bytes(f) for f in frames])
    assert torch.equal(back["small"], small) and torch.equal(back["big"], big)
    assert np.array_equal(back["arr"], arr)


def make_output(text: str, tokens: list[int], finished: bool = False) -> RequestOutput:
    completion = CompletionOutput(0, text, tokens, finish_reason="length" if finished else None)
    return RequestOutput("r", None, [1], [completion], finished)


async def test_a_slow_consumer_gets_merged_deltas_not_a_growing_queue():
    collector = RequestOutputCollector(RequestOutputKind.DELTA)
    for i in range(100):
        collector.put(make_output(f"t{i} ", [i], finished=i == 99))
    merged = await collector.get()
    assert merged.outputs[0].text == "".join(f"t{i} " for i in range(100))
    assert merged.outputs[0].token_ids == list(range(100))
    assert merged.finished and collector.pending is None


async def test_cumulative_outputs_replace_each_other_and_errors_surface():
    collector = RequestOutputCollector(RequestOutputKind.CUMULATIVE)
    collector.put(make_output("a", [1]))
    collector.put(make_output("ab", [1, 2]))
    assert (await collector.get()).outputs[0].text == "ab"
    waiter = asyncio.ensure_future(collector.get())
    await asyncio.sleep(0)
    collector.put(RuntimeError("engine died"))
    try:
        await waiter
        raise AssertionError("the error did not surface")
    except RuntimeError as exc:
        assert "engine died" in str(exc)


def test_offline_llm_with_the_core_in_a_background_process(model_dir):
    path = model_dir("llama")
    prompts = ["Hello world", "The license grants permission", "naïve café"]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(path, dtype="float32").generate(prompts, params)]
    llm = LLM(path, dtype="float32", multiprocess=True)
    try:
        outputs = llm.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        stats = llm.stats()  # a UTILITY call over the wire
        assert stats["num_generation_tokens"] == 48 and stats["kv_blocks_free"] == stats["kv_blocks_total"]
        assert llm.reset_prefix_cache() is True
        proc = llm.engine.client.proc
        sockets = [a[len("ipc://"):] for a in (llm.engine.client.input_address, llm.engine.client.output_address)]
        assert all(os.path.exists(s) for s in sockets)
    finally:
        llm.shutdown()
    assert not proc.is_alive() and proc.exitcode == 0
    # The socket files go with the engine (the handshake's as soon as it is done): none pile up in /tmp.
    assert not any(os.path.exists(s) for s in sockets)


def test_sigterm_to_the_engine_core_finishes_in_flight_requests_and_refuses_new_ones(model_dir):
    import os
    import signal

    from pdserve.engine.config import EngineArgs
    from pdserve.engine.frontend.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(model=model_dir("llama"), dtype="float32"), multiprocess=True)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    try:
        for i in range(3):
            engine.add_request(f"r{i}", f"request number {i}", params)
        while not engine.step():  # wait until generation is under way
            pass
        os.kill(engine.client.proc.pid, signal.SIGTERM)
        engine.add_request("late", "too late", params)
        finished = {}
        while len(finished) < 4:
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out.outputs[0]
        assert {i: (o.finish_reason, len(o.token_ids)) for i, o in finished.items() if i != "late"} == \
            {f"r{i}": ("length", 40) for i in range(3)}
        assert finished["late"].finish_reason == "abort" and finished["late"].token_ids == []
        # The client's death watcher reaps the process from another thread; a concurrent join can
        # miss the status (waitpid gets ECHILD), so read exitcode until it is set.
        deadline = time.monotonic() + 30
        while engine.client.proc.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.client.proc.exitcode == 0
    finally:
        engine.shutdown()
