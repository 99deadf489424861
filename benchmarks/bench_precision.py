"""Precision: float32 against bfloat16 and int8 weights, on this CPU, and what `dtype auto` picks.

Two measurements, each an A/B inside this one process with the variants alternated:
1. The matmuls of one decode step of the bench model (bench_offline's ~100M Llama: hidden 768,
   12 layers, 4 KV heads, intermediate 2048, vocab 32000) at 1 and 16 rows, through the engine's
   own `linear` (prepacked float32, bfloat16 as this CPU runs it, int8 via engine/model/quant.py
   with a scale per row, q8_0 with a scale per 32 weights, and q8_0 with int8 activations too,
   `q8_0+a8`: W8A8, see quant.py; `bfloat16+int8`: int8 weights with a scale per row multiplied
   by bfloat16 rows, on AMX tiles where the CPU has AMX).
2. Decode throughput of the whole engine on that model, float32 against `quantization="int8"`,
   `"q8_0"` and `"q8_0"` with `int8_activations=True`, and bfloat16 with and without
   `quantization="int8"`: 1 and 16 requests of 16-token prompts each generating the same number of
   tokens. Rows of a bfloat16 model also say their ratio to bfloat16 weights (`vs_bfloat16`).
The `auto` row says which dtype `dtype auto` gives a bfloat16 checkpoint here, and whether the
measured step times agree (bfloat16 must be faster at both batch sizes to be the right pick).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from pdserve.bench.report import write_report

HIDDEN, LAYERS, HEADS, KV_HEADS, INTER, VOCAB = 768, 12, 12, 4, 2048, 32000


def step_shapes() -> list[tuple[int, int]]:
    """(out, in) of every matmul in one step: per layer qkv, o, gate_up, down; then the lm_head."""
    head = HIDDEN // HEADS
    layer = [((HEADS + 2 * KV_HEADS) * head, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]
    return layer * LAYERS + [(VOCAB, HIDDEN)]


def make_layers(dtype: str, shapes: list[tuple[int, int]]):
    from pdserve.engine.model.layers import linear, pack_weight
    from pdserve.engine.model.quant import Int8Linear

    gen = torch.Generator().manual_seed(0)
    fns = []
    for out_f, in_f in shapes:
        w = torch.randn(out_f, in_f, generator=gen) * 0.02
        if dtype == "bfloat16+int8":
            fns.append(Int8Linear(w.bfloat16()))
        elif dtype in ("int8", "q8_0", "q8_0+a8"):
            fns.append(Int8Linear(w, group=None if dtype == "int8" else 32, int8_activations=dtype == "q8_0+a8"))
        else:
            w = w.to(getattr(torch, dtype))
            packed = pack_weight(w)
            fns.append(lambda x, w=w, packed=packed: linear(x, w, None, packed))
    return fns


def time_step(fns, rows: int, dtype: torch.dtype, seconds: float) -> float:
    """Seconds per step: every matmul once on `rows` rows (fresh input each, as layers chain)."""
    xs = {f: torch.randn(rows, HIDDEN if i % 4 != 3 or i == len(fns) - 1 else INTER).to(dtype)
          for i, f in enumerate(fns)}
    for f in fns:
        f(xs[f])
    n, start = 0, time.perf_counter()
    while True:
        for f in fns:
            f(xs[f])
        n += 1
        if time.perf_counter() - start > seconds:
            return (time.perf_counter() - start) / n


def matmul_rows(rounds: int, seconds: float) -> tuple[list[dict], dict]:
    shapes = step_shapes()
    variants = {"float32": make_layers("float32", shapes), "bfloat16": make_layers("bfloat16", shapes),
                "int8": make_layers("int8", shapes), "q8_0": make_layers("q8_0", shapes),
                "q8_0+a8": make_layers("q8_0+a8", shapes), "bfloat16+int8": make_layers("bfloat16+int8", shapes)}
    acts = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.float32, "q8_0": torch.float32,
            "q8_0+a8": torch.float32, "bfloat16+int8": torch.bfloat16}
    best: dict[tuple[str, int], float] = {}
    for _ in range(rounds):  # alternate the variants, keep each one's best
        for rows in (1, 16):
            for name, fns in variants.items():
                t = time_step(fns, rows, acts[name], seconds)
                best[(name, rows)] = min(best.get((name, rows), float("inf")), t)
    rows_out = []
    for rows in (1, 16):
        base = best[("float32", rows)]
        for name in variants:
            t = best[(name, rows)]
            rows_out.append({"measure": "step matmuls", "batch": rows, "precision": name, "ms_per_step": t * 1e3,
                             "tok_per_s": rows / t, "vs_float32": base / t,
                             **vs_bfloat16(name, best[("bfloat16", rows)], t)})
    return rows_out, best


def vs_bfloat16(name: str, bf16_seconds: float, seconds: float) -> dict:
    """A bfloat16 model's row also against bfloat16 weights."""
    return {"vs_bfloat16": bf16_seconds / seconds} if name.startswith("bfloat16") else {}


