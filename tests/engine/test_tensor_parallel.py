"""Tensor parallelism over worker processes (MultiprocExecutor, gloo on CPU).

TP=2 must generate exactly what TP=1 generates; a worker that dies must surface as an error
within seconds, never a hang; and nothing (processes, shared memory, sockets) may outlive the
engine, not even when the engine's own process is killed.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import EngineArgs
from pdserve.engine.executor.multiproc import MultiprocExecutor, WorkerDiedError, WorkerStartupError

from support.checkpoints import truncated_checkpoint
from support.hf_reference import hf_greedy, load_hf_model

PROMPT_LENGTHS = [1, 7, 15, 16, 17, 40, 64, 130]
MAX_NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
ENGINE_ARGS = dict(dtype="float32", num_kv_blocks=256)


def random_prompts(seed: int, lengths: list[int] = PROMPT_LENGTHS) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 4096) for _ in range(n)] for n in lengths]


def generate(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] = GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def executor_of(llm: LLM) -> MultiprocExecutor:
    executor = llm.engine.client.engine_core.executor
    assert isinstance(executor, MultiprocExecutor)
    return executor


def footprint(executor: MultiprocExecutor) -> tuple[list[int], list[str]]:
    """The worker pids and the paths (shared memory, sockets) the executor's queues use."""
    state = executor._state
    handles = [state.broadcast.handle()] + [w.response_handle for w in state.workers]
    paths = [f"/dev/shm/{h.shm_name}" for h in handles]
    paths += [h.zmq_address[len("ipc://"):] for h in handles if h.zmq_address.startswith("ipc://")]
    return [pid for pid in executor.worker_pids if pid is not None], paths


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_until(condition, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return condition()


def assert_nothing_left(pids: list[int], paths: list[str], timeout: float = 0.0) -> None:
    assert wait_until(lambda: all(gone(p) for p in pids), timeout), \
        f"worker processes still alive: {[p for p in pids if not gone(p)]}"
    assert wait_until(lambda: not any(os.path.exists(p) for p in paths), timeout), \
        f"left behind: {[p for p in paths if os.path.exists(p)]}"


@pytest.fixture(scope="module", autouse=True)
def workers_share_the_cores():
    """conftest pins OMP_NUM_THREADS for single-process tests; TP workers must instead split the
    cores between them (the executor does, when the variable is unset), or 2 ranks x 2 threads
    on 2 cores make every step several times slower."""
    saved = os.environ.pop("OMP_NUM_THREADS", None)
    yield
    if saved is not None:
        os.environ["OMP_NUM_THREADS"] = saved


@pytest.fixture(scope="module")
def llama_tp2(model_dir):
    llm = LLM(model_dir("llama"), tensor_parallel_size=2, **ENGINE_ARGS)
    yield llm
    pids, paths = footprint(executor_of(llm))
    llm.shutdown()
    assert_nothing_left(pids, paths)


def test_bfloat16_int8_shards_go_in_amx_tiles_and_track_transformers(model_dir):
    """In bfloat16 on a CPU with AMX each rank quantizes its own shard (into AMX tiles: a byte a
    weight where bf16 takes two, plus padding and scales), and TP=2 computes the model with rounded
    weights within bf16's error (0.1 in log-probability, as test_dtypes)."""
    from pdserve.engine.model import quant

    from support.hf_reference import assert_greedy_tracks, rounded_copy

    if not quant.amx_available():
        pytest.skip("no AMX here: int8 weights do not go in AMX tiles")
    path = model_dir("llama")
    prompts = random_prompts(6, [5, 17, 40])
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1, ignore_eos=True)
    llm = LLM(path, tensor_parallel_size=2, dtype="bfloat16", quantization="int8", num_kv_blocks=256)
    try:
        int8_bytes = executor_of(llm).collective_rpc("weight_bytes")
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    finally:
        llm.shutdown()
    full = LLM(path, tensor_parallel_size=2, dtype="bfloat16", quantization="none", num_kv_blocks=256)
    try:
        bf16_bytes = executor_of(full).collective_rpc("weight_bytes")
    finally:
        full.shutdown()
    cfg = json.loads((Path(path) / "config.json").read_text())
    hidden, inter, heads, kv_heads = (cfg[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                                       "num_key_value_heads"))
    head_dim = hidden // heads
    per_layer = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden + 3 * hidden * inter
    linear_per_rank = (cfg["num_hidden_layers"] * per_layer + cfg["vocab_size"] * hidden) // 2
    # A byte per weight saved, less the scales and the tiles' zero padding.
    assert all(0.8 * linear_per_rank < f - i <= linear_per_rank for i, f in zip(int8_bytes, bf16_bytes))
    assert all(len(o.outputs[0].token_ids) == 8 for o in outputs)
    assert_greedy_tracks(rounded_copy(load_hf_model(path), "int8"), prompts, outputs, 0.1)


