"""`pdserve up`: start a local stack on one machine and print how to call it.

Today the stack is one engine server (prefill and decode in the same engine); the P/D router and
coordinator join it when they exist.
"""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="demo", help="model directory, or 'demo' (built in, random weights)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--tensor-parallel-size", type=int, default=1)


def banner(url: str, model: str) -> str:
    body = f'{{"model": "{model}", "prompt": "Hello, my name is", "max_tokens": 32}}'
    return "\n".join([
        "",
        f"pdserve is up at {url}/v1 (model: {model})",
        "",
        "  curl:",
        f"    curl {url}/v1/completions -H 'Content-Type: application/json' -d '{body}'",
        "  openai SDK:",
        f"    python -c \"import openai; c = openai.OpenAI(base_url='{url}/v1', api_key='none'); "
        f"print(c.chat.completions.create(model='{model}', messages=[{{'role': 'user', 'content': 'Hi'}}], "
        f"max_tokens=32).choices[0].message.content)\"",
        f"  health and metrics: {url}/health  {url}/metrics",
        "",
        "The demo model has random weights: its text is gibberish, by design. Ctrl-C stops everything.",
        "",
    ])


def run(args: argparse.Namespace) -> int:
    from pdserve.engine.server import cli as serve_cli

    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    serve_args = parser.parse_args(["--model", args.model, "--host", args.host, "--port", str(args.port),
                                    "--dtype", args.dtype, "--tensor-parallel-size", str(args.tensor_parallel_size)])
    url = f"http://{args.host}:{args.port}"
    return serve_cli.run(serve_args, on_ready=lambda: print(banner(url, args.model), flush=True))
