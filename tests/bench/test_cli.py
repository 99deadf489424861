"""`pdserve bench serve` end to end: the installed command, as a subprocess, against the fake server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

PDSERVE = str(Path(sys.executable).with_name("pdserve"))


def pdserve(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PDSERVE_BENCH_DIR", "OPENAI_API_KEY")}
    env["PYTHONSAFEPATH"] = "1"
    return subprocess.run([PDSERVE, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


def test_serve_writes_a_json_report(server, tmp_path):
    out = tmp_path / "reports" / "run.json"
    proc = pdserve("bench", "serve", "--url", f"{server.url}/v1", "--num-requests", "8", "--concurrency", "2",
                   "--input-len", "4:8", "--output-len", "2:6", "--seed", "5", "--json", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "serve"
    summary = doc["meta"]["summary"]
    assert summary["completed"] == 8 and summary["failed"] == 0
    assert summary["output_tokens"] == sum(s.tokens_sent for s in server.fake.served)
    assert {row["metric"] for row in doc["rows"]} >= {"request_throughput", "ttft_p99_ms", "itl_p50_ms", "e2e_mean_ms"}
    assert doc["meta"]["model"] == "fake-model"
    assert doc["meta"]["config"]["concurrency"] == 2 and "api_key" not in doc["meta"]["config"]
    assert doc["meta"]["errors"] == []
    # The table went to stdout, naming the real path; nothing was left beside the report.
    assert "bench serve: completions" in proc.stdout and "ttft_p50_ms" in proc.stdout
    assert str(out) in proc.stdout
    assert sorted(p.name for p in out.parent.iterdir()) == ["run.json"]
    # Progress goes to stderr, the report to stdout.
    assert "bench serve: 8/8 done" in proc.stderr
    assert not (tmp_path / "bench-results").exists()


def test_all_failed_exits_1_and_shows_the_message_once(server, tmp_path):
    server.fake.behaviour.reject_unknown_fields = True
    proc = pdserve("bench", "serve", "--url", server.url, "--endpoint", "chat", "--num-requests", "5",
                   "--input-len", "4:8", "--output-len", "2:4", "--name", "strict", "--quiet", cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stdout.count("Extra inputs are not permitted") == 1
    assert "5 x HTTP 422" in proc.stdout
    assert proc.stderr == ""  # --quiet
    doc = json.loads((tmp_path / "bench-results" / "strict.json").read_text())
    assert doc["meta"]["errors"] == [{"message": "HTTP 422: body.ignore_eos: Extra inputs are not permitted",
                                      "count": 5}]

    proc = pdserve("bench", "serve", "--url", server.url, "--endpoint", "chat", "--num-requests", "5",
                   "--input-len", "4:8", "--output-len", "2:4", "--no-ignore-eos", "--extra-body",
                   '{"temperature": 0}', "--quiet", "--json", str(tmp_path / "ok.json"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads((tmp_path / "ok.json").read_text())["meta"]["summary"]["completed"] == 5


def test_bad_arguments_and_unreachable_server(tmp_path):
    proc = pdserve("bench", "serve", "--url", "http://127.0.0.1:9", "--input-len", "9:3", cwd=tmp_path)
    assert proc.returncode == 2 and "MIN <= MAX" in proc.stderr
    proc = pdserve("bench", "serve", "--url", "http://127.0.0.1:9", "--num-requests", "2", "--quiet", cwd=tmp_path)
    assert proc.returncode == 2 and "cannot list models" in proc.stderr
    proc = pdserve("bench", "serve", "--url", "http://127.0.0.1:9", "--model", "m", "--num-requests", "2",
                   "--quiet", "--json", str(tmp_path / "down.json"), cwd=tmp_path)
    assert proc.returncode == 1
    assert json.loads((tmp_path / "down.json").read_text())["meta"]["summary"]["failed"] == 2
