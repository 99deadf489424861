"""The GPU path's checks, shared by the pytest files and by a by-hand report run on a GPU machine.

What runs only on CUDA in pdserve: the compiled Triton kernels (`engine/attention/triton_paged.py`),
the model runner's choice of them for a cuda device, and the KV budget from free GPU memory
(`Worker._cuda_kv_budget`). The helpers here drive them with the engine's public API and compare
against Hugging Face transformers on the same device and dtype.

On a GPU machine, one command gathers every number docs/gpu-validation.md asks for:

    PYTHONSAFEPATH=1 python tests/gpu/gpu_checks.py report --json report.json

Without a GPU, `engine --device cpu --triton` runs the engine with the Triton backend in the
Triton interpreter (TRITON_INTERPRET=1 is set before triton is imported): the GPU path's
integration with the engine, minus compilation. Importing this module imports no triton.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import random
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TRITON_CASES = HERE.parent / "engine" / "triton_cases.py"



def _load_by_path(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


# The tests' tiny checkpoints (tests/support/model_specs.py, loaded by path: child processes here
# have no pytest and no tests/ on sys.path), and the ~100M one of benchmarks/bench_offline.py.
TINY_SPECS: dict[str, dict] = _load_by_path("pdserve_model_specs", HERE.parent / "support" / "model_specs.py").MODEL_SPECS
MODEL_100M = dict(arch="llama", hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                  intermediate_size=2048, vocab_size=32000, max_position_embeddings=2048, init_std=0.02, seed=0)
SPECS = {**TINY_SPECS, "llama_100m": MODEL_100M}

# Around block boundaries (block size 16), across several blocks, and one long enough to be chunked.
PROMPT_LENGTHS = [1, 7, 15, 16, 17, 40, 64, 130]


def random_prompts(seed: int, lengths: list[int], vocab: int = 4096) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def build_model(name: str, root: str | os.PathLike) -> str:
    from pdserve.engine.demo import build_random_model

    path = Path(root) / name
    if not (path / "config.json").exists():
        build_random_model(path, **SPECS[name])
    return str(path)


def matched_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two generations share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# -- the engine and its reference -------------------------------------------------------------------


def use_triton_backend() -> None:
    """Make the model runner pick the Triton kernels whatever the device (the CPU runs them in the
    interpreter): the same backend object attention_backend builds for cuda."""
    from pdserve.engine.attention import triton_paged
    from pdserve.engine.worker import model_runner

    def triton_backend(device):
        def attend(q, key_cache, value_cache, meta, scale, key=None, value=None):
            return triton_paged.paged_attention(q, key_cache, value_cache, meta, scale)

        return model_runner.AttentionBackend(triton_paged.plan, attend, triton_paged.write_kv)

    model_runner.attention_backend = triton_backend


class ReplayGraph:
    """Stands in for a CUDA graph where none can be recorded (engine/worker/decode_graphs.py's
    Graph): capture runs the step once and keeps it, a closure over the static input buffers and
    the metadata fixed at capture, as a graph keeps its kernels; replay runs it again."""

    def __init__(self) -> None:
        self.fn = None
        self.output = None

    def capture(self, fn) -> None:
        self.fn = fn
        self.output = fn()

    def replay(self) -> None:
        self.output = self.fn()


def use_replayed_graphs() -> None:
    """Make the model runner capture decode graphs on any device, with ReplayGraph recording them."""
    from pdserve.engine.worker import decode_graphs

    decode_graphs.graph_factory = lambda device: ReplayGraph


def engine_greedy(path: str, prompts: list[list[int]], max_new_tokens: int, device: str, dtype: str,
                  **engine_args: Any) -> tuple[list[list[int]], int]:
    """Greedy tokens per prompt, and how many decode steps replayed a captured graph."""
    from pdserve.engine import LLM, SamplingParams

    engine_args.setdefault("num_kv_blocks", 256)
    with LLM(path, device=device, dtype=dtype, **engine_args) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True))
        graphs = llm.engine.client.engine_core.executor.worker.runner.decode_graphs
    return [o.outputs[0].token_ids for o in outputs], graphs.replays if graphs is not None else 0


def load_hf(path: str, device: str, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device)
    model.eval()
    model.generation_config.eos_token_id = None  # exactly max_new_tokens, as ignore_eos does
    model.generation_config.pad_token_id = 0
    return model


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy `generate`, one prompt at a time (no padding to differ on)."""
    import torch

    device = next(model.parameters()).device
    results = []
    with torch.inference_mode():
        for ids in prompts:
            inputs = torch.tensor([ids], device=device)
            out = model.generate(inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                 attention_mask=torch.ones_like(inputs))
            results.append(out[0, len(ids):].tolist())
    return results


