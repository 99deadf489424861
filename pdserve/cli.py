"""The `pdserve` command.

Each subcommand lives with the package that implements it; this module only dispatches. A
subcommand module exposes `add_arguments(parser)` and `run(args) -> int | None`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module implementing it, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("pdserve.engine.server.cli", "run an OpenAI-compatible engine server"),
    "router": ("pdserve.router.cli", "run the OpenAI-compatible P/D router"),
    "coordinator": ("pdserve.router.coordinator_cli", "run the load/stats coordinator"),
    "epp": ("pdserve.router.epp.cli", "run the Gateway API Inference Extension endpoint picker (Envoy ext_proc)"),
    "kvstore": ("pdserve.kvstore.cli", "run the KV store service"),
    "operator": ("pdserve.operator.cli", "run or render the Kubernetes operator"),
    "up": ("pdserve.up", "start a whole local stack on one machine"),
    "bench": ("pdserve.bench", "benchmarks and load generators"),
    "generate": ("pdserve.engine.demo.cli", "offline generation demo with the LLM class"),
}


def _load(name: str):
    module_name, _ = SUBCOMMANDS[name]
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            return None
        raise


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    # Importing every subcommand would pull torch into `pdserve router --help`; load only the one named.
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (_, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name == chosen:
            module = _load(name)
            if module is None:
                parser.error(f"'{name}' is not available in this build")
            module.add_arguments(p)
            p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
