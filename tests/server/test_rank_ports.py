"""Per-rank ports (issue 22): `pdserve serve --data-parallel-size 2 --rank-port-base B` also listens
on B and B+1, and a request arriving on B+r runs on data-parallel rank r, as an InferencePool with
one targetPort per rank expects.

One real DP=2 server on 127.0.0.1 (the tiny checkpoint), with an API key and a small body limit so
that a rank port can be shown to keep every check of the main port. Which rank ran a request is
read from the server's per-rank counters (`vllm:request_success_total{engine="r"}`) on the main
port, which shows every rank; a rank port's /metrics shows only its own.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.engine.server.dp_rank import DP_RANK_HEADER
from support.auth import internal_headers
from support.server import run_server

MODEL = "tiny"
API_KEY = "rank-port-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
BODY_LIMIT = 65536
# Long enough to still run when the test looks at it, whatever the machine; the test hangs up.
LONG_TOKENS = 16000
SERVER_ARGS = ("--served-model-name", MODEL, "--data-parallel-size", "2", "--num-kv-blocks", "2100",
               "--max-model-len", "16384", "--api-key", API_KEY, "--max-request-body-bytes", str(BODY_LIMIT))


def free_port_run(count: int) -> int:
    """The first of `count` consecutive free ports, below the kernel's ephemeral range (32768 up) so
    that no port the OS hands out (the server's main port among them) can fall inside it."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 32000 - count)
        taken: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                taken.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in taken:
                s.close()
    raise RuntimeError("no run of free ports found")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    base = free_port_run(2)
    with run_server(model_dir("llama_long"), *SERVER_ARGS, "--rank-port-base", str(base),
                    tmp_path=tmp_path_factory.mktemp("rank_ports")) as s:
        s.rank_urls = [f"http://127.0.0.1:{base + r}" for r in range(2)]
        yield s


def scrape(url: str) -> dict[str, list]:
    """{sample name: [samples]} of one /metrics page."""
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def per_rank(samples: dict[str, list], name: str) -> dict[str, float]:
    """{engine label: value} of one metric, summed over its other labels."""
    values: dict[str, float] = {}
    for sample in samples.get(name, []):
        values[sample.labels["engine"]] = values.get(sample.labels["engine"], 0.0) + sample.value
    return values


def successes(server) -> dict[str, float]:
    return {"0": 0.0, "1": 0.0, **per_rank(scrape(server.url), "vllm:request_success_total")}


def wait_until(predicate, message: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {message}")
        time.sleep(0.1)


def complete(url: str, prompt: str, headers: dict[str, str] | None = None) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{url}/v1/completions", json=body, headers={**AUTH, **(headers or {})}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_each_rank_port_runs_its_rank_with_the_main_ports_greedy_output(server):
    prompts = ["The quick brown fox", "Once upon a time"]
    client = openai.OpenAI(base_url=server.base_url, api_key=API_KEY)
    expected = [client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0).choices[0].text
                for p in prompts]
    for rank, url in enumerate(server.rank_urls):
        before = wait_until(lambda: successes(server), "a scrape")
        assert [complete(url, p) for p in prompts] == expected
        want = {**before, str(rank): before[str(rank)] + len(prompts)}
        wait_until(lambda: successes(server) == want, f"{len(prompts)} more successes on rank {rank} only "
                                                      f"(before {before}, now {successes(server)})")


def test_on_a_rank_port_the_port_wins_over_the_rank_header(server):
    """Even with the internal key: a gateway may pass a client's header along with a key its picker
    added, and the port is what the picker chose (see engine/server/rank_ports.py)."""
    before = successes(server)
    complete(server.rank_urls[1], "Hello", {**internal_headers(), DP_RANK_HEADER: "0"})
    wait_until(lambda: successes(server) == {**before, "1": before["1"] + 1}, "the request on rank 1")
    # A header naming no rank, which the main port refuses, is not even read there.
    complete(server.rank_urls[0], "Hello", {**internal_headers(), DP_RANK_HEADER: "7"})
    wait_until(lambda: successes(server) == {**before, "0": before["0"] + 1, "1": before["1"] + 1},
               "the request on rank 0")
    response = httpx.post(f"{server.base_url}/completions", headers={**AUTH, **internal_headers(), DP_RANK_HEADER: "7"},
                          json={"model": MODEL, "prompt": "Hello", "max_tokens": 1}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_dp_rank", response.text


def open_long_stream(url: str) -> socket.socket:
    """A long greedy stream started on `url` and left unread; closing the socket hangs up."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps({"model": MODEL, "prompt": "Once upon a time", "max_tokens": LONG_TOKENS,
                          "temperature": 0, "ignore_eos": True, "stream": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n").encode()
    sock = socket.create_connection((host, int(port)), timeout=60)
    sock.sendall(head + payload)
    assert sock.recv(64).startswith(b"HTTP/1.1 200"), "the stream did not start"
    return sock


def test_a_rank_ports_metrics_and_health_speak_for_that_rank(server):
    idle = scrape(server.rank_urls[0])
    assert set(per_rank(idle, "vllm:num_requests_running")) == {"0"}
    stream = open_long_stream(server.rank_urls[1])
    try:
        busy = wait_until(lambda: (s := scrape(server.rank_urls[1])) and
                          per_rank(s, "vllm:num_requests_running") == {"1": 1.0} and s,
                          "rank 1's port to show its running request")
        # Every series with a rank there is rank 1's: a picker takes the first it finds as the endpoint's.
        ranks = {s.labels["engine"] for samples in busy.values() for s in samples if "engine" in s.labels}
        assert ranks == {"1"}, ranks
        assert per_rank(busy, "vllm:num_requests_waiting") == {"1": 0.0}
        assert 0 < per_rank(busy, "vllm:kv_cache_usage_perc")["1"] < 1
        assert [s.labels["engine"] for s in busy["vllm:cache_config_info"]] == ["1"]
        assert len(busy["vllm:lora_requests_info"]) == 1  # the pod's own: no rank label
        idle = scrape(server.rank_urls[0])
        assert per_rank(idle, "vllm:num_requests_running") == {"0": 0.0}
        assert per_rank(idle, "vllm:kv_cache_usage_perc") == {"0": 0.0}
        # The main port shows both ranks.
        assert per_rank(scrape(server.url), "vllm:num_requests_running") == {"0": 0.0, "1": 1.0}
        for url in (server.url, *server.rank_urls):
            assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    finally:
        stream.close()
    wait_until(lambda: per_rank(scrape(server.url), "vllm:num_requests_running") == {"0": 0.0, "1": 0.0},
               "the hung-up stream to end")


def test_a_rank_port_keeps_every_check_of_the_main_port(server):
    url = server.rank_urls[1]
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 1}
    no_key = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert no_key.status_code == 401 and no_key.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{url}/v1/models", timeout=30).status_code == 401
    # The internal key opens every route here as on the main port (routers and pickers hold it).
    assert httpx.post(f"{url}/v1/completions", json=body, headers=internal_headers(), timeout=60).status_code == 200
    stolen = httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=30,
                        json={**body, "kv_transfer_params": {"do_remote_decode": True}})
    assert stolen.status_code == 403 and stolen.json()["error"]["param"] == "kv_transfer_params", stolen.text
    released = httpx.post(f"{url}/v1/kv/release", headers=AUTH, json={"kv_transfer_params": {}}, timeout=30)
    assert released.status_code == 403, released.text
    big = httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=30,
                     json={**body, "prompt": "x" * (BODY_LIMIT + 1)})
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    wrong_model = httpx.post(f"{url}/v1/completions", headers=AUTH, json={**body, "model": "other"}, timeout=30)
    assert wrong_model.status_code == 404, wrong_model.text


@pytest.mark.faults
def test_a_frozen_rank_fails_its_own_ports_health_only(server):
    """A gateway that health-checks each rank's port keeps sending to the ranks that still work."""
    cores = [c for c in psutil.Process(server.proc.pid).children() if "spawn_main" in " ".join(c.cmdline())]
    assert len(cores) == 2, cores
    os.kill(cores[0].pid, signal.SIGSTOP)  # one of the two ranks' engine cores; which one, the ports tell
    try:
        def codes() -> list[int] | None:
            """(main, rank 0, rank 1) health codes, once a rank port and the main port fail. Both: the
            ports are asked one after another, and the freeze can be seen between two of the asks."""
            found = [httpx.get(f"{url}/health", timeout=10).status_code for url in (server.url, *server.rank_urls)]
            return found if found[0] == 503 and 503 in found[1:] else None

        main, *ranks = wait_until(codes, "a rank port to fail", 30)
        assert main == 503 and sorted(ranks) == [200, 503], (main, ranks)
        frozen, alive = ranks.index(503), ranks.index(200)
        body = httpx.get(f"{server.rank_urls[frozen]}/health", timeout=10).json()
        assert body["error"]["code"] == "engine_unresponsive", body
        assert complete(server.rank_urls[alive], "still served") is not None
    finally:
        os.kill(cores[0].pid, signal.SIGCONT)
    wait_until(lambda: all(httpx.get(f"{url}/health", timeout=10).status_code == 200
                           for url in (server.url, *server.rank_urls)), "every port healthy again")


def serve_exit(*args: str, timeout: float = 120) -> tuple[int, str]:
    """`pdserve serve` with arguments that must be refused before a model loads: (exit code, stderr)."""
    proc = subprocess.run([sys.executable, "-m", "pdserve", "serve", "--model", "demo", *args],
                          capture_output=True, text=True, timeout=timeout, env=dict(os.environ, PYTHONSAFEPATH="1"))
    assert "ready on" not in proc.stdout, proc.stdout
    return proc.returncode, proc.stderr


def test_bad_uses_of_the_flag_are_refused_with_clear_errors():
    base = free_port_run(6)
    code, err = serve_exit("--port", str(base + 5), "--rank-port-base", str(base))
    assert code == 2 and "needs --data-parallel-size 2 or more" in err, err
    code, err = serve_exit("-dp", "2", "--port", str(base + 1), "--rank-port-base", str(base))
    assert code == 2 and f"include --port {base + 1}" in err, err
    code, err = serve_exit("-dp", "3", "--port", str(base + 5), "--dp-coordinator-http-port", str(base + 2),
                           "--rank-port-base", str(base))
    assert code == 2 and f"include --dp-coordinator-http-port {base + 2}" in err, err
    code, err = serve_exit("-dp", "2", "--rank-port-base", "65535")
    assert code == 2 and "ports are 1-65535" in err, err
    # A rank port already taken fails at once, naming it, not after the model has loaded.
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", base + 1))
        holder.listen()
        code, err = serve_exit("-dp", "2", "--host", "127.0.0.1", "--port", str(base + 5),
                               "--rank-port-base", str(base))
    assert code == 1 and f"127.0.0.1:{base + 1} (data-parallel rank 1)" in err, err
