"""`pdserve epp` as a real process, spoken to over a real gRPC channel with Envoy's ext_proc
messages (the xds-protos classes), in front of real engines on 127.0.0.1 and a real coordinator
whose feed carries hand-made engine reports.

One set of processes for the module: two engines (role both) and one prefill engine; the
coordinator; and pickers with different flags (each starts in about a second).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import grpc
import httpx
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from support.coordinator import PeriodicReporter as Reporter, run_coordinator
from support.server import ServerProcess, free_port, p2p_config, wait_healthy
from support.scrape import metric_total, successes, wait_until

MODEL = "tiny"
ENGINE_ARGS = ("--max-model-len", "512", "--num-kv-blocks", "96", "--max-num-seqs", "8")
LONG_PROMPT = " ".join(f"word{i % 37}" for i in range(120))
RANK_PORT_BASE = 41000
DEST = "x-gateway-destination-endpoint"


# --- processes --------------------------------------------------------------------------------------

def launch(cmd: list[str], port: int, log_path: Path) -> ServerProcess:
    with open(log_path, "a") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, PYTHONSAFEPATH="1"))
    return ServerProcess(proc, port, log_path)


def stop(server: ServerProcess) -> None:
    if server.proc.poll() is None:
        try:
            os.killpg(server.proc.pid, signal.SIGTERM)
            server.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        except ProcessLookupError:
            return
    try:
        os.killpg(server.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    server.proc.wait()


@dataclass
class Picker:
    server: ServerProcess  # its HTTP (/health, /metrics) port
    grpc_port: int

    @property
    def url(self) -> str:
        return self.server.url

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}")

    def metric(self, name: str, **labels: str) -> float:
        return metric_total(self.url, name, **labels)


@contextmanager
def picker(tmp: Path, *args: str) -> Iterator[Picker]:
    http_port, grpc_port = free_port(), free_port()
    server = launch([sys.executable, "-m", "pdserve", "epp", "--model", MODEL, "--host", "127.0.0.1",
                     "--grpc-port", str(grpc_port), "--metrics-port", str(http_port), "--health-interval", "0.5",
                     *args], http_port, tmp / f"epp-{http_port}.log")
    try:
        wait_healthy(server.url, server.proc, server.log_path, timeout=60)
        yield Picker(server, grpc_port)
    finally:
        stop(server)
        assert server.proc.returncode == 0, server.log()  # a clean stop on SIGTERM


# --- ext_proc messages ------------------------------------------------------------------------------

def headers_message(path: str, method: str = "POST", headers: dict[str, str] | None = None, eos: bool = False,
                    subset: list[str] | None = None) -> pb.ProcessingRequest:
    values = {":path": path, ":method": method, ":authority": "gateway", "content-type": "application/json",
              **(headers or {})}
    message = pb.ProcessingRequest(request_headers=pb.HttpHeaders(
        headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode())
                                            for k, v in values.items()]),
        end_of_stream=eos))
    if subset is not None:
        message.metadata_context.filter_metadata["envoy.lb.subset_hint"].update(
            {"x-gateway-destination-endpoint-subset": subset})
    return message


def body_message(body: bytes | dict) -> pb.ProcessingRequest:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=raw, end_of_stream=True))


def duplex_headers(path: str, **kw) -> pb.ProcessingRequest:
    """Request headers as Envoy sends them in FULL_DUPLEX_STREAMED mode: with the protocol config."""
    message = headers_message(path, **kw)
    message.protocol_config.request_body_mode = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
    return message


def body_chunks(body: bytes | dict, pieces: int, last: bool = True) -> list[pb.ProcessingRequest]:
    """The body cut into `pieces` messages, end_of_stream on the final one when `last`."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    cuts = [len(raw) * i // pieces for i in range(pieces + 1)]
    return [pb.ProcessingRequest(request_body=pb.HttpBody(body=raw[a:b], end_of_stream=last and i == pieces - 1))
            for i, (a, b) in enumerate(zip(cuts, cuts[1:]))]


def streamed(answer: pb.ProcessingResponse) -> tuple[bytes, bool]:
    assert answer.WhichOneof("response") == "request_body", answer
    chunk = answer.request_body.response.body_mutation.streamed_response
    return chunk.body, chunk.end_of_stream


def exchange(channel: grpc.Channel, *messages: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
    stub = pb_grpc.ExternalProcessorStub(channel)
    return list(stub.Process(iter(messages), timeout=60))


def completion(prompt: str = "The capital of France", max_tokens: int = 2, **extra) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}


