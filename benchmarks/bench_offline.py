"""Offline throughput: pdserve against Hugging Face transformers on the same requests.

Workload (seeded): 64 requests, prompts of 32-512 random tokens, outputs of 16-256 tokens,
greedy with ignore_eos so every system produces exactly the requested lengths. Model: a random
~100M-parameter Llama (hidden 768, 12 layers, 12 heads, 4 KV heads, intermediate 2048, vocab
32000). Systems, in one process, on the same weights:
- pdserve: `LLM.generate` with everything submitted at once.
- transformers `generate` in static batches (left padding; a batch runs until its longest
  output; only requested tokens count as useful).
- transformers continuous batching (its manager, with each request's own max_new_tokens).
Also reported: where an engine step's time goes, and the roofline of a decode step at the batch
size pdserve achieved, from bandwidth and matmul rates measured in this run; and a profile of
single step kinds (a 512-token prefill, decode batches of 1, 16 and 64 at 256 tokens of context)
with torch's profiler: ms per step, the share of matmul, attention, KV write, norm, rotary,
activation, sampler and Python, and each kind's roofline fraction (pdserve.bench.step_profile). Then the same
workload on the real model SmolLM2-135M-Instruct (`smollm2`), with its start-up times.
"""

from __future__ import annotations

import argparse
import gc
import math
import random
import sys
import time
from dataclasses import dataclass

import torch

from pdserve.bench import step_profile
from pdserve.bench.report import write_report
from pdserve.engine.demo import build_random_model, cache_root

MODEL_SPEC = dict(arch="llama", hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                  intermediate_size=2048, vocab_size=32000, max_position_embeddings=2048, init_std=0.02, seed=0)


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def useful_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(n: int, prompt_range: tuple[int, int], output_range: tuple[int, int], seed: int) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, MODEL_SPEC["vocab_size"]) for _ in range(rng.randint(*prompt_range))] for _ in range(n)]
    return Workload(prompts, [rng.randint(*output_range) for _ in range(n)])


def model_dir() -> str:
    path = cache_root() / "bench" / "llama-100m-v1"
    if not (path / "config.json").exists():
        print(f"building the benchmark model in {path} ...", file=sys.stderr, flush=True)
        build_random_model(path, **MODEL_SPEC)
    return str(path)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- pdserve ------------------------------------------------------------------------------------

def run_pdserve(path: str, dtype: str, wl: Workload) -> dict:
    from pdserve.engine import LLM, SamplingParams

    began = time.perf_counter()
    llm = LLM(path, dtype=dtype, max_num_seqs=256, enable_prefix_caching=False)
    load_s = time.perf_counter() - began
    llm.generate({"prompt_token_ids": wl.prompts[0][:16]}, SamplingParams(max_tokens=4))  # warm-up
    core = llm.engine.client.engine_core
    core.record_steps()
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in wl.output_lens]
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in wl.prompts], params, use_tqdm=True)
    wall = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert produced == wl.useful_tokens, (produced, wl.useful_tokens)
    records = core.step_records
    timings = [r.timing for r in records if r.timing is not None]
    forward = sum(t.forward_s for t in timings)
    decode_steps = [r for r in records if r.timing and r.timing.num_decodes == r.timing.num_reqs]
    decode_time = sum(r.updated - r.start for r in decode_steps)
    decode_tokens = sum(r.timing.num_tokens for r in decode_steps)
    result = {
        "tokens": produced, "seconds": wall, "load_s": load_s, "steps": len(records), "forward_s": forward,
        "prepare_s": sum(t.prepare_s for t in timings), "sample_s": sum(t.sample_s for t in timings),
        "schedule_s": sum(r.scheduled - r.start for r in records), "update_s": sum(r.updated - r.executed for r in records),
        "decode_steps": len(decode_steps),
        "decode_tok_s": decode_tokens / decode_time if decode_time else 0.0,
        "decode_batch": decode_tokens / len(decode_steps) if decode_steps else 0.0,
        "decode_context": (sum(r.timing.decode_context_tokens for r in decode_steps) / decode_tokens) if decode_tokens else 0.0,
    }
    llm.shutdown()
    return result


