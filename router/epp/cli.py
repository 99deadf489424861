"""`pdserve epp`: the endpoint picker a Gateway API inference gateway asks over ext_proc."""

from __future__ import annotations

import argparse
import os
import sys

from pdserve.engine.server.cli import add_internal_key_arguments, resolve_internal_key
from pdserve.engine.server.tool_parsers import DEFAULT_PARSER, parser_names
from pdserve.router.balancer import Policy


def url_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def objective(text: str) -> tuple[str, int]:
    name, sep, priority = text.partition("=")
    try:
        if not sep or not name.strip():
            raise ValueError
        return name.strip(), int(priority)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NAME=PRIORITY (an integer), got {text!r}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="the served model name; a request naming another gets a 404")
    p.add_argument("--host", default="0.0.0.0", help="address the gRPC and HTTP servers listen on")
    p.add_argument("--grpc-port", type=int, default=9002,
                   help="ext_proc and grpc.health.v1 port (0: any free port, printed at start)")
    p.add_argument("--metrics-port", type=int, default=9090, help="HTTP port of /health and Prometheus /metrics")
    pool = p.add_argument_group("the InferencePool's engines (the decode pool with P/D)")
    pool.add_argument("--pool-endpoints", type=url_list, default=[], metavar="URL,...",
                      help="engine URLs at their main API port, comma-separated (http://IP:PORT: the gateway "
                           "connects to the IP:PORT the picker names)")
    pool.add_argument("--pool-service", help="in a cluster: the Service whose ready EndpointSlice addresses form "
                                             "the pool")
    pool.add_argument("--pool-port", type=int, default=8000, help="the engines' API port with --pool-service")
    pd = p.add_argument_group("P/D: the picker runs the prefill leg itself")
    pd.add_argument("--prefill-endpoints", type=url_list, default=[], metavar="URL,...",
                    help="prefill engine URLs, comma-separated")
    pd.add_argument("--prefill-service", help="in a cluster: the prefill engines' Service")
    pd.add_argument("--prefill-port", type=int, default=8000, help="the prefill engines' API port")
    pd.add_argument("--pd-min-prompt-tokens", type=int, default=256,
                    help="shorter prompts skip the prefill pool (0: disaggregate every request)")
    pd.add_argument("--prefill-timeout", type=float, default=60.0,
                    help="seconds a prefill leg may take; past it the decode engine computes the prompt itself")
    k8s = p.add_argument_group("Kubernetes discovery")
    k8s.add_argument("--namespace", help="namespace of the Services (default: the pod's, else 'default')")
    k8s.add_argument("--relist-interval", type=float, default=30.0,
                     help="seconds between full re-lists of the EndpointSlices")
    k8s.add_argument("--kubeconfig", help="kubeconfig outside a cluster (default: $KUBECONFIG, ~/.kube/config)")
    p.add_argument("--rank-port-base", type=int,
                   help="pods with data-parallel ranks (seen in the coordinator feed) serve rank r on this port + r: "
                        "each rank is scored and named as an endpoint of its own (without it, pods are picked whole)")
    p.add_argument("--coordinator", help="the coordinator's load feed, tcp://HOST:PORT (as the router's "
                                         "--coordinator-address)")
    p.add_argument("--coordinator-http-port", type=int, default=8080,
                   help="the coordinator's HTTP port, for the prefix index snapshot (GET /blocks)")
    p.add_argument("--policy", choices=[policy.value for policy in Policy], default=Policy.LEAST_LOADED.value,
                   help="how to pick, as the router's --routing-policy")
    p.add_argument("--tokenizer", help="tokenizer directory: exact prompt lengths and prefix hashes (prefix-aware)")
    p.add_argument("--tool-call-parser", choices=parser_names(), default=DEFAULT_PARSER,
                   help="the engines' --tool-call-parser (chat prompts with tools are rendered as theirs)")
    add_internal_key_arguments(p)
    p.add_argument("--max-body-bytes", type=int, default=8 << 20,
                   help="larger request bodies get 413 (default: %(default)s)")
    p.add_argument("--saturation-waiting", type=int,
                   help="the pool is saturated when every endpoint reports more waiting requests than this; "
                        "sheddable requests (objective priority < 0) then get 429 (default: never)")
    p.add_argument("--objective", type=objective, action="append", default=[], metavar="NAME=PRIORITY",
                   help="an inference objective the x-gateway-inference-objective header may name, with its "
                        "priority (repeatable); below 0 is sheddable. Unnamed or unknown objectives are priority 0")
    p.add_argument("--fallbacks", type=int, default=2,
                   help="endpoints listed after the pick in x-gateway-destination-endpoint, for the gateway's "
                        "retries (default: %(default)s)")
    p.add_argument("--pool-name", default="pdserve", help="the `name` label of the inference_pool_* metrics")
    p.add_argument("--health-interval", type=float, default=2.0, help="seconds between engine /health checks")
    p.add_argument("--connect-timeout", type=float, default=2.0, help="seconds to connect to an engine")
    p.add_argument("--event-loop", choices=("auto", "uvloop", "asyncio"), default="auto",
                   help="the picker's event loop; auto: uvloop where installed, on which gRPC's work per "
                        "request costs less (bench_gateway measures both)")
    p.add_argument("--log-level", default=os.environ.get("PDSERVE_LOG_LEVEL", "INFO"))