@dataclass
class Placement:
    destinations: list[str]
    metadata: str
    set_headers: dict[str, str]
    removed: list[str]
    body: bytes | None
    clear_route_cache: bool


def placement(answer: pb.ProcessingResponse) -> Placement:
    phase = answer.WhichOneof("response")
    assert phase in ("request_body", "request_headers"), answer
    common = getattr(answer, phase).response
    set_headers = {h.header.key: (h.header.raw_value or h.header.value.encode()).decode()
                   for h in common.header_mutation.set_headers}
    metadata = answer.dynamic_metadata.fields["envoy.lb"].struct_value.fields[DEST].string_value
    assert set_headers[DEST] == metadata  # the protocol: never two different values
    body = common.body_mutation.body if common.HasField("body_mutation") else None
    return Placement(set_headers[DEST].split(","), metadata, set_headers, list(common.header_mutation.remove_headers),
                     body, common.clear_route_cache)


def immediate(answer: pb.ProcessingResponse) -> tuple[int, dict]:
    assert answer.WhichOneof("response") == "immediate_response", answer
    return answer.immediate_response.status.code, json.loads(answer.immediate_response.body)


def place(channel: grpc.Channel, body: dict | bytes, path: str = "/v1/completions", **kw) -> pb.ProcessingResponse:
    answers = exchange(channel, headers_message(path, **kw), body_message(body))
    assert len(answers) == 2 and answers[0].WhichOneof("response") == "request_headers"
    return answers[1]


def address(engine: ServerProcess) -> str:
    return f"127.0.0.1:{engine.port}"


# --- module processes --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("epp")


@pytest.fixture(scope="module")
def engines(model_dir, tmp) -> Iterator[list[ServerProcess]]:
    """[engine a, engine b, prefill engine], started together."""
    model = model_dir("llama")
    started = []
    try:
        # a pulls KV over the p2p connector (the P/D tests' decode engine); the prefill engine holds it.
        for role, kv in (("both", ["--kv-transfer-config", p2p_config("kv_both", transport="tcp")]), ("both", []),
                         ("prefill", ["--kv-transfer-config", p2p_config("kv_producer", transport="tcp")])):
            port = free_port()
            started.append(launch([sys.executable, "-m", "pdserve", "serve", "--model", model, "--served-model-name",
                                   MODEL, "--port", str(port), "--dtype", "float32", "--engine-role", role, *kv,
                                   *ENGINE_ARGS], port, tmp / f"engine-{port}.log"))
        for server in started:
            wait_healthy(server.url, server.proc, server.log_path)
        yield started
    finally:
        for server in started:
            stop(server)


@pytest.fixture(scope="module")
def coordinator(tmp):
    with run_coordinator("--stale-after", "1.0", "--forget-after", "60", tmp_path=tmp) as c:
        reporter = Reporter(c.stats_address)
        try:
            yield c, reporter
        finally:
            reporter.close()


@pytest.fixture(scope="module")
def main_picker(engines, coordinator, tmp) -> Iterator[Picker]:
    c, _ = coordinator
    with picker(tmp, "--pool-endpoints", f"{engines[0].url},{engines[1].url}",
                "--coordinator", f"tcp://127.0.0.1:{c.publish_port}", "--coordinator-http-port", str(c.http_port),
                "--rank-port-base", str(RANK_PORT_BASE), "--objective", "batch=-1", "--objective", "chat=5",
                "--saturation-waiting", "5", "--max-body-bytes", "4096") as p:
        yield p


# --- placing requests --------------------------------------------------------------------------------

def test_bodiless_and_body_requests_are_placed_with_header_and_metadata(engines, main_picker):
    a, b = address(engines[0]), address(engines[1])
    with main_picker.channel() as channel:
        # GET /v1/models has no body: placed on the headers phase.
        answers = exchange(channel, headers_message("/v1/models", "GET", eos=True))
        assert len(answers) == 1
        got = placement(answers[0])
        assert sorted(got.destinations) == sorted([a, b])
        # A body request: CONTINUE on its headers (client copies of the picker's headers removed),
        # then the placement on its body. The client's own destination header never survives.
        answers = exchange(channel, headers_message("/v1/completions", headers={DEST: "10.9.9.9:80"}),
                           body_message(completion()))
        removed = answers[0].request_headers.response.header_mutation.remove_headers
        assert DEST in removed and "x-pdserve-internal-key" in removed and "x-pdserve-dp-rank" in removed
        got = placement(answers[1])
        assert set(got.destinations) == {a, b} and "10.9.9.9:80" not in got.metadata
        assert got.body is None  # nothing to change: the client's bytes go upstream as sent
        # What the gateway then does: the request to the first destination answers as the engine does.
        direct = httpx.post(f"{engines[0].url}/v1/completions", json=completion(max_tokens=4), timeout=60).json()
        routed = httpx.post(f"http://{got.destinations[0]}/v1/completions", json=completion(max_tokens=4),
                            timeout=60).json()
        assert routed["choices"][0]["text"] == direct["choices"][0]["text"]
    assert main_picker.metric("inference_objective_request_total", model_name=MODEL) >= 2
    assert main_picker.metric("pdserve_epp_picks_total") >= 2


