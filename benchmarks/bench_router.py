"""Router overhead: the same requests straight to an engine and through `pdserve router` (one pool).

Two measurements:
- against a stub engine that answers at once (a fixed JSON answer, or an 8-chunk SSE stream), one
  request at a time: what the router adds to a request's latency, with no model time to hide it;
  then 16 at a time: the request rate one router process sustains on this machine.
- against a real `pdserve serve` (the benchmark model) under the serving load generator at
  concurrency 16: end-to-end and time-to-first-token latency, and the output throughput lost.
Targets (issue 11): at most 2 ms added at p50, at most 5% of the throughput lost. On the 2-core CI
machine the router, the engine and the load generator share the same two cores, so the real-engine
rows include the router's CPU competing with the engine's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve()
MODEL = "bench"


# The stub engine runs as `python bench_router.py --stub-engine PORT`, with PYTHONSAFEPATH set (no
# script folder on sys.path): the benchmark helpers are imported inside the functions that use them.

# --- the stub engine --------------------------------------------------------------------------------

def stub_app():
    """An OpenAI-shaped engine that computes nothing: the router's cost is all that is left."""
    answer = json.dumps({"id": "cmpl-stub", "object": "text_completion", "created": 0, "model": MODEL,
                         "choices": [{"index": 0, "text": "hello", "finish_reason": "length"}],
                         "usage": {"prompt_tokens": 4, "completion_tokens": 8, "total_tokens": 12}}).encode()
    chunk = json.dumps({"id": "cmpl-stub", "object": "text_completion", "created": 0, "model": MODEL,
                        "choices": [{"index": 0, "text": " tok", "finish_reason": None}]})
    stream_body = (f"data: {chunk}\n\n" * 8 + "data: [DONE]\n\n").encode()

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["path"] == "/health":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        streaming = b'"stream": true' in body or b'"stream":true' in body
        media = b"text/event-stream" if streaming else b"application/json"
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", media)]})
        await send({"type": "http.response.body", "body": stream_body if streaming else answer})

    return app


def serve_stub(port: int) -> None:
    import uvicorn

    uvicorn.run(stub_app(), host="127.0.0.1", port=port, log_level="warning", access_log=False)


# --- measurements -------------------------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


async def sequential_latency(url: str, count: int, stream: bool) -> list[float]:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 8, "stream": stream}
    latencies = []
    async with httpx.AsyncClient(timeout=30) as client:
        for i in range(count + 20):
            began = time.perf_counter()
            async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                async for _ in response.aiter_raw():
                    pass
                assert response.status_code == 200, response.status_code
            if i >= 20:  # the first ones warm connections up
                latencies.append(time.perf_counter() - began)
    return latencies


async def request_rate(url: str, count: int, concurrency: int) -> float:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 8}
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:
        queue = list(range(count))

        async def worker() -> None:
            while queue:
                queue.pop()
                response = await client.post(f"{url}/v1/completions", json=body)
                assert response.status_code == 200, response.status_code

        began = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return count / (time.perf_counter() - began)


def router_cmd(port: int, engine_url: str) -> list[str]:
    return [sys.executable, "-m", "pdserve", "router", "--model", MODEL, "--port", str(port), "--decode", engine_url,
            "--log-level", "WARNING"]


def stub_rows(workdir: Path, sequential: int, rate_requests: int) -> list[dict]:
    from bench_serve import free_port, start, stop

    stub_port, router_port = free_port(), free_port()
    stub = start([sys.executable, str(HERE), "--stub-engine", str(stub_port)], stub_port, workdir / "stub.log")
    router = None
    try:
        router = start(router_cmd(router_port, f"http://127.0.0.1:{stub_port}"), router_port,
                       workdir / "router-stub.log")
        rows = []
        for stream in (False, True):
            direct = asyncio.run(sequential_latency(f"http://127.0.0.1:{stub_port}", sequential, stream))
            routed = asyncio.run(sequential_latency(f"http://127.0.0.1:{router_port}", sequential, stream))
            rows.append({
                "case": f"stub engine, 1 at a time, {'streamed (8 chunks)' if stream else 'JSON'}",
                "direct_p50_ms": 1000 * statistics.median(direct), "routed_p50_ms": 1000 * statistics.median(routed),
                "added_p50_ms": 1000 * (statistics.median(routed) - statistics.median(direct)),
                "added_p99_ms": 1000 * (percentile(routed, 99) - percentile(direct, 99)),
            })
        direct_rate = asyncio.run(request_rate(f"http://127.0.0.1:{stub_port}", rate_requests, 16))
        routed_rate = asyncio.run(request_rate(f"http://127.0.0.1:{router_port}", rate_requests, 16))
        rows.append({"case": "stub engine, 16 at a time (requests/s)", "direct_req_s": direct_rate,
                     "routed_req_s": routed_rate, "lost_pct": 100 * (1 - routed_rate / direct_rate)})
        return rows
    finally:
        if router is not None:
            stop(router)
        stop(stub)