# -- transformers ---------------------------------------------------------------------------------

def load_hf(path: str, dtype: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@torch.inference_mode()
def run_hf_static(path: str, dtype: str, wl: Workload, batch_size: int) -> dict:
    from tqdm import tqdm

    model = load_hf(path, dtype)
    model.generate(torch.tensor([wl.prompts[0][:16]]), max_new_tokens=2, do_sample=False)  # warm-up
    start = time.perf_counter()
    batches = range(0, len(wl.prompts), batch_size)
    for i in tqdm(batches, desc=f"transformers generate (batch {batch_size})", unit="batch", file=sys.stderr):
        prompts, lens = wl.prompts[i:i + batch_size], wl.output_lens[i:i + batch_size]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max(lens), do_sample=False)
        assert out.shape[1] == width + max(lens)
    wall = time.perf_counter() - start
    del model
    gc.collect()
    return {"tokens": wl.useful_tokens, "seconds": wall}


# no_grad, not inference_mode: the manager's worker thread updates tensors created here.
@torch.no_grad()
def run_hf_continuous(path: str, dtype: str, wl: Workload, max_batch_tokens: int) -> dict | None:
    from tqdm import tqdm
    from transformers import ContinuousBatchingConfig, GenerationConfig

    model = load_hf(path, dtype)
    if not hasattr(model, "continuous_batching_context_manager"):
        return None
    page = 256
    blocks = sum(math.ceil((len(p) + n) / page) for p, n in zip(wl.prompts, wl.output_lens)) + 8
    config = ContinuousBatchingConfig(page_size=page, num_blocks=blocks, max_batch_tokens=max_batch_tokens)
    gen = GenerationConfig(do_sample=False, max_new_tokens=max(wl.output_lens), eos_token_id=None, pad_token_id=0)
    produced = 0
    start = time.perf_counter()
    with model.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=config,
                                                   block=True, timeout=30) as manager:
        ids = [manager.add_request(p, max_new_tokens=n) for p, n in zip(wl.prompts, wl.output_lens)]
        done: set[str] = set()
        with tqdm(total=len(ids), desc="transformers continuous batching", unit="req", file=sys.stderr) as bar:
            while len(done) < len(ids):
                result = manager.get_result(timeout=1)
                if result is not None and result.error is not None:
                    raise RuntimeError(f"transformers continuous batching failed: {result.error}")
                if result is not None and result.is_finished() and result.request_id not in done:
                    done.add(result.request_id)
                    produced += len(result.generated_tokens)
                    bar.update(1)
                elif result is None and not manager.is_running():
                    raise RuntimeError("transformers' continuous batching manager stopped")
    wall = time.perf_counter() - start
    assert produced == wl.useful_tokens, (produced, wl.useful_tokens)
    del model
    gc.collect()
    return {"tokens": produced, "seconds": wall}


# -- roofline ---------------------------------------------------------------------------------

def measure_read_bandwidth(gib: float = 1.0) -> float:
    """Bytes/s of streaming a large tensor through a reduction (memory read bound), the best of five reads."""
    x = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
    x.sum()
    best = min(_timed(lambda: x.sum()) for _ in range(5))
    return x.numel() * 4 / best


