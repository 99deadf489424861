"""Data parallelism inside one pod: DP=1 against DP=2 with the same total CPU threads.

- offline: the whole workload through AsyncLLM in this process (no HTTP), at DP=1 with T threads
  and at DP=2 with T/2 threads per rank (OMP_NUM_THREADS, inherited by the engine processes);
- serving: `pdserve serve --data-parallel-size 1|2` under the same load generator as bench_serve;
- lock-step: `--data-parallel-size 2 --data-parallel-lockstep` under a light load (concurrency 1,
  so one rank is often idle): the share of the ranks' step time spent in dummy steps, and of steps.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
import time
from pathlib import Path

import httpx

from pdserve.bench.loadgen import LoadConfig, build_workload, run_load_sync
from pdserve.bench.report import write_report
from pdserve.bench.workload import load_tokenizer

from bench_offline import model_dir as bench_model_dir
from bench_serve import free_port, log, start, stop


def threads_env(threads: int) -> None:
    os.environ["OMP_NUM_THREADS"] = str(threads)


async def _offline(model: str, dtype: str, dp: int, items: list) -> dict:
    from pdserve.engine.config import EngineArgs
    from pdserve.engine.frontend.async_llm import AsyncLLM
    from pdserve.engine.sampling_params import SamplingParams

    llm = AsyncLLM.from_engine_args(EngineArgs(model=model, dtype=dtype, data_parallel_size=dp, max_num_seqs=32))
    try:
        async def one(i: int, item) -> int:
            params = SamplingParams(temperature=0.0, max_tokens=item.max_tokens, ignore_eos=True)
            last = None
            async for out in llm.generate(item.prompt, params, f"b{i}"):
                last = out
            return len(last.outputs[0].token_ids)

        await one(-1, items[0])  # warm up
        started = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(i, item) for i, item in enumerate(items))))
        wall = time.perf_counter() - started
    finally:
        llm.shutdown()
    return {"output_tokens": tokens, "out_tok_s": tokens / wall, "duration_s": wall}


def _metric(url: str, name: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{"):
            engine = re.search(r'engine="(\d+)"', line).group(1)
            values[engine] = values.get(engine, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="bench_dp")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="total CPU threads, split over ranks")
    args = parser.parse_args(argv)
    model = bench_model_dir()
    n = 16 if args.quick else args.num_requests
    input_len, output_len = ((16, 128), (8, 48)) if args.quick else ((32, 512), (16, 256))
    workdir = Path(os.environ.get("PDSERVE_BENCH_DIR", "bench-results"))
    workdir.mkdir(parents=True, exist_ok=True)
    reference = LoadConfig(url="http://unused", num_requests=n, input_len=input_len, output_len=output_len, seed=0,
                           tokenizer=model)
    items = build_workload(reference, load_tokenizer(model))
    saved_threads = os.environ.get("OMP_NUM_THREADS")
    rows = []
    try:
        for dp in (1, 2):
            per_rank = max(1, args.threads // dp)
            threads_env(per_rank)
            log(f"--- offline, DP={dp} x {per_rank} threads ---")
            offline = asyncio.run(_offline(model, args.dtype, dp, items))
            log(f"--- pdserve serve, DP={dp} x {per_rank} threads ---")
            port = free_port()
            proc = start([sys.executable, "-m", "pdserve", "serve", "--model", model, "--served-model-name", "bench",
                          "--port", str(port), "--dtype", args.dtype, "--log-level", "WARNING",
                          "--data-parallel-size", str(dp)], port, workdir / f"pdserve-serve-dp{dp}.log")
            try:
                config = LoadConfig(url=f"http://127.0.0.1:{port}", model="bench", num_requests=n,
                                    concurrency=args.concurrency, input_len=input_len, output_len=output_len, seed=0,
                                    tokenizer=model, extra_body={"temperature": 0.0}, warmup=2)
                served = run_load_sync(config, progress=True).summary()
            finally:
                stop(proc)
            rows.append({"dp": dp, "threads_per_rank": per_rank, "offline_out_tok_s": offline["out_tok_s"],
                         "serve_out_tok_s": served["output_tokens_per_s"], "serve_failed": served["failed"],
                         "ttft_p50_ms": served.get("ttft_p50_ms"), "itl_p50_ms": served.get("itl_p50_ms")})

        threads_env(max(1, args.threads // 2))
        log("--- lock-step DP=2, concurrency 1 ---")
        port = free_port()
        proc = start([sys.executable, "-m", "pdserve", "serve", "--model", model, "--served-model-name", "bench",
                      "--port", str(port), "--dtype", args.dtype, "--log-level", "WARNING", "--data-parallel-size", "2",
                      "--data-parallel-lockstep"], port, workdir / "pdserve-serve-lockstep.log")
        try:
            config = LoadConfig(url=f"http://127.0.0.1:{port}", model="bench", num_requests=max(4, n // 4),
                                concurrency=1, input_len=input_len, output_len=output_len, seed=0, tokenizer=model,
                                extra_body={"temperature": 0.0})
            light = run_load_sync(config, progress=True).summary()
            time.sleep(2.0)  # let the last wave end, so its counters are reported
            url = f"http://127.0.0.1:{port}"
            steps, dummy = _metric(url, "pdserve:dp_lockstep_steps_total"), _metric(url, "pdserve:dp_dummy_steps_total")
            seconds = _metric(url, "pdserve:dp_lockstep_step_seconds_total")
            dummy_seconds = _metric(url, "pdserve:dp_dummy_step_seconds_total")
        finally:
            stop(proc)
    finally:
        if saved_threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved_threads
    lockstep_rows = [{"engine": e, "steps": steps.get(e, 0), "dummy_steps": dummy.get(e, 0),
                      "dummy_step_share_pct": 100 * dummy.get(e, 0) / max(steps.get(e, 0), 1),
                      "dummy_time_share_pct": 100 * dummy_seconds.get(e, 0) / max(seconds.get(e, 0), 1e-9)}
                     for e in sorted(steps)]
    meta = {"requests": n, "concurrency": args.concurrency, "total_threads": args.threads, "dtype": args.dtype,
            "model": model, "lockstep_out_tok_s": light["output_tokens_per_s"]}
    write_report("dp", rows, title=f"DP=1 vs DP=2 at {args.threads} CPU threads in all (output tokens/s)", meta=meta)
    write_report("dp_lockstep", lockstep_rows, title="Lock-step DP=2 at concurrency 1: dummy steps", meta=meta)
