"""One way to report a benchmark: a plain-text table on stdout and the same rows as JSON."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any, Sequence

from pdserve.engine import cpu_info

RESULTS_DIR = Path(os.environ.get("PDSERVE_BENCH_DIR", "bench-results"))


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    if not rows:
        return "(no rows)"
    columns = list(columns or rows[0].keys())
    cells = [[_cell(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    line = "  ".join(c.ljust(w) for c, w in zip(columns, widths))
    rule = "  ".join("-" * w for w in widths)
    body = ["  ".join(v.rjust(w) if _numeric(v) else v.ljust(w) for v, w in zip(r, widths)) for r in cells]
    return "\n".join([line, rule, *body])


def _numeric(text: str) -> bool:
    return text.replace(".", "", 1).replace("-", "", 1).replace("x", "").replace("e", "").isdigit()


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value == 0 or 0.01 <= abs(value) < 1e6:
            return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
        return f"{value:.3g}"
    return str(value)


def machine_info() -> dict[str, Any]:
    """What a result depends on: on CPUs the vector extensions decide bf16 speed by several times."""
    info: dict[str, Any] = {"python": platform.python_version(), "cpus": os.cpu_count(),
                            "platform": platform.platform(), "cpu": cpu_info.model_name()}
    try:
        import torch

        from pdserve.engine.config import cpu_has_native_bf16
    except ImportError:
        return info
    info["torch"] = torch.__version__
    info["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    info["native_bf16"] = cpu_has_native_bf16()
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def write_report(name: str, rows: Sequence[dict[str, Any]], *, title: str, meta: dict[str, Any] | None = None,
                 columns: Sequence[str] | None = None) -> Path:
    """Print `rows` as a table under `title` and write them with `meta` to bench-results/<name>.json."""
    print(f"\n== {title} ==")
    print(format_table(rows, columns))
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    doc = {
        "benchmark": name,
        "title": title,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_info(),
        "meta": meta or {},
        "rows": list(rows),
    }
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    print(f"(written to {path})")
    return path
