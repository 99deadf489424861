"""`pdserve serve`: one engine behind an OpenAI-compatible HTTP API."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import threading
from typing import Callable, Iterator

import uvicorn

from pdserve.engine.core.liveness import DEFAULT_STEP_TIMEOUT_S

log = logging.getLogger("pdserve.serve")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="Hugging Face model directory, or 'demo' for the built-in model")
    p.add_argument("--served-model-name", help="the name clients use (default: --model)")
    p.add_argument("--tokenizer", help="tokenizer directory (default: the model's)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $PDSERVE_API_KEY)")
    p.add_argument("--metrics-require-key", action="store_true",
                   help="with --api-key, /metrics needs the key too (default: open, like /health)")
    add_internal_key_arguments(p)
    p.add_argument("--insecure-kv-transfer", action="store_true",
                   help="run a KV connector without the internal key: anyone who reaches this engine can send "
                        "kv_transfer_params and its side channel authenticates nobody (local experiments only)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engine cores behind this server, each with its own scheduler, KV cache and TP workers")
    p.add_argument("--data-parallel-lockstep", action="store_true",
                   help="data-parallel ranks step in waves: while any has work all step (for expert parallelism)")
    p.add_argument("--rank-port-base", type=int, metavar="PORT",
                   help="with --data-parallel-size N > 1, also listen on PORT+r for each rank r (0..N-1): a request "
                        "arriving there runs on rank r, so a gateway that picks host:port (an InferencePool with one "
                        "targetPort per rank) places it; /health and /metrics there speak for that rank alone")
    p.add_argument("--dp-coordinator-http-port", type=int, default=0,
                   help="HTTP port of the in-pod coordinator (/stats) started when data-parallel size > 1 and "
                        "no --coordinator-address is given (default: a free port)")
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument("--long-prefill-token-threshold", type=int, default=0)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    p.add_argument("--quantization", choices=["auto", "none", "int8", "q8_0"], default="auto",
                   help="CPU only. auto: a GGUF file's Q8_0 weights stay int8 (served exactly as stored), "
                        "everything else float; none: every weight float; int8: every linear weight int8 "
                        "with a scale per output channel; q8_0: with a scale per 32 weights. int8 weights "
                        "take a quarter of float32's memory and decode faster; logits stay within ~1%% of "
                        "float32. In bfloat16 on CPUs with AMX, int8 runs on AMX tiles (faster than bf16)")
    p.add_argument("--int8-activations", action="store_true",
                   help="with int8 weights: also round each decode row to int8 (blocks of 32, a scale "
                        "each) and take integer dot products, as llama.cpp's Q8_0 does: faster decode "
                        "at a few rows; adds that rounding to the weights' (see engine/model/quant.py)")
    p.add_argument("--device", default="auto")
    p.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: run every step eagerly; by default decode steps of up to min(max-num-seqs, 256) "
                        "requests replay CUDA graphs captured at start-up (one launch per step instead of a few "
                        "hundred). No effect on the CPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-kv-blocks", type=int, help="override the measured KV block count")
    p.add_argument("--kv-cache-memory-bytes", type=int,
                   help="CPU: bytes of KV cache (default min(4 GiB, 30%% of RAM)); pages are taken as blocks are first used")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-logprobs", type=int, default=20)
    p.add_argument("--max-request-body-bytes", type=int, default=8 << 20)
    p.add_argument("--max-n", type=int, default=16, help="the most completions one request may ask for (n)")
    p.add_argument("--max-waiting-requests", type=int, default=1024,
                   help="with this many requests queued in the engine, new ones get 503 and Retry-After")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds to let in-flight requests finish after SIGTERM")
    p.add_argument("--step-timeout", type=step_timeout, default=DEFAULT_STEP_TIMEOUT_S, metavar="SECONDS",
                   help="a step running longer than this makes /health answer 503 engine_unresponsive and stops "
                        "the load reports vouching for the engine, so routers skip it; 0 turns the rule off (a "
                        "stopped or frozen core is still caught by its missing heartbeat, after 3 s). The default, "
                        "%(default)g, is over 6x the longest legitimate step measured: a full 2048-token prefill "
                        "chunk (the default --max-num-batched-tokens) of smollm2 at TP=1 on 2 CPU cores took 15-18 s. "
                        "Raise it for larger models on CPU")
    p.add_argument("--engine-role", choices=["prefill", "decode", "both"], default="both",
                   help="this engine's pool in a disaggregated deployment")
    p.add_argument("--kv-transfer-config", type=json.loads,
                   help='KV connector settings as JSON, e.g. {"kv_connector": "p2p", "kv_role": "kv_producer"}')
    p.add_argument("--coordinator-address", type=host_port,
                   help="host:port of the coordinator that collects this engine's load")
    p.add_argument("--coordinator-publish-address",
                   help="host:port of that coordinator's feed; the data-parallel ranks are balanced by it")
    from pdserve.engine.server.tool_parsers import DEFAULT_PARSER, parser_names

    p.add_argument("--tool-call-parser", choices=parser_names(), default=DEFAULT_PARSER,
                   help="how the model writes tool calls, to read them out of its text into tool_calls (and to "
                        "constrain tool_choice required / a named function to that format): hermes "
                        "(<tool_call>{json}</tool_call>), llama3_json, mistral ([TOOL_CALLS][...]) or pythonic "
                        "([f(a=1)]) (default: %(default)s)")
    p.add_argument("--log-level", default=os.environ.get("PDSERVE_LOG_LEVEL", "INFO"))


def add_internal_key_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--internal-key-file", metavar="PATH",
                   help="file holding the deployment's internal key (default: $PDSERVE_INTERNAL_KEY, or the file "
                        "named by $PDSERVE_INTERNAL_KEY_FILE)")


def resolve_internal_key(args: argparse.Namespace, command: str) -> tuple[bytes | None, str | None]:
    """(key, problem): the key from --internal-key-file or the environment, exported so that
    child processes (engine cores, TP workers) hold the same one."""
    from pdserve.engine.internal_auth import InternalKeyError, load_internal_key, use_key_file

    try:
        if getattr(args, "internal_key_file", None):
            return use_key_file(args.internal_key_file), None
        return load_internal_key(), None
    except InternalKeyError as exc:
        return None, f"pdserve {command}: {exc}"


def step_timeout(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected 0 (off) or a number of seconds, got {text!r}")
    return value


def host_port(text: str) -> str:
    from pdserve.engine.core.load_reporter import parse_host_port

    try:
        parse_host_port(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def engine_args_from(args: argparse.Namespace):
    from pdserve.engine.config import EngineArgs

    return EngineArgs(
        model=args.model, tokenizer=args.tokenizer, served_model_name=args.served_model_name or args.model,
        dtype=args.dtype, quantization=args.quantization, int8_activations=args.int8_activations,
        device=args.device, seed=args.seed,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, long_prefill_token_threshold=args.long_prefill_token_threshold,
        enable_prefix_caching=args.enable_prefix_caching, max_model_len=args.max_model_len,
        scheduling_policy=args.scheduling_policy, tensor_parallel_size=args.tensor_parallel_size,
        max_logprobs=args.max_logprobs, kv_transfer_config=args.kv_transfer_config,
        engine_role=args.engine_role, coordinator_address=args.coordinator_address,
        coordinator_publish_address=args.coordinator_publish_address,
        data_parallel_size=args.data_parallel_size, data_parallel_lockstep=args.data_parallel_lockstep,
        advertise_address=advertise_address(args.host, args.port),
        step_timeout=args.step_timeout, enforce_eager=args.enforce_eager,
    )


def advertise_address(host: str, port: int) -> str:
    """host:port where routers reach this server: the pod's IP when bound to every interface."""
    if host in ("0.0.0.0", "::", ""):
        import socket

        host = os.environ.get("POD_IP") or socket.gethostbyname(socket.gethostname())
    return f"{host}:{port}"


