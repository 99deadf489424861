"""`pdserve up` against `pdserve serve` on one machine, at one stream and at sixteen.

A laptop user runs `pdserve up` (1 prefill + 1 decode engine sharing the machine's cores) by default;
this asks what that costs against one `pdserve serve` on the same cores. The workload is the one of
issue 20: SmolLM2-135M-Instruct, float32, 256-token prompts, 64 output tokens, greedy, ignore_eos,
through pdserve's load generator (`pdserve bench serve`'s library).

Every system runs at once, each started once (an idle engine sleeps), and the measurements
alternate between them: one stream, repetition 1 for every system, then repetition 2, then sixteen
streams. Rows:
- `pdserve serve`: the baseline of every ratio;
- `pdserve up`: the current defaults;
- `pdserve up, one thread per engine (before)`: the defaults before issue 20 (each engine an equal
  share of the cores as its OMP_NUM_THREADS, every prompt of 256 tokens or more disaggregated).
Reported: ITL p50 and TTFT p50 at one stream (the median of the repetitions, and each one), output
tokens/s at sixteen, each as a ratio to serve's; and how the router sent the requests (its
pd_decisions counter: disaggregated or local).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pdserve.bench.loadgen import LoadConfig, run_load_sync
from pdserve.bench.report import write_report

from bench_serve import free_port, log, start, stop

PROMPT_TOKENS = 256
OUTPUT_TOKENS = 64
KV_BYTES = 512 << 20  # per engine: sixteen 320-token sequences need about 240 MB of smollm2's KV


@dataclass
class System:
    name: str
    kind: str                          # "serve" or "up"
    args: tuple[str, ...] = ()         # extra flags
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    url: str = ""
    one_stream: list[dict] = field(default_factory=list)
    many: dict | None = None
    routing: dict[str, int] = field(default_factory=dict)  # the router's P/D decisions


def start_serve(system: System, model: str, workdir: Path) -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "pdserve", "serve", "--model", model, "--served-model-name", "smollm2",
           "--port", str(port), "--dtype", "float32",
           "--kv-cache-memory-bytes", str(KV_BYTES), "--log-level", "WARNING", *system.args]
    system.proc = start(cmd, port, workdir / f"{slug(system.name)}.log")
    system.url = f"http://127.0.0.1:{port}"


def start_up(system: System, model: str, workdir: Path, timeout: float = 900) -> None:
    port = free_port()
    run_dir = workdir / slug(system.name)
    run_dir.mkdir(parents=True, exist_ok=True)
    # The built-in name, which up resolves to `model` itself and serves under that name.
    cmd = [sys.executable, "-m", "pdserve", "up", "--model", "smollm2", "--port", str(port), "--dtype", "float32",
           "--kv-cache-memory-bytes", str(KV_BYTES), "--run-dir", str(run_dir), *system.args]
    log(f"starting: {' '.join(cmd)}" + (f" with {system.env}" if system.env else ""))
    log_path = run_dir / "up.log"
    with open(log_path, "w") as out:
        system.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                       env=dict(os.environ, PYTHONSAFEPATH="1", **system.env))
    system.url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if system.proc.poll() is not None:
            raise RuntimeError(f"pdserve up exited with {system.proc.returncode}: {log_path.read_text()[-3000:]}")
        if "pdserve is up at" in log_path.read_text(errors="replace"):
            return
        time.sleep(1)
    stop_system(system)
    raise TimeoutError(f"{system.name} did not come up in {timeout:.0f}s")


def stop_system(system: System) -> None:
    if system.proc is None:
        return
    if system.kind == "up" and system.proc.poll() is None:
        # `up` drains its children itself on SIGTERM; its process group holds only itself.
        system.proc.send_signal(signal.SIGTERM)
        try:
            system.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            pass
    stop(system.proc)


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def pd_decisions(url: str) -> dict[str, int]:
    """The router's P/D decisions so far (empty for a lone engine, which has no router)."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=5).text
    except httpx.HTTPError:
        return {}
    found = re.findall(r'^pdserve_router_pd_decisions_total\{decision="([^"]+)"\} ([0-9.e+]+)$', text, re.M)
    return {decision: int(float(value)) for decision, value in found if float(value) > 0}


def load(system: System, model: str, seed: int, n: int, concurrency: int, warmup: int) -> dict:
    config = LoadConfig(url=system.url, model="smollm2", num_requests=n, concurrency=concurrency,
                        input_len=(PROMPT_TOKENS, PROMPT_TOKENS), output_len=(OUTPUT_TOKENS, OUTPUT_TOKENS),
                        seed=seed, tokenizer=model, ignore_eos=True, extra_body={"temperature": 0.0}, warmup=warmup)
    result = run_load_sync(config)
    summary = result.summary()
    if summary["failed"]:
        raise RuntimeError(f"{system.name}: {summary['failed']} of {n} requests failed: {result.errors()[:3]}")
    return summary


