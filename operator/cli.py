"""`pdserve operator run | render | crd`."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, TextIO

import yaml

from pdserve.operator import crd
from pdserve.operator.spec import ALLOW_HOST_PATH_FLAG


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="operator_command", metavar="ACTION", required=True)

    run = sub.add_parser("run", help="run the operator against the current cluster")
    scope = run.add_mutually_exclusive_group()
    scope.add_argument("--namespace", "-n", action="append", default=[], metavar="NS",
                       help="watch this namespace (repeatable); default: the kubeconfig's or pod's namespace")
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace")
    run.add_argument("--kubeconfig", default=None, help="kubeconfig file (default: in-cluster, then $KUBECONFIG)")
    run.add_argument("--context", default=None, help="kubeconfig context")
    run.add_argument("--autoscale-interval", type=float, default=15.0, metavar="SECONDS")
    run.add_argument("--stats-url-template", default=os.environ.get("PDSERVE_STATS_URL_TEMPLATE"),
                     metavar="URL", help="coordinator stats URL with {namespace} and {name} "
                                         "(default: http://{name}-coordinator.{namespace}.svc:8080/stats)")
    run.add_argument("--liveness", default=None, metavar="URL",
                     help="serve kopf's liveness probe, e.g. http://0.0.0.0:8080/healthz")
    run.add_argument(ALLOW_HOST_PATH_FLAG, action="store_true",
                     help="serve InferenceServices with hostPath volumes (refused by default: they expose "
                          "the node's filesystem to whoever may create an InferenceService)")
    run.add_argument("--verbose", "-v", action="store_true")

    render = sub.add_parser("render", help="print the objects an InferenceService renders to, as YAML")
    render.add_argument("-f", "--filename", required=True, help="InferenceService YAML ('-' for stdin)")
    render.add_argument("--namespace", "-n", default=None,
                        help="namespace for resources that name none (default: 'default')")
    render.add_argument(ALLOW_HOST_PATH_FLAG, action="store_true",
                        help="render hostPath volumes, as an operator run with this flag would")

    sub.add_parser("crd", help="print the InferenceService CustomResourceDefinition")


def _default_namespace() -> str:
    # In a pod, the operator watches its own namespace unless told otherwise.
    path = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
    if os.path.exists(path):
        with open(path) as f:
            return f.read().strip()
    return "default"


def _run_operator(args: argparse.Namespace) -> int:
    import kopf

    from pdserve.operator.autoscaler import DEFAULT_STATS_URL
    from pdserve.operator.handlers import OperatorConfig, make_settings, register

    kopf.configure(verbose=args.verbose, log_format=kopf.LogFormat.PLAIN)
    config = OperatorConfig(kubeconfig=args.kubeconfig, context=args.context,
                            autoscale_interval=args.autoscale_interval,
                            stats_url_template=args.stats_url_template or DEFAULT_STATS_URL,
                            allow_host_path=args.allow_host_path)
    namespaces = [] if args.all_namespaces else (args.namespace or [_default_namespace()])
    kopf.run(registry=register(config), settings=make_settings(), standalone=True,
             clusterwide=args.all_namespaces, namespaces=namespaces, liveness_endpoint=args.liveness,
             memo=kopf.Memo())
    return 0


def _render(args: argparse.Namespace, out: TextIO) -> int:
    from pdserve.operator.render import render
    from pdserve.operator.spec import InvalidSpec

    if args.filename == "-":
        docs = list(yaml.safe_load_all(sys.stdin))
    else:
        with open(args.filename) as f:
            docs = list(yaml.safe_load_all(f))
    services = [d for d in docs if isinstance(d, dict) and d.get("kind") == crd.KIND]
    if not services:
        print(f"pdserve operator render: no {crd.KIND} in {args.filename}", file=sys.stderr)
        return 2
    manifests: list[dict[str, Any]] = []
    for doc in services:
        try:
            manifests += render(doc, namespace=args.namespace, allow_host_path=args.allow_host_path)
        except InvalidSpec as error:
            name = (doc.get("metadata") or {}).get("name", "?")
            print(f"pdserve operator render: {crd.KIND} {name} is invalid:", file=sys.stderr)
            for message in error.messages:
                print(f"  - {message}", file=sys.stderr)
            return 1
    out.write(crd.to_yaml(manifests))
    return 0


def run(args: argparse.Namespace) -> int:
    if args.operator_command == "run":
        return _run_operator(args)
    if args.operator_command == "render":
        return _render(args, sys.stdout)
    sys.stdout.write(crd.crd_yaml())
    return 0