def test_duplex_streamed_bodies_get_one_answer_pair_once_whole(engines, main_picker):
    """FULL_DUPLEX_STREAMED (the GIE gateways' mode): Envoy sends the chunks without waiting; the
    picker answers nothing until the body is whole, then the headers (the pick and every header
    change) and the body, sent back whole, since in this mode Envoy forwards only what it gets."""
    pool = {address(engines[0]), address(engines[1])}
    with main_picker.channel() as channel:
        body = completion()
        raw = json.dumps(body).encode()
        answers = exchange(channel, duplex_headers("/v1/completions", headers={DEST: "10.9.9.9:80"}),
                           *body_chunks(body, 3))
        assert [a.WhichOneof("response") for a in answers] == ["request_headers", "request_body"]
        got = placement(answers[0])
        assert set(got.destinations) == pool and "10.9.9.9:80" not in got.metadata
        assert "x-pdserve-internal-key" in got.removed and "x-pdserve-dp-rank" in got.removed
        assert streamed(answers[1]) == (raw, True)
        # A client's kv_transfer_params are cut out and the content-length follows the new body.
        forged = completion(kv_transfer_params={"do_remote_prefill": True, "remote_host": "10.9.9.9"})
        answers = exchange(channel, duplex_headers("/v1/completions",
                                                   headers={"content-length": str(len(json.dumps(forged)))}),
                           *body_chunks(forged, 2))
        sent, last = streamed(answers[1])
        assert json.loads(sent) == body and last
        assert placement(answers[0]).set_headers["content-length"] == str(len(sent))
        # Trailers end the body: the body goes back unfinished and the trailers pass.
        answers = exchange(channel, duplex_headers("/v1/completions"), *body_chunks(body, 2, last=False),
                           pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))
        assert [a.WhichOneof("response") for a in answers] == ["request_headers", "request_body", "request_trailers"]
        assert streamed(answers[1]) == (raw, False)
        # A bodiless request is placed on its headers, as in the buffered mode.
        answers = exchange(channel, duplex_headers("/v1/models", method="GET", eos=True))
        assert len(answers) == 1 and set(placement(answers[0]).destinations) <= pool
        # Past --max-body-bytes (4096) the 413 comes as soon as the chunks pass it; the rest of the
        # body, still in flight from the gateway, is dropped without another answer.
        answers = exchange(channel, duplex_headers("/v1/completions"),
                           *body_chunks(completion(prompt="x" * 9000), 3))
        assert len(answers) == 1
        status, error = immediate(answers[0])
        assert status == 413 and error["error"]["code"] == "request_too_large"
        # Errors about the body are the same OpenAI errors as in the buffered mode.
        status, error = immediate(exchange(channel, duplex_headers("/v1/completions"),
                                           *body_chunks(b"{not json", 2))[0])
        assert status == 400 and "not valid JSON" in error["error"]["message"]
        # Once placed, the picker ends the stream with OK: a body chunk the gateway still sends is
        # not read, and the stream ends cleanly (Envoy then finishes the request on its own).
        answers = exchange(channel, duplex_headers("/v1/completions"), *body_chunks(body, 1), *body_chunks(body, 1))
        assert [a.WhichOneof("response") for a in answers] == ["request_headers", "request_body"]
        assert placement(exchange(channel, duplex_headers("/v1/completions"), *body_chunks(body, 1))[0]).destinations