def measure_matmul_rate(dtype: torch.dtype, n: int = 2048) -> float:
    """FLOP/s of the fastest large matmul this CPU has for `dtype` weights.

    F.linear, the engine's path or oneDNN's, not `a @ b`: on CPUs without native bf16 a square
    bf16 matmul takes a path 60x slower than F.linear's. And never slower than float32: where bf16
    is emulated, widening bf16 weights to fp32 (as the engine does there) reaches the fp32 rate,
    so that rate is the ceiling a bf16 engine is measured against.
    """
    from pdserve.engine.model import layers

    def rate(dt: torch.dtype) -> float:
        x, w = torch.randn(n, n).to(dt), torch.randn(n, n).to(dt)
        # F.linear, the engine's own path for these rows (our layouts where they serve them) and oneDNN's
        # packed matmul: on AMD's AVX-512 CPUs MKL's float32 GEMM runs AVX2 code at half the rate of the
        # other two, so F.linear alone made a roofline that a step could beat twice over.
        packed = layers.pack_weight(w)
        ways = [lambda: torch.nn.functional.linear(x, w)]
        if layers.linear_path(w, packed, None, n) != "torch":  # else the engine's path is that same F.linear
            ways.append(lambda: layers.linear(x, w, None, packed))
        if layers.packing_supported(dt):
            onednn = torch.ops.mkldnn._reorder_linear_weight(w, 64)
            ways.append(lambda: torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], ""))
        best = float("inf")
        for way in ways:
            way()
            best = min(best, *(_timed(way) for _ in range(5)))
        return 2 * n ** 3 / best
    return max(rate(dtype), rate(torch.float32)) if dtype != torch.float32 else rate(dtype)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def decode_roofline(dtype: torch.dtype, batch: float, context: float, bandwidth: float, flops_rate: float) -> dict:
    s = MODEL_SPEC
    h, layers, inter, vocab = s["hidden_size"], s["num_hidden_layers"], s["intermediate_size"], s["vocab_size"]
    head_dim = h // s["num_attention_heads"]
    kv_width = s["num_key_value_heads"] * head_dim
    linear_params = layers * (h * (h + 2 * kv_width) + h * h + 3 * h * inter) + vocab * h
    elem = torch.empty((), dtype=dtype).element_size()
    kv_bytes = batch * context * 2 * layers * kv_width * elem
    bytes_read = linear_params * elem + kv_bytes
    flops = 2 * batch * linear_params + 4 * batch * context * layers * s["num_attention_heads"] * head_dim
    t_mem, t_compute = bytes_read / bandwidth, flops / flops_rate
    return {"roofline_tok_s": batch / max(t_mem, t_compute), "bound": "memory" if t_mem >= t_compute else "compute",
            "bytes_per_step": bytes_read, "flops_per_step": flops}


# -- step profile ---------------------------------------------------------------------------------

PROFILE_KV_BLOCKS = 1600  # room for the largest kind (64 requests of ~270 tokens in blocks of 16)
PROFILE_ROUNDS = 3


def run_profile(model: str, dtype: str, flops_rate: float, quick: bool) -> list[dict]:
    """Rows of step_profile's table for `model` (a path or a name pdserve resolves)."""
    from pdserve.engine import LLM

    llm = LLM(model, dtype=dtype, max_num_seqs=256, enable_prefix_caching=False, num_kv_blocks=PROFILE_KV_BLOCKS)
    runner = llm.engine.client.engine_core.executor.worker.runner
    kinds = step_profile.DEFAULT_KINDS
    if quick:
        kinds = tuple(k for k in kinds if k.name in ("prefill 512", "decode b16"))
    # Each kind's roofline from the read rate measured next to its steps; the kinds in rounds (fastest_round).
    profiles = step_profile.profile_step_kinds(runner, kinds, PROFILE_KV_BLOCKS, repeats=2 if quick else 5,
                                               profiled=1 if quick else 3, read_rate=measure_read_bandwidth,
                                               rounds=1 if quick else PROFILE_ROUNDS)
    llm.shutdown()
    # The matmul rate timed again after the rounds, the higher kept: a rate timed in the machine's slow
    # minutes would set a roofline that steps timed in its fast ones beat too easily.
    if not quick:
        flops_rate = max(flops_rate, measure_matmul_rate(getattr(torch, dtype)))
    return step_profile.report_rows(profiles, flops_rate=flops_rate, dtype=dtype)


