"""`pdserve generate`: offline generation with the LLM class; prints prompts and completions."""

from __future__ import annotations

import argparse

DEFAULT_PROMPTS = ["Hello, my name is", "The capital of France is", "def fibonacci(n):", "Permission is hereby granted"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="demo")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable; default: four examples)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--dtype", default="auto")


def run(args: argparse.Namespace) -> int:
    from pdserve.engine import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype)
    prompts = args.prompt or DEFAULT_PROMPTS
    outputs = llm.generate(prompts, SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens),
                           use_tqdm=True)
    for out in outputs:
        print(f"\nprompt:     {out.prompt!r}\ncompletion: {out.outputs[0].text!r}")
    return 0