def measure(systems: list[System], model: str, workdir: Path, per_rep: int, repetitions: int, streams: int,
            many_requests: int) -> None:
    """Start every system, load them in turn, stop them; the results land on each System."""
    try:
        for system in systems:
            (start_serve if system.kind == "serve" else start_up)(system, model, workdir)
        # Alternate the systems within each repetition, so a slow spell of a shared machine lands on all.
        for rep in range(repetitions):
            for system in systems:
                summary = load(system, model, seed=100 + rep, n=per_rep, concurrency=1, warmup=2 if rep == 0 else 0)
                system.one_stream.append(summary)
                log(f"{system.name}: one stream, rep {rep + 1}: ITL p50 {summary['itl_p50_ms']:.1f} ms, "
                    f"TTFT p50 {summary['ttft_p50_ms']:.0f} ms")
        for system in systems:
            system.many = load(system, model, seed=200, n=many_requests, concurrency=streams, warmup=0)
            log(f"{system.name}: {streams} streams: {system.many['output_tokens_per_s']:.1f} output tok/s")
        for system in systems:
            if system.kind == "up":
                system.routing = pd_decisions(system.url)
    finally:
        for system in systems:
            stop_system(system)


def table(systems: list[System], streams: int) -> list[dict]:
    """One row per system, each measure also as a ratio to the first system's (serve's)."""
    def itl(s: System) -> float:
        return statistics.median(r["itl_p50_ms"] for r in s.one_stream)

    def ttft(s: System) -> float:
        return statistics.median(r["ttft_p50_ms"] for r in s.one_stream)

    base = systems[0]
    rows = []
    for system in systems:
        tps = system.many["output_tokens_per_s"]
        rows.append({
            "system": system.name,
            "itl_p50_ms": itl(system), "itl_vs_serve": itl(system) / itl(base),
            "ttft_p50_ms": ttft(system), "ttft_vs_serve": ttft(system) / ttft(base),
            f"out_tok_s_{streams}": tps, "tok_s_vs_serve": tps / base.many["output_tokens_per_s"],
            "itl_p50_reps": " ".join(f"{r['itl_p50_ms']:.1f}" for r in system.one_stream),
            "ttft_p50_reps": " ".join(f"{r['ttft_p50_ms']:.0f}" for r in system.one_stream),
            "routing": " ".join(f"{k}={v}" for k, v in sorted(system.routing.items())) or "-",
        })
    return rows


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="bench_up", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    parser.add_argument("--requests", type=int, help="requests per one-stream repetition (default 8; quick: 3)")
    parser.add_argument("--repetitions", type=int, default=2, help="one-stream repetitions per system")
    parser.add_argument("--streams", type=int, default=16, help="concurrency of the throughput run")
    parser.add_argument("--no-before", action="store_true", help="skip the row with the defaults before issue 20")
    parser.add_argument("--env", action="append", default=[], metavar="VAR=VALUE[,VAR=VALUE]",
                        help="one more `pdserve up` row run with these environment variables (repeatable), "
                             "e.g. GOMP_SPINCOUNT=20000 to try OpenMP's bounded spin against the default wait policy")
    args = parser.parse_args(argv)
    from pdserve.engine.demo import resolve_model

    model = resolve_model("smollm2")  # converts on the first run; every system then loads the same folder
    workdir = Path(os.environ.get("PDSERVE_BENCH_DIR", "bench-results")) / "up"
    workdir.mkdir(parents=True, exist_ok=True)
    per_rep = args.requests or (3 if args.quick else 8)
    many_requests = args.streams * (1 if args.quick else 2)
    cores = len(os.sched_getaffinity(0))
    systems = [System("pdserve serve", "serve"), System("pdserve up", "up")]
    if not args.no_before:
        # Before issue 20: every engine an equal share of the cores, and a 256-token prompt disaggregated.
        systems.append(System("pdserve up, one thread per engine (before)", "up",
                              args=("--engine-threads", "split", "--pd-when", "always")))
    for spec in args.env:
        env = dict(item.split("=", 1) for item in spec.split(","))
        systems.append(System(f"pdserve up, {spec}", "up", env=env))

    measure(systems, model, workdir, per_rep, args.repetitions, args.streams, many_requests)
    rows = table(systems, args.streams)
    meta = {"model": "smollm2", "dtype": "float32", "prompt_tokens": PROMPT_TOKENS, "output_tokens": OUTPUT_TOKENS,
            "one_stream_requests_per_rep": per_rep, "repetitions": args.repetitions, "streams": args.streams,
            "stream_requests": many_requests, "cores": cores,
            "systems": {s.name: {"args": list(s.args), "env": s.env} for s in systems}}
    write_report("up_vs_serve", rows, meta=meta,
                 title=f"pdserve up vs serve on {cores} cores: one stream (ITL/TTFT p50, ms) and "
                       f"{args.streams} streams (output tok/s)")


if __name__ == "__main__":
    main(sys.argv[1:])