def engine_rows(workdir: Path, model: str, dtype: str, requests: int, concurrency: int) -> tuple[list[dict], dict]:
    from bench_serve import free_port, log, start, stop

    from pdserve.bench.loadgen import LoadConfig, run_load_sync

    engine_port, router_port = free_port(), free_port()
    engine = start([sys.executable, "-m", "pdserve", "serve", "--model", model, "--served-model-name", MODEL,
                    "--port", str(engine_port), "--dtype", dtype, "--log-level", "WARNING"], engine_port,
                   workdir / "engine.log")
    router = None
    try:
        router = start(router_cmd(router_port, f"http://127.0.0.1:{engine_port}"), router_port,
                       workdir / "router-engine.log")

        def load(port: int) -> dict:
            config = LoadConfig(url=f"http://127.0.0.1:{port}", model=MODEL, num_requests=requests,
                                concurrency=concurrency, input_len=(32, 256), output_len=(16, 64), seed=0,
                                tokenizer=model, extra_body={"temperature": 0.0}, warmup=4)
            return run_load_sync(config, progress=True).summary()

        # Alternating, twice each, so a slow spell of the shared machine does not land on one side only.
        runs = {"direct": [], "routed": []}
        for _ in range(2):
            for name, port in (("direct", engine_port), ("routed", router_port)):
                log(f"--- {name} ---")
                runs[name].append(load(port))
        best = {name: max(results, key=lambda s: s["output_tokens_per_s"]) for name, results in runs.items()}
        rows = []
        for name, s in best.items():
            rows.append({"case": f"pdserve serve, {name}", "completed": s["completed"], "failed": s["failed"],
                         "out_tok_s": s["output_tokens_per_s"], "ttft_p50_ms": s["ttft_p50_ms"],
                         "ttft_p99_ms": s["ttft_p99_ms"], "e2e_p50_ms": s["e2e_p50_ms"], "e2e_p99_ms": s["e2e_p99_ms"]})
        d, r = best["direct"], best["routed"]
        summary = {"added_e2e_p50_ms": r["e2e_p50_ms"] - d["e2e_p50_ms"],
                   "added_e2e_p99_ms": r["e2e_p99_ms"] - d["e2e_p99_ms"],
                   "added_ttft_p50_ms": r["ttft_p50_ms"] - d["ttft_p50_ms"],
                   "throughput_lost_pct": 100 * (1 - r["output_tokens_per_s"] / d["output_tokens_per_s"])}
        return rows, summary
    finally:
        if router is not None:
            stop(router)
        stop(engine)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="bench_router")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--stub-engine", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.stub_engine:
        serve_stub(args.stub_engine)
        return
    from bench_offline import model_dir as bench_model_dir
    from bench_serve import log

    from pdserve.bench.report import write_report

    workdir = Path(os.environ.get("PDSERVE_BENCH_DIR", "bench-results"))
    workdir.mkdir(parents=True, exist_ok=True)
    sequential, rate_requests, requests = (200, 400, 16) if args.quick else (1000, 2000, 64)

    log("--- stub engine: router overhead per request ---")
    stub = stub_rows(workdir, sequential, rate_requests)
    write_report("router_overhead_stub", stub, title="Router overhead against an instant stub engine (ms, requests/s)",
                 meta={"sequential_requests": sequential, "rate_requests": rate_requests},
                 columns=["case", "direct_p50_ms", "routed_p50_ms", "added_p50_ms", "added_p99_ms", "direct_req_s",
                          "routed_req_s", "lost_pct"])
    model = bench_model_dir()
    rows, summary = engine_rows(workdir, model, args.dtype, requests, args.concurrency)
    write_report("router_overhead", rows,
                 title=f"pdserve serve direct vs through the router, concurrency {args.concurrency} (ms, tokens/s)",
                 meta={"requests": requests, "concurrency": args.concurrency, "dtype": args.dtype, "model": model,
                       **summary})
    print("router overhead on a real engine: " + ", ".join(f"{k} {v:.2f}" for k, v in summary.items()))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--stub-engine":
        serve_stub(int(sys.argv[2]))
    else:
        sys.path.insert(0, str(HERE.parent))
        main(sys.argv[1:])
