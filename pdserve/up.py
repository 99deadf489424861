"""`pdserve up`: the whole disaggregated stack on one machine.

Starts, as child processes on 127.0.0.1: the coordinator, the KV store (with the kvstore
connector), N prefill and M decode engine servers and the router on --port; waits until each
answers /health; prints how to call it; then shows the engines' load from the coordinator until
Ctrl-C or SIGTERM, which stops every child and exits 0.

A child that dies is reported (which one, its exit code, the end of its log) and `up` then stops
the rest and exits 1: a stack with a missing piece would serve wrong or slow answers, and the
log of the first failure is the useful one. Restarting it is the user's call.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import httpx

from pdserve.engine.cores import usable_cores
from pdserve.engine.internal_auth import ENV_KEY, generate_key
from pdserve.stack import Child, ChildExited, Component, Stack, describe_death, free_ports, port_in_use

LOCAL = "127.0.0.1"
TTY_REFRESH_S = 2.0
LOG_REFRESH_S = 10.0  # not a TTY: print the status on change, at most this often


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2",
                   help="model directory, .gguf file, or built-in name ('smollm2': SmolLM2-135M-Instruct; "
                        "'demo': random weights)")
    p.add_argument("--prefill", type=int, default=1, help="prefill engines (0: one decode pool, no P/D)")
    p.add_argument("--decode", type=int, default=1, help="decode engines")
    p.add_argument("--kv-connector", choices=["p2p", "kvstore"], default="p2p",
                   help="how KV blocks go from prefill to decode engines")
    p.add_argument("--pd-min-prompt-tokens", type=int,
                   help="prompts shorter than this skip the prefill pool (router default: 256; 0: all disaggregated)")
    p.add_argument("--routing-policy", choices=["least-loaded", "prefix-aware", "round-robin"])
    p.add_argument("--host", default=LOCAL, help="the router's address (everything else stays on 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="the router's port: the endpoint clients call")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--kv-cache-memory-bytes", type=int,
                   help="CPU: KV cache bytes per engine (several engines share this machine's memory)")
    p.add_argument("--kvstore-capacity", default="1Gi", help="the KV store's capacity (bytes or 4Gi-style)")
    p.add_argument("--run-dir", type=Path, help="where the children's logs go (default: a new folder in /tmp)")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for every child's /health")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds the children get to finish after SIGTERM before SIGKILL")


# --- the plan: which processes, with which flags --------------------------------------------------

@dataclass(frozen=True)
class ModelSource:
    name: str               # what clients send as "model"
    path: str               # what the engines load
    tokenizer: str | None   # a local tokenizer directory for the router, when there is one


@dataclass
class Plan:
    components: list[Component]
    endpoint: str                      # the router's base URL (no /v1)
    stats_url: str                     # the coordinator's GET /stats
    engine_names: dict[str, str] = field(default_factory=dict)  # "host:port" -> "prefill-0"


def resolve_model(model: str) -> ModelSource:
    """Built-in names become their directory once, here, rather than racing in every engine."""
    if os.path.isdir(model):
        return ModelSource(model, model, model)
    from pdserve.engine.demo import resolve_model as resolve_builtin

    path = resolve_builtin(model)
    if path != model and os.path.isdir(path):
        return ModelSource(model, path, path)
    return ModelSource(model, model, None)


def engine_thread_env(engines: int, tensor_parallel_size: int, cores: int | None = None,
                      environ: dict[str, str] | None = None) -> tuple[tuple[str, str], ...]:
    """Each engine process (or TP worker) gets an equal share of this machine's cores as its torch
    threads. Left alone, every engine spins one thread per core, and a prefill running beside a
    decode makes both many times slower. A user's own OMP_NUM_THREADS wins."""
    if "OMP_NUM_THREADS" in (os.environ if environ is None else environ):
        return ()
    if cores is None:
        cores = usable_cores()
    return (("OMP_NUM_THREADS", str(max(1, cores // max(1, engines * tensor_parallel_size)))),)


def build_plan(args: argparse.Namespace, model: ModelSource) -> Plan:
    n_engines = args.prefill + args.decode
    kvstore = args.kv_connector == "kvstore" and args.prefill > 0
    p2p = args.kv_connector == "p2p" and args.prefill > 0
    ports = iter(free_ports(3 + 2 * kvstore + n_engines + (args.prefill if p2p else 0)))
    stats_port, publish_port, coordinator_http = next(ports), next(ports), next(ports)
    components = [Component("coordinator", (
        "coordinator", "--host", LOCAL, "--stats-port", str(stats_port), "--publish-port", str(publish_port),
        "--http-port", str(coordinator_http)), f"http://{LOCAL}:{coordinator_http}/health")]
    kvstore_url = None
    if kvstore:
        store_port, store_http = next(ports), next(ports)
        kvstore_url = f"tcp://{LOCAL}:{store_port}"
        components.append(Component("kvstore", (
            "kvstore", "--host", LOCAL, "--port", str(store_port), "--capacity", str(args.kvstore_capacity),
            "--http-port", str(store_http)), f"http://{LOCAL}:{store_http}/health"))

    urls: dict[str, list[str]] = {"prefill": [], "decode": []}
    names: dict[str, str] = {}
    engine_env = engine_thread_env(n_engines, args.tensor_parallel_size)
    for role, count in (("prefill", args.prefill), ("decode", args.decode)):
        for i in range(count):
            port = next(ports)
            argv = ["serve", "--model", model.path, "--served-model-name", model.name, "--host", LOCAL,
                    "--port", str(port), "--dtype", args.dtype, "--tensor-parallel-size", str(args.tensor_parallel_size),
                    "--coordinator-address", f"{LOCAL}:{stats_port}"]
            if args.max_model_len is not None:
                argv += ["--max-model-len", str(args.max_model_len)]
            if args.kv_cache_memory_bytes is not None:
                argv += ["--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes)]
            if args.prefill > 0:
                extra: dict[str, Any] = {}
                if p2p and role == "prefill":
                    # Rank r listens on port + r: with several ranks let the engine pick free ports.
                    side_channel = next(ports)
                    extra["side_channel_port"] = side_channel if args.tensor_parallel_size == 1 else 0
                if kvstore_url is not None:
                    extra["kvstore_url"] = kvstore_url
                config = {"kv_connector": args.kv_connector,
                          "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
                          "kv_connector_extra_config": extra}
                argv += ["--engine-role", role, "--kv-transfer-config", json.dumps(config, separators=(",", ":"))]
            else:
                argv += ["--engine-role", "both"]  # one pool: each engine prefills its own requests
            name = f"{role}-{i}"
            url = f"http://{LOCAL}:{port}"
            urls[role].append(url)
            names[f"{LOCAL}:{port}"] = name
            components.append(Component(name, tuple(argv), f"{url}/health", env=engine_env))

    router_host = LOCAL if args.host in ("0.0.0.0", "::", "") else args.host
    router = ["router", "--host", args.host, "--port", str(args.port), "--model", model.name,
              "--coordinator-address", f"{LOCAL}:{publish_port}", "--coordinator-http-port", str(coordinator_http)]
    if urls["prefill"]:
        router += ["--prefill", *urls["prefill"]]
    router += ["--decode", *urls["decode"]]
    if args.pd_min_prompt_tokens is not None:
        router += ["--pd-min-prompt-tokens", str(args.pd_min_prompt_tokens)]
    if args.routing_policy is not None:
        router += ["--routing-policy", args.routing_policy]
    if model.tokenizer is not None:
        router += ["--tokenizer", model.tokenizer]
    endpoint = f"http://{router_host}:{args.port}"
    # The router starts last: it health-checks its engines at start, and ejects any still loading.
    components.append(Component("router", tuple(router), f"{endpoint}/health", stage=1))
    return Plan(components, endpoint, f"http://{LOCAL}:{coordinator_http}/stats", names)


# --- what the user sees -----------------------------------------------------------------------------

def banner(url: str, model: str, run_dir: Path, stats_url: str) -> str:
    question = "What is the capital of France?"
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": 32})
    lines = [
        "",
        f"pdserve is up at {url}/v1 (model: {model})",
        "",
        "  curl:",
        f"    curl {url}/v1/chat/completions -H 'Content-Type: application/json' -d '{body}'",
        "  openai SDK:",
        f"    python -c \"import openai; c = openai.OpenAI(base_url='{url}/v1', api_key='none'); "
        f"print(c.chat.completions.create(model='{model}', messages=[{{'role': 'user', 'content': '{question}'}}], "
        f"max_tokens=32).choices[0].message.content)\"",
        f"  health and metrics: {url}/health  {url}/metrics",
        f"  engine load (JSON): {stats_url}",
        f"  logs: {run_dir}",
        "",
    ]
    if model == "demo":
        lines.append("The demo model has random weights: its text is gibberish, by design.")
    lines += ["Ctrl-C stops everything.", ""]
    return "\n".join(lines)


def status_rows(stats: dict[str, Any], names: dict[str, str]) -> list[tuple[str, ...]]:
    """(name, role, waiting, running, kv use, note) per engine, in our own start order."""
    order = {address: i for i, address in enumerate(names)}
    engines = sorted(stats.get("engines") or [], key=lambda e: (order.get(e.get("address"), len(order)),
                                                                 str(e.get("id"))))
    rows = []
    for e in engines:
        name = names.get(e.get("address"), str(e.get("id")))
        kv = e.get("kv_usage")
        rows.append((name, str(e.get("role", "?")), str(e.get("waiting", "?")), str(e.get("running", "?")),
                     f"{100 * kv:.1f}%" if isinstance(kv, (int, float)) else "?", "stale" if e.get("stale") else ""))
    return rows


def format_table(rows: list[tuple[str, ...]]) -> list[str]:
    header = ("engine", "role", "waiting", "running", "kv use", "")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    right = {2, 3, 4}

    def line(row: tuple[str, ...]) -> str:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        return "  " + "  ".join(cells).rstrip()

    return [line(header), *(line(r) for r in rows)]


def format_line(rows: list[tuple[str, ...]]) -> str:
    parts = [f"{name} {role} waiting={w} running={r} kv={kv}{' ' + note if note else ''}"
             for name, role, w, r, kv, note in rows]
    return f"[status {time.strftime('%H:%M:%S')}] " + (" | ".join(parts) if parts else "no engine has reported yet")


class StatusView:
    """The engines' load from the coordinator: redrawn in place on a TTY, else a line on change."""

    def __init__(self, stats_url: str, names: dict[str, str], out: TextIO) -> None:
        self.stats_url = stats_url
        self.names = names
        self.out = out
        self.tty = out.isatty()
        self.interval = TTY_REFRESH_S if self.tty else LOG_REFRESH_S
        self.client = httpx.Client(timeout=1.0, trust_env=False)
        self.next_poll = 0.0
        self.last_printed: Any = None
        self.last_print_at = -float("inf")
        self.drawn_lines = 0

    def close(self) -> None:
        self.client.close()

    def _fetch(self) -> list[tuple[str, ...]] | str:
        try:
            response = self.client.get(self.stats_url)
            response.raise_for_status()
            return status_rows(response.json(), self.names)
        except (httpx.HTTPError, ValueError) as exc:
            return f"coordinator not answering /stats ({type(exc).__name__})"

    def tick(self, now: float) -> None:
        if now < self.next_poll:
            return
        self.next_poll = now + (TTY_REFRESH_S if self.tty else 1.0)
        state = self._fetch()
        if self.tty:
            lines = [f"engine load at {time.strftime('%H:%M:%S')}:",
                     *([f"  {state}"] if isinstance(state, str) else format_table(state))]
            # Move up over the previous table and clear to the end of the screen, then redraw.
            prefix = f"\x1b[{self.drawn_lines}F\x1b[J" if self.drawn_lines else ""
            self.out.write(prefix + "\n".join(lines) + "\n")
            self.drawn_lines = len(lines)
        else:
            key = state if isinstance(state, str) else [row for row in state]
            if key == self.last_printed or now - self.last_print_at < LOG_REFRESH_S:
                return
            self.out.write((state if isinstance(state, str) else format_line(state)) + "\n")
            self.last_printed, self.last_print_at = key, now
        self.out.flush()

    def forget_drawing(self) -> None:
        """Something else was printed below the table: never move the cursor over it."""
        self.drawn_lines = 0


# --- signals ----------------------------------------------------------------------------------------

class Signals:
    """SIGINT/SIGTERM set a flag the loops poll; a second one while stopping means 'kill now'."""

    def __init__(self) -> None:
        self.count = 0
        self.first: int | None = None
        self._saved: dict[int, Any] = {}

    def __enter__(self) -> "Signals":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._saved[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: object) -> None:
        self.count += 1
        self.first = self.first or signum

    @property
    def stop_requested(self) -> bool:
        return self.count > 0


# --- run --------------------------------------------------------------------------------------------

def _say(text: str = "") -> None:
    print(text, flush=True)


def _error(text: str) -> None:
    print(f"pdserve up: {text}", file=sys.stderr, flush=True)


def _check_args(args: argparse.Namespace) -> str | None:
    if args.decode < 1:
        return "--decode must be at least 1 (the decode pool serves every request)"
    if args.prefill < 0:
        return "--prefill must be 0 or more"
    if args.pd_min_prompt_tokens is not None and args.pd_min_prompt_tokens < 0:
        return "--pd-min-prompt-tokens must be 0 or more"
    if not 0 < args.port < 65536:
        return f"--port {args.port} is not a TCP port"
    if port_in_use(args.host, args.port):
        return f"port {args.port} on {args.host} is already in use (choose another with --port)"
    return None


def run(args: argparse.Namespace) -> int:
    problem = _check_args(args)
    if problem is not None:
        _error(problem)
        return 2
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix=f"pdserve-up-{time.strftime('%Y%m%d-%H%M%S')}-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    if not os.path.isdir(args.model):
        _say(f"pdserve up: preparing model {args.model} ...")
    try:
        model = resolve_model(args.model)
    except (OSError, ValueError) as exc:
        _error(f"cannot load model {args.model!r}: {exc}")
        return 2
    except KeyboardInterrupt:
        return 130
    with Signals() as signals:
        plan = build_plan(args, model)
        # One internal key per run, for this run's processes only: engines hand kv_transfer_params
        # only to a router holding it, and side channels, store and coordinator admit only its holders.
        stack = Stack(run_dir, env={ENV_KEY: generate_key()})
        try:
            return _serve(stack, plan, model, run_dir, args, signals)
        finally:
            if any(not c.exited() for c in stack.children):
                _say(f"pdserve up: stopping {len(stack.children)} processes ...")
            stack.stop(grace=args.shutdown_timeout, force=lambda: signals.count > 1)
            _say("pdserve up: stopped")


def _serve(stack: Stack, plan: Plan, model: ModelSource, run_dir: Path, args: argparse.Namespace,
           signals: Signals) -> int:
    roles = f"{args.prefill} prefill + {args.decode} decode" if args.prefill else f"{args.decode} engine(s), no P/D"
    _say(f"pdserve up: starting {len(plan.components)} processes ({roles}, {args.kv_connector if args.prefill else 'no'}"
         f" KV connector); logs in {run_dir}")
    width = max(len(c.name) for c in plan.components)
    started = time.monotonic()

    def ready(child: Child) -> None:
        _say(f"  ready  {child.name:<{width}}  {time.monotonic() - started:5.1f}s  "
             f"{child.component.health_url.removesuffix('/health')}")

    try:
        for stage in sorted({c.stage for c in plan.components}):
            for component in plan.components:
                if component.stage == stage:
                    stack.start(component)
            left = args.ready_timeout - (time.monotonic() - started)
            if not stack.wait_ready(left, ready, should_stop=lambda: signals.stop_requested):
                return 0
    except ChildExited as exc:
        _error(f"{exc.child.name} stopped while starting.\n" + describe_death(exc.child))
        return 1
    except TimeoutError as exc:
        _error(f"{exc} (see the logs in {run_dir})")
        return 1
    _say(banner(plan.endpoint, model.name, run_dir, plan.stats_url))
    view = StatusView(plan.stats_url, plan.engine_names, sys.stdout)
    try:
        while not signals.stop_requested:
            dead = stack.first_exited()
            if dead is not None:
                view.forget_drawing()
                _error(f"{dead.name} stopped unexpectedly; stopping the stack.\n" + describe_death(dead))
                return 1
            view.tick(time.monotonic())
            time.sleep(0.2)
    finally:
        view.close()
    _say(f"\npdserve up: {signal.Signals(signals.first).name if signals.first else 'stop'} received")
    return 0
