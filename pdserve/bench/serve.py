"""`pdserve bench serve`: drive an OpenAI-compatible endpoint with synthetic load and report latencies."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from pdserve.bench import report
from pdserve.bench.loadgen import ENDPOINTS, LoadConfig, LoadError, LoadResult, normalize_base_url, run_load_sync
from pdserve.bench.workload import parse_range


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Send streaming requests to an OpenAI-compatible server and report throughput, "
                          "TTFT, TPOT, ITL and end-to-end latency.")
    parser.add_argument("--url", required=True, help="server root, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)")
    parser.add_argument("--model", help="model name to request (default: the first id from GET /v1/models)")
    parser.add_argument("--endpoint", choices=sorted(ENDPOINTS), default="completions",
                        help="/v1/completions or /v1/chat/completions (default: completions)")
    parser.add_argument("--num-requests", type=_positive_int, default=100, help="measured requests (default: 100)")
    parser.add_argument("--request-rate", type=_rate, default=float("inf"),
                        help="Poisson arrival rate in requests/s; inf sends all at once (default: inf)")
    parser.add_argument("--concurrency", type=_positive_int,
                        help="at most this many requests in flight; with an infinite rate, exactly this many")
    parser.add_argument("--input-len", type=_range, default=(32, 512), metavar="MIN:MAX",
                        help="prompt length in tokens, uniform per request (default: 32:512)")
    parser.add_argument("--output-len", type=_range, default=(16, 256), metavar="MIN:MAX",
                        help="max_tokens, uniform per request (default: 16:256)")
    parser.add_argument("--seed", type=int, default=0, help="seed for lengths, prompts and arrivals (default: 0)")
    parser.add_argument("--tokenizer", metavar="DIR",
                        help="Hugging Face tokenizer for exact prompt lengths (default: random words, approximate)")
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="send vLLM's ignore_eos so outputs are exactly max_tokens long (default: on)")
    parser.add_argument("--extra-body", type=_json_object, metavar="JSON", help="JSON object merged into each request")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="bearer token (default: $OPENAI_API_KEY)")
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request limit in seconds (default: 600)")
    parser.add_argument("--warmup", type=_non_negative_int, default=0, help="unmeasured requests sent first")
    parser.add_argument("--name", default="serve", help="report name (default: serve)")
    parser.add_argument("--json", type=Path, metavar="PATH",
                        help="write the JSON report here (default: bench-results/<name>.json)")
    parser.add_argument("--quiet", action="store_true", help="no progress line")


def config_from_args(args: argparse.Namespace) -> LoadConfig:
    return LoadConfig(url=args.url, model=args.model, endpoint=args.endpoint, num_requests=args.num_requests,
                      request_rate=args.request_rate, concurrency=args.concurrency, input_len=args.input_len,
                      output_len=args.output_len, seed=args.seed, tokenizer=args.tokenizer,
                      ignore_eos=args.ignore_eos, extra_body=args.extra_body, api_key=args.api_key,
                      timeout=args.timeout, warmup=args.warmup)


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    _raise_open_file_limit(config.concurrency or config.num_requests + config.warmup)
    try:
        result = run_load_sync(config, progress=not args.quiet)
    except LoadError as exc:
        print(f"pdserve bench serve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\npdserve bench serve: interrupted", file=sys.stderr)
        return 130
    write(result, args.name, args.json)
    return 0 if result.summary()["completed"] > 0 else 1


def report_rows(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per summary entry: the report reads top to bottom instead of as one very wide row."""
    return [{"metric": key, "value": value} for key, value in summary.items()]


def report_meta(result: LoadResult) -> dict[str, Any]:
    return {
        "config": result.config.public(),
        "model": result.model,
        "summary": result.summary(),
        "errors": [{"message": message, "count": count} for message, count in result.errors()],
        "max_in_flight": result.max_in_flight,
        "warmup": {"sent": len(result.warmup_results), "failed": sum(not r.ok for r in result.warmup_results)},
    }


def title_of(result: LoadResult) -> str:
    c = result.config
    arrivals = "all at once" if math.isinf(c.request_rate) else f"{c.request_rate:g} req/s"
    cap = f", concurrency {c.concurrency}" if c.concurrency else ""
    return (f"bench serve: {c.endpoint} {normalize_base_url(c.url)} model={result.model}, "
            f"{c.num_requests} requests, {arrivals}{cap}")


def write(result: LoadResult, name: str, json_path: Path | None) -> Path:
    summary = result.summary()
    path = _write_report(name, report_rows(summary), title_of(result), report_meta(result), json_path)
    errors = result.errors()
    if errors:
        print(f"failed requests ({summary['failed']}):")
        for message, count in errors:
            print(f"  {count} x {message}")
    return path


def _write_report(name: str, rows: list[dict[str, Any]], title: str, meta: dict[str, Any],
                  json_path: Path | None) -> Path:
    if json_path is None:
        return report.write_report(name, rows, title=title, meta=meta)
    # write_report always writes <RESULTS_DIR>/<name>.json; to honour --json without changing it,
    # let it write into a scratch folder next to the target and move the file into place.
    json_path = json_path.resolve()
    json_path.parent.mkdir(parents=True, exist_ok=True)
    saved = report.RESULTS_DIR
    printed = io.StringIO()
    with tempfile.TemporaryDirectory(dir=json_path.parent, prefix=".bench-") as scratch:
        report.RESULTS_DIR = Path(scratch)
        try:
            with contextlib.redirect_stdout(printed):
                written = report.write_report(name, rows, title=title, meta=meta)
        finally:
            report.RESULTS_DIR = saved
        os.replace(written, json_path)
    sys.stdout.write(printed.getvalue().replace(str(written), str(json_path)))
    sys.stdout.flush()
    return json_path


def _raise_open_file_limit(connections: int) -> None:
    """Each request in flight holds a socket; the usual soft limit of 1024 descriptors would turn a
    large all-at-once run into connection errors that say nothing about the server."""
    try:
        import resource
    except ImportError:  # not on this platform
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = connections + 256
    if soft != resource.RLIM_INFINITY and soft < wanted:
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def _range(text: str) -> tuple[int, int]:
    try:
        return parse_range(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or inf, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (or inf), got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value