PROFILE_META = {
    "how": f"the model runner driven directly, one step kind at a time, the kinds in {PROFILE_ROUNDS} interleaved "
           "rounds (1 with --quick); "
           "ms_per_step is the fastest unprofiled step of the fastest round, the shares come from that round's "
           "fastest profiled step, the read rate is the best measured beside any round's steps and the "
           "matmul rate the best of its timings before and after the rounds (module hooks label matmul/norm/rotary/embed, "
           "the runner's attention/KV-write/sampler calls are labelled too); python is the step's wall time "
           "outside every op, profiler overhead included",
    "ipc": "not in this process: LLM runs the engine core in-process (pdserve serve adds the front end's "
           "ZMQ hop per step)",
}


# -- main -------------------------------------------------------------------------------------

def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="bench_offline")
    parser.add_argument("--quick", action="store_true", help="16 short requests, for a smoke run")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--max-batch-tokens", type=int, default=2048)
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers baselines")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-smollm2", action="store_true", help="skip the real-model (SmolLM2) rows")
    parser.add_argument("--no-profile", action="store_true",
                        help="skip the per-step-kind profile (torch profiler on single steps)")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    if args.quick:
        wl = make_workload(16, (16, 128), (8, 48), args.seed)
    else:
        wl = make_workload(args.num_requests, (32, 512), (16, 256), args.seed)
    path = model_dir()
    log(f"workload: {len(wl.prompts)} requests, {sum(map(len, wl.prompts))} prompt tokens, "
        f"{wl.useful_tokens} output tokens; model {path}")
    throughput_rows, step_rows, roofline_rows, profile_rows = [], [], [], []
    for dtype in args.dtypes.split(","):
        log(f"\n--- {dtype} ---")
        # The decode roofline's read rate, measured on either side of pdserve's run: a shared VM's
        # bandwidth moves from minute to minute, so one measured at the start would not hold for later runs.
        before = measure_read_bandwidth()
        ours = run_pdserve(path, dtype, wl)
        run_bandwidth = max(before, measure_read_bandwidth())
        systems = {"pdserve": ours}
        if not args.no_hf:
            systems["transformers generate (static)"] = run_hf_static(path, dtype, wl, args.hf_batch_size)
            cb = run_hf_continuous(path, dtype, wl, args.max_batch_tokens)
            if cb is not None:
                systems["transformers continuous batching"] = cb
        ours_rate = ours["tokens"] / ours["seconds"]
        for name, r in systems.items():
            rate = r["tokens"] / r["seconds"]
            throughput_rows.append({"system": name, "dtype": dtype, "useful_tokens": r["tokens"],
                                    "seconds": r["seconds"], "tok_s": rate, "pdserve_speedup": ours_rate / rate})
        steps = ours["steps"]
        outside = ours["seconds"] - ours["forward_s"]
        step_rows.append({
            "dtype": dtype, "steps": steps, "wall_s": ours["seconds"], "forward_s": ours["forward_s"],
            "outside_forward_pct": 100 * outside / ours["seconds"],
            "schedule_ms": 1e3 * ours["schedule_s"] / steps, "prepare_ms": 1e3 * ours["prepare_s"] / steps,
            "sample_ms": 1e3 * ours["sample_s"] / steps, "update_ms": 1e3 * ours["update_s"] / steps,
            "other_ms": 1e3 * (outside - ours["schedule_s"] - ours["prepare_s"] - ours["sample_s"] - ours["update_s"]) / steps,
        })
        tdtype = getattr(torch, dtype)
        rate = measure_matmul_rate(tdtype)
        roof = decode_roofline(tdtype, ours["decode_batch"], ours["decode_context"], run_bandwidth, rate)
        roofline_rows.append({
            "dtype": dtype, "decode_batch": ours["decode_batch"], "decode_context": ours["decode_context"],
            "read_GB_s": run_bandwidth / 1e9, "matmul_GFLOP_s": rate / 1e9, "bound": roof["bound"],
            "roofline_tok_s": roof["roofline_tok_s"], "achieved_tok_s": ours["decode_tok_s"],
            "fraction": ours["decode_tok_s"] / roof["roofline_tok_s"],
        })
        if not args.no_profile:
            profile_rows += run_profile(path, dtype, rate, args.quick)
    meta = {"model": MODEL_SPEC, "requests": len(wl.prompts), "prompt_tokens": sum(map(len, wl.prompts)),
            "output_tokens": wl.useful_tokens, "threads": torch.get_num_threads(), "hf_batch_size": args.hf_batch_size,
            "quick": args.quick}
    write_report("offline", throughput_rows, title="Offline throughput (useful output tokens/s)", meta=meta)
    write_report("offline_steps", step_rows, title="pdserve engine steps: time outside the model forward", meta=meta)
    write_report("offline_roofline", roofline_rows, title="Decode step roofline at pdserve's achieved batch", meta=meta)
    if profile_rows:
        write_report("offline_profile", profile_rows, title="pdserve step kinds: ms per step, % of it per category, "
                     "roofline fraction", meta={**meta, **PROFILE_META})
    if not args.no_smollm2:
        run_smollm2(args, wl)


