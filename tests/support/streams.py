"""A streaming completion read on a background thread, for tests that act while it runs."""

from __future__ import annotations

import json
import threading
import time
import traceback

import httpx


def stream_in_background(server, body: dict) -> tuple[threading.Thread, dict]:
    """Start a streaming request and return once its first chunk (or its end) has arrived.

    The result dict records `chunks`, `text`, `finish`, `error` (HTTP status, transport error or
    the stream's error event), `ended` (monotonic time) and `crash` (a traceback, should reading
    itself fail: kept apart so it is never taken for an error event). Setting `result["stop"]`
    makes the reader hang up after its next chunk.
    """
    result: dict = {"chunks": 0, "error": None, "text": "", "ended": None, "finish": None, "crash": None}
    started = threading.Event()

    def run() -> None:
        try:
            with httpx.stream("POST", f"{server.base_url}/completions", json=body, timeout=120) as resp:
                if resp.status_code != 200:
                    result["error"] = f"HTTP {resp.status_code}: {resp.read().decode()}"
                    return
                for line in resp.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    payload = json.loads(line[6:])
                    if "error" in payload:
                        result["error"] = payload["error"]["message"]
                        return
                    result["chunks"] += 1
                    result["text"] += payload["choices"][0]["text"]
                    result["finish"] = payload["choices"][0]["finish_reason"] or result["finish"]
                    started.set()
                    if result.get("stop"):
                        return
        except httpx.HTTPError as exc:
            result["error"] = f"{type(exc).__name__}: {exc}"
        except Exception:
            result["crash"] = traceback.format_exc()
        finally:
            result["ended"] = time.monotonic()
            started.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(60), "the stream never started"
    return thread, result
