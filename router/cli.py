"""`pdserve router`: the OpenAI-compatible front of a disaggregated (or single-pool) deployment."""

from __future__ import annotations

import argparse
import os
import sys

from pdserve.engine.server.cli import add_internal_key_arguments, resolve_internal_key
from pdserve.engine.server.tool_parsers import DEFAULT_PARSER, parser_names
from pdserve.router.balancer import Policy


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", required=True, help="the model name clients send (the engines' served name)")
    p.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $PDSERVE_API_KEY)")
    p.add_argument("--metrics-require-key", action="store_true",
                   help="with --api-key, /metrics needs the key too (default: open, like /health)")
    add_internal_key_arguments(p)
    p.add_argument("--routing-policy", choices=[policy.value for policy in Policy], default=Policy.LEAST_LOADED.value)
    p.add_argument("--coordinator-address", help="host:port of the coordinator's load feed (zmq PUB)")
    p.add_argument("--coordinator-http-port", type=int, default=8080,
                   help="the coordinator's HTTP port, for the prefix index snapshot (GET /blocks)")
    static = p.add_argument_group("static endpoints")
    static.add_argument("--prefill", nargs="+", action="extend", default=[], metavar="URL",
                        help="prefill engine URLs (none: every request goes to the decode pool alone)")
    static.add_argument("--decode", nargs="+", action="extend", default=[], metavar="URL", help="decode engine URLs")
    k8s = p.add_argument_group("Kubernetes discovery (EndpointSlices)")
    k8s.add_argument("--prefill-service", help="Service whose ready endpoints form the prefill pool")
    k8s.add_argument("--decode-service", help="Service whose ready endpoints form the decode pool")
    k8s.add_argument("--namespace", help="namespace of the Services (default: the pod's, else 'default')")
    k8s.add_argument("--engine-port", type=int, default=8000, help="the engines' HTTP port")
    k8s.add_argument("--relist-interval", type=float, default=30.0,
                     help="seconds between full re-lists of the EndpointSlices")
    k8s.add_argument("--kubeconfig", help="kubeconfig outside a cluster (default: $KUBECONFIG, ~/.kube/config)")
    p.add_argument("--pd-min-prompt-tokens", type=int, default=256,
                   help="shorter prompts skip the prefill pool (0: disaggregate every request)")
    p.add_argument("--pd-only-when-busy", action="store_true",
                   help="disaggregate only while every decode engine has a request of this router in flight: a "
                        "prompt that finds one idle is computed there, without the prefill hop. For engines that "
                        "share their cores (`pdserve up` on one machine), where the hop spares no running decode "
                        "then; only this router's requests count, so it suits a router that is the engines' only "
                        "client")
    p.add_argument("--tokenizer", help="tokenizer directory: exact prompt lengths and prefix hashes locally")
    p.add_argument("--tool-call-parser", choices=parser_names(), default=DEFAULT_PARSER,
                   help="the engines' --tool-call-parser: with --tokenizer, chat prompts with tools are rendered as "
                        "the engines render them (a template that ignores tools gets the parser's description of "
                        "them), for exact lengths and prefix hashes")
    p.add_argument("--max-prompt-chars", type=int, default=None,
                   help="refuse (400) prompts longer than this many characters before tokenizing them; 0: never "
                        "(default: with --tokenizer, the most characters a prompt that fits the model can have: "
                        "its context length times the most characters one token covers)")
    p.add_argument("--max-request-body-bytes", type=int, default=8 << 20)
    p.add_argument("--health-interval", type=float, default=2.0, help="seconds between /health checks")
    p.add_argument("--connect-timeout", type=float, default=2.0, help="seconds to connect to an engine")
    add_fault_arguments(p)
    p.add_argument("--log-level", default=os.environ.get("PDSERVE_LOG_LEVEL", "INFO"))


FAULT_BOUNDS = """\
How long a request may wait on one engine, and where it goes next. The defaults come from the
default model (smollm2, 135M, TP=1) on 2 CPU cores: a 2048-token prompt, which is also the longest
step (one full default --max-num-batched-tokens chunk), took 15-18 s on idle cores and 30 s on a
busy host; 500 tokens took 8 s. Each bound leaves about 2x over the busy host, so only an engine
that is stuck or far overloaded reaches it. A frozen or dead engine is cut much sooner: its /health
turns 503 (engine --step-timeout, or a core that stops answering after 3 s), the router ejects it
and cuts its legs at once. Raise the bounds for larger models on CPUs or longer prompts."""


def add_fault_arguments(p: argparse.ArgumentParser) -> None:
    """Time bounds, connection limits and migration (FAULT_BOUNDS says how the defaults were chosen)."""
    g = p.add_argument_group("time bounds and failover", FAULT_BOUNDS)
    g.add_argument("--prefill-timeout", type=float, default=60.0,
                   help="seconds a prefill leg may take to answer (waiting for a connection slot included); "
                        "past it the decode engine computes the prompt itself. 2x a 2048-token prompt on a busy "
                        "2-core host with smollm2 (30 s) (default: %(default)s)")
    g.add_argument("--decode-first-byte-timeout", type=float, default=120.0,
                   help="seconds a streamed decode leg may take to its first output (queueing, the KV pull, or "
                        "the whole prompt when there was no prefill leg, included); past it the request is retried "
                        "on another engine. 2x --prefill-timeout, since a prompt may be computed here after the "
                        "prefill leg gave up (default: %(default)s)")
    g.add_argument("--decode-idle-timeout", type=float, default=60.0,
                   help="seconds a streamed decode leg may stay silent between two chunks; past it the stream "
                        "continues on another engine (see --migration-limit). 2x the longest step on a busy "
                        "2-core host with smollm2 (another request's 2048-token chunk: 30 s) (default: %(default)s)")
    g.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds a non-streamed decode leg may take to its whole answer (it sends nothing "
                        "before); past it the request is retried on another engine (default: %(default)s)")
    g.add_argument("--max-connections-per-endpoint", type=int, default=256,
                   help="legs in flight to one engine server at most; more wait for a slot, and the wait counts "
                        "toward the leg's time bound (default: %(default)s)")
    g.add_argument("--migration-limit", type=int, default=1,
                   help="times a streamed single-choice answer that breaks after its first byte (engine dead, "
                        "silent or ejected) continues on another decode engine before the client gets an SSE "
                        "error; 0: never (default: %(default)s)")