# -- the same tokens as one rank --------------------------------------------------------------


def test_llama_tp2_equals_tp1_and_transformers(model_dir, llama_tp2):
    path = model_dir("llama")
    prompts = random_prompts(1)
    tp1 = generate(LLM(path, **ENGINE_ARGS), prompts)
    tp2 = generate(llama_tp2, prompts)
    assert tp2 == tp1
    assert tp2 == hf_greedy(load_hf_model(path), prompts, MAX_NEW_TOKENS)
    # The workers keep per-request state between steps; a second batch must not see the first's.
    assert generate(llama_tp2, prompts[::-1]) == tp1[::-1]


@pytest.mark.parametrize("name", ["qwen2", "mistral"])
def test_tp2_equals_tp1_and_shuts_down_clean(model_dir, name):
    # qwen2: qkv bias split with its rows. mistral: one KV head, replicated on both ranks.
    path = model_dir(name)
    prompts = random_prompts(2)
    tp1 = generate(LLM(path, **ENGINE_ARGS), prompts)
    llm = LLM(path, tensor_parallel_size=2, **ENGINE_ARGS)
    pids, paths = footprint(executor_of(llm))
    assert all(psutil.pid_exists(p) for p in pids) and all(os.path.exists(p) for p in paths)
    assert generate(llm, prompts) == tp1
    llm.shutdown()
    assert_nothing_left(pids, paths)
    llm.shutdown()  # idempotent


def test_seeded_sampling_tp2_reproduces_and_equals_tp1(model_dir, llama_tp2):
    prompts = random_prompts(3, [5, 30, 70])
    params = [SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=100 + i, max_tokens=24, ignore_eos=True)
              for i in range(len(prompts))]
    first = generate(llama_tp2, prompts, params)
    assert generate(llama_tp2, prompts, params) == first
    assert generate(LLM(model_dir("llama"), **ENGINE_ARGS), prompts, params) == first
    # Not greedy in disguise: the seeds make the samples differ from the argmax path.
    assert first != generate(llama_tp2, prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))


def test_kv_heads_that_do_not_split_are_a_clear_error(model_dir):
    # "tied" has 3 KV heads: they neither split over 2 ranks nor replicate evenly.
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ValueError, match="3 KV heads do not split over tensor_parallel_size=2"):
        LLM(model_dir("tied"), tensor_parallel_size=2, **ENGINE_ARGS)
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before  # refused before spawning


# -- collective RPC ---------------------------------------------------------------------------


def test_collective_rpc_replies_errors_and_futures(llama_tp2):
    executor = executor_of(llama_tp2)
    blocks = executor.collective_rpc("determine_num_kv_blocks")
    assert blocks == [256, 256]
    assert executor.collective_rpc("determine_num_kv_blocks", unique_reply_rank=1) == 256
    future = executor.collective_rpc("determine_num_kv_blocks", non_block=True)
    # A blocking call behind a pending non-blocking one gets its own reply, not the earlier one's.
    assert executor.collective_rpc("determine_num_kv_blocks", unique_reply_rank=0) == 256
    assert future.result(timeout=10) == [256, 256]

    with pytest.raises(AttributeError, match="no_such_method") as info:
        executor.collective_rpc("no_such_method")
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "tensor-parallel worker rank 0" in notes and "Traceback" in notes and "worker.py" in notes
    # An error that every rank reported leaves the executor in step and usable.
    executor.check_health()
    assert executor.collective_rpc("determine_num_kv_blocks") == [256, 256]
    assert generate(llama_tp2, random_prompts(4, [9])) == generate(llama_tp2, random_prompts(4, [9]))


def test_every_rank_maps_its_kv_cache_ahead_and_answers_the_same(llama_tp2):
    """The engine core's idle-time mapping (worker/kv_memory.py) reaches each rank's own shard of the
    cache; the fraction it reports is the rank furthest behind; outputs do not change."""
    prompts = random_prompts(3, [11])
    before = generate(llama_tp2, prompts)
    core = llama_tp2.engine.client.engine_core
    assert core.warm_kv_cache(60.0) is False and core.scheduler.kv_cache_mapped == 1.0
    assert executor_of(llama_tp2).collective_rpc("warm_kv_cache", (0.0,)) == [1.0, 1.0]
    assert generate(llama_tp2, prompts) == before


