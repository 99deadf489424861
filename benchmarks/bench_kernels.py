"""The fused elementwise ops of a decoder layer against the eager PyTorch they replace.

Per op (RMSNorm with the residual add, SiLU·mul, rotary of q and k, the KV cache write), at the shapes of SmolLM2-135M
(hidden 576, 9 heads / 3 KV heads of 64, intermediate 1536) and of the ~100M benchmark Llama of
bench_offline (hidden 768, 12 / 4 heads of 64, intermediate 2048), for 1 to 512 tokens, float32
and bfloat16: microseconds per call of the reference expression (fused.*_reference) and of the
kernel the engine picks on this machine, and their ratio. Then the whole effect: decode steps of
the benchmark model through `LLM.generate` at batch 1 and 16, model forward time per step with
the reference ops and with the fused ones (fused.use_reference toggles them in one process).
Then the float32 matmuls of one decode step of the benchmark model (its 12 layers and the
lm_head, weights read from memory as in a real step) three ways: weights in panels (our kernel,
csrc/cpu_panel_linear.cpp), oneDNN's packed layout, and F.linear (MKL), at 1 to 1024 rows; and
whole decode steps (batch 1, 16, 64) of that model loaded twice in one process, once with each
float32 packing (layers.float_packing), the step kinds alternated between the two. Where the CPU
has AMX or AVX512-BF16, the same in bfloat16: weights in AMX tiles (csrc/cpu_amx_linear.cpp) or in
pair groups (csrc/cpu_bf16_pair_linear.cpp) against oneDNN's packing and F.linear, with the GB/s the
weights stream at, and whole steps with each bf16 packing.
Last, whether torch.compile would pay: the MLP half of a layer as the engine runs it against
inductor's compile of the reference expression (static shapes, frozen weights) at 1/16/64 rows,
with the one-time compile cost.

Timings alternate the two paths round by round in one process and report medians, so a noisy
neighbour slows both alike; the ratio (eager / fused, above 1 = fused faster) is the result.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from pdserve.bench.report import write_report
from pdserve.engine.model import fused
from pdserve.engine.model.rotary import RotaryEmbedding

SHAPES = {  # name -> (hidden, heads, kv_heads, head_dim, intermediate)
    "smollm2": (576, 9, 3, 64, 1536),
    "bench-100m": (768, 12, 4, 64, 2048),
}


def _time_pair(eager, fast, rounds: int, min_s: float) -> tuple[float, float]:
    """Median microseconds per call of each, alternating rounds of enough calls to last min_s."""
    eager()
    fast()
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < min_s:
        eager()
        calls += 1
    per_round = max(3, calls)
    samples: dict[str, list[float]] = {"eager": [], "fused": []}
    for _ in range(rounds):
        for name, fn in (("eager", eager), ("fused", fast)):
            began = time.perf_counter()
            for _ in range(per_round):
                fn()
            samples[name].append((time.perf_counter() - began) / per_round * 1e6)
    return statistics.median(samples["eager"]), statistics.median(samples["fused"])


def op_cases(shape: tuple[int, int, int, int, int], tokens: int, dtype: torch.dtype):
    """(op name, eager call, fused call) on fresh inputs of one shape."""
    hidden, heads, kv_heads, head_dim, inter = shape
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    residual = torch.randn(tokens, hidden, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    gate_up = torch.randn(tokens, 2 * inter, generator=gen).to(dtype)
    rotary = RotaryEmbedding(head_dim, 2048, {"rope_theta": 10000.0}, dtype)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    positions = torch.randint(0, 2048, (tokens,), generator=gen)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(tokens, kv_heads, head_dim)
    block_size, blocks = 16, max(64, 2 * tokens // 16)
    key_cache = torch.zeros(blocks, block_size, kv_heads, head_dim, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    slots = torch.randperm(blocks * block_size, generator=gen)[:tokens]
    # The fused RMSNorm and rotary work in place: repeating them on the same buffers only keeps
    # rescaling values, which costs the same.
    return [
        ("add_rms_norm", lambda: fused.rms_norm_reference(x, residual, weight, 1e-5),
         lambda: fused.rms_norm(x, residual, weight, 1e-5)),
        ("silu_mul", lambda: fused.silu_mul_reference(gate_up), lambda: fused.silu_mul(gate_up)),
        ("rotary_qk", lambda: fused.rotate_qk_reference(positions, q, k, rotary.cos, rotary.sin, rotary.rotary_dim),
         lambda: fused.rotate_qk(positions, q, k, rotary.cos, rotary.sin, rotary.rotary_dim)),
        ("kv_write", lambda: fused.write_kv_reference(k, v, key_cache, value_cache, slots),
         lambda: fused.write_kv(k, v, key_cache, value_cache, slots)),
    ]


# -- torch.compile: does it pay on this CPU? ---------------------------------------------------------

class ReferenceMLPBlock(torch.nn.Module):
    """The dense half of a decoder layer as plain eager ops (add+RMSNorm, gate/up, SiLU·mul, down):
    what torch.compile would see and fuse if the engine compiled its step."""

    def __init__(self, weight: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.gate_up = torch.nn.Parameter(gate_up, requires_grad=False)
        self.down = torch.nn.Parameter(down, requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        h, _ = fused.rms_norm_reference(x, residual, self.weight, 1e-5)
        return torch.nn.functional.linear(fused.silu_mul_reference(torch.nn.functional.linear(h, self.gate_up)),
                                          self.down)


def run_compile(dtype: torch.dtype, token_counts: list[int], rounds: int, min_s: float) -> list[dict]:
    """The same block as the engine runs it (oneDNN-packed weights where they pay, our fused
    kernels) against torch.compile (inductor, weights frozen, one static shape per row count, as
    padded batch buckets would give) of the reference block. compile_s is the one-time cost."""
    import torch._inductor.config as inductor_config

    from pdserve.engine.model.layers import linear, pack_weight

    hidden, _, _, _, inter = SHAPES["bench-100m"]
    gen = torch.Generator().manual_seed(0)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    gate_up = (torch.randn(2 * inter, hidden, generator=gen) / hidden ** 0.5).to(dtype)
    down = (torch.randn(hidden, inter, generator=gen) / inter ** 0.5).to(dtype)
    packed_gate_up, packed_down = pack_weight(gate_up), pack_weight(down)
    inductor_config.freezing = True  # weights become constants: inductor may prepack them itself
    block = ReferenceMLPBlock(weight, gate_up, down).eval()
    rows = []
    with torch.no_grad():
        compiled = torch.compile(block, dynamic=False)
        for tokens in token_counts:
            x = torch.randn(tokens, hidden, generator=gen).to(dtype)
            residual = torch.randn(tokens, hidden, generator=gen).to(dtype)

            def engine() -> torch.Tensor:
                h, _ = fused.rms_norm(x.clone(), residual.clone(), weight, 1e-5)
                return linear(fused.silu_mul(linear(h, gate_up, None, packed_gate_up)), down, None, packed_down)

            began = time.perf_counter()
            compiled(x, residual)
            compile_s = time.perf_counter() - began
            torch.testing.assert_close(compiled(x, residual), engine(), rtol=1e-3, atol=1e-3)  # the same block
            engine_us, compiled_us = _time_pair(engine, lambda: compiled(x, residual), rounds, min_s)
            rows.append({"block": "add_rms_norm+gate_up+silu_mul+down", "shape": "bench-100m",
                         "dtype": str(dtype).removeprefix("torch."), "tokens": tokens, "engine_us": engine_us,
                         "compiled_us": compiled_us, "compile_s": compile_s,
                         "compiled_speedup": engine_us / compiled_us})
    return rows


LAYOUT_NAME = {"panels": "panels", "amx": "AMX tiles", "pairs": "pair groups"}


def our_layout(dtype: torch.dtype) -> str | None:
    """Our layout for `dtype` weights on this CPU (float32: panels; bfloat16: AMX tiles, else pair
    groups with AVX512-BF16), each measured against oneDNN's packing; None where we have none."""
    from pdserve.engine.model import layers

    if dtype == torch.float32:
        return "panels" if layers.panels_supported() else None
    if layers.amx_supported():
        return "amx"
    return "pairs" if layers.pair_groups_supported() else None