def test_subset_hint_limits_the_pick(engines, main_picker):
    a, b = address(engines[0]), address(engines[1])
    with main_picker.channel() as channel:
        for _ in range(3):
            got = placement(place(channel, completion(), subset=[b, "10.1.1.1:8000"]))
            assert got.destinations == [b]
        status, error = immediate(place(channel, completion(), subset=["10.1.1.1:8000"]))
        assert status == 503 and error["error"]["code"] == "no_endpoints"
        status, _ = immediate(place(channel, completion(), subset=[]))
        assert status == 503
        got = placement(exchange(channel, headers_message("/v1/models", "GET", eos=True, subset=[a]))[0])
        assert got.destinations == [a]


def test_bad_bodies_get_openai_errors(main_picker):
    def errors(code: str) -> float:
        return main_picker.metric("inference_objective_request_error_total", error_code=code)

    before = {code: errors(code) for code in ("model_not_found", "request_too_large")}
    with main_picker.channel() as channel:
        status, error = immediate(place(channel, b"{not json"))
        assert status == 400 and "not valid JSON" in error["error"]["message"]
        status, error = immediate(place(channel, b"[1, 2]"))
        assert status == 400 and "JSON object" in error["error"]["message"]
        status, error = immediate(place(channel, completion(model="gpt-unknown")))
        assert status == 404 and error["error"]["code"] == "model_not_found"
        status, error = immediate(place(channel, completion(prompt="x" * 5000)))  # over --max-body-bytes 4096
        assert status == 413 and error["error"]["code"] == "request_too_large"
    assert {code: errors(code) - count for code, count in before.items()} == {"model_not_found": 1,
                                                                              "request_too_large": 1}


def test_garbage_and_out_of_order_streams_end_alone(engines, main_picker):
    with main_picker.channel() as channel:
        # Bytes that are no ProcessingRequest at all.
        raw = channel.stream_stream("/envoy.service.ext_proc.v3.ExternalProcessor/Process",
                                    request_serializer=lambda b: b, response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError):
            list(raw(iter([b"\xff\xfe\xfd garbage \x00"]), timeout=30))
        protocol_before = main_picker.metric("pdserve_epp_stream_errors_total", kind="protocol")
        for messages in ([body_message(completion())],                       # a body before any headers
                         [pb.ProcessingRequest()],                            # no phase at all
                         [headers_message("/v1/completions"), headers_message("/v1/completions")]):
            with pytest.raises(grpc.RpcError) as failed:
                exchange(channel, *messages)
            assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert main_picker.metric("pdserve_epp_stream_errors_total", kind="protocol") == protocol_before + 3
        # A second body after the placement is not read: the picker ended the stream with OK once it
        # had answered (it would only have been a gateway's protocol error).
        answers = exchange(channel, headers_message("/v1/completions"), body_message(completion()), body_message(b"{}"))
        assert [a.WhichOneof("response") for a in answers] == ["request_headers", "request_body"]
        # A client that opens a stream and goes away mid-request.
        stub = pb_grpc.ExternalProcessorStub(channel)
        gone = threading.Event()

        def messages():
            yield headers_message("/v1/completions")
            gone.wait(5)

        call = stub.Process(messages(), timeout=30)
        next(call)
        call.cancel()
        gone.set()
        # A response phase on a stream still open is passed on unchanged (after the placement there
        # is none: the stream has ended and Envoy sends the picker nothing more).
        answers = exchange(channel, headers_message("/v1/completions"),
                           pb.ProcessingRequest(response_headers=pb.HttpHeaders()))
        assert [a.WhichOneof("response") for a in answers] == ["request_headers", "response_headers"]
        # And the next stream is served as ever.
        assert placement(place(channel, completion())).destinations
    assert main_picker.server.proc.poll() is None


def test_grpc_health(main_picker, tmp):
    with main_picker.channel() as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            answer = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING, service


def test_no_ready_endpoint_gets_503_and_readiness_not_serving(tmp):
    dead = free_port()  # nothing listens there
    with picker(tmp, "--pool-endpoints", f"http://127.0.0.1:{dead}") as p:
        wait_until(lambda: httpx.get(f"{p.url}/health", timeout=5).json()["ready"] is False, "the ejection")
        with p.channel() as channel:
            status, error = immediate(place(channel, completion()))
            assert status == 503 and error["error"]["code"] == "no_endpoints" and error["error"]["type"]
            status, _ = immediate(exchange(channel, headers_message("/v1/models", "GET", eos=True))[0])
            assert status == 503
            stub = health_pb2_grpc.HealthStub(channel)
            check = lambda service: stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status  # noqa: E731
            # Readiness follows the ejection within the picker's quarter-second watch.
            wait_until(lambda: check("readiness") == health_pb2.HealthCheckResponse.NOT_SERVING, "readiness")
            assert check("") == health_pb2.HealthCheckResponse.SERVING  # alive: a liveness probe keeps it
        assert p.metric("inference_pool_ready_pods") == 0