def run(args: argparse.Namespace, on_ready: Callable[[], None] | None = None) -> int:
    from pdserve.engine.logging_config import configure_logging

    configure_logging(args.log_level)
    if args.data_parallel_size < 1:
        print(f"pdserve serve: --data-parallel-size must be at least 1, got {args.data_parallel_size}", file=sys.stderr)
        return 2
    args.internal_key, problem = resolve_internal_key(args, "serve")
    if problem:
        print(problem, file=sys.stderr)
        return 2
    from pdserve.engine.server.rank_ports import RankPortError, check_rank_ports, probe

    if args.rank_port_base is not None:
        problem = check_rank_ports(args.rank_port_base, args.data_parallel_size, args.port,
                                   {"--dp-coordinator-http-port": args.dp_coordinator_http_port})
        if problem:
            print(f"pdserve serve: {problem}", file=sys.stderr)
            return 2
    try:  # a port already taken fails now, not after the model has loaded
        probe(args.host, _ports(args))
    except RankPortError as exc:
        print(f"pdserve serve: {exc}", file=sys.stderr)
        return 1
    if args.kv_transfer_config and args.internal_key is None:
        if not args.insecure_kv_transfer:
            print("pdserve serve: a KV connector needs the deployment's internal key, or anyone who reaches this "
                  "engine could make it read or serve other requests' KV. Give --internal-key-file PATH (or set "
                  "$PDSERVE_INTERNAL_KEY), or --insecure-kv-transfer for a local experiment.", file=sys.stderr)
            return 2
        log.warning("KV transfer runs WITHOUT the internal key (--insecure-kv-transfer): any client that reaches "
                    "this engine can send kv_transfer_params, and its side channel authenticates nobody")
    coordinator = None
    if args.data_parallel_size > 1 and not args.coordinator_address:
        from pdserve.engine.server.dp_coordinator import InPodCoordinator

        try:
            coordinator = InPodCoordinator.start(args.dp_coordinator_http_port)
        except OSError as exc:
            print(f"pdserve serve: {exc}", file=sys.stderr)
            return 1
        args.coordinator_address, args.coordinator_publish_address = (coordinator.stats_address,
                                                                      coordinator.publish_address)
        print(f"pdserve serve: in-pod coordinator on {coordinator.http_url}/stats", flush=True)
    try:
        return _serve(args, on_ready)
    finally:
        if coordinator is not None:
            coordinator.stop()


