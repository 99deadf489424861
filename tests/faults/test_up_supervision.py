"""`pdserve up` supervises its children: kill -9 of each kind of process under a real `up` stack.

One stack (1 prefill + 2 decode, p2p, every prompt disaggregated) loses, in turn, its coordinator,
a decode engine's server together with the prefill engine's core, and its router: each time the
rest keeps serving where it can, and the child is back (healthy, with a new pid, its restart in
the status line) within RESTART_BOUND_S. Last, Ctrl-C while long-prompt requests are in flight: every one of
them completes with its full output, then `up` exits 0 and leaves no process behind.
(Giving up on a child that keeps failing is in tests/up/test_up.py, on a stack of its own.)
"""

from __future__ import annotations

import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from support.up_stack import UpProcess, gone

# Generous: a restart means a new Python process importing torch and loading a model on 2 shared cores.
RESTART_BOUND_S = 120.0
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def model(model_dir):
    return model_dir("llama_long")  # room for prompts long enough to be in flight when Ctrl-C comes


@pytest.fixture(scope="module")
def stack(model, tmp_path_factory):
    proc = UpProcess(["--model", model, "--prefill", "1", "--decode", "2", "--pd-min-prompt-tokens", "0",
                      "--dtype", "float32", "--kv-cache-memory-bytes", str(64 << 20)],
                     tmp_path_factory.mktemp("up-supervision") / "run")
    try:
        proc.endpoint = proc.wait_for(r"pdserve is up at (http://\S+)/v1", timeout=300).group(1)
        yield proc
    finally:
        proc.stop()


def complete(stack: UpProcess, model: str, prompt: str = PROMPT, max_tokens: int = 8, timeout: float = 120.0) -> dict:
    response = httpx.post(f"{stack.endpoint}/v1/completions", timeout=timeout, trust_env=False,
                          json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                "ignore_eos": True})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["usage"]["completion_tokens"] == max_tokens, body
    return body


def kill_and_see_them_back(stack: UpProcess, victims: dict[str, int], model: str, serving_meanwhile: bool) -> None:
    """kill -9 each pid of `victims` (child name -> the child's pid or a process of its group); each
    named child must be restarted with a new pid and answer /health 200 again within RESTART_BOUND_S."""
    mark = stack.mark()
    old = {name: stack.child_pid(name) for name in victims}
    for pid in victims.values():
        os.kill(pid, signal.SIGKILL)
    if serving_meanwhile:
        # Right away, while the children are dead or still restarting: the rest of the stack answers.
        for i in range(3):
            complete(stack, model, prompt=f"{PROMPT} {' '.join(victims)} {i}")
    for name in victims:
        stack.wait_for(rf"event=child_failed child={re.escape(name)} pid={old[name]} .*restart_in_s=", timeout=30,
                       after=mark)
        stack.wait_for(rf"event=child_restarted child={re.escape(name)} pid=\d+ restart=1", timeout=30, after=mark)
    for name in victims:
        stack.wait_for(rf"event=child_healthy child={re.escape(name)} pid=\d+ restart=1 after_s=",
                       timeout=RESTART_BOUND_S, after=mark)
        new = stack.child_pid(name)
        assert new is not None and new != old[name], (name, old[name], new)
        assert httpx.get(stack.health_url(name), timeout=10, trust_env=False).status_code == 200
    complete(stack, model)


def test_killed_coordinator_is_restarted_while_completions_still_answer(stack, model):
    kill_and_see_them_back(stack, {"coordinator": stack.child_pid("coordinator")}, model, serving_meanwhile=True)
    # The restarted coordinator hears from every engine again.
    stats_url = stack.wait_for(r"engine load \(JSON\): (http://\S+/stats)", timeout=1).group(1)
    deadline = time.monotonic() + 60
    while True:
        engines = httpx.get(stats_url, timeout=10, trust_env=False).json().get("engines") or []
        if len([e for e in engines if not e.get("stale")]) == 3:
            break
        assert time.monotonic() < deadline, engines
        time.sleep(0.5)


def test_killed_engine_server_and_engine_core_restart_while_the_other_decode_serves(stack, model):
    # At once (one restart wait for both): decode-1's server, and the core under prefill-0's live
    # server, which then answers /health 503 engine_dead. decode-0 computes every prompt meanwhile.
    server = psutil.Process(stack.child_pid("prefill-0"))
    core = [p for p in server.children() if "spawn_main" in " ".join(p.cmdline())]
    assert core, [p.cmdline() for p in server.children()]
    mark = stack.mark()
    kill_and_see_them_back(stack, {"decode-1": stack.child_pid("decode-1"), "prefill-0": core[0].pid}, model,
                           serving_meanwhile=True)
    stack.wait_for(r"event=child_failed child=prefill-0 .*reason=\"lost its engine core", timeout=1, after=mark)
    stack.wait_for(r"event=child_failed child=decode-1 .*reason=\"was killed by SIGKILL\"", timeout=1, after=mark)


def test_killed_router_comes_back_on_the_same_port(stack, model):
    kill_and_see_them_back(stack, {"router": stack.child_pid("router")}, model, serving_meanwhile=False)


def test_status_line_counts_every_restart(stack):
    # Printed on change, at most every 10 s; names in start order; nothing is still restarting.
    stack.wait_for(r"\[status .* \|\| restarts: coordinator=1 prefill-0=1 decode-1=1 router=1$", timeout=60)


def test_ctrl_c_lets_in_flight_long_prompt_requests_finish_then_stops_everything(stack, model):
    # Last in this module: it ends the shared stack.
    # 1024 new tokens each: at 32, and once at 256 (after stop 53's faster kernels), one request
    # finished before the last of the four had reached the router.
    requests, max_tokens = 4, 1024
    received_before = router_requests(stack)
    prompts = [" ".join(f"topic{r} item{i} value{(i * 7 + r) % 97}" for i in range(160)) for r in range(requests)]

    def call(prompt: str) -> httpx.Response:
        return httpx.post(f"{stack.endpoint}/v1/completions", timeout=180, trust_env=False,
                          json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                "ignore_eos": True})

    children = stack.descendants()
    with ThreadPoolExecutor(requests) as pool:
        futures = [pool.submit(call, p) for p in prompts]
        deadline = time.monotonic() + 60
        while router_requests(stack) < received_before + requests:  # every one is inside the router
            assert time.monotonic() < deadline and not any(f.done() for f in futures), "requests did not arrive"
            time.sleep(0.05)
        assert not any(f.done() for f in futures), "finished before Ctrl-C: make the requests longer"
        stack.proc.send_signal(signal.SIGINT)
        responses = [f.result() for f in futures]
    for response in responses:
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["usage"]["completion_tokens"] == max_tokens and body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["prompt_tokens"] > 1000
    assert stack.proc.wait(timeout=120) == 0, stack.output
    assert gone(children, timeout=10) == []
    # In order: the router drained first, the coordinator last.
    out = stack.output
    steps = [out.index("pdserve up: draining router"), out.index("pdserve up: stopping prefill-0, decode-0, decode-1"),
             out.index("pdserve up: stopping coordinator"), out.index("pdserve up: stopped")]
    assert steps == sorted(steps), out


def router_requests(stack: UpProcess) -> float:
    text = httpx.get(f"{stack.endpoint}/metrics", timeout=10, trust_env=False).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pdserve_router_requests_total{"))