@dataclass
class ParityResult:
    model: str
    device: str
    dtype: str
    backend: str
    max_new_tokens: int
    prompt_lengths: list[int]
    # Leading tokens the engine shares with transformers, per prompt.
    matched: list[int]
    engine_tokens: list[list[int]] = field(repr=False)
    hf_tokens: list[list[int]] = field(repr=False)
    # Decode steps that replayed a captured graph (0 with --enforce-eager, or where none was captured).
    decode_graph_replays: int = 0

    @property
    def exact(self) -> bool:
        return all(m == self.max_new_tokens for m in self.matched)

    def summary(self) -> dict:
        """Everything but the token lists."""
        return {k: v for k, v in asdict(self).items() if k not in ("engine_tokens", "hf_tokens")}


def parity(name: str, root: str, device: str, dtype: str, max_new_tokens: int = 32, triton: bool = False,
           prompt_lengths: list[int] | None = None, **engine_args: Any) -> ParityResult:
    if triton:
        use_triton_backend()
    lengths = prompt_lengths or PROMPT_LENGTHS
    path = build_model(name, root)
    prompts = random_prompts(sum(map(ord, name)), lengths)
    hf_model = load_hf(path, device, dtype)
    expected = hf_greedy(hf_model, prompts, max_new_tokens)
    del hf_model
    _release(device)
    got, replays = engine_greedy(path, prompts, max_new_tokens, device, dtype, **engine_args)
    _release(device)
    backend = "triton" if triton or device.startswith("cuda") else "cpu"
    if triton and not device.startswith("cuda"):
        backend += " (interpreted)" if os.environ.get("TRITON_INTERPRET") == "1" else ""
    return ParityResult(name, device, dtype, backend, max_new_tokens, lengths,
                        [matched_prefix(a, b) for a, b in zip(got, expected)], got, expected, replays)


def first_token_logprob_gap(name: str, root: str, device: str, dtype: str, k: int = 5,
                            prompt_lengths: list[int] | None = None) -> dict:
    """Largest |engine - transformers| log-probability among the engine's top-k first tokens of each
    prompt. Unlike token parity, this does not hinge on near-ties flipping an argmax, so it also
    bounds how far 16-bit numerics drift."""
    import torch

    from pdserve.engine import LLM, SamplingParams

    lengths = prompt_lengths or PROMPT_LENGTHS
    path = build_model(name, root)
    prompts = random_prompts(sum(map(ord, name)) + 1, lengths)
    with LLM(path, device=device, dtype=dtype, num_kv_blocks=256) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0.0, max_tokens=1, logprobs=k))
    engine = [o.outputs[0].logprobs[0] for o in outputs]
    _release(device)
    model = load_hf(path, device, dtype)
    gaps = []
    with torch.inference_mode():
        for ids, top in zip(prompts, engine):
            hf = model(torch.tensor([ids], device=device)).logits[0, -1].float().log_softmax(-1)
            gaps.append(max(abs(lp.logprob - float(hf[token])) for token, lp in top.items()))
    del model
    _release(device)
    return dict(model=name, device=device, dtype=dtype, k=k, prompt_lengths=lengths, max_gap=max(gaps), gaps=gaps)