# --- picks follow the feed -----------------------------------------------------------------------------

def feed_seen(p: Picker, engine: ServerProcess, waiting: int) -> bool:
    return p.metric("inference_pool_per_pod_queue_size", model_server_pod=address(engine)) == waiting


def test_lower_score_wins_and_the_rest_follow_in_order(engines, coordinator, main_picker):
    _, reporter = coordinator
    a, b = engines[0], engines[1]
    reporter.set(engine_a=dict(address=address(a), waiting=5), engine_b=dict(address=address(b), waiting=0))
    wait_until(lambda: feed_seen(main_picker, a, 5) and feed_seen(main_picker, b, 0), "the feed at the picker")
    with main_picker.channel() as channel:
        # b scores 0 against a's 20; each pick bumps b by 4, so the first five go to b.
        for _ in range(5):
            assert placement(place(channel, completion())).destinations == [address(b), address(a)]
        reporter.set(engine_a=dict(address=address(a), waiting=0, step=2),
                     engine_b=dict(address=address(b), waiting=9, step=2))
        wait_until(lambda: feed_seen(main_picker, b, 9), "the new counts")
        for _ in range(3):
            assert placement(place(channel, completion())).destinations == [address(a), address(b)]
    assert main_picker.metric("inference_pool_average_queue_size") == 4.5


def test_stale_engines_are_not_preferred(engines, coordinator, main_picker):
    c, reporter = coordinator
    a, b = engines[0], engines[1]
    reporter.set(engine_a=dict(address=address(a), waiting=0, step=3),
                 engine_b=dict(address=address(b), waiting=8, step=3))
    wait_until(lambda: feed_seen(main_picker, b, 8) and feed_seen(main_picker, a, 0), "the feed at the picker")
    with main_picker.channel() as channel:
        assert placement(place(channel, completion())).destinations[0] == address(a)
        with reporter.lock:
            reporter.paused.add("engine-a")  # a's core froze: the coordinator marks it stale after 1 s
        wait_until(lambda: (c.engine("engine-a") or {}).get("stale"), "the coordinator's stale mark")
        time.sleep(0.3)
        for _ in range(3):
            assert placement(place(channel, completion())).destinations == [address(b)]


def test_sheddable_requests_get_429_when_the_pool_is_saturated(engines, coordinator, main_picker):
    _, reporter = coordinator
    a, b = engines[0], engines[1]
    reporter.set(engine_a=dict(address=address(a), waiting=20, step=4),
                 engine_b=dict(address=address(b), waiting=20, step=4))
    wait_until(lambda: feed_seen(main_picker, a, 20) and feed_seen(main_picker, b, 20), "the saturated feed")
    objective = "x-gateway-inference-objective"
    with main_picker.channel() as channel:
        status, error = immediate(place(channel, completion(), headers={objective: "batch"}))
        assert status == 429 and error["error"]["code"] == "rate_limit_exceeded"
        assert placement(place(channel, completion(), headers={objective: "chat"})).destinations
        assert placement(place(channel, completion())).destinations  # no objective: priority 0
        reporter.set(engine_a=dict(address=address(a), waiting=0, step=5),
                     engine_b=dict(address=address(b), waiting=20, step=5))
        wait_until(lambda: feed_seen(main_picker, a, 0), "a's queue drained")
        assert placement(place(channel, completion(), headers={objective: "batch"})).destinations[0] == address(a)
    assert main_picker.metric("inference_objective_request_error_total", error_code="rate_limit_exceeded") == 1