def check_arguments(args: argparse.Namespace) -> str | None:
    """What is wrong with the endpoint flags, if anything."""
    kubernetes = args.prefill_service or args.decode_service
    if kubernetes and (args.prefill or args.decode):
        return "give either static endpoints (--prefill/--decode) or Services (--prefill-service/--decode-service)"
    if kubernetes and not args.decode_service:
        return "--decode-service is required with --prefill-service"
    if not kubernetes and not args.decode:
        return "no engines: give --decode URL... (and optionally --prefill URL...), or --decode-service"
    for value, name in ((args.health_interval, "--health-interval"), (args.relist_interval, "--relist-interval"),
                        (args.connect_timeout, "--connect-timeout"), (args.prefill_timeout, "--prefill-timeout"),
                        (args.decode_first_byte_timeout, "--decode-first-byte-timeout"),
                        (args.decode_idle_timeout, "--decode-idle-timeout"),
                        (args.request_timeout, "--request-timeout"),
                        (args.max_connections_per_endpoint, "--max-connections-per-endpoint")):
        if value <= 0:
            return f"{name} must be positive"
    if args.migration_limit < 0:
        return "--migration-limit must be 0 or more"
    if args.pd_min_prompt_tokens < 0:
        return "--pd-min-prompt-tokens must be 0 or more"
    return None


def run(args: argparse.Namespace) -> int:
    from pdserve.engine.logging_config import configure_logging

    configure_logging(args.log_level)
    problem = check_arguments(args)
    if problem:
        print(f"pdserve router: {problem}", file=sys.stderr)
        return 2
    internal_key, problem = resolve_internal_key(args, "router")
    if problem:
        print(problem, file=sys.stderr)
        return 2
    if internal_key is None:
        import logging

        logging.getLogger("pdserve.router").warning(
            "no internal key: engines that hold one refuse this router's P/D requests (403), so prompts are "
            "computed by the decode engines alone")

    import uvicorn

    from pdserve.engine.server.cli import GracefulServer
    from pdserve.router.app import Router, RouterSettings, build_app
    from pdserve.router.endpoints import normalize_url
    from pdserve.router.pd import FlowSettings

    settings = RouterSettings(
        model=args.model, policy=Policy(args.routing_policy), api_key=args.api_key,
        max_body_bytes=args.max_request_body_bytes, health_interval=args.health_interval, tokenizer=args.tokenizer,
        coordinator_address=args.coordinator_address, coordinator_http_port=args.coordinator_http_port,
        internal_key=internal_key, metrics_require_key=args.metrics_require_key, max_prompt_chars=args.max_prompt_chars,
        tool_call_parser=args.tool_call_parser,
        flow=FlowSettings(pd_min_prompt_tokens=args.pd_min_prompt_tokens, pd_only_when_busy=args.pd_only_when_busy,
                          connect_timeout=args.connect_timeout,
                          prefill_timeout=args.prefill_timeout, request_timeout=args.request_timeout,
                          decode_first_byte_timeout=args.decode_first_byte_timeout,
                          decode_idle_timeout=args.decode_idle_timeout,
                          max_connections_per_endpoint=args.max_connections_per_endpoint,
                          migration_limit=args.migration_limit))
    discovery = []
    try:
        prefill = [normalize_url(u) for u in args.prefill]
        decode = [normalize_url(u) for u in args.decode]
        if args.decode_service:
            from pdserve.router.discovery import default_namespace, kube_connection, kubernetes_discovery

            connection = kube_connection(args.kubeconfig)
            discovery.append(kubernetes_discovery(connection, args.namespace or default_namespace(),
                                                  args.prefill_service, args.decode_service, args.engine_port,
                                                  args.relist_interval))
        router = Router(settings, prefill, decode, discovery)
    except Exception as exc:  # bad URLs, no cluster config, an unreadable tokenizer: say so and stop
        print(f"pdserve router: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    pools = (f"Services {args.prefill_service or '-'} / {args.decode_service} in namespace "
             f"{args.namespace or 'the pod namespace'}" if args.decode_service
             else f"{len(prefill)} prefill + {len(decode)} decode endpoints")
    print(f"pdserve router: ready on http://{args.host}:{args.port}/v1 (model {args.model}, "
          f"{args.routing_policy}, {pools})", flush=True)
    config = uvicorn.Config(build_app(router), host=args.host, port=args.port, log_level="warning",
                            access_log=False, timeout_keep_alive=30, lifespan="on")
    GracefulServer(config).run()
    return 0
