"""Serving: `pdserve serve` under load, against the offline engine and `transformers serve`.

One seeded workload (prompts 32-512 tokens, outputs 16-256, greedy) at fixed concurrency 32,
through the same load generator (`pdserve bench serve`'s library), in one run:
- the offline engine on the same prompts, at most 32 in flight (`max_num_seqs=32`): what the
  serving layer costs is the throughput the server loses against it;
- `pdserve serve` as a subprocess;
- `transformers serve --continuous-batching` on the same model directory. Its quirks: it sends no
  `data: [DONE]`, rejects unknown fields such as `ignore_eos` with 422 (so its outputs may stop
  early at EOS; throughput counts the tokens it really produced), and its /v1/models needs a hub
  cache, so the model id is given explicitly.
Then the real model, SmolLM2-135M-Instruct (`smollm2`): offline engine and `pdserve serve` on the
same load, and the time a server takes to start on its cached conversion (report serve_smollm2).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from pdserve.bench.loadgen import LoadConfig, build_workload, run_load_sync
from pdserve.bench.report import write_report
from pdserve.bench.workload import load_tokenizer

from bench_offline import model_dir as bench_model_dir


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], port: int, log_path: Path, ready_path: str = "/health", timeout: float = 600,
          env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start `cmd` (with `env` added to this environment) and wait until GET `ready_path` answers 200."""
    log(f"starting: {' '.join(cmd)}")
    with open(log_path, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, PYTHONSAFEPATH="1", **(env or {})))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[0]} exited with {proc.returncode}: {log_path.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}{ready_path}", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop(proc)
    raise TimeoutError(f"{cmd[0]} did not become ready")


def wait_kv_mapped(port: int, timeout: float = 300) -> float:
    """Wait until a pdserve server reports its KV cache mapped ahead of use (the gauge
    pdserve:kv_cache_mapped_ratio at 1: what an idle engine does in its first seconds, see
    engine/worker/kv_memory.py), so that a measurement is not of a fresh server's page faults;
    returns the seconds waited. A server without /metrics (llama-server) is not waited for."""
    start_at = time.monotonic()
    while time.monotonic() - start_at < timeout:
        r = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
        if r.status_code != 200:
            return 0.0
        ratios = [float(line.rsplit(" ", 1)[1]) for line in r.text.splitlines()
                  if line.startswith("pdserve:kv_cache_mapped_ratio{")]
        if ratios and min(ratios) >= 1.0:
            return time.monotonic() - start_at
        time.sleep(0.5)
    raise TimeoutError(f"the server on port {port} did not map its KV cache in {timeout:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_offline(model: str, dtype: str, config: LoadConfig, concurrency: int) -> dict:
    from pdserve.engine import LLM, SamplingParams

    items = build_workload(config, load_tokenizer(config.tokenizer))
    llm = LLM(model, dtype=dtype, max_num_seqs=concurrency)
    llm.generate("warm up", SamplingParams(max_tokens=4))
    params = [SamplingParams(temperature=0.0, max_tokens=item.max_tokens, ignore_eos=True) for item in items]
    start_time = time.perf_counter()
    outputs = llm.generate([item.prompt for item in items], params, use_tqdm=True)
    wall = time.perf_counter() - start_time
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    llm.shutdown()
    return {"completed": len(outputs), "failed": 0, "output_tokens": tokens, "output_tokens_per_s": tokens / wall,
            "duration_s": wall}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="bench_serve")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-requests", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--no-smollm2", action="store_true", help="skip the real-model (SmolLM2) rows")
    args = parser.parse_args(argv)
    model = bench_model_dir()
    n = 16 if args.quick else args.num_requests
    input_len, output_len = ((16, 128), (8, 48)) if args.quick else ((32, 512), (16, 256))
    workdir = Path(os.environ.get("PDSERVE_BENCH_DIR", "bench-results"))
    workdir.mkdir(parents=True, exist_ok=True)

    def load(port: int, model_id: str, ignore_eos: bool) -> dict:
        config = LoadConfig(url=f"http://127.0.0.1:{port}", model=model_id, num_requests=n,
                            concurrency=args.concurrency, input_len=input_len, output_len=output_len, seed=0,
                            tokenizer=model, ignore_eos=ignore_eos, extra_body={"temperature": 0.0}, warmup=2)
        return run_load_sync(config, progress=True).summary()

    systems: dict[str, dict] = {}
    log("--- offline engine ---")
    reference = LoadConfig(url="http://unused", num_requests=n, input_len=input_len, output_len=output_len, seed=0,
                           tokenizer=model)
    systems["pdserve offline LLM (max_num_seqs=32)"] = run_offline(model, args.dtype, reference, args.concurrency)

    log("--- pdserve serve ---")
    port = free_port()
    proc = start([sys.executable, "-m", "pdserve", "serve", "--model", model, "--served-model-name", "bench",
                  "--port", str(port), "--dtype", args.dtype, "--log-level", "WARNING"], port, workdir / "pdserve-serve.log")
    try:
        systems["pdserve serve"] = load(port, "bench", ignore_eos=True)
    finally:
        stop(proc)

    transformers_cli = shutil.which("transformers") or str(Path(sys.executable).parent / "transformers")
    if not args.no_transformers and Path(transformers_cli).exists():
        log("--- transformers serve --continuous-batching ---")
        port = free_port()
        proc = start([transformers_cli, "serve", model, "--continuous-batching", "--cb-num-blocks", "512",
                      "--cb-max-batch-tokens", "2048", "--device", "cpu", "--dtype", args.dtype, "--port", str(port)],
                     port, workdir / "transformers-serve.log")
        try:
            systems["transformers serve --continuous-batching"] = load(port, model, ignore_eos=False)
        finally:
            stop(proc)

    served = systems["pdserve serve"]
    offline = systems["pdserve offline LLM (max_num_seqs=32)"]
    rows = []
    for name, s in systems.items():
        rows.append({
            "system": name, "completed": s["completed"], "failed": s["failed"], "output_tokens": s["output_tokens"],
            "out_tok_s": s["output_tokens_per_s"], "ttft_p50_ms": s.get("ttft_p50_ms"), "ttft_p90_ms": s.get("ttft_p90_ms"),
            "ttft_p99_ms": s.get("ttft_p99_ms"), "itl_p50_ms": s.get("itl_p50_ms"), "itl_p99_ms": s.get("itl_p99_ms"),
            "e2e_p50_ms": s.get("e2e_p50_ms"), "pdserve_serve_speedup": served["output_tokens_per_s"] / s["output_tokens_per_s"],
        })
    meta = {"concurrency": args.concurrency, "requests": n, "dtype": args.dtype, "model": model,
            "serving_overhead_pct": 100 * (1 - served["output_tokens_per_s"] / offline["output_tokens_per_s"])}
    write_report("serve", rows, title=f"Serving at concurrency {args.concurrency} (output tokens/s, latency ms)",
                 meta=meta)
    print(f"serving overhead vs the offline engine: {meta['serving_overhead_pct']:.1f}% of throughput")
    if not args.no_smollm2:
        run_smollm2(args, n, input_len, output_len, workdir)