def run_loop(main, choice: str) -> None:
    """Runs `main` on uvloop (libuv: fewer wake-ups per gRPC message than asyncio's selector loop)
    or on asyncio's own loop."""
    import asyncio

    if choice != "asyncio":
        try:
            import uvloop
        except ImportError:
            if choice == "uvloop":
                raise RuntimeError("--event-loop uvloop: uvloop is not installed") from None
        else:
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                runner.run(main)
            return
    asyncio.run(main)


def coordinator_address(text: str | None) -> str | None:
    if not text:
        return None
    return text[len("tcp://"):] if text.startswith("tcp://") else text


def check_arguments(args: argparse.Namespace) -> str | None:
    if args.pool_service and args.pool_endpoints:
        return "give either --pool-endpoints or --pool-service"
    if not args.pool_service and not args.pool_endpoints:
        return "no engines: give --pool-endpoints URL,... or --pool-service NAME"
    if args.prefill_service and args.prefill_endpoints:
        return "give either --prefill-endpoints or --prefill-service"
    for value, name in ((args.health_interval, "--health-interval"), (args.relist_interval, "--relist-interval"),
                        (args.connect_timeout, "--connect-timeout"), (args.prefill_timeout, "--prefill-timeout"),
                        (args.max_body_bytes, "--max-body-bytes")):
        if value <= 0:
            return f"{name} must be positive"
    for value, name in ((args.fallbacks, "--fallbacks"), (args.pd_min_prompt_tokens, "--pd-min-prompt-tokens"),
                        (args.grpc_port, "--grpc-port"), (args.metrics_port, "--metrics-port")):
        if value < 0:
            return f"{name} must be 0 or more"
    if args.rank_port_base is not None and not 0 < args.rank_port_base < 65536:
        return "--rank-port-base must be a port number"
    if args.saturation_waiting is not None and args.saturation_waiting < 0:
        return "--saturation-waiting must be 0 or more"
    return None


def run(args: argparse.Namespace) -> int:
    from pdserve.engine.logging_config import configure_logging

    configure_logging(args.log_level)
    problem = check_arguments(args)
    if problem:
        print(f"pdserve epp: {problem}", file=sys.stderr)
        return 2
    internal_key, problem = resolve_internal_key(args, "epp")
    if problem:
        print(problem, file=sys.stderr)
        return 2

    import asyncio

    from pdserve.engine.server.tool_parsers import get_parser
    from pdserve.router.endpoints import normalize_url
    from pdserve.router.epp.metrics import EppMetrics
    from pdserve.router.epp.prefill import PrefillLeg
    from pdserve.router.epp.processor import Processor
    from pdserve.router.epp.request import PromptReader
    from pdserve.router.epp.server import serve
    from pdserve.router.epp.settings import EppSettings
    from pdserve.router.epp.state import PoolState
    from pdserve.router.local_tokenizer import LocalTokenizer
    from pdserve.router.release import HoldReleaser

    settings = EppSettings(
        model=args.model, policy=Policy(args.policy), pool_name=args.pool_name, max_body_bytes=args.max_body_bytes,
        health_interval=args.health_interval, tokenizer=args.tokenizer, tool_call_parser=args.tool_call_parser,
        coordinator_address=coordinator_address(args.coordinator), coordinator_http_port=args.coordinator_http_port,
        rank_port_base=args.rank_port_base, internal_key=internal_key, saturation_waiting=args.saturation_waiting,
        objectives=dict(args.objective), destinations=1 + args.fallbacks,
        pd_min_prompt_tokens=args.pd_min_prompt_tokens, prefill_timeout=args.prefill_timeout,
        connect_timeout=args.connect_timeout)
    has_prefill = bool(args.prefill_endpoints or args.prefill_service)
    if has_prefill and internal_key is None:
        import logging

        logging.getLogger("pdserve.epp").warning(
            "no internal key: engines that hold one refuse the picker's prefill legs (403), so prompts are computed "
            "by the decode engines alone")

    async def main() -> None:
        discovery = []
        if args.pool_service or args.prefill_service:
            from pdserve.router.discovery import default_namespace, kube_connection, kubernetes_discovery

            connection = kube_connection(args.kubeconfig)
            namespace = args.namespace or default_namespace()
            if args.pool_service:
                discovery.append(kubernetes_discovery(connection, namespace, None, args.pool_service, args.pool_port,
                                                      args.relist_interval))
            if args.prefill_service:
                discovery.append(kubernetes_discovery(connection, namespace, args.prefill_service, None,
                                                      args.prefill_port, args.relist_interval))
        metrics = EppMetrics(settings.pool_name)
        state = PoolState(settings, metrics, [normalize_url(u) for u in args.prefill_endpoints],
                          [normalize_url(u) for u in args.pool_endpoints], discovery)
        tokenizer = LocalTokenizer(args.tokenizer) if args.tokenizer else None
        try:
            reader = PromptReader(tokenizer, get_parser(settings.tool_call_parser))
            prefill = None
            if has_prefill:
                releaser = HoldReleaser(state.client, metrics, settings.release_timeout,  # type: ignore[arg-type]
                                        settings.connect_timeout)
                prefill = PrefillLeg(state.client, state.health, releaser, internal_key, settings.prefill_timeout,
                                     settings.connect_timeout)
            processor = Processor(settings, state, metrics, reader, prefill)
            await serve(processor, state, metrics, args.host, args.grpc_port, args.metrics_port,
                        settings.max_body_bytes, settings.model)
        finally:
            if tokenizer is not None:
                tokenizer.close()

    try:
        run_loop(main(), args.event_loop)
    except Exception as exc:  # bad URLs, no cluster config, an unreadable tokenizer: say so and stop
        print(f"pdserve epp: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    return 0