def test_data_parallel_ranks_are_endpoints_on_their_rank_ports(engines, coordinator, main_picker):
    _, reporter = coordinator
    a, b = engines[0], engines[1]
    rank = lambda r: f"127.0.0.1:{RANK_PORT_BASE + r}"  # noqa: E731 (the port a's rank r serves on)
    reporter.set(engine_a=dict(address=address(a), dp_rank=0, waiting=3, step=6),
                 engine_a1=dict(address=address(a), dp_rank=1, waiting=0, step=6),
                 engine_b=dict(address=address(b), waiting=1, step=6))
    wait_until(lambda: main_picker.metric("inference_pool_per_pod_queue_size",
                                          model_server_pod=f"{address(a)}#1") == 0
               and feed_seen(main_picker, a, 3) and feed_seen(main_picker, b, 1), "the ranks in the feed")
    with main_picker.channel() as channel:
        # Rank 1 (score 0) first; then the best other pod (b, 4), not rank 0 of the same pod.
        assert placement(place(channel, completion())).destinations == [rank(1), address(b)]
        # Rank 1 is bumped to 4: b (4) and rank 1 tie, rank 0 (12) stays last.
        second = placement(place(channel, completion())).destinations
        assert set(second) == {rank(1), address(b)}
        got = placement(exchange(channel, headers_message("/v1/models", "GET", eos=True, subset=[rank(0)]))[0])
        assert got.destinations == [rank(0)]


# --- P/D: the picker runs the prefill leg -------------------------------------------------------------

def test_pd_body_carries_the_prefill_engines_kv_params_and_decodes_the_same(engines, tmp):
    decode, prefill = engines[0], engines[2]
    expected = httpx.post(f"{decode.url}/v1/completions", json=completion(LONG_PROMPT, 8), timeout=60).json()
    before = successes(prefill)
    with picker(tmp, "--pool-endpoints", decode.url, "--prefill-endpoints", prefill.url,
                "--pd-min-prompt-tokens", "0") as p, p.channel() as channel:
        # A client's own kv_transfer_params and internal key are never what reaches an engine.
        sent = completion(LONG_PROMPT, 8, kv_transfer_params={"do_remote_prefill": True,
                                                              "remote_host": "10.6.6.6"})
        raw = json.dumps(sent).encode()
        got = placement(place(channel, raw, headers={"content-length": str(len(raw)),
                                                     "x-pdserve-internal-key": "guess"}))
        assert got.destinations == [address(decode)]
        body = json.loads(got.body)
        params = body.pop("kv_transfer_params")
        assert params.get("remote_host") != "10.6.6.6" and params.get("remote_engine_id")
        assert body == {k: v for k, v in sent.items() if k != "kv_transfer_params"}
        assert got.set_headers["content-length"] == str(len(got.body))
        key = got.set_headers["x-pdserve-internal-key"]
        assert key == os.environ["PDSERVE_INTERNAL_KEY"]
        wait_until(lambda: successes(prefill) == before + 1, "the prefill leg")
        # What the gateway sends on: the decode engine pulls the KV and answers as one engine does.
        decode_before = successes(decode)
        answer = httpx.post(f"http://{got.destinations[0]}/v1/completions", content=got.body,
                            headers={"content-type": "application/json", "x-pdserve-internal-key": key},
                            timeout=60).json()
        assert answer["choices"][0]["text"] == expected["choices"][0]["text"]
        assert successes(decode) == decode_before + 1
        # n>1 stays on the decode engine (nothing to pull), as with the router: no prefill leg.
        got = placement(place(channel, completion(LONG_PROMPT, 2, n=2)))
        assert got.body is None and p.metric("pdserve_epp_prefill_legs_total") == 1
        # The prefill engine refuses a prompt over its context: that 400 is the client's answer.
        status, error = immediate(place(channel, completion(LONG_PROMPT * 5, 2)))
        assert status == 400 and error["error"]["code"] == "context_length_exceeded"


def test_pd_with_the_prefill_engine_down_sends_the_plain_body_to_decode(engines, tmp):
    decode = engines[0]
    dead = free_port()
    with picker(tmp, "--pool-endpoints", decode.url, "--prefill-endpoints", f"http://127.0.0.1:{dead}",
                "--pd-min-prompt-tokens", "0") as p, p.channel() as channel:
        sent = completion(LONG_PROMPT, 4, kv_transfer_params={"do_remote_prefill": True})
        got = placement(place(channel, sent))
        assert got.destinations == [address(decode)]
        assert json.loads(got.body) == completion(LONG_PROMPT, 4)  # only the client's params are gone
        assert "x-pdserve-internal-key" not in got.set_headers and "x-pdserve-internal-key" in got.removed
        assert p.metric("pdserve_epp_prefill_fallbacks_total") == 1
        expected = httpx.post(f"{decode.url}/v1/completions", json=completion(LONG_PROMPT, 4), timeout=60).json()
        answer = httpx.post(f"http://{got.destinations[0]}/v1/completions", content=got.body,
                            headers={"content-type": "application/json"}, timeout=60).json()
        assert answer["choices"][0]["text"] == expected["choices"][0]["text"]
