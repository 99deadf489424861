"""Structured outputs: what a JSON-schema constraint costs in decode throughput, and how long a
grammar takes to compile.

Throughput: SmolLM2-135M-Instruct (`smollm2`, the real model), 16 chat prompts asking for a
person record as JSON, greedy, all submitted at once (batch 16): unconstrained (ignore_eos, so
every step holds the whole batch) and under a JSON schema. Constrained requests end when their
JSON does, so the comparison uses the steps where all 16 requests decode together, and where a
step's time goes (schedule: includes filling the bitmask; sample: includes applying it; update:
includes advancing the matchers). The two runs alternate for several rounds and each is summed
up by its median step. Target: constrained >= 0.90 x unconstrained decode tokens/s. `ratio`
compares whole steps; `ratio_same_forward` adds each run's time outside the forward (all the
grammar work is there) to the same forward time, which is what to read on a machine whose load
swings: the forward itself is the same computation in both runs.

Compile: through the engine's StructuredOutputManager: the tokenizer description xgrammar builds
once per engine, a cold compile, and a cached one (the LRU hit every later request with the same
schema gets); for the typical schema, and for one with a length-bounded string (maxLength),
which xgrammar expands into a much larger grammar.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from pdserve.bench.report import write_report

BATCH = 16
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "email": {"type": "string"},
        "role": {"enum": ["engineer", "designer", "manager", "scientist"]},
        "skills": {"type": "array", "items": {"type": "string"}, "maxItems": 6},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                           "country": {"type": "string"}, "zip": {"type": "string", "pattern": "[0-9]{5}"}},
            "required": ["city", "country"],
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "skills", "address", "active"],
}
SUBJECTS = ["a chef in Lyon", "a pilot", "a retired teacher", "a marathon runner", "a violinist", "a beekeeper",
            "a software engineer in Oslo", "a nurse", "an architect", "a fisherman", "a librarian", "a botanist",
            "a taxi driver in Rome", "a chess player", "a carpenter", "a physicist"]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def chat_prompts(llm) -> list[dict]:
    processor = llm.engine.input_processor
    return [{"prompt_token_ids": processor.apply_chat_template(
        [{"role": "user", "content": f"Describe {s} as a JSON record with name, age, role, skills, address "
                                     f"and whether they are active."}], True)} for s in SUBJECTS[:BATCH]]


def generate_recorded(llm, prompts: list[dict], params) -> tuple[list, list, int]:
    """Outputs, the steps that decoded the whole batch, and the tokens produced."""
    core = llm.engine.client.engine_core
    core.record_steps()
    outputs = llm.generate(prompts, params)
    records = core.step_records or []
    core.record_steps(False)
    full = [r for r in records if r.timing and r.timing.num_reqs == BATCH and r.timing.num_decodes == BATCH]
    if not full:
        raise RuntimeError("no step decoded the whole batch: raise --max-tokens")
    return outputs, full, sum(len(o.outputs[0].token_ids) for o in outputs)


def summarize(steps: list, tokens: int) -> dict:
    median = statistics.median
    step_s = median(r.updated - r.start for r in steps)
    return {
        "full_batch_steps": len(steps), "tokens": tokens,
        "decode_tok_s": BATCH / step_s,
        "step_ms": 1e3 * step_s,
        "forward_ms": 1e3 * median(r.timing.forward_s for r in steps),
        "schedule_ms": 1e3 * median(r.scheduled - r.start for r in steps),
        "sample_ms": 1e3 * median(r.timing.sample_s for r in steps),
        "update_ms": 1e3 * median(r.updated - r.executed for r in steps),
        "outside_forward_ms": 1e3 * median((r.updated - r.start) - r.timing.forward_s for r in steps),
    }


def run_throughput(args: argparse.Namespace) -> tuple[list[dict], dict]:
    import jsonschema

    from pdserve.engine import LLM, SamplingParams
    from pdserve.engine.structured_output.params import StructuredOutputsParams, canonical_json

    llm = LLM("smollm2", dtype=args.dtype, max_model_len=1024, max_num_seqs=BATCH, enable_prefix_caching=False)
    try:
        prompts = chat_prompts(llm)
        so = StructuredOutputsParams(json=canonical_json(SCHEMA))
        free = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        constrained = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, structured_outputs=so)
        llm.generate(prompts[:2], [free.clone(max_tokens=4), constrained.clone(max_tokens=4)])  # warm-up, compile
        runs = {"unconstrained": free, "json_schema": constrained}
        steps: dict[str, list] = {name: [] for name in runs}
        tokens = dict.fromkeys(runs, 0)
        valid = finished = 0
        for round_ in range(args.rounds):
            for name, params in runs.items():
                log(f"round {round_ + 1}/{args.rounds}: {name} ...")
                outputs, full, produced = generate_recorded(llm, prompts, params)
                steps[name] += full
                tokens[name] += produced
                if name == "json_schema":
                    for out in outputs:
                        c = out.outputs[0]
                        if c.finish_reason == "stop":
                            jsonschema.validate(json.loads(c.text), SCHEMA)  # raises if a request broke its schema
                            valid += 1
                        finished += 1
        rows = [{"run": name, **summarize(steps[name], tokens[name])} for name in runs]
        base = rows[0]["decode_tok_s"]
        # On a shared machine the forward's time swings with the neighbours' load, and the
        # grammar never touches the forward: also compare the two runs' time outside it, each
        # added to the same forward (the faster of the two medians).
        forward = min(r["forward_ms"] for r in rows)
        for row in rows:
            row["ratio"] = row["decode_tok_s"] / base
            outside = row["outside_forward_ms"]
            row["ratio_same_forward"] = (forward + rows[0]["outside_forward_ms"]) / (forward + outside)
        rows[1]["grammar_ms_per_step"] = rows[1]["outside_forward_ms"] - rows[0]["outside_forward_ms"]
        return rows, {"valid_json": f"{valid}/{finished} finished within max_tokens and validated",
                      "rounds": args.rounds}
    finally:
        llm.shutdown()


def run_compile(args: argparse.Namespace) -> list[dict]:
    from pdserve.engine.config import EngineArgs
    from pdserve.engine.structured_output.manager import StructuredOutputManager
    from pdserve.engine.structured_output.params import StructuredOutputsParams, canonical_json
    from pdserve.engine.structured_output.request_state import StructuredOutputRequest

    config = EngineArgs(model="smollm2", max_model_len=1024).create_engine_config().model
    bounded = {**SCHEMA, "properties": {**SCHEMA["properties"], "name": {"type": "string", "maxLength": 40}}}
    schemas = {"typical": SCHEMA, "typical + maxLength 40": bounded}
    cold: dict[str, list[float]] = {name: [] for name in schemas}
    cached: dict[str, list[float]] = {name: [] for name in schemas}
    info_s = []
    for _ in range(args.compile_trials):
        manager = StructuredOutputManager(config)
        # A trivial schema first: it pays for the tokenizer description, once per engine.
        manager.grammar_for(StructuredOutputsParams(json=canonical_json({"type": "integer"}))).result()
        info_s.append(manager.compiler.tokenizer_info_seconds or 0.0)
        for name, schema in schemas.items():
            params = StructuredOutputsParams(json=canonical_json(schema))
            start = time.perf_counter()
            manager.grammar_for(params).result()
            cold[name].append(time.perf_counter() - start)
            for _ in range(50):
                state = StructuredOutputRequest(params)
                start = time.perf_counter()
                manager.start(state)
                assert state.compiled and manager.activate(state)  # a ready grammar and a fresh matcher
                cached[name].append(time.perf_counter() - start)
        manager.shutdown()
    median = statistics.median
    return [{"schema": name, "trials": args.compile_trials, "tokenizer_info_ms": 1e3 * median(info_s),
             "cold_compile_ms": 1e3 * median(cold[name]), "cold_min_ms": 1e3 * min(cold[name]),
             "cached_ms": 1e3 * median(cached[name])} for name in schemas]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="bench_structured")
    parser.add_argument("--quick", action="store_true", help="shorter outputs and fewer compile trials")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="output tokens per request (default 160; quick 48)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--compile-trials", type=int, default=None, help="cold compiles timed (default 5; quick 2)")
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds of both runs (default 3; quick 2)")
    args = parser.parse_args(argv)
    args.max_tokens = args.max_tokens or (48 if args.quick else 160)
    args.compile_trials = args.compile_trials or (2 if args.quick else 5)
    args.rounds = args.rounds or (2 if args.quick else 3)
    torch.set_num_threads(2)
    rows, extra = run_throughput(args)
    meta = {"model": "smollm2 (SmolLM2-135M-Instruct)", "batch": BATCH, "max_tokens": args.max_tokens,
            "dtype": args.dtype, "threads": torch.get_num_threads(), "grammar_engine": "xgrammar", "schema": SCHEMA,
            "target_ratio": 0.90, "quick": args.quick, **extra}
    write_report("structured", rows, title="Decode throughput with a JSON-schema constraint vs none (batch 16)",
                 meta=meta)
    compile_rows = run_compile(args)
    write_report("structured_compile", compile_rows, title="Grammar compile time, typical JSON schema (smollm2 vocab)",
                 meta={"model": "smollm2", "schema": SCHEMA, "quick": args.quick})


if __name__ == "__main__":
    main(sys.argv[1:])