def run_smollm2(args: argparse.Namespace, n: int, input_len: tuple[int, int], output_len: tuple[int, int],
                workdir: Path) -> None:
    """The real model: 30 thin layers, so per-layer overhead weighs more than in the bench model.

    Also times a server start on the cached conversion (process start to /health answering).
    """
    from pdserve.engine.demo import resolve_model

    model_path = resolve_model("smollm2")  # converts on the first run, so the start below is a cached one
    config = LoadConfig(url="http://unused", model="smollm2", num_requests=n, concurrency=args.concurrency,
                        input_len=input_len, output_len=output_len, seed=0, tokenizer=model_path, ignore_eos=True,
                        extra_body={"temperature": 0.0}, warmup=2)
    log("--- smollm2: offline engine ---")
    systems = {"pdserve offline LLM (max_num_seqs=32)": run_offline("smollm2", args.dtype, config, args.concurrency)}
    log("--- smollm2: pdserve serve ---")
    port = free_port()
    began = time.perf_counter()
    proc = start([sys.executable, "-m", "pdserve", "serve", "--model", "smollm2", "--port", str(port),
                  "--dtype", args.dtype, "--log-level", "WARNING"], port, workdir / "pdserve-serve-smollm2.log")
    start_s = time.perf_counter() - began
    try:
        served_config = dataclasses.replace(config, url=f"http://127.0.0.1:{port}")
        systems["pdserve serve"] = run_load_sync(served_config, progress=True).summary()
    finally:
        stop(proc)
    rows = [{"system": name, "completed": s["completed"], "failed": s["failed"], "output_tokens": s["output_tokens"],
             "out_tok_s": s["output_tokens_per_s"], "ttft_p50_ms": s.get("ttft_p50_ms"),
             "itl_p50_ms": s.get("itl_p50_ms"), "e2e_p50_ms": s.get("e2e_p50_ms"),
             "cached_start_s": start_s if name == "pdserve serve" else None} for name, s in systems.items()]
    served, offline = (systems[k]["output_tokens_per_s"] for k in ("pdserve serve", "pdserve offline LLM (max_num_seqs=32)"))
    meta = {"concurrency": args.concurrency, "requests": n, "dtype": args.dtype, "model": "smollm2",
            "serving_overhead_pct": 100 * (1 - served / offline), "cached_start_s": start_s}
    write_report("serve_smollm2", rows, title=f"SmolLM2-135M serving at concurrency {args.concurrency}", meta=meta)


if __name__ == "__main__":
    main(sys.argv[1:])
