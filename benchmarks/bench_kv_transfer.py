"""KV transfer: how fast blocks move between engines, and what a P/D hand-off adds to TTFT.

1. Transport throughput. A realistic block (16 tokens x 8 KV heads x 128 head dim x K and V x 32
   layers, bf16: 2 MiB) in the layout the engine uses. A producer process serves its cache; this
   process pulls 1, 64 and 1024 blocks (scattered block ids) over NIXL and over our TCP transport,
   and, as the baseline in the same run, copies the same blocks from one cache to another inside
   this process. GB/s and the ratio to the copy. Targets: NIXL >= 50% of the copy at 1024 blocks,
   TCP >= 25%.
2. TTFT of a 2048-token prompt: one engine, against prefill engine -> KV transfer -> decode engine
   (the router's flow, done here by hand), for each transport. Target: the hand-off adds under 10%
   of the prefill time.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from pathlib import Path

import httpx
import torch

from pdserve.bench.report import write_report

from bench_offline import MODEL_SPEC, cache_root
from bench_serve import free_port, log, start, stop

LAYERS, BLOCK, HEADS, HEAD_DIM = 32, 16, 8, 128


# Every benchmark read is of one "prompt": the prefill side checks each read against its digest.
BENCH_DIGEST = hashlib.sha256(b"kv-transfer benchmark").hexdigest()


def make_caches(num_blocks: int, fill: bool) -> list[torch.Tensor]:
    caches = []
    for layer in range(LAYERS):
        t = torch.empty(2, num_blocks, BLOCK, HEADS, HEAD_DIM, dtype=torch.bfloat16)
        if fill:
            t.fill_(layer + 1)
        else:
            t.zero_()
        caches.append(t)
    return caches


def producer(num_blocks: int, requests: dict[str, list[int]], ready, done) -> None:
    from pdserve.kvstore.send_registry import SendRegistry
    from pdserve.kvstore.transport_nixl import NixlEndpoint, nixl_available
    from pdserve.kvstore.transport_tcp import BlockServer

    caches = make_caches(num_blocks, fill=True)
    registry = SendRegistry()
    for request_id, blocks in requests.items():
        registry.hold(request_id, blocks, timeout_s=3600, digest=BENCH_DIGEST)
    server = BlockServer(caches, registry, "127.0.0.1", 0)
    if nixl_available():
        server.nixl = NixlEndpoint("bench-producer", caches)
    ready.send(server.port)
    done.recv()
    server.close()


def transfer_rows(sizes: list[int], repeats: dict[int, int]) -> list[dict]:
    from pdserve.kvstore.block_io import KVLayout
    from pdserve.kvstore.transport_nixl import NixlEndpoint, nixl_available
    from pdserve.kvstore.transport_tcp import BlockClient, HeldKV

    largest = max(sizes)
    num_blocks = 2 * (largest + 8)  # the second half is the in-process copy's source
    rng = random.Random(0)
    plans = {n: (rng.sample(range(largest + 8), n), rng.sample(range(largest + 8), n)) for n in sizes}
    requests = {f"r{n}-{i}": plans[n][0] for n in sizes for i in range(2 * repeats[n])}
    ctx = mp.get_context("spawn")
    ready_recv, ready_send = ctx.Pipe(duplex=False)
    done_recv, done_send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=producer, args=(largest + 8, requests, ready_send, done_recv), daemon=True)
    proc.start()
    port = ready_recv.recv()
    caches = make_caches(num_blocks, fill=False)
    for cache in caches:
        cache[:, largest + 8:] = 7
    layout = KVLayout.of(caches)
    peer = ("127.0.0.1", port)
    tcp = BlockClient(caches, timeout_s=120)
    nixl = BlockClient(caches, timeout_s=120, nixl=NixlEndpoint("bench-consumer", caches)) if nixl_available() else None
    rows = []
    try:
        for n in sizes:
            remote, local = plans[n]
            nbytes = layout.transfer_bytes(n)
            # The baseline: the same blocks copied inside this process, slab by slab (what an
            # in-process hand-off does), from the second half of the cache to the first.
            copy_s = []
            for _ in range(repeats[n]):
                t = time.perf_counter()
                for cache in caches:
                    for src_block, dst_block in zip(remote, local):
                        cache[:, dst_block].copy_(cache[:, src_block + largest + 8])
                copy_s.append(time.perf_counter() - t)
            # For reference: one contiguous memcpy of as many bytes (the best case for any copy).
            flat_src = torch.ones(nbytes, dtype=torch.uint8)
            flat_dst = torch.zeros(nbytes, dtype=torch.uint8)
            memcpy_s = []
            for _ in range(repeats[n]):
                t = time.perf_counter()
                flat_dst.copy_(flat_src)
                memcpy_s.append(time.perf_counter() - t)
            del flat_src, flat_dst
            index_dst = torch.tensor(local)
            for cache in caches:
                cache[:, index_dst] = 0
            results = {"copy": min(copy_s), "memcpy (contiguous)": min(memcpy_s)}
            for name, client in (("tcp", tcp), ("nixl", nixl)):
                if client is None:
                    continue
                times = []
                for i in range(repeats[n]):
                    request_id = f"r{n}-{i + (repeats[n] if name == 'nixl' else 0)}"
                    t = time.perf_counter()
                    held = HeldKV(request_id, BENCH_DIGEST)
                    if name == "nixl":
                        client.nixl_pull(peer, "bench", held, remote, local, time.monotonic() + 120)
                    else:
                        client.pull(peer, held, remote, local, (0, HEADS), (0, HEADS), time.monotonic() + 120)
                    times.append(time.perf_counter() - t)
                    client.release(peer, held, expected=1)
                results[name] = min(times)
                expected = float(LAYERS)  # the last layer holds LAYERS everywhere
                assert caches[-1][:, local].float().mean().item() == expected, f"{name} moved wrong bytes"
                for cache in caches:
                    cache[:, index_dst] = 0
            for name, seconds in results.items():
                rows.append({"blocks": n, "MiB": nbytes / 2**20, "path": name, "seconds": seconds,
                             "GB/s": nbytes / seconds / 1e9, "vs copy": results["copy"] / seconds})
            log(f"  {n} blocks: " + ", ".join(f"{k} {nbytes / v / 1e9:.2f} GB/s" for k, v in results.items()))
    finally:
        done_send.send(True)
        proc.join(timeout=30)
        tcp.close()
        if nixl is not None:
            nixl.close()
    return rows


def ttft_model() -> str:
    from pdserve.engine.demo import build_random_model

    path = cache_root() / "bench" / "llama-100m-4k-v1"
    if not (path / "config.json").exists():
        build_random_model(path, **dict(MODEL_SPEC, max_position_embeddings=4096))
    return str(path)


def internal_headers() -> dict[str, str]:
    """The engines refuse kv_transfer_params without the deployment's key (benchmarks/run.py sets one)."""
    from pdserve.engine.internal_auth import ENV_KEY, HEADER

    return {HEADER: os.environ[ENV_KEY]}