def test_worker_startup_failure_is_reported_with_its_traceback(model_dir, tmp_path):
    broken = truncated_checkpoint(model_dir("llama"), tmp_path / "broken")  # every rank fails to load it
    config = EngineArgs(model=str(broken), tensor_parallel_size=2, **ENGINE_ARGS).create_engine_config()
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    started = time.monotonic()
    with pytest.raises(WorkerStartupError, match=r"worker rank \d \(pid \d+\) failed to start") as info:
        MultiprocExecutor(config)
    assert time.monotonic() - started < 60
    assert "Traceback" in "\n".join(getattr(info.value.__cause__, "__notes__", []))
    assert wait_until(lambda: {p.pid for p in psutil.Process().children(recursive=True)} <= before, 10)


def test_a_rendezvous_port_taken_meanwhile_is_chosen_again(model_dir, monkeypatch, caplog):
    # free_tcp_port finds a port free, rank 0 binds it a moment later in another process; a program
    # that takes it in between (a fault-suite run's EADDRINUSE) must not stop the engine from starting.
    from pdserve.engine.executor import multiproc

    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    real = multiproc.free_tcp_port
    offered = iter([port])
    monkeypatch.setattr(multiproc, "free_tcp_port", lambda: next(offered, None) or real())
    config = EngineArgs(model=model_dir("llama"), tensor_parallel_size=2, **ENGINE_ARGS).create_engine_config()
    try:
        with caplog.at_level(logging.WARNING, logger="pdserve.engine.executor"):
            executor = MultiprocExecutor(config)
        try:
            assert executor.distributed_init_method != f"tcp://127.0.0.1:{port}"
            assert executor.collective_rpc("warm_kv_cache", (0.0,)) == [1.0, 1.0]  # both ranks answer
            assert any("rendezvous port" in r.getMessage() for r in caplog.records)
        finally:
            executor.shutdown()
        # A port the config names is the operator's: taken, it is a startup error, not another port.
        given = EngineArgs(model=model_dir("llama"), tensor_parallel_size=2, **ENGINE_ARGS).create_engine_config()
        given.parallel.distributed_init_method = f"tcp://127.0.0.1:{port}"
        with pytest.raises(WorkerStartupError, match="address already in use|EADDRINUSE"):
            MultiprocExecutor(given)
    finally:
        taken.close()


# -- worker death is engine death ---------------------------------------------------------------


def run_until_killed(llm: LLM, victim_rank: int, after_steps: int = 4) -> tuple[BaseException | None, float]:
    """Generate on a background thread, SIGKILL a worker mid-way; return (error, seconds to error)."""
    executor = executor_of(llm)
    steps = threading.Event()
    count = 0
    execute = executor.execute_model

    def counting_execute(so):
        nonlocal count
        count += 1
        if count == after_steps:
            steps.set()
        return execute(so)

    executor.execute_model = counting_execute  # type: ignore[method-assign]
    result: dict[str, BaseException | float] = {}

    def run() -> None:
        try:
            generate(llm, random_prompts(5, [20] * 8), SamplingParams(temperature=0.0, max_tokens=900,
                                                                       ignore_eos=True))
        except BaseException as exc:  # noqa: BLE001
            result["error"] = exc
        result["at"] = time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert steps.wait(60), "generation did not start"
    killed_at = time.monotonic()
    os.kill(executor.worker_pids[victim_rank], signal.SIGKILL)
    thread.join(10)
    if thread.is_alive():
        executor.shutdown()  # unblocks the thread; the test has failed already
        pytest.fail("generate() still running 10 s after a worker was killed")
    return result.get("error"), result["at"] - killed_at  # type: ignore[return-value,operator]


# Rank 0 in the fault suite (make test-faults): make test keeps rank 1, within its time budget.
@pytest.mark.parametrize("victim_rank", [1, pytest.param(0, marks=pytest.mark.faults)])
def test_killed_worker_fails_generate_within_seconds(model_dir, victim_rank):
    llm = LLM(model_dir("llama"), tensor_parallel_size=2, **ENGINE_ARGS)
    executor = executor_of(llm)
    pids, paths = footprint(executor)
    error, seconds = run_until_killed(llm, victim_rank)
    assert isinstance(error, WorkerDiedError), f"expected WorkerDiedError, got {error!r}"
    assert seconds < 5, f"generate() raised {seconds:.1f} s after the kill"
    assert f"worker rank {victim_rank} (pid {pids[victim_rank]}) died" in str(error)
    assert "SIGKILL" in str(error)
    with pytest.raises(WorkerDiedError):
        executor.check_health()
    with pytest.raises(WorkerDiedError):
        executor.collective_rpc("determine_num_kv_blocks")
    llm.shutdown()
    # The survivor is stopped too, and the dead worker's queue is removed on its behalf.
    assert_nothing_left(pids, paths)