def engine_rows(rounds: int, max_tokens: int) -> list[dict]:
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
    from bench_offline import model_dir

    from pdserve.engine import LLM, SamplingParams

    path = model_dir()
    engines = {"float32": LLM(path, dtype="float32", enable_prefix_caching=False, max_model_len=512),
               **{q: LLM(path, dtype="float32", quantization=q, enable_prefix_caching=False, max_model_len=512)
                  for q in ("int8", "q8_0")},
               "q8_0+a8": LLM(path, dtype="float32", quantization="q8_0", int8_activations=True,
                              enable_prefix_caching=False, max_model_len=512),
               "bfloat16": LLM(path, dtype="bfloat16", enable_prefix_caching=False, max_model_len=512),
               "bfloat16+int8": LLM(path, dtype="bfloat16", quantization="int8", enable_prefix_caching=False,
                                    max_model_len=512)}
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    best: dict[tuple[str, int], float] = {}
    for _ in range(rounds):
        for batch in (1, 16):
            prompts = [{"prompt_token_ids": [3 + (7 * i + j) % 30000 for j in range(16)]} for i in range(batch)]
            for name, llm in engines.items():
                llm.generate(prompts[:1], SamplingParams(max_tokens=2))  # warm
                start = time.perf_counter()
                llm.generate(prompts, params)
                wall = time.perf_counter() - start
                best[(name, batch)] = min(best.get((name, batch), float("inf")), wall)
    out = []
    for batch in (1, 16):
        for name in engines:
            rate = batch * max_tokens / best[(name, batch)]
            out.append({"measure": "engine decode", "batch": batch, "precision": name, "tok_per_s": rate,
                        "vs_float32": best[("float32", batch)] / best[(name, batch)],
                        **vs_bfloat16(name, best[("bfloat16", batch)], best[(name, batch)])})
    return out


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and tokens, for a smoke run")
    parser.add_argument("--no-engine", action="store_true", help="only the matmul rows (no engine start-ups)")
    args = parser.parse_args(argv)
    from pdserve.engine.config import auto_cpu_dtype_here

    rounds = 2 if args.quick else 4
    rows, best = matmul_rows(rounds, 0.2 if args.quick else 0.5)
    picked, why = auto_cpu_dtype_here(torch.bfloat16, {"hidden_size": HIDDEN, "num_attention_heads": HEADS,
                                                       "num_key_value_heads": KV_HEADS, "intermediate_size": INTER})
    bf16_faster = all(best[("bfloat16", r)] < best[("float32", r)] for r in (1, 16))
    measured = "bfloat16" if bf16_faster else "float32"
    auto = str(picked).removeprefix("torch.")
    rows.append({"measure": "dtype auto (bf16 checkpoint)", "precision": auto,
                 "note": f"{why}; measured faster at batch 1 and 16: {measured}"
                         + ("" if auto == measured else " (rule and measurement disagree)")})
    if not args.no_engine:
        rows += engine_rows(1 if args.quick else 2, 16 if args.quick else 64)
    write_report("precision", rows, title="Precision: float32 vs bfloat16 vs int8 weights (A/B in one process)",
                 meta={"threads": torch.get_num_threads(), "auto_pick": auto, "measured_faster": measured},
                 columns=["measure", "batch", "precision", "ms_per_step", "tok_per_s", "vs_float32", "vs_bfloat16",
                          "note"])


if __name__ == "__main__":
    main(sys.argv[1:])
