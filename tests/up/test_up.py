"""`pdserve up` as a user runs it: a real process that starts the whole P/D stack on 127.0.0.1.

One stack (1 prefill + 2 decode, p2p, every prompt disaggregated) serves the OpenAI API tests and
is finally stopped with SIGTERM; a second, small one (kvstore connector) loses its coordinator to
kill -9 over and over until `up` gives up. (Restarts that succeed: tests/faults/test_up_supervision.py.)
The expected outputs come from one offline engine (the `LLM` class) on the same checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time

import openai
import psutil
import pytest

from pdserve import up

from support.up_stack import UpProcess, gone

PROMPT = "The capital of France is"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = dict(max_tokens=16, temperature=0, extra_body={"ignore_eos": True})


def client_for(stack: UpProcess, endpoint: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{endpoint}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(model_dir):
    return model_dir("llama")


@pytest.fixture(scope="module")
def expected(model):
    """Greedy answers of one engine (the offline one, in this process), taken before the stack starts."""
    from pdserve.engine import LLM, SamplingParams

    llm = LLM(model, dtype="float32")
    try:
        params = SamplingParams(temperature=0.0, max_tokens=GREEDY["max_tokens"], ignore_eos=True)
        return {"completion": llm.generate(PROMPT, params)[0].outputs[0].text,
                "chat": llm.chat(QUESTION, params)[0].outputs[0].text}
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def stack(model, expected, tmp_path_factory):
    proc = UpProcess(["--model", model, "--prefill", "1", "--decode", "2", "--pd-min-prompt-tokens", "0",
                      "--dtype", "float32"], tmp_path_factory.mktemp("up") / "run")
    try:
        proc.endpoint = proc.wait_for(r"pdserve is up at (http://\S+)/v1", timeout=300).group(1)
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def client(stack):
    return client_for(stack, stack.endpoint)


def test_progress_then_endpoint_and_ready_to_paste_lines(stack):
    for name in ("coordinator", "prefill-0", "decode-0", "decode-1", "router"):
        stack.wait_for(rf"ready\s+{name}\s+\d+\.\ds", timeout=5)
    assert stack.endpoint == f"http://127.0.0.1:{stack.port}"
    curl = stack.wait_for(r"curl (\S+/v1/chat/completions) .* -d '(.*)'$", timeout=5)
    assert curl.group(1) == f"{stack.endpoint}/v1/chat/completions"
    assert json.loads(curl.group(2))["messages"][0]["content"] == "What is the capital of France?"
    stack.wait_for(rf"import openai; c = openai.OpenAI\(base_url='{re.escape(stack.endpoint)}/v1'", timeout=5)
    stack.wait_for(rf"logs: {re.escape(str(stack.run_dir))}", timeout=5)


def test_completions_through_the_stack_equal_one_engine(client, model, expected):
    full = client.completions.create(model=model, prompt=PROMPT, **GREEDY)
    assert full.choices[0].text == expected["completion"]
    assert full.usage.completion_tokens == 16
    streamed = "".join(chunk.choices[0].text for chunk in
                       client.completions.create(model=model, prompt=PROMPT, stream=True, **GREEDY) if chunk.choices)
    assert streamed == expected["completion"]


def test_chat_through_the_stack_equals_one_engine(client, model, expected):
    full = client.chat.completions.create(model=model, messages=QUESTION, **GREEDY)
    assert full.choices[0].message.content == expected["chat"]
    chunks = client.chat.completions.create(model=model, messages=QUESTION, stream=True, **GREEDY)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected["chat"]


def test_disaggregated_requests_report_their_prompt_as_cached(client, model):
    # A prompt no engine has seen: any cached tokens on the decode side came from the prefill engine.
    prompt = " ".join(f"word{i} number{i * 7 % 13}" for i in range(40))
    response = client.completions.create(model=model, prompt=prompt, **GREEDY)
    details = response.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens > 0, response.usage


def test_status_lines_show_every_engine(stack):
    # Not a TTY here: the status is printed as one line, on change.
    line = stack.wait_for(r"\[status [\d:]+\] .*prefill-0 prefill waiting=\d+ running=\d+ kv=[\d.]+%.*"
                          r"decode-0 decode .*decode-1 decode", timeout=60)
    assert "stale" not in line.group(0)


def test_sigterm_stops_every_child_and_exits_0(stack):
    # Last in this module: it ends the shared stack.
    children = stack.descendants()
    assert len(children) >= 5, [p.cmdline() for p in children]  # coordinator, 3 engines, router (+ engine cores)
    stack.proc.send_signal(signal.SIGTERM)
    assert stack.proc.wait(timeout=120) == 0, stack.output
    assert gone(children, timeout=10) == []
    stack.wait_for(r"pdserve up: stopped", timeout=5)


@pytest.mark.faults  # a stack of its own killed six times: in the fault suite (`make test-faults`)
def test_a_child_that_keeps_dying_makes_up_give_up_with_its_log_and_stop_everything(model, tmp_path):
    stack = UpProcess(["--model", model, "--prefill", "1", "--decode", "1", "--kv-connector", "kvstore",
                       "--pd-min-prompt-tokens", "0", "--dtype", "float32", "--restart-backoff", "0.2"], tmp_path / "run")
    try:
        endpoint = stack.wait_for(r"pdserve is up at (http://\S+)/v1", timeout=300).group(1)
        answer = client_for(stack, endpoint).completions.create(model=model, prompt=PROMPT, **GREEDY)
        assert answer.usage.completion_tokens == 16
        http_port = stack.wait_for(r"ready\s+coordinator\s+\S+s\s+http://[\d.]+:(\d+)", timeout=1).group(1)
        children = stack.descendants()
        killed: list[int] = []
        deadline = time.monotonic() + 120
        # Each run of the coordinator is killed as soon as it appears: 1 + 5 restarts, then up gives up.
        while stack.proc.poll() is None and time.monotonic() < deadline:
            for child in stack.descendants():
                try:
                    argv = child.cmdline()
                    if child.pid not in killed and "--http-port" in argv and argv[argv.index("--http-port") + 1] == http_port:
                        child.kill()
                        killed.append(child.pid)
                except (psutil.NoSuchProcess, ValueError, IndexError):
                    pass
            time.sleep(0.05)
        assert stack.proc.wait(timeout=60) == 1, stack.output
        assert len(killed) == 6, killed
        assert len(re.findall(r"event=child_restarted child=coordinator pid=\d+", stack.output)) == 5, stack.output
        stack.wait_for(r"coordinator was killed by SIGKILL, after 5 restarts within 300s: giving up", timeout=5)
        stack.wait_for(rf"coordinator \(pid {killed[-1]}\) was killed by SIGKILL", timeout=5)
        stack.wait_for(r"Last lines of .*coordinator\.log", timeout=5)
        stack.wait_for(r"pdserve up: stopped", timeout=5)
        assert gone(children, timeout=10) == []
    finally:
        stack.stop()


# In the fault suite (make test-faults), to keep make test within its time budget.
@pytest.mark.faults
def test_one_pool_without_prefill_and_no_orphans_when_up_is_killed(model, expected, tmp_path):
    stack = UpProcess(["--model", model, "--prefill", "0", "--decode", "1", "--dtype", "float32"], tmp_path / "run")
    try:
        endpoint = stack.wait_for(r"pdserve is up at (http://\S+)/v1", timeout=300).group(1)
        assert re.findall(r"ready\s+(\S+)", stack.output) == ["coordinator", "decode-0", "router"]
        answer = client_for(stack, endpoint).completions.create(model=model, prompt=PROMPT, **GREEDY)
        assert answer.choices[0].text == expected["completion"]
        children = stack.descendants()
        stack.proc.kill()  # no cleanup code runs: the children learn of it from the kernel
        stack.proc.wait(timeout=10)
        assert gone(children, timeout=60) == []
    finally:
        stack.stop()


# --- without starting anything -------------------------------------------------------------------------

def plan_for(*argv: str, model: str = "/models/m") -> up.Plan:
    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    return up.build_plan(parser.parse_args(list(argv)), up.ModelSource(model, model, model))


def flag(argv: tuple[str, ...], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_plan_wires_engines_router_and_coordinator_together():
    from pdserve.engine.server import cli as serve_cli
    from pdserve.kvstore.config import parse_kv_transfer_config

    plan = plan_for("--prefill", "2", "--decode", "3", "--kv-connector", "kvstore", "--pd-min-prompt-tokens", "0")
    by_name = {c.name: c for c in plan.components}
    assert list(by_name) == ["coordinator", "kvstore", "prefill-0", "prefill-1", "decode-0", "decode-1", "decode-2",
                             "router"]
    stats_port = flag(by_name["coordinator"].argv, "--stats-port")
    store = f"tcp://127.0.0.1:{flag(by_name['kvstore'].argv, '--port')}"
    serve_parser = argparse.ArgumentParser()
    serve_cli.add_arguments(serve_parser)
    ports = set()
    for name, component in by_name.items():
        if "-" not in name:
            continue
        args = serve_parser.parse_args(list(component.argv[1:]))
        role = name.split("-")[0]
        assert (args.engine_role, args.coordinator_address) == (role, f"127.0.0.1:{stats_port}")
        kv = parse_kv_transfer_config(args.kv_transfer_config)
        assert (kv.connector, kv.role, kv.extra["kvstore_url"]) == (
            "kvstore", "kv_producer" if role == "prefill" else "kv_consumer", store)
        assert component.health_url == f"http://127.0.0.1:{args.port}/health"
        ports.add(args.port)
    assert len(ports) == 5
    router = by_name["router"].argv
    from pdserve.router import cli as router_cli

    router_parser = argparse.ArgumentParser()
    router_cli.add_arguments(router_parser)
    router_args = router_parser.parse_args(list(router[1:]))
    assert router_args.prefill == [by_name[f"prefill-{i}"].health_url.removesuffix("/health") for i in range(2)]
    assert router_args.decode == [by_name[f"decode-{i}"].health_url.removesuffix("/health") for i in range(3)]
    assert router_args.coordinator_http_port == int(flag(by_name["coordinator"].argv, "--http-port"))
    assert router_args.pd_min_prompt_tokens == 0
    prefill_urls = router[router.index("--prefill") + 1:router.index("--decode")]
    assert prefill_urls == tuple(by_name[f"prefill-{i}"].health_url.removesuffix("/health") for i in range(2))
    assert flag(router, "--coordinator-address") == f"127.0.0.1:{flag(by_name['coordinator'].argv, '--publish-port')}"
    assert flag(router, "--tokenizer") == "/models/m"
    assert set(plan.engine_names.values()) == {n for n in by_name if "-" in n}


def test_plan_p2p_gives_each_prefill_engine_its_own_side_channel():
    plan = plan_for("--prefill", "2", "--decode", "1")
    configs = {c.name: json.loads(flag(c.argv, "--kv-transfer-config")) for c in plan.components if "-" in c.name}
    channels = [configs[f"prefill-{i}"]["kv_connector_extra_config"]["side_channel_port"] for i in range(2)]
    assert len(set(channels)) == 2 and all(port > 0 for port in channels)
    assert configs["decode-0"] == {"kv_connector": "p2p", "kv_role": "kv_consumer", "kv_connector_extra_config": {}}


def test_plan_without_prefill_is_one_pool_without_connectors():
    plan = plan_for("--prefill", "0", "--decode", "2")
    names = [c.name for c in plan.components]
    assert names == ["coordinator", "decode-0", "decode-1", "router"]
    for component in plan.components[1:3]:
        assert "--kv-transfer-config" not in component.argv and flag(component.argv, "--engine-role") == "both"
    assert "--prefill" not in plan.components[-1].argv


@pytest.mark.parametrize("argv, message", [
    (["--decode", "0"], "--decode must be at least 1"),
    (["--prefill", "-1"], "--prefill must be 0 or more"),
])
def test_bad_arguments_are_refused_before_anything_starts(argv, message, tmp_path):
    result = subprocess.run([sys.executable, "-m", "pdserve", "up", "--run-dir", str(tmp_path), *argv],
                            capture_output=True, text=True, env=dict(os.environ, PYTHONSAFEPATH="1"), timeout=60)
    assert result.returncode == 2 and message in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_busy_port_is_refused_with_a_clear_error(tmp_path):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "pdserve", "up", "--port", str(port), "--run-dir",
                                 str(tmp_path)], capture_output=True, text=True,
                                env=dict(os.environ, PYTHONSAFEPATH="1"), timeout=60)
    assert result.returncode == 2 and f"port {port} on 127.0.0.1 is already in use" in result.stderr


def test_status_without_a_tty_prints_changes_at_most_every_10_seconds():
    class Out:
        def __init__(self):
            self.text = []

        def isatty(self):
            return False

        def write(self, s):
            self.text.append(s)

        def flush(self):
            pass

    out = Out()
    view = up.StatusView("http://unused/stats", {"127.0.0.1:1": "decode-0"}, out)
    stats = {"engines": [{"id": "e", "role": "decode", "address": "127.0.0.1:1", "waiting": 0, "running": 0,
                          "kv_usage": 0.0, "stale": False}]}
    view._fetch = lambda: up.status_rows(stats, view.names)
    view.tick(100.0)
    assert len(out.text) == 1 and "decode-0 decode waiting=0 running=0 kv=0.0%" in out.text[0]
    view.tick(105.0)  # unchanged
    stats["engines"][0].update(running=3, kv_usage=0.25)
    view.tick(107.0)  # changed, but within 10 s of the last line
    assert len(out.text) == 1
    view.tick(110.5)
    assert len(out.text) == 2 and "running=3 kv=25.0%" in out.text[1]
    view.tick(125.0)  # unchanged again
    assert len(out.text) == 2
    view.close()


def test_status_on_a_tty_is_redrawn_in_place():
    import io

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    out = Terminal()
    view = up.StatusView("http://unused/stats", {"127.0.0.1:1": "prefill-0", "127.0.0.1:2": "decode-0"}, out)
    stats = {"engines": [{"id": "d", "role": "decode", "address": "127.0.0.1:2", "waiting": 2, "running": 5,
                          "kv_usage": 0.5, "stale": True},
                         {"id": "p", "role": "prefill", "address": "127.0.0.1:1", "waiting": 0, "running": 1,
                          "kv_usage": 0.125, "stale": False}]}
    view._fetch = lambda: up.status_rows(stats, view.names)
    view.tick(0.0)
    first = out.getvalue()
    lines = first.splitlines()
    assert len(lines) == 4 and lines[0].startswith("engine load at ")
    assert lines[2].split() == ["prefill-0", "prefill", "0", "1", "12.5%"]  # start order, not the report's
    assert lines[3].split() == ["decode-0", "decode", "2", "5", "50.0%", "stale"]
    view.tick(1.0)  # within the 2 s refresh: nothing
    assert out.getvalue() == first
    view.tick(2.5)
    assert out.getvalue()[len(first):].startswith("\x1b[4F\x1b[J")  # up over the 4 lines drawn, clear, redraw
    view.close()


def test_engines_share_every_core_with_idle_threads_asleep_but_a_lone_decode_engines_unless_set(monkeypatch):
    from pdserve.up import engine_thread_env

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)

    passive = ("OMP_WAIT_POLICY", "PASSIVE")
    # shared (the default): one thread per core for every engine, per TP rank; waiting threads sleep.
    assert engine_thread_env(2, 1, cores=2, environ={}) == (("OMP_NUM_THREADS", "2"), passive)
    assert engine_thread_env(3, 2, cores=16, environ={}) == (("OMP_NUM_THREADS", "8"), passive)
    assert engine_thread_env(1, 1, cores=4, environ={}) == (("OMP_NUM_THREADS", "4"),)  # nobody to share with
    # split: an equal share of the cores each, spinning as OpenMP likes.
    assert engine_thread_env(2, 1, cores=2, environ={}, mode="split") == (("OMP_NUM_THREADS", "1"),)
    assert engine_thread_env(2, 2, cores=16, environ={}, mode="split") == (("OMP_NUM_THREADS", "4"),)
    assert engine_thread_env(5, 1, cores=2, environ={}, mode="split") == (("OMP_NUM_THREADS", "1"),)
    # The user's own settings win, each on its own.
    assert engine_thread_env(2, 1, cores=16, environ={"OMP_NUM_THREADS": "3"}) == (passive,)
    assert engine_thread_env(2, 1, cores=2, environ={"GOMP_SPINCOUNT": "1000"}) == (("OMP_NUM_THREADS", "2"),)
    assert engine_thread_env(2, 1, cores=2, environ={"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "ACTIVE"}) == ()

    cores = len(os.sched_getaffinity(0))
    for argv, env in ((("--prefill", "1", "--decode", "2"), (("OMP_NUM_THREADS", str(cores)), passive)),
                      (("--prefill", "1", "--decode", "2", "--engine-threads", "split"),
                       (("OMP_NUM_THREADS", str(max(1, cores // 3))),))):
        plan = plan_for(*argv)
        engines = [c for c in plan.components if "-" in c.name]
        others = [c for c in plan.components if "-" not in c.name]
        assert len(engines) == 3 and all(c.env == env for c in engines)
        assert all(c.env == () for c in others)  # the router and coordinator keep their defaults

    # A lone decode engine beside prefill engines keeps spinning; the prefill engines sleep.
    plan = plan_for("--prefill", "1", "--decode", "1")
    env = {c.name: c.env for c in plan.components if "-" in c.name}
    assert env == {"prefill-0": (("OMP_NUM_THREADS", str(cores)), passive),
                   "decode-0": (("OMP_NUM_THREADS", str(cores)),)}
    assert engine_thread_env(2, 1, cores=2, environ={"OMP_WAIT_POLICY": "PASSIVE"}, spin=True) == (
        ("OMP_NUM_THREADS", "2"),)  # the user's PASSIVE is in their environment, which engines inherit


@pytest.mark.parametrize("argv, busy_only", [
    ((), True),                                            # the default on one machine
    (("--pd-min-prompt-tokens", "0"), False),              # 0 has always meant every prompt disaggregated
    (("--pd-when", "always"), False),
    (("--pd-min-prompt-tokens", "0", "--pd-when", "busy"), True),
    (("--prefill", "0"), False),                           # one pool: nothing to skip
])
def test_the_router_skips_the_prefill_hop_for_an_idle_decode_engine_unless_told_always(argv, busy_only):
    router = next(c for c in plan_for(*argv).components if c.name == "router")
    assert ("--pd-only-when-busy" in router.argv) is busy_only


def test_status_notes_restarts_on_the_line_and_below_the_table():
    import io

    class Log(io.StringIO):
        def isatty(self):
            return False

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    note = {"text": ""}
    stats = {"engines": [{"id": "d", "role": "decode", "address": "127.0.0.1:2", "waiting": 0, "running": 1,
                          "kv_usage": 0.5, "stale": False}]}
    log_out, tty_out = Log(), Terminal()
    views = [up.StatusView("http://unused/stats", {"127.0.0.1:2": "decode-0"}, out, supervision=lambda: note["text"])
             for out in (log_out, tty_out)]
    for view in views:
        view._fetch = lambda view=view: up.status_rows(stats, view.names)
        view.tick(0.0)
    assert "||" not in log_out.getvalue() and len(tty_out.getvalue().splitlines()) == 3
    note["text"] = up.supervision_note({"coordinator": 1, "decode-0": 2}, ["decode-0"])
    assert note["text"] == "restarts: coordinator=1 decode-0=2; restarting: decode-0"
    for view in views:
        view.tick(10.5)  # a change in the note alone is news
    assert log_out.getvalue().splitlines()[-1].endswith(" || restarts: coordinator=1 decode-0=2; restarting: decode-0")
    assert tty_out.getvalue().splitlines()[-1] == "  restarts: coordinator=1 decode-0=2; restarting: decode-0"
    for view in views:
        view.close()


def test_supervision_events_are_one_key_value_line_each(tmp_path):
    from pdserve.stack import Child, Component, Event

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    child = Child(Component("decode-0", ("serve",), "http://127.0.0.1:1/health"), proc, tmp_path / "x.log", 0.0)
    line = up.format_event(Event("failed", child, {"pid": 42, "reason": "was killed by SIGKILL", "restart_in_s": 1.0,
                                                   "restarts_in_window": "1/5"}))
    assert line == ('pdserve up: event=child_failed child=decode-0 pid=42 reason="was killed by SIGKILL" '
                    'restart_in_s=1.0 restarts_in_window=1/5')


def test_restart_backoff_doubles_up_to_its_cap():
    from pdserve.stack import RestartPolicy

    policy = RestartPolicy(backoff_s=1.0, backoff_max_s=30.0)
    assert [policy.backoff(n) for n in range(1, 8)] == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]


def test_plan_drains_the_router_first_and_stops_coordinator_and_store_last():
    plan = plan_for("--prefill", "1", "--decode", "1", "--kv-connector", "kvstore")
    ranks = {c.name: c.stop_rank for c in plan.components}
    assert ranks["router"] < ranks["prefill-0"] == ranks["decode-0"] < ranks["coordinator"] == ranks["kvstore"]