def test_failure_on_a_rank_that_does_not_reply_is_engine_death(model_dir):
    # Rank 1's state would silently diverge from rank 0's; it must exit and the executor must say so.
    config = EngineArgs(model=model_dir("mistral"), tensor_parallel_size=2, **ENGINE_ARGS).create_engine_config()
    executor = MultiprocExecutor(config)
    died = threading.Event()
    executor.register_failure_callback(died.set)
    pids, paths = footprint(executor)
    try:
        with pytest.raises(AttributeError):
            executor.collective_rpc("no_such_method", unique_reply_rank=0)
        assert died.wait(5)
        with pytest.raises(WorkerDiedError, match=r"worker rank 1 .* exit code 3 .*no_such_method"):
            executor.check_health()
    finally:
        executor.shutdown()
    assert_nothing_left(pids, paths)


PARENT_SCRIPT = textwrap.dedent("""
    import json, sys, time
    from pdserve.engine.config import EngineArgs
    from pdserve.engine.executor.multiproc import MultiprocExecutor

    if __name__ == "__main__":
        config = EngineArgs(model=sys.argv[1], tensor_parallel_size=2, dtype="float32",
                            num_kv_blocks=64).create_engine_config()
        executor = MultiprocExecutor(config)
        state = executor._state
        handles = [state.broadcast.handle()] + [w.response_handle for w in state.workers]
        print(json.dumps({"pids": executor.worker_pids, "shm": [h.shm_name for h in handles],
                          "ipc": [h.zmq_address for h in handles]}), flush=True)
        executor.collective_rpc("determine_num_kv_blocks")
        time.sleep(600)
""")


def test_workers_exit_when_the_engine_process_is_killed(model_dir, tmp_path):
    script = tmp_path / "engine_proc.py"
    script.write_text(PARENT_SCRIPT)
    env = dict(os.environ, PYTHONSAFEPATH="1")
    proc = subprocess.Popen([sys.executable, str(script), model_dir("llama")], stdout=subprocess.PIPE, env=env,
                            text=True)
    try:
        line = proc.stdout.readline()
        assert line, "the engine process died before reporting its workers"
        info = json.loads(line)
        pids = info["pids"]
        assert all(not gone(p) for p in pids)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        assert wait_until(lambda: all(gone(p) for p in pids), 10), \
            f"workers outlived their parent: {[p for p in pids if not gone(p)]}"
        # The workers remove their own queues and the parent's socket file; the parent's shared
        # memory is removed by the resource tracker once the last process holding it is gone.
        leftovers = [f"/dev/shm/{n}" for n in info["shm"]]
        leftovers += [a[len("ipc://"):] for a in info["ipc"] if a.startswith("ipc://")]
        assert wait_until(lambda: not any(os.path.exists(p) for p in leftovers), 10), leftovers
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_q8_0_gguf_shards_stay_int8_and_tp2_equals_tp1(model_dir, tmp_path, monkeypatch):
    """Each rank requantizes its own shard of a Q8_0 file's weights (row-parallel shards split rows
    at block boundaries), exactly, so TP=2 serves the file's int8 weights and generates TP=1's tokens."""
    from pdserve.engine.model.gguf_write import write_gguf

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = str(write_gguf(model_dir("llama"), tmp_path / "llama-q8_0.gguf", "q8_0"))
    prompts = random_prompts(5)
    tp1 = generate(LLM(path, num_kv_blocks=256), prompts)
    llm = LLM(path, tensor_parallel_size=2, num_kv_blocks=256)
    try:
        kept = executor_of(llm).collective_rpc("weight_bytes")
        assert generate(llm, prompts) == tp1
    finally:
        llm.shutdown()
    # float32 named: with no quantization dtype auto may pick bfloat16 here (engine/dtype_probe.py),
    # and the bytes below compare int8 against float32 weights.
    full = LLM(path, tensor_parallel_size=2, num_kv_blocks=256, quantization="none", dtype="float32")
    try:
        floats = executor_of(full).collective_rpc("weight_bytes")
    finally:
        full.shutdown()
    # Every linear weight of a rank's shard (the lm_head included) takes 1 byte and a float32 scale
    # per 32 instead of 4 bytes; the embedding and norms stay float32.
    cfg = json.loads((Path(model_dir("llama")) / "config.json").read_text())
    hidden, inter, heads, kv_heads = (cfg[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                                       "num_key_value_heads"))
    head_dim = hidden // heads
    per_layer = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden + 3 * hidden * inter
    linear_per_rank = (cfg["num_hidden_layers"] * per_layer + cfg["vocab_size"] * hidden) // 2
    assert kept == [f - linear_per_rank * 4 + linear_per_rank * 9 // 8 for f in floats]