def _release(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


# -- kernels ---------------------------------------------------------------------------------------


def load_triton_cases():
    """tests/engine/triton_cases.py as a module (it imports no triton until a check runs)."""
    return _load_by_path("pdserve_triton_cases", TRITON_CASES)


def extra_attention_cases(cases_module) -> list:
    """Serving shapes beyond triton_cases.py's: block 16, head_dim 64/128, GQA, mixed batches, long
    contexts, every dtype, and the decode key split with empty segments."""
    case = cases_module.AttentionCase
    decodes_64 = tuple((1, c) for c in (0, 1, 15, 16, 17, 31, 255, 256, 257, 1023, 1500, 4095))
    return [
        case("gpu_hd64_gqa4_bf16_mixed", decodes_64 + ((128, 0), (300, 700), (17, 2000), (64, 64)),
             num_heads=16, num_kv_heads=4, head_dim=64, dtype="bfloat16"),
        case("gpu_hd64_gqa4_fp16_mixed", decodes_64 + ((128, 0), (300, 700), (17, 2000), (64, 64)),
             num_heads=16, num_kv_heads=4, head_dim=64, dtype="float16"),
        case("gpu_hd64_gqa4_fp32_mixed", decodes_64 + ((128, 0), (300, 700), (17, 2000)),
             num_heads=16, num_kv_heads=4, head_dim=64, dtype="float32"),
        case("gpu_hd128_gqa8_bf16_long", ((1, 16000), (1, 100), (2048, 0), (256, 6000)),
             num_heads=32, num_kv_heads=4, head_dim=128, dtype="bfloat16"),
        case("gpu_hd128_gqa4_fp32_mixed", ((1, 3000), (1, 10), (200, 500), (33, 0)),
             num_heads=32, num_kv_heads=8, head_dim=128, dtype="float32"),
        case("gpu_hd128_gqa4_bf16_32k_decode_auto_split", ((1, 32000), (1, 20000)),
             num_heads=32, num_kv_heads=8, head_dim=128, dtype="bfloat16"),
        # 16 segments over short contexts: most segments hold no key at all.
        case("gpu_hd128_bf16_forced_split_empty_segments", ((1, 5), (1, 300), (1, 16)),
             num_heads=32, num_kv_heads=8, head_dim=128, dtype="bfloat16", num_segments=16),
        case("gpu_hd64_mha_bf16_128_decodes", tuple((1, 50 + 37 * i) for i in range(128)),
             num_heads=12, num_kv_heads=12, head_dim=64, dtype="bfloat16"),
        case("gpu_hd128_gqa4_bf16_prefill_chunks", tuple((q, c) for q in (1, 64, 512) for c in (0, 16, 1000)),
             num_heads=32, num_kv_heads=8, head_dim=128, dtype="bfloat16", num_decodes=0),
    ]


def kernel_checks(device: str, bench: bool = False) -> list[dict]:
    """Every case of triton_cases.py (serving-sized ones too) plus the extras above, on `device`."""
    cases = load_triton_cases()
    cases.BENCH = bench
    results = cases.run(device, large=True, only=None)
    for case in extra_attention_cases(cases):
        try:
            result = cases.check_attention(case, device)
        except Exception:
            result = {"ok": False, "message": traceback.format_exc()}
        result["name"] = case.name
        results.append(result)
        errs = " ".join(f"{k}={v:.2e}" for k, v in result.items() if k.startswith("err_"))
        errs += "".join(f" {k}={result[k]}" for k in ("triton_ms", "torch_ms") if k in result)
        print(f"{'ok  ' if result['ok'] else 'FAIL'} {case.name} {errs} {result.get('message', '')}", flush=True)
    return results


# -- throughput (report only; never asserted) -------------------------------------------------------


def throughput(root: str, device: str, dtype: str, num_requests: int = 64, prompt_len: int = 128,
               output_len: int = 128) -> dict:
    """Offline output tokens/s of pdserve's LLM.generate and of transformers' batched `generate` on
    the same requests (equal prompt lengths, so transformers needs no padding). Each side runs
    twice and the second run counts: the first compiles the Triton kernels and warms the allocator."""
    import torch

    from pdserve.engine import LLM, SamplingParams

    path = build_model("llama_100m", root)
    prompts = random_prompts(7, [prompt_len] * num_requests, vocab=32000)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    useful = num_requests * output_len
    result: dict[str, Any] = dict(model="llama_100m", device=device, dtype=dtype, num_requests=num_requests,
                                  prompt_len=prompt_len, output_len=output_len)

    # With the decode graphs (the default on CUDA), then every step eager (--enforce-eager).
    for key, eager in (("pdserve", False), ("pdserve_eager", True)):
        with LLM(path, device=device, dtype=dtype, enforce_eager=eager) as llm:
            for run in range(2):
                start = time.perf_counter()
                outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
                elapsed = time.perf_counter() - start
            assert sum(len(o.outputs[0].token_ids) for o in outputs) == useful
            result[f"{key}_s"] = round(elapsed, 3)
            result[f"{key}_tok_s"] = round(useful / elapsed, 1)
            result["num_kv_blocks"] = llm.engine.config.num_kv_blocks
            graphs = llm.engine.client.engine_core.executor.worker.runner.decode_graphs
            result[f"{key}_graph_sizes"] = graphs.sizes if graphs is not None else []
        _release(device)

    model = load_hf(path, device, dtype)
    inputs = torch.tensor(prompts, device=device)
    with torch.inference_mode():
        for run in range(2):
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            start = time.perf_counter()
            out = model.generate(inputs, max_new_tokens=output_len, do_sample=False,
                                 attention_mask=torch.ones_like(inputs))
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
    assert out.shape == (num_requests, prompt_len + output_len)
    result["hf_generate_s"] = round(elapsed, 3)
    result["hf_generate_tok_s"] = round(useful / elapsed, 1)
    del model
    _release(device)
    return result


# -- the by-hand report ----------------------------------------------------------------------------


def environment() -> dict:
    import torch
    import transformers

    info: dict[str, Any] = dict(python=sys.version.split()[0], torch=torch.__version__,
                                transformers=transformers.__version__)
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, sms=props.multi_processor_count, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    cuda=torch.version.cuda)
    return info


