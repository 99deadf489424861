"""Runs every benchmark in this folder (`bench_*.py`), or those named with --only.

Each benchmark module defines `main(argv: list[str]) -> None` and reports through
`pdserve.bench.report.write_report`, so results land in bench-results/<name>.json.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def available() -> list[str]:
    return sorted(p.stem.removeprefix("bench_") for p in HERE.glob("bench_*.py"))


def main() -> int:
    parser = argparse.ArgumentParser(description="pdserve benchmarks")
    parser.add_argument("--only", action="append", choices=available(), help="run only this benchmark (repeatable)")
    parser.add_argument("--quick", action="store_true", help="smaller workloads, for a smoke run")
    args, rest = parser.parse_known_args()
    sys.path.insert(0, str(HERE))
    # One internal key for every engine, router and store the benchmarks start, as in a deployment:
    # engines with a KV connector refuse to start without one.
    from pdserve.engine.internal_auth import ENV_KEY, generate_key

    os.environ.setdefault(ENV_KEY, generate_key())
    for name in args.only or available():
        print(f"\n#### benchmark: {name}", flush=True)
        start = time.perf_counter()
        module = importlib.import_module(f"bench_{name}")
        module.main((["--quick"] if args.quick else []) + rest)
        print(f"#### {name} took {time.perf_counter() - start:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