def stream_ttft(url: str, body: dict) -> float:
    """Time to the first token; the stream is read to its end, so the request's remaining decode
    steps never overlap the next measurement on these two cores."""
    start_t = time.perf_counter()
    ttft = None
    with httpx.stream("POST", f"{url}/v1/completions", json=dict(body, stream=True), headers=internal_headers(),
                      timeout=600) as r:
        for line in r.iter_lines():
            if ttft is None and line.startswith("data: ") and '"text"' in line:
                ttft = time.perf_counter() - start_t
    if ttft is None:
        raise RuntimeError("no token came back")
    return ttft


def ttft_rows(prompt_len: int, repeats: int, run_dir: Path) -> list[dict]:
    model = ttft_model()
    rng = random.Random(1)
    rows = []
    for transport in ("tcp", "nixl"):
        ports = free_port(), free_port()
        common = ["--model", model, "--dtype", "float32", "--max-model-len", "4096", "--no-enable-prefix-caching"]
        configs = [json.dumps({"kv_connector": "p2p", "kv_role": role, "kv_connector_extra_config": {
            "transport": transport}}) for role in ("kv_producer", "kv_consumer")]
        procs = []
        try:
            for port, config in zip(ports, configs):
                procs.append(start([sys.executable, "-m", "pdserve", "serve", *common, "--port", str(port),
                                    "--kv-transfer-config", config], port, run_dir / f"kv-{transport}-{port}.log"))
            prefill, decode = (f"http://127.0.0.1:{p}" for p in ports)
            single, pd, transfer = [], [], []
            for i in range(repeats + 1):  # the first round warms both engines up
                prompt = [rng.randrange(3, MODEL_SPEC["vocab_size"]) for _ in range(prompt_len)]
                body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0}
                one = stream_ttft(prefill, body)
                t = time.perf_counter()
                first = httpx.post(f"{prefill}/v1/completions", timeout=600, headers=internal_headers(), json=dict(
                    body, max_tokens=1, kv_transfer_params={"do_remote_decode": True})).json()
                prefill_s = time.perf_counter() - t
                second = stream_ttft(decode, dict(body, kv_transfer_params=first["kv_transfer_params"]))
                if i:
                    single.append(one)
                    pd.append(prefill_s + second)
                    transfer.append(second)
            # P/D TTFT = prefill leg (the same prefill work as one engine's) + decode leg (pull the
            # KV, compute the last prompt token, first token back): the hand-off adds the decode
            # leg. The difference of the two end-to-end medians says the same but carries the
            # run-to-run noise of a 2048-token prefill on a shared 2-core machine (±20% seen).
            prefill = statistics.median(single)
            added = statistics.median(transfer)
            rows.append({"transport": transport, "prompt tokens": prompt_len, "one engine TTFT s": prefill,
                         "P/D TTFT s": statistics.median(pd), "added by hand-off s": added,
                         "added % of prefill": 100 * added / prefill,
                         "P/D - one engine s (noisy)": statistics.median(pd) - prefill})
            log(f"  ttft {transport}: one engine {statistics.median(single):.3f}s, P/D {statistics.median(pd):.3f}s")
        finally:
            for proc in procs:
                stop(proc)
    return rows


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="bench kv_transfer")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    sizes = [1, 64] if args.quick else [1, 64, 1024]
    repeats = {1: 20, 64: 5, 1024: 3}
    log("transfer throughput (2 MiB blocks) ...")
    rows = transfer_rows(sizes, repeats)
    write_report("kv_transfer", rows, title="KV transfer: NIXL and TCP vs an in-process copy of the same blocks",
                 meta={"block": {"tokens": BLOCK, "kv_heads": HEADS, "head_dim": HEAD_DIM, "layers": LAYERS,
                                 "dtype": "bfloat16"}, "targets": {"nixl_vs_copy_1024": 0.5, "tcp_vs_copy_1024": 0.25}})
    run_dir = Path(cache_root()) / "bench" / "runs"
    run_dir.mkdir(parents=True, exist_ok=True)
    log("TTFT through P/D vs one engine ...")
    ttft = ttft_rows(512 if args.quick else 2048, 1 if args.quick else 3, run_dir)
    write_report("kv_transfer_ttft", ttft, title="TTFT: prefill -> KV transfer -> decode vs one engine",
                 meta={"target_added_pct_of_prefill": 10})