def report(root: str) -> dict:
    out: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "environment": environment()}
    print(json.dumps(out["environment"]), flush=True)
    out["kernels"] = kernel_checks("cuda", bench=True)
    out["parity"] = []
    for name in [*TINY_SPECS, "llama_100m"]:
        for dtype in ("float32", "bfloat16"):
            try:
                row = parity(name, root, "cuda", dtype, max_new_tokens=64).summary()
            except Exception:
                row = {"model": name, "dtype": dtype, "error": traceback.format_exc()}
            print(json.dumps(row), flush=True)
            out["parity"].append(row)
    out["logprob_gaps"] = []
    for name in [*TINY_SPECS, "llama_100m"]:
        for dtype in ("float32", "bfloat16"):
            try:
                row = first_token_logprob_gap(name, root, "cuda", dtype)
            except Exception:
                row = {"model": name, "dtype": dtype, "error": traceback.format_exc()}
            print(json.dumps(row), flush=True)
            out["logprob_gaps"].append(row)
    out["throughput"] = []
    for dtype in ("float32", "bfloat16"):
        try:
            row = throughput(root, "cuda", dtype)
        except Exception:
            row = {"dtype": dtype, "error": traceback.format_exc()}
        print(json.dumps(row), flush=True)
        out["throughput"].append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    rep = sub.add_parser("report", help="on a GPU: kernels, parity fp32/bf16, throughput")
    ker = sub.add_parser("kernels", help="the Triton kernel cases (compiled) against the torch reference")
    ker.add_argument("--device", default="cuda")
    ker.add_argument("--bench", action="store_true")
    eng = sub.add_parser("engine", help="greedy parity of the engine with transformers on one model")
    eng.add_argument("--model", default="llama", choices=sorted(SPECS))
    eng.add_argument("--device", default="cpu")
    eng.add_argument("--dtype", default="float32")
    eng.add_argument("--max-new-tokens", type=int, default=32)
    eng.add_argument("--max-num-batched-tokens", type=int, default=None)
    eng.add_argument("--triton", action="store_true", help="use the Triton backend (interpreted on CPU)")
    eng.add_argument("--max-num-seqs", type=int, default=None)
    eng.add_argument("--graphs", action="store_true",
                     help="on the CPU: capture decode graphs too, recorded by ReplayGraph (CUDA records real ones)")
    eng.add_argument("--enforce-eager", action="store_true", help="no decode graphs (on CUDA)")
    for p in (rep, ker, eng):
        p.add_argument("--models-dir", default=None, help="where checkpoints are built (default: a temp folder)")
        p.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)

    # Triton kernels on CPU tensors run only in the interpreter; on cuda they must be compiled.
    device = "cuda" if args.command == "report" else args.device
    if device == "cpu" and (args.command == "kernels" or args.triton):
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("triton was imported before TRITON_INTERPRET=1 could be set")
        os.environ["TRITON_INTERPRET"] = "1"
    elif device.startswith("cuda") and os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("TRITON_INTERPRET=1 is set: the GPU checks need the real compiler")

    with tempfile.TemporaryDirectory() as tmp:
        root = args.models_dir or tmp
        if args.command == "report":
            result: Any = report(root)
            ok = all(r["ok"] for r in result["kernels"])
        elif args.command == "kernels":
            result = kernel_checks(args.device, bench=args.bench)
            ok = all(r["ok"] for r in result)
        else:
            extra = {}
            if args.max_num_batched_tokens:
                extra["max_num_batched_tokens"] = args.max_num_batched_tokens
            if args.max_num_seqs:
                extra["max_num_seqs"] = args.max_num_seqs
            if args.enforce_eager:
                extra["enforce_eager"] = True
            if args.graphs and not args.device.startswith("cuda"):
                use_replayed_graphs()
            r = parity(args.model, root, args.device, args.dtype, args.max_new_tokens, triton=args.triton, **extra)
            result = asdict(r)
            ok = r.exact
            print(json.dumps(r.summary()))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
