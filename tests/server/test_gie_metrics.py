"""The metrics a Gateway API Inference Extension endpoint picker reads from every engine (issue 22,
item 4), under vLLM's names: the queue and KV gauges, `vllm:cache_config_info` and
`vllm:lora_requests_info`, checked in a scrape parsed the way Prometheus parses it.

One real server on 127.0.0.1 (the tiny checkpoint) with a config that differs from the defaults
where the info metric reports it (block size 32, 1100 blocks, no prefix caching), and room for
one running request only, so a second one has to wait.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from support.server import run_server

MODEL = "tiny"
BLOCK_SIZE = 32
NUM_BLOCKS = 1100
# Long enough to still run when the test looks at it, whatever the machine; the test hangs up.
LONG_TOKENS = 16000
SERVER_ARGS = ("--served-model-name", MODEL, "--block-size", str(BLOCK_SIZE), "--num-kv-blocks", str(NUM_BLOCKS),
               "--no-enable-prefix-caching", "--max-num-seqs", "1", "--max-model-len", "16384")


def scrape(url: str) -> dict[str, list]:
    """{sample name: [samples]} of one /metrics page."""
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def only(samples: dict[str, list], name: str):
    assert len(samples.get(name, [])) == 1, samples.get(name)
    return samples[name][0]


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    launched = time.time()
    with run_server(model_dir("llama_long"), *SERVER_ARGS, tmp_path=tmp_path_factory.mktemp("gie_metrics")) as s:
        s.launched = launched
        s.first_scrape = scrape(s.url)  # before any request, whatever order the tests run in
        yield s


def test_queue_and_kv_gauges_are_there_before_any_request(server):
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        sample = only(server.first_scrape, name)
        assert sample.labels == {"model_name": MODEL, "engine": "0"} and sample.value == 0.0, sample


def test_cache_config_info_reports_the_kv_cache_as_configured(server):
    info = only(server.first_scrape, "vllm:cache_config_info")
    assert info.value == 1.0
    # What pickers read (block_size, num_gpu_blocks), and the rest written as vLLM writes them.
    assert {k: info.labels[k] for k in ("block_size", "num_gpu_blocks", "num_gpu_blocks_override",
                                        "enable_prefix_caching", "cache_dtype", "engine")} == {
        "block_size": str(BLOCK_SIZE), "num_gpu_blocks": str(NUM_BLOCKS), "num_gpu_blocks_override": str(NUM_BLOCKS),
        "enable_prefix_caching": "False", "cache_dtype": "auto", "engine": "0"}


def test_lora_requests_info_is_empty_and_dated(server):
    info = only(server.first_scrape, "vllm:lora_requests_info")
    assert info.labels == {"max_lora": "0", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    # The value is when the series was last updated (pickers keep the newest series).
    assert server.launched <= info.value <= time.time()


def open_long_stream(url: str) -> socket.socket:
    """A long greedy stream started on `url` and left unread; closing the socket hangs up."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps({"model": MODEL, "prompt": "Once upon a time", "max_tokens": LONG_TOKENS,
                          "temperature": 0, "ignore_eos": True, "stream": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n").encode()
    sock = socket.create_connection((host, int(port)), timeout=60)
    sock.sendall(head + payload)
    assert sock.recv(64).startswith(b"HTTP/1.1 200"), "the stream did not start"
    return sock


def gauges(url: str) -> tuple[float, float, float, float]:
    """(running, waiting, KV usage, lora info's value) from one scrape."""
    s = scrape(url)
    return tuple(only(s, name).value for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                                                  "vllm:kv_cache_usage_perc", "vllm:lora_requests_info"))


def wait_for(url: str, predicate, message: str, timeout: float = 60.0) -> tuple[float, float, float, float]:
    deadline = time.monotonic() + timeout
    while True:
        values = gauges(url)
        if predicate(*values):
            return values
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {message}; last (running, waiting, "
                                 f"kv usage, lora) {values}")
        time.sleep(0.1)


def test_the_gauges_follow_the_scheduler(server):
    started = time.time()
    streams = [open_long_stream(server.url)]
    try:
        wait_for(server.url, lambda running, waiting, kv, _: running == 1 and waiting == 0, "one running request")
        streams.append(open_long_stream(server.url))  # --max-num-seqs 1: it has to wait
        running, waiting, kv, lora = wait_for(server.url, lambda running, waiting, kv, _: waiting == 1,
                                              "one waiting request")
        assert running == 1
        # The fraction of the configured blocks the running request holds: a whole number of them.
        blocks = kv * NUM_BLOCKS
        assert round(blocks) >= 1 and abs(blocks - round(blocks)) < 1e-6, kv
        assert lora >= started  # updated as the engine steps
    finally:
        for stream in streams:
            stream.close()
    wait_for(server.url, lambda running, waiting, kv, _: (running, waiting, kv) == (0, 0, 0),
             "the hung-up requests to leave the queue and free their blocks")
