"""P/D against one pool with the same cores, on a mixed workload.

Two loads run at once through the router of a `pdserve up` stack: "decoders" (short prompts,
long outputs, a fixed number in flight) and "long prompts" (1-1.5k-token prompts, short outputs,
Poisson arrivals). In one pool, every long prompt's prefill lands in a batch that is also decoding,
so the decoders' inter-token latency jumps whenever one arrives; with P/D, prefills run on the
prefill engine and the decode engine's ITL stays flat. Both stacks get two engines of one thread
each (the same total cores): one pool = 2 engines serving both phases; P/D = 1 prefill + 1 decode.
Reported: the decoders' ITL p50/p99/max and the long prompts' TTFT p50/p99.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from pdserve.bench.loadgen import LoadConfig, run_load_sync
from pdserve.bench.report import write_report

from bench_offline import cache_root, model_dir
from bench_serve import free_port, log, stop


def start_stack(model: str, prefill: int, decode: int, run_dir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "pdserve", "up", "--model", model, "--prefill", str(prefill), "--decode", str(decode),
           "--port", str(port), "--dtype", "float32", "--pd-min-prompt-tokens", "512", "--max-model-len", "2048",
           "--kv-cache-memory-bytes", str(2 << 30), "--run-dir", str(run_dir)]
    log(f"starting: {' '.join(cmd)}")
    out = open(run_dir / "up.log", "w")
    env = dict(os.environ, PYTHONSAFEPATH="1", OMP_NUM_THREADS="1")  # one core per engine
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pdserve up exited with {proc.returncode}: {(run_dir / 'up.log').read_text()[-3000:]}")
        if "pdserve is up at" in (run_dir / "up.log").read_text(errors="replace"):
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    return proc, url
            except httpx.HTTPError:
                pass
        time.sleep(1)
    stop(proc)
    raise TimeoutError("the stack did not come up")


def mixed_load(url: str, model: str, quick: bool, seed: int) -> dict:
    """Prompts are drawn from `seed`: the warm-up uses other ones, or prefix caching would
    answer the measured long prompts from the warm-up's blocks."""
    # Greedy, as the other serving benchmarks; logprobs=0 puts each token in its chunk, so TTFT and
    # ITL count tokens whose text is empty (the random model often picks byte pieces: without it,
    # most long prompts' 8 tokens carried no text and their TTFT went unrecorded).
    extra = {"temperature": 0.0, "logprobs": 0}
    # The decoders must still be decoding while the long prompts arrive (4 or 8 at 0.25/s: ~16 or
    # ~32 s): two rounds of 4 outputs this long last that long on the bench model.
    decoders = LoadConfig(url=url, model=model, num_requests=8 if quick else 16, concurrency=4,
                          input_len=(32, 64), output_len=(384, 512) if quick else (640, 768), seed=seed,
                          extra_body=extra)
    prompts = LoadConfig(url=url, model=model, num_requests=4 if quick else 8, request_rate=0.25,
                         input_len=(1024, 1536), output_len=(8, 8), seed=seed + 1, extra_body=extra)
    results: dict[str, dict] = {}

    def run(name: str, config: LoadConfig) -> None:
        result = run_load_sync(config)
        # p99 hides the few long stalls (one per prefill landing beside the decoders): the worst gap too.
        gaps = [gap for r in result.results if r.ok for gap in r.itls]
        results[name] = dict(result.summary(), itl_max_ms=max(gaps) * 1000 if gaps else None)
        if result.errors():
            log(f"  {name} errors: {result.errors()}")

    threads = [threading.Thread(target=run, args=item) for item in (("decoders", decoders), ("long", prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def warm_up(url: str, model: str) -> None:
    """Kernels, allocators and connections, with prompts the measured run does not share."""
    for input_len in ((32, 64), (1024, 1536)):
        run_load_sync(LoadConfig(url=url, model=model, num_requests=2, concurrency=2, input_len=input_len,
                                 output_len=(8, 8), seed=100, extra_body={"temperature": 0.0}))


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="bench pd")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    model = model_dir()
    rows = []
    for label, prefill, decode in (("one pool (2 engines)", 0, 2), ("P/D (1 prefill + 1 decode)", 1, 1)):
        run_dir = Path(cache_root()) / "bench" / "runs" / f"pd-{prefill}-{decode}-{int(time.time())}"
        run_dir.mkdir(parents=True, exist_ok=True)
        proc, url = start_stack(model, prefill, decode, run_dir)
        try:
            warm_up(url, model)
            result = mixed_load(url, model, args.quick, seed=1)
        finally:
            stop(proc)
        d, p = result["decoders"], result["long"]
        rows.append({"stack": label, "decoder ITL p50 ms": d["itl_p50_ms"], "decoder ITL p99 ms": d["itl_p99_ms"],
                     "decoder ITL max ms": d["itl_max_ms"],
                     "long-prompt TTFT p50 ms": p["ttft_p50_ms"], "long-prompt TTFT p99 ms": p["ttft_p99_ms"],
                     "output tok/s": (d["output_tokens_per_s"] or 0) + (p["output_tokens_per_s"] or 0),
                     "long completed": p["completed"], "failed": d["failed"] + p["failed"]})
        log(f"  {label}: ITL p99 {d['itl_p99_ms']} ms, TTFT p50 {p['ttft_p50_ms']} ms")
    for stat in ("p99", "max"):
        base = rows[0][f"decoder ITL {stat} ms"]
        for row in rows:
            row[f"ITL {stat} vs one pool"] = (row[f"decoder ITL {stat} ms"] / base) if base else None
    write_report("pd", rows, title="P/D vs one pool, same cores, mixed workload (decoders + arriving long prompts)",
                 meta={"threads_per_engine": 1, "pd_min_prompt_tokens": 512})