def _serve(args: argparse.Namespace, on_ready: Callable[[], None] | None) -> int:
    from pdserve.engine.frontend.async_llm import AsyncLLM
    from pdserve.engine.server.app import ServerSettings, build_app

    try:
        from pdserve.engine.frontend.limits import RequestLimits

        limits = RequestLimits(max_n=args.max_n, max_waiting_requests=args.max_waiting_requests)
        engine = AsyncLLM.from_engine_args(engine_args_from(args), limits=limits)
    except (ValueError, OSError) as exc:
        print(f"pdserve serve: {exc}", file=sys.stderr)
        return 2
    from pdserve.engine.server.rank_ports import RankPortError, RankPorts, bind_all, listen_all

    rank_ports = (RankPorts(args.rank_port_base, args.data_parallel_size)
                  if args.rank_port_base is not None else None)
    sockets = None
    try:
        app = build_app(engine, ServerSettings(api_key=args.api_key, max_body_bytes=args.max_request_body_bytes,
                                               internal_key=args.internal_key,
                                               metrics_require_key=args.metrics_require_key),
                        tool_call_parser=args.tool_call_parser, rank_ports=rank_ports)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", access_log=False,
                                timeout_graceful_shutdown=args.shutdown_timeout, timeout_keep_alive=30)
        # Listening before "ready" is printed: a port taken while the model loaded (the check at
        # start-up cannot hold it) fails here with its name, not after a ready line in the log.
        # With rank ports: one server, one app, several listening sockets; the app tells them apart.
        try:
            sockets = listen_all(bind_all(args.host, _ports(args)), config.backlog)
        except RankPortError as exc:
            print(f"pdserve serve: {exc}", file=sys.stderr)
            return 1
        if rank_ports is not None:
            log.info("data-parallel rank ports %s", rank_ports.describe())
        log.info("serving %s on http://%s:%d/v1 (%d KV blocks)", engine.model_name, args.host, args.port,
                 engine.config.num_kv_blocks)
        extra = f"; rank ports {rank_ports.describe()}" if rank_ports is not None else ""
        print(f"pdserve serve: ready on http://{args.host}:{args.port}/v1 (model {engine.model_name}{extra})",
              flush=True)
        if on_ready is not None:
            on_ready()
        GracefulServer(config).run(sockets=sockets)
    finally:
        for sock in sockets or ():
            sock.close()
        engine.shutdown()
    return 0


def _ports(args: argparse.Namespace) -> dict[int, str]:
    """The ports this server listens on (port -> what it is): --port, and the rank ports if any."""
    from pdserve.engine.server.rank_ports import RankPorts, server_ports

    if args.rank_port_base is None:
        return {args.port: "--port"}
    return server_ports(args.port, RankPorts(args.rank_port_base, args.data_parallel_size))


class GracefulServer(uvicorn.Server):
    """uvicorn's server, minus re-raising SIGTERM/SIGINT after its graceful shutdown.

    Exiting through the signal again would skip the engine's shutdown and report an orderly stop
    as a failure; we drain, shut the engine down, and exit 0.
    """

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        originals = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)