def run_smollm2(args: argparse.Namespace, wl: Workload) -> None:
    """The same workload on the real model, SmolLM2-135M-Instruct: 30 thin layers (hidden 576), so
    the per-layer cost outside the matmuls weighs more than in the 12-layer bench model.

    Also timed: converting its GGUF (a first start; skipped with --quick) and building the engine
    from the cached conversion (every later start).
    """
    import tempfile
    from pathlib import Path

    from pdserve.engine.demo import resolve_model
    from pdserve.engine.model.gguf_convert import convert_gguf, smollm2_gguf

    log("\n--- smollm2 ---")
    convert_s = None
    if not args.quick:
        with tempfile.TemporaryDirectory() as scratch:
            began = time.perf_counter()
            convert_gguf(smollm2_gguf(), name="smollm2", cache=Path(scratch))
            convert_s = time.perf_counter() - began
    path = resolve_model("smollm2")
    rows = []
    dtypes = ["float32"] if args.quick else args.dtypes.split(",")
    for dtype in dtypes:
        ours = run_pdserve("smollm2", dtype, wl)
        systems = {"pdserve": ours}
        if not args.no_hf:
            systems["transformers generate (static)"] = run_hf_static(path, dtype, wl, args.hf_batch_size)
        ours_rate = ours["tokens"] / ours["seconds"]
        for name, r in systems.items():
            rate = r["tokens"] / r["seconds"]
            rows.append({"system": name, "dtype": dtype, "useful_tokens": r["tokens"], "seconds": r["seconds"],
                         "tok_s": rate, "pdserve_speedup": ours_rate / rate,
                         "outside_forward_pct": 100 * (1 - r["forward_s"] / r["seconds"]) if "forward_s" in r else None,
                         "cached_start_s": r.get("load_s")})
    meta = {"model": "smollm2 (SmolLM2-135M-Instruct, Q4_1 GGUF dequantized)", "requests": len(wl.prompts),
            "prompt_tokens": sum(map(len, wl.prompts)), "output_tokens": wl.useful_tokens,
            "threads": torch.get_num_threads(), "gguf_convert_s": convert_s, "quick": args.quick}
    write_report("offline_smollm2", rows, title="Offline throughput on SmolLM2-135M (useful output tokens/s)", meta=meta)
    if not args.no_profile:
        profile_rows = run_profile("smollm2", "float32", measure_matmul_rate(torch.float32), args.quick)
        write_report("offline_profile_smollm2", profile_rows, title="SmolLM2-135M step kinds (float32): ms per step, "
                     "% of it per category, roofline fraction", meta={**meta, **PROFILE_META})


if __name__ == "__main__":
    main(sys.argv[1:])
