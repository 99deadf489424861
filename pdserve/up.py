"""`pdserve up`: the whole disaggregated stack on one machine.

Starts, as child processes on 127.0.0.1: the coordinator, the KV store (with the kvstore
connector), N prefill and M decode engine servers and the router on --port; waits until each
answers /health; prints how to call it; then shows the engines' load from the coordinator until
Ctrl-C or SIGTERM.

Once up, it supervises (stack.Supervisor): a child that dies, an engine server whose core died,
or a child that stops answering for long is restarted with the same command and ports after a
backoff, while the rest keeps serving; each restart is one log line and shows in the status. A
child that keeps failing (--max-restarts within --restart-window) makes `up` stop the stack and
exit 1 with that child's log tail. A child that fails while the stack is first starting is not
retried: that is a configuration error, and its log says which.

Ctrl-C or SIGTERM drains in order: the router stops taking requests and finishes those in flight
(through both legs), then the engines stop, then the coordinator and the KV store; then exit 0.
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
from typing import Any, Callable, TextIO

import httpx

from pdserve.engine.cores import usable_cores
from pdserve.engine.internal_auth import ENV_KEY, generate_key
from pdserve.stack import (Child, ChildExited, Component, Event, GaveUp, RestartPolicy, Stack, Supervisor,
                           describe_death, free_ports, port_in_use)

LOCAL = "127.0.0.1"
TTY_REFRESH_S = 2.0
LOG_REFRESH_S = 10.0  # not a TTY: print the status on change, at most this often
LOOP_INTERVAL_S = 0.2

# The order of a drain: the router first (its in-flight requests need the engines), then the engines
# (what they hold in flight), then what the engines report to and store into.
STOP_ROUTER, STOP_ENGINES, STOP_SERVICES = 0, 1, 2


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
    p.add_argument("--pd-when", choices=["busy", "always"],
                   help="busy: a prompt skips the prefill engine while a decode engine has nothing in flight (the "
                        "engines share this machine's cores, so the hop only pays when a prefill would stall "
                        "running decodes); always: every prompt of --pd-min-prompt-tokens or more is "
                        "disaggregated (default: busy, but always with --pd-min-prompt-tokens 0)")
    p.add_argument("--engine-threads", choices=["shared", "split"], default="shared",
                   help="shared: every engine may use all of this machine's cores, and an engine's idle threads "
                        "sleep rather than spin (OMP_WAIT_POLICY=PASSIVE), except a lone decode engine's, so a "
                        "lone prefill or decode runs at full speed; split: each engine an equal share of the "
                        "cores, so engines never compete for one (a user's own OMP_NUM_THREADS wins over either)")
    p.add_argument("--routing-policy", choices=["least-loaded", "prefix-aware", "round-robin"])
    p.add_argument("--host", default=LOCAL, help="the router's address (everything else stays on 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="the router's port: the endpoint clients call")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", choices=["auto", "none", "int8", "q8_0"], default="auto",
                   help="passed to every engine: int8 and q8_0 store linear weights as int8, auto keeps a "
                        "GGUF's Q8_0 weights so (CPU; see `pdserve serve --help`)")
    p.add_argument("--int8-activations", action="store_true",
                   help="passed to every engine: decode rows rounded to int8 too (needs int8 weights)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="passed to every engine: on CUDA, no decode steps replayed from captured CUDA graphs "
                        "(see `pdserve serve --help`); nothing changes on CPU")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--kv-cache-memory-bytes", type=int,
                   help="CPU: KV cache bytes per engine (several engines share this machine's memory)")
    p.add_argument("--tool-call-parser",
                   help="passed to every engine (and the router, which renders chat prompts as they do): how tool "
                        "calls are written and read (see `pdserve serve --help`; default: the engine's own)")
    p.add_argument("--kvstore-capacity", default="1Gi", help="the KV store's capacity (bytes or 4Gi-style)")
    p.add_argument("--run-dir", type=Path, help="where the children's logs go (default: a new folder in /tmp)")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for every child's /health (at start, and for a restarted child)")
    p.add_argument("--drain-timeout", "--shutdown-timeout", dest="drain_timeout", type=float, default=30.0,
                   help="on Ctrl-C/SIGTERM: seconds in all for the router's in-flight requests to finish and the "
                        "children to exit, in order (router, engines, coordinator and store); then SIGKILL. "
                        "A second Ctrl-C kills at once")
    supervision = p.add_argument_group("supervision (once the stack is up)")
    supervision.add_argument("--restart-backoff", type=float, default=1.0,
                             help="seconds before restarting a failed child, doubled for each further restart "
                                  "within --restart-window (at most 30 s)")
    supervision.add_argument("--max-restarts", type=int, default=5,
                             help="a child failing again after this many restarts within --restart-window makes "
                                  "`up` stop the stack and exit 1")
    supervision.add_argument("--restart-window", type=float, default=300.0,
                             help="seconds over which --max-restarts counts")
    supervision.add_argument("--unresponsive-timeout", type=float, default=60.0,
                             help="seconds a child may leave /health unanswered (or an engine report its core "
                                  "unresponsive) before it is restarted; a dead engine core is restarted at once")


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
                      environ: dict[str, str] | None = None, mode: str = "shared",
                      spin: bool = False) -> tuple[tuple[str, str], ...]:
    """The thread settings of each engine process (or TP worker) on this machine.

    "split": an equal share of the cores each, so no two engines compete for a core, and a lone
    request's prefill and decode each run on that share alone (half the machine with 1 + 1).
    "shared": every engine one thread per core (per TP rank), and OpenMP's waiting threads sleep
    at once instead of spinning: by default they spin for a while after each op, and a spinning
    engine takes the cores another engine is computing on (a prefill beside a decode made both
    many times slower). `spin` keeps OpenMP's default for this engine: for the one decode engine
    beside sleeping prefill engines, whose step is a chain of short parallel matmuls that would
    each wait for sleeping threads to wake (one-stream ITL 1.2-1.5x serve's instead of 1.03-1.08x, for
    an eighth less throughput at 16 streams on 2 cores). A user's own OMP_NUM_THREADS,
    OMP_WAIT_POLICY or GOMP_SPINCOUNT wins.
    """
    env = os.environ if environ is None else environ
    if cores is None:
        cores = usable_cores()
    settings = []
    if "OMP_NUM_THREADS" not in env:
        share = engines * tensor_parallel_size if mode == "split" else tensor_parallel_size
        settings.append(("OMP_NUM_THREADS", str(max(1, cores // max(1, share)))))
    if mode == "shared" and engines > 1 and not spin and not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & env.keys():
        settings.append(("OMP_WAIT_POLICY", "PASSIVE"))
    return tuple(settings)


def pd_when(args: argparse.Namespace) -> str:
    """--pd-when, resolved: `--pd-min-prompt-tokens 0` has always meant every prompt disaggregated."""
    if args.pd_when is not None:
        return args.pd_when
    return "always" if args.pd_min_prompt_tokens == 0 else "busy"


def build_plan(args: argparse.Namespace, model: ModelSource) -> Plan:
    n_engines = args.prefill + args.decode
    kvstore = args.kv_connector == "kvstore" and args.prefill > 0
    p2p = args.kv_connector == "p2p" and args.prefill > 0
    ports = iter(free_ports(3 + 2 * kvstore + n_engines + (args.prefill if p2p else 0)))
    stats_port, publish_port, coordinator_http = next(ports), next(ports), next(ports)
    components = [Component("coordinator", (
        "coordinator", "--host", LOCAL, "--stats-port", str(stats_port), "--publish-port", str(publish_port),
        "--http-port", str(coordinator_http)), f"http://{LOCAL}:{coordinator_http}/health", stop_rank=STOP_SERVICES)]
    kvstore_url = None
    if kvstore:
        store_port, store_http = next(ports), next(ports)
        kvstore_url = f"tcp://{LOCAL}:{store_port}"
        components.append(Component("kvstore", (
            "kvstore", "--host", LOCAL, "--port", str(store_port), "--capacity", str(args.kvstore_capacity),
            "--http-port", str(store_http)), f"http://{LOCAL}:{store_http}/health", stop_rank=STOP_SERVICES))

    urls: dict[str, list[str]] = {"prefill": [], "decode": []}
    names: dict[str, str] = {}
    engine_env = {role: engine_thread_env(n_engines, args.tensor_parallel_size, mode=args.engine_threads,
                                          spin=role == "decode" and args.decode == 1 and args.prefill > 0)
                  for role in ("prefill", "decode")}
    for role, count in (("prefill", args.prefill), ("decode", args.decode)):
        for i in range(count):
            port = next(ports)
            argv = ["serve", "--model", model.path, "--served-model-name", model.name, "--host", LOCAL,
                    "--port", str(port), "--dtype", args.dtype, "--quantization", args.quantization,
                    "--tensor-parallel-size", str(args.tensor_parallel_size),
                    "--coordinator-address", f"{LOCAL}:{stats_port}"]
            if args.int8_activations:
                argv.append("--int8-activations")
            if args.enforce_eager:
                argv.append("--enforce-eager")
            if args.max_model_len is not None:
                argv += ["--max-model-len", str(args.max_model_len)]
            if args.kv_cache_memory_bytes is not None:
                argv += ["--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes)]
            if args.tool_call_parser is not None:
                # Prefill engines too: whatever the parser adds to a prompt, or refuses, must be the
                # same on both legs of a request.
                argv += ["--tool-call-parser", args.tool_call_parser]
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
            components.append(Component(name, tuple(argv), f"{url}/health", env=engine_env[role],
                                        stop_rank=STOP_ENGINES))

    router_host = LOCAL if args.host in ("0.0.0.0", "::", "") else args.host
    router = ["router", "--host", args.host, "--port", str(args.port), "--model", model.name,
              "--coordinator-address", f"{LOCAL}:{publish_port}", "--coordinator-http-port", str(coordinator_http)]
    if urls["prefill"]:
        router += ["--prefill", *urls["prefill"]]
    router += ["--decode", *urls["decode"]]
    if args.pd_min_prompt_tokens is not None:
        router += ["--pd-min-prompt-tokens", str(args.pd_min_prompt_tokens)]
    if urls["prefill"] and pd_when(args) == "busy":
        router += ["--pd-only-when-busy"]
    if args.routing_policy is not None:
        router += ["--routing-policy", args.routing_policy]
    if model.tokenizer is not None:
        router += ["--tokenizer", model.tokenizer]
    if args.tool_call_parser is not None:
        router += ["--tool-call-parser", args.tool_call_parser]
    endpoint = f"http://{router_host}:{args.port}"
    # The router starts last: it health-checks its engines at start, and ejects any still loading.
    components.append(Component("router", tuple(router), f"{endpoint}/health", stage=1, stop_rank=STOP_ROUTER))
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
    lines += ["Ctrl-C drains in-flight requests and stops everything (a second Ctrl-C kills at once).", ""]
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


def supervision_note(restarts: dict[str, int], restarting: list[str]) -> str:
    """'restarts: coordinator=1 decode-0=2; restarting: decode-0', or '' while nothing was restarted."""
    parts = []
    if restarts:
        parts.append("restarts: " + " ".join(f"{name}={count}" for name, count in restarts.items()))
    if restarting:
        parts.append("restarting: " + " ".join(restarting))
    return "; ".join(parts)


class StatusView:
    """The engines' load from the coordinator, and the supervisor's restarts: redrawn in place on a
    TTY, else a line on change."""

    def __init__(self, stats_url: str, names: dict[str, str], out: TextIO,
                 supervision: Callable[[], str] = lambda: "") -> None:
        self.stats_url = stats_url
        self.names = names
        self.out = out
        self.supervision = supervision
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
        note = self.supervision()
        if self.tty:
            lines = [f"engine load at {time.strftime('%H:%M:%S')}:",
                     *([f"  {state}"] if isinstance(state, str) else format_table(state)),
                     *([f"  {note}"] if note else [])]
            # Move up over the previous table and clear to the end of the screen, then redraw.
            prefix = f"\x1b[{self.drawn_lines}F\x1b[J" if self.drawn_lines else ""
            self.out.write(prefix + "\n".join(lines) + "\n")
            self.drawn_lines = len(lines)
        else:
            key = (state if isinstance(state, str) else [row for row in state], note)
            if key == self.last_printed or now - self.last_print_at < LOG_REFRESH_S:
                return
            line = f"[status {time.strftime('%H:%M:%S')}] {state}" if isinstance(state, str) else format_line(state)
            self.out.write(line + (f" || {note}" if note else "") + "\n")
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


def _field(value: Any) -> str:
    text = str(value)
    return json.dumps(text) if not text or any(c in text for c in ' "=\\') else text


def format_event(event: Event) -> str:
    """One key=value line per supervision event, greppable and parseable."""
    fields = {"event": f"child_{event.kind}", "child": event.child.name, **event.fields}
    return "pdserve up: " + " ".join(f"{key}={_field(value)}" for key, value in fields.items())


def _policy(args: argparse.Namespace) -> RestartPolicy:
    return RestartPolicy(backoff_s=args.restart_backoff, max_restarts=args.max_restarts, window_s=args.restart_window,
                         ready_timeout_s=args.ready_timeout, unresponsive_s=args.unresponsive_timeout)


def _check_args(args: argparse.Namespace) -> str | None:
    if args.decode < 1:
        return "--decode must be at least 1 (the decode pool serves every request)"
    if args.prefill < 0:
        return "--prefill must be 0 or more"
    if args.pd_min_prompt_tokens is not None and args.pd_min_prompt_tokens < 0:
        return "--pd-min-prompt-tokens must be 0 or more"
    if not 0 < args.port < 65536:
        return f"--port {args.port} is not a TCP port"
    for value, name in ((args.restart_backoff, "--restart-backoff"), (args.restart_window, "--restart-window"),
                        (args.unresponsive_timeout, "--unresponsive-timeout"), (args.drain_timeout, "--drain-timeout")):
        if value < 0:
            return f"{name} must be 0 or more"
    if args.max_restarts < 0:
        return "--max-restarts must be 0 or more"
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
            _stop(stack, args.drain_timeout, signals)


def _stop(stack: Stack, drain_timeout: float, signals: Signals) -> None:
    def step(group: list[Child]) -> None:
        names = ", ".join(c.name for c in group)
        if any(c.component.stop_rank == STOP_ROUTER for c in group):
            _say(f"pdserve up: draining {names}: no new requests, finishing those in flight ...")
        else:
            _say(f"pdserve up: stopping {names} ...")

    if any(not c.exited() for c in stack.children):
        _say(f"pdserve up: stopping {len(stack.children)} processes in order (at most {drain_timeout:g}s; "
             f"Ctrl-C again to kill them now) ...")
    stack.stop(grace=drain_timeout, force=lambda: signals.count > 1, on_step=step)
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
    supervisor = Supervisor(stack, _policy(args))
    view = StatusView(plan.stats_url, plan.engine_names, sys.stdout,
                      supervision=lambda: supervision_note(supervisor.restarts(), supervisor.restarting()))
    try:
        while not signals.stop_requested:
            try:
                events = supervisor.check()
            except GaveUp as exc:
                view.forget_drawing()
                _error(f"{exc}; stopping the stack.\n" + describe_death(exc.child, reason=exc.reason))
                return 1
            for event in events:
                view.forget_drawing()
                print(format_event(event), file=sys.stderr, flush=True)
            view.tick(time.monotonic())
            time.sleep(LOOP_INTERVAL_S)
    finally:
        view.close()
        supervisor.close()
    _say(f"\npdserve up: {signal.Signals(signals.first).name if signals.first else 'stop'} received")
    return 0
