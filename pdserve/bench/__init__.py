"""`pdserve bench`: benchmarks and load generators, one sub-command each.

Sub-command modules are imported only when named, so importing `pdserve.bench.report` (which every
benchmark does) stays free of httpx and numpy.
"""

from __future__ import annotations

import argparse
import importlib

# name -> (module exposing add_arguments/run, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("pdserve.bench.serve", "load-test an OpenAI-compatible endpoint with streaming requests"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        child = sub.add_parser(name, help=help_text)
        module.add_arguments(child)
        child.set_defaults(_bench_run=module.run)


def run(args: argparse.Namespace) -> int | None:
    return args._bench_run(args)