def matmul_title(dtype: torch.dtype) -> str:
    """The title of run_matmuls' table for `dtype`."""
    name, layout = str(dtype).removeprefix("torch."), LAYOUT_NAME[our_layout(dtype) or "panels"]
    return (f"a decode step's {name} matmuls (bench model): weights in {layout} vs oneDNN's packing vs F.linear "
            "(ms per step and GB/s of weights, medians of alternated rounds; sum_gb_s: a plain sum's read rate; "
            f"ratios: medians of the paired ratios, > 1: {layout} faster)")


def run_matmuls(row_counts: list[int], rounds: int, dtype: torch.dtype = torch.float32) -> list[dict]:
    """ms per decode step's matmuls in `dtype`, per layout (ours: float32 in panels, bfloat16 in AMX
    tiles or pair groups; oneDNN's packing; F.linear), alternated round by round: the medians, the GB/s the weights
    stream at with a plain sum's read rate beside them, and our layout's speed against the others as
    the median of the paired ratios (this machine's speed drifts within minutes; a round's pair does not)."""
    import torch.nn.functional as F

    from pdserve.engine.model import layers

    hidden, heads, kv_heads, head_dim, inter = SHAPES["bench-100m"]
    per_layer = [((heads + 2 * kv_heads) * head_dim, hidden), (hidden, heads * head_dim), (2 * inter, hidden),
                 (hidden, inter)]
    shapes = per_layer * 12 + [(32000, hidden)]
    gen = torch.Generator().manual_seed(0)
    weights = [(torch.randn(out_f, in_f, generator=gen) * 0.02).to(dtype) for out_f, in_f in shapes]
    ways = {"F.linear": lambda x, w, i: F.linear(x, w)}
    ours = our_layout(dtype)
    if ours is not None:
        pack = {"panels": layers.to_panels, "amx": layers.to_amx_tiles, "pairs": layers.to_pair_groups}[ours]
        packed, op = [pack(w) for w in weights], layers.layout_op(ours)
        ways[ours] = lambda x, w, i: op(x, packed[i], w.shape[0])
    if layers.packing_supported(dtype):
        onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in weights]
        ways["onednn"] = lambda x, w, i: torch.ops.mkldnn._linear_pointwise(x, onednn[i], None, "none", [], "")
    streamed = torch.ones((1 << 30) // 4)  # the read rate of a plain sum, next to each round
    ways["sum"] = lambda x, w, i: streamed.sum() if i == 0 else None
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    rows = []
    for count in row_counts:
        xs = {in_f: torch.randn(count, in_f, generator=gen).to(dtype) for _, in_f in shapes}
        # oneDNN's packed matmul is measured only where the engine uses it (layers.PACKED_ROWS):
        # far past it, at 1024 rows, it has crashed in this torch.
        high = layers.PACKED_ROWS[dtype][1]
        timed = {name: fn for name, fn in ways.items() if name != "onednn" or count <= high}

        def step(fn) -> None:
            for i, w in enumerate(weights):
                fn(xs[w.shape[1]], w, i)

        samples: dict[str, list[float]] = {name: [] for name in timed}
        for round_ in range(rounds + 1):  # the first round warms every way up (oneDNN builds primitives)
            for name, fn in timed.items():
                began = time.perf_counter()
                step(fn)
                if round_:
                    samples[name].append(time.perf_counter() - began)
        median = {name: statistics.median(t) for name, t in samples.items()}
        flops = 2 * count * sum(o * i for o, i in shapes)
        row = {"rows": count, **{f"{name}_ms": t * 1e3 for name, t in median.items() if name != "sum"},
               **{f"{name}_gflops": flops / t / 1e9 for name, t in median.items() if name != "sum"},
               **{f"{name}_gb_s": (streamed.numel() * 4 if name == "sum" else weight_bytes) / t / 1e9
                  for name, t in median.items()}}
        for other, label in (("F.linear", "flinear"), ("onednn", "onednn")):
            if ours in samples and other in samples:
                row[f"{ours}_vs_{label}"] = statistics.median(t / m for t, m in zip(samples[other], samples[ours]))
        rows.append(row)
    return rows


def run_packing_steps(rounds: int, dtype: str = "float32") -> list[dict]:
    """ms per step (bench_offline's step kinds) with weights in our layout (float32: panels, bfloat16:
    AMX tiles or pair groups) and in oneDNN's: two engines on the same checkpoint in this process, alternated; the
    medians and the median of the paired ratios."""
    import os

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_offline import PROFILE_KV_BLOCKS, model_dir

    from pdserve.bench import step_profile
    from pdserve.engine import LLM
    from pdserve.engine.model import layers

    ours = our_layout(getattr(torch, dtype))
    variable = "PDSERVE_FLOAT_PACKING" if dtype == "float32" else "PDSERVE_BF16_PACKING"
    packings = (ours, "onednn")
    kinds = list(step_profile.DEFAULT_KINDS)
    if ours is None or not layers.packing_supported(getattr(torch, dtype)):
        return []
    before = os.environ.get(variable)
    engines = {}
    try:
        for packing in packings:
            os.environ[variable] = packing  # read when the weights are packed, at load
            layers.float_packing.cache_clear()
            engines[packing] = LLM(model_dir(), dtype=dtype, max_num_seqs=256, enable_prefix_caching=False,
                                   num_kv_blocks=PROFILE_KV_BLOCKS)
        samples: dict[tuple[str, str], list[float]] = {}
        for _ in range(rounds):
            for kind in kinds:
                for packing, llm in engines.items():
                    runner = llm.engine.client.engine_core.executor.worker.runner
                    got = step_profile.profile_step_kind(runner, kind, PROFILE_KV_BLOCKS, repeats=5, profiled=0)
                    samples.setdefault((kind.name, packing), []).append(statistics.median(got.samples))
    finally:
        for llm in engines.values():
            llm.shutdown()
        if before is None:
            os.environ.pop(variable, None)
        else:
            os.environ[variable] = before
        layers.float_packing.cache_clear()
    rows = []
    for kind in kinds:
        mine, theirs = samples[(kind.name, ours)], samples[(kind.name, "onednn")]
        rows.append({"step": kind.name, f"{ours}_ms": 1e3 * statistics.median(mine),
                     "onednn_ms": 1e3 * statistics.median(theirs),
                     f"{ours}_speedup": statistics.median(t / m for t, m in zip(theirs, mine))})
    return rows


def run_ops(dtypes: list[torch.dtype], token_counts: list[int], rounds: int, min_s: float) -> list[dict]:
    rows = []
    for shape_name, shape in SHAPES.items():
        for dtype in dtypes:
            for tokens in token_counts:
                for op, eager, fast in op_cases(shape, tokens, dtype):
                    eager_us, fused_us = _time_pair(eager, fast, rounds, min_s)
                    rows.append({"op": op, "shape": shape_name, "dtype": str(dtype).removeprefix("torch."),
                                 "tokens": tokens, "eager_us": eager_us, "fused_us": fused_us,
                                 "speedup": eager_us / fused_us})
    return rows


def run_steps(dtype: str, batches: list[int], rounds: int, output_len: int) -> list[dict]:
    """Model forward ms per decode step, reference ops vs fused, alternating whole generate calls."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_offline import model_dir

    from pdserve.engine import LLM, SamplingParams

    llm = LLM(model_dir(), dtype=dtype, max_num_seqs=max(batches), enable_prefix_caching=False)
    core = llm.engine.client.engine_core
    rows = []
    try:
        for batch in batches:
            prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 30000 + 3 for j in range(64)]} for i in range(batch)]
            params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
            samples: dict[str, list[float]] = {"eager": [], "fused": []}
            tokens: dict[str, list[list[int]]] = {}
            for r in range(rounds + 1):  # round 0 warms both paths up and is not counted
                for mode in ("eager", "fused"):
                    fused.use_reference(mode == "eager")
                    core.record_steps()
                    outputs = llm.generate(prompts, params, use_tqdm=False)
                    tokens[mode] = [list(o.outputs[0].token_ids) for o in outputs]
                    steps = [rec.timing for rec in core.step_records
                             if rec.timing is not None and rec.timing.num_decodes == rec.timing.num_reqs == batch]
                    if r and steps:
                        samples[mode].append(statistics.median(t.forward_s for t in steps) * 1e3)
            fused.use_reference(False)
            eager_ms, fused_ms = statistics.median(samples["eager"]), statistics.median(samples["fused"])
            rows.append({"op": "decode_step_forward", "shape": "bench-100m", "dtype": dtype, "tokens": batch,
                         "eager_us": eager_ms * 1e3, "fused_us": fused_ms * 1e3, "speedup": eager_ms / fused_ms,
                         "same_tokens": tokens["eager"] == tokens["fused"]})
    finally:
        fused.use_reference(False)
        llm.shutdown()
    return rows


def _float_packing() -> str:
    from pdserve.engine.model import layers

    return layers.float_packing()


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="bench_kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes and rounds, for a smoke run")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated dtypes of the per-op rows")
    parser.add_argument("--no-steps", action="store_true", help="skip the whole decode step rows")
    parser.add_argument("--no-ops", action="store_true", help="skip the per-op rows")
    parser.add_argument("--step-dtype", default="float32", help="dtype of the decode step rows")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    parser.add_argument("--no-matmuls", action="store_true", help="skip the matmul layout rows")
    parser.add_argument("--no-packing-steps", action="store_true",
                        help="skip the steps with our weight layouts against oneDNN's packing")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    token_counts = [1, 16, 512] if args.quick else [1, 16, 64, 512]
    rounds = 3 if args.quick else 7
    rows = [] if args.no_ops else run_ops(dtypes, token_counts, rounds, min_s=0.005 if args.quick else 0.02)
    if not args.no_steps:
        rows += run_steps(args.step_dtype, [1, 16], rounds=2 if args.quick else 4, output_len=16 if args.quick else 48)
    if rows:
        write_report("kernels", rows, title="fused layer ops: eager vs fused (us per call; speedup = eager / fused)",
                     meta={"kernels_loaded": fused.cpu_kernels_ready(), "threads": torch.get_num_threads(),
                           "rounds": rounds, "quick": args.quick})
    if not args.no_matmuls:
        matmul_rows = run_matmuls([1, 16, 256] if args.quick else [1, 2, 4, 8, 16, 32, 64, 128, 512, 1024],
                                  rounds=2 if args.quick else 4)
        write_report("kernels_matmul", matmul_rows, title=matmul_title(torch.float32),
                     meta={"threads": torch.get_num_threads(), "float_packing_here": _float_packing(),
                           "quick": args.quick})
    if not args.no_matmuls:
        matmul_rows = run_matmuls([1, 16, 256] if args.quick else [1, 4, 16, 32, 64, 128, 512],
                                  rounds=2 if args.quick else 6, dtype=torch.bfloat16)
        if any(f"{our_layout(torch.bfloat16)}_ms" in row for row in matmul_rows):
            write_report("kernels_matmul_bf16", matmul_rows, title=matmul_title(torch.bfloat16),
                         meta={"threads": torch.get_num_threads(), "quick": args.quick})
    if not args.no_packing_steps:
        for name, table in (("float32", "kernels_packing_steps"), ("bfloat16", "kernels_bf16_packing_steps")):
            step_rows = run_packing_steps(rounds=2 if args.quick else 6, dtype=name)
            if step_rows:
                ours = our_layout(getattr(torch, name))
                write_report(table, step_rows,
                             title=f"steps of the bench model, {name} weights in "
                                   f"{LAYOUT_NAME[ours]} vs oneDNN's packing (ms per step, medians; both engines in "
                                   f"this process, alternated; {ours}_speedup: median of the paired ratios, > 1: "
                                   f"{LAYOUT_NAME[ours]} faster)",
                             meta={"threads": torch.get_num_threads(), "quick": args.quick})
    if not args.no_compile:
        compile_rows = run_compile(torch.float32, [1, 16, 64], rounds, min_s=0.005 if args.quick else 0.02)
        write_report("kernels_compile", compile_rows,
                     title="a decoder layer's MLP half: the engine's eager path vs torch.compile (us per call; "
                           "compiled_speedup > 1: compiling would pay)",
                     meta={"threads": torch.get_num_threads(), "rounds": rounds, "quick": args.quick})


if __name__ == "__main__":
    main(sys.argv[1:])
