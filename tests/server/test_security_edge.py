"""The HTTP edge of the trust boundary (issue 17): kv_transfer_params only with the internal key and
only well-formed, the API key on every route but /health (and /metrics unless asked), opaque 500s
on the router too, and engines with a KV connector refusing to start without a key."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import httpx
import pytest

from pdserve.engine.internal_auth import HEADER, InternalKeyError, header_matches, load_internal_key
from pdserve.engine.server.app import ServerSettings, build_app
from pdserve.engine.server.errors import APIError
from pdserve.engine.server.kv_params import check_blocks_fit_prompt, validate_kv_transfer_params

from support.fake_engine import FakeEngine, asgi_client

KEY = b"edge-test-internal-key-0123456789"
INTERNAL = {HEADER: KEY.decode()}
DIGEST = "ab" * 32
PULL = {"do_remote_prefill": True, "remote_engine_id": "prefill-0", "remote_request_id": "cmpl-1",
        "remote_block_ids": [3], "remote_host": "10.0.0.7", "remote_port": 5600, "remote_tp_size": 1,
        "prompt_digest": DIGEST}


@pytest.fixture(scope="module")
def model(model_dir):
    return model_dir("llama")


@pytest.fixture
def engine(model):
    return FakeEngine(model)


def completion(**extra) -> dict:
    # "Hello world" is 2-3 tokens for the test tokenizer: one block of 16.
    return {"model": "tiny", "prompt": "Hello world", "max_tokens": 2, "temperature": 0, **extra}


# -- kv_transfer_params need the internal key --------------------------------------------------------


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", completion(kv_transfer_params={"do_remote_decode": True})),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                              "kv_transfer_params": dict(PULL, remote_block_ids=[1])}),
])
@pytest.mark.parametrize("headers", [{}, {HEADER: "not-the-key-but-long-enough-0000"}])
async def test_kv_transfer_params_without_the_internal_key_are_refused_and_never_acted_on(engine, route, body,
                                                                                           headers):
    async with asgi_client(build_app(engine, ServerSettings(internal_key=KEY))) as client:
        resp = await client.post(route, json=body, headers=headers)
    assert resp.status_code == 403, resp.text
    error = resp.json()["error"]
    assert error["param"] == "kv_transfer_params" and error["type"] == "PermissionDeniedError"
    assert engine.kv_transfer_params == []  # nothing reached the engine


async def test_an_engine_without_a_key_refuses_every_kv_transfer_params(engine):
    async with asgi_client(build_app(engine, ServerSettings())) as client:
        resp = await client.post("/v1/completions", json=completion(kv_transfer_params={"do_remote_decode": True}),
                                 headers=INTERNAL)
        plain = await client.post("/v1/completions", json=completion())
    assert resp.status_code == 403 and plain.status_code == 200
    assert engine.kv_transfer_params == [None]


async def test_with_the_key_the_params_reach_the_engine_checked_and_copied(engine):
    async with asgi_client(build_app(engine, ServerSettings(internal_key=KEY))) as client:
        decode_side = await client.post("/v1/completions", json=completion(kv_transfer_params=PULL), headers=INTERNAL)
        prefill_side = await client.post("/v1/completions", json=completion(kv_transfer_params={"do_remote_decode": True}),
                                         headers=INTERNAL)
    assert decode_side.status_code == prefill_side.status_code == 200, decode_side.text
    assert engine.kv_transfer_params == [PULL, {"do_remote_decode": True}]


@pytest.mark.parametrize("change, field", [
    ({"remote_port": "abc"}, "remote_port"),
    ({"remote_port": 0}, "remote_port"),
    ({"remote_port": 70000}, "remote_port"),
    ({"remote_tp_size": 0}, "remote_tp_size"),
    ({"remote_tp_size": 3}, "remote_tp_size"),
    ({"remote_tp_size": 10**9}, "remote_tp_size"),
    ({"remote_tp_size": True}, "remote_tp_size"),
    ({"remote_block_ids": [-1]}, "remote_block_ids[0]"),
    ({"remote_block_ids": ["1"]}, "remote_block_ids[0]"),
    ({"remote_block_ids": list(range(17))}, "remote_block_ids"),  # more than 256 tokens / 16 can hold
    ({"remote_block_ids": 7}, "remote_block_ids"),
    ({"remote_host": "evil host"}, "remote_host"),
    ({"remote_host": ["10.0.0.1"]}, "remote_host"),
    ({"remote_engine_id": "x" * 300}, "remote_engine_id"),
    ({"remote_request_id": ""}, "remote_request_id"),
    ({"prompt_digest": "zz"}, "prompt_digest"),
    ({"transport": "rdma"}, "transport"),
    ({"remote_ports": [5600, 5601]}, "remote_ports"),  # two ports for one rank
    ({"do_remote_decode": True}, "do_remote_prefill"),
    ({"surprise": 1}, "surprise"),
])
async def test_every_field_is_checked_and_a_bad_one_is_a_400_naming_it(engine, change, field):
    params = dict(PULL, **change)
    async with asgi_client(build_app(engine, ServerSettings(internal_key=KEY))) as client:
        resp = await client.post("/v1/completions", json=completion(kv_transfer_params=params), headers=INTERNAL)
        again = await client.post("/v1/completions", json=completion())
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == f"kv_transfer_params.{field}"
    assert again.status_code == 200 and engine.kv_transfer_params == [None]


@pytest.mark.parametrize("missing", ["remote_request_id", "remote_block_ids", "remote_host", "remote_tp_size",
                                     "prompt_digest", "remote_port"])
def test_a_pull_needs_every_field_that_locates_the_blocks(missing):
    params = {k: v for k, v in PULL.items() if k != missing}
    with pytest.raises(APIError) as caught:
        validate_kv_transfer_params(params, max_blocks=16)
    assert caught.value.status == 400 and caught.value.param == f"kv_transfer_params.{missing}"


async def test_a_store_connectors_params_need_no_pull_fields():
    params = {"do_remote_prefill": True, "do_remote_decode": False, "kv_connector": "kvstore",
              "remote_engine_id": "prefill-0"}
    assert validate_kv_transfer_params(params, max_blocks=16) == params
    check_blocks_fit_prompt(params, prompt_len=40, block_size=16)
    with pytest.raises(APIError) as caught:
        validate_kv_transfer_params(dict(params, kv_connector="mystery"), max_blocks=16)
    assert caught.value.param == "kv_transfer_params.kv_connector"


async def test_the_block_count_must_fit_the_prompt(engine):
    async with asgi_client(build_app(engine, ServerSettings(internal_key=KEY))) as client:
        resp = await client.post("/v1/completions", json=completion(kv_transfer_params=dict(PULL, remote_block_ids=[1, 2, 3])),
                                 headers=INTERNAL)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "kv_transfer_params.remote_block_ids"
    check_blocks_fit_prompt(dict(PULL, remote_block_ids=[1, 2]), prompt_len=32, block_size=16)  # exact fit
    check_blocks_fit_prompt(dict(PULL, remote_block_ids=[1, 2, 3]), prompt_len=32, block_size=16)  # + sampled
    check_blocks_fit_prompt(dict(PULL, remote_block_ids=[1]), prompt_len=17, block_size=16)  # all but the last
    with pytest.raises(APIError):
        check_blocks_fit_prompt(dict(PULL, remote_block_ids=[1]), prompt_len=40, block_size=16)


# -- the API key covers every route but /health (and /metrics unless asked) ----------------------------


@pytest.mark.parametrize("metrics_require_key", [False, True])
async def test_the_api_key_covers_every_route_but_health(engine, metrics_require_key):
    settings = ServerSettings(api_key="sekret", internal_key=KEY, metrics_require_key=metrics_require_key)
    tokenize = {"model": "tiny", "prompt": "Hello"}
    async with asgi_client(build_app(engine, settings)) as client:
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/metrics")).status_code == (401 if metrics_require_key else 200)
        for method, path, body in (("POST", "/tokenize", tokenize), ("GET", "/version", None),
                                   ("POST", "/detokenize", {"model": "tiny", "tokens": [5, 6]}),
                                   ("GET", "/v1/models", None), ("GET", "/v1/models/tiny", None),
                                   ("POST", "/v1/completions", completion())):
            assert (await client.request(method, path, json=body)).status_code == 401, path
            ok = await client.request(method, path, json=body, headers={"Authorization": "Bearer sekret"})
            assert ok.status_code == 200, path
            # The router holds the internal key, not the clients' API key.
            assert (await client.request(method, path, json=body, headers=INTERNAL)).status_code == 200, path
        assert (await client.get("/metrics", headers={"Authorization": "Bearer sekret"})).status_code == 200


# -- the router: forwards the key, never a client's, and answers 500s with an id only --------------------


async def test_the_router_sends_its_key_and_never_forwards_a_clients(monkeypatch):
    from pdserve.router.app import Router, RouterSettings, build_app as build_router

    seen: list[httpx.Request] = []

    def engine(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path == "/health":
            return httpx.Response(200)
        body = json.loads(request.content)
        answer = {"id": "x", "object": "text_completion", "model": "tiny",
                  "choices": [{"index": 0, "text": "y", "finish_reason": "length"}]}
        if body.get("kv_transfer_params", {}).get("do_remote_decode"):
            answer["kv_transfer_params"] = dict(PULL, remote_block_ids=[1])
        return httpx.Response(200, json=answer)

    real_client = httpx.AsyncClient
    monkeypatch.setattr(httpx, "AsyncClient", lambda **kw: real_client(**kw) if "transport" in kw
                        else real_client(transport=httpx.MockTransport(engine)))
    settings = RouterSettings(model="tiny", internal_key=KEY, health_interval=60)
    router = Router(settings, ["http://prefill:1"], ["http://decode:1"])
    settings.flow.pd_min_prompt_tokens = 0
    app = build_router(router)
    await router.start()
    try:
        async with asgi_client(app) as client:
            resp = await client.post("/v1/completions", json=completion(),
                                     headers={HEADER: "a-client-guessing-the-key-000000"})
    finally:
        await router.stop()
    assert resp.status_code == 200, resp.text
    legs = [r for r in seen if r.url.path == "/v1/completions"]
    assert [r.url.host for r in legs] == ["prefill", "decode"]
    assert all(r.headers[HEADER] == KEY.decode() for r in legs)
    assert json.loads(legs[1].content)["kv_transfer_params"]["remote_block_ids"] == [1]


async def test_a_prefill_that_refuses_the_routers_key_leaves_the_prompt_to_the_decode_engine(monkeypatch):
    from pdserve.router.app import Router, RouterSettings, build_app as build_router

    def engine(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200)
        if request.url.host == "prefill":
            return httpx.Response(403, json={"error": {"message": "no key"}})
        assert "kv_transfer_params" not in json.loads(request.content)
        return httpx.Response(200, json={"choices": [{"index": 0, "text": "y", "finish_reason": "length"}]})

    real_client = httpx.AsyncClient
    monkeypatch.setattr(httpx, "AsyncClient", lambda **kw: real_client(**kw) if "transport" in kw
                        else real_client(transport=httpx.MockTransport(engine)))
    router = Router(RouterSettings(model="tiny", health_interval=60), ["http://prefill:1"], ["http://decode:1"])
    router.settings.flow.pd_min_prompt_tokens = 0
    app = build_router(router)
    await router.start()
    try:
        async with asgi_client(app) as client:
            resp = await client.post("/v1/completions", json=completion())
    finally:
        await router.stop()
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == "y"


async def test_a_router_500_carries_only_an_error_id(monkeypatch, caplog):
    from pdserve.router.app import Router, RouterSettings, build_app as build_router

    router = Router(RouterSettings(model="tiny", health_interval=60), [], ["http://decode:1"])

    async def broken(request):
        raise RuntimeError("cannot reach 10.1.2.3:9999 with token abc")

    monkeypatch.setattr(router, "completion_request", broken)
    with caplog.at_level(logging.ERROR, logger="pdserve.router"):
        async with asgi_client(build_router(router)) as client:
            resp = await client.post("/v1/completions", json=completion())
    assert resp.status_code == 500
    assert "10.1.2.3" not in resp.text and "RuntimeError" not in resp.text
    error_id = resp.json()["error"]["message"].split("error id ")[1].split(")")[0]
    assert any(error_id in r.getMessage() for r in caplog.records)


# -- the key itself, and engines that will not start without it -----------------------------------------


def test_the_key_comes_from_the_environment_or_a_file_and_a_short_one_is_refused(tmp_path):
    path = tmp_path / "key"
    path.write_text("file-key-0123456789abcdef\n")
    assert load_internal_key({}) is None
    assert load_internal_key({"PDSERVE_INTERNAL_KEY": "env-key-0123456789abcdef"}) == b"env-key-0123456789abcdef"
    assert load_internal_key({"PDSERVE_INTERNAL_KEY_FILE": str(path)}) == b"file-key-0123456789abcdef"
    with pytest.raises(InternalKeyError, match="at least 16"):
        load_internal_key({"PDSERVE_INTERNAL_KEY": "short"})
    with pytest.raises(InternalKeyError, match="cannot read"):
        load_internal_key({"PDSERVE_INTERNAL_KEY_FILE": str(tmp_path / "missing")})
    assert header_matches(KEY.decode(), KEY) and not header_matches(KEY.decode()[:-1], KEY)
    assert not header_matches(KEY.decode(), None)


P2P_CONSUMER = json.dumps({"kv_connector": "p2p", "kv_role": "kv_consumer"})


def serve(model: str, *extra: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve", "serve", "--model", model, "--port", "0",
                           "--kv-transfer-config", P2P_CONSUMER, *extra],
                          env=env, capture_output=True, text=True, timeout=120)


def test_an_engine_with_a_kv_connector_and_no_key_refuses_to_start(model):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_INTERNAL_KEY")}
    result = serve(model, env=dict(env, PYTHONSAFEPATH="1"))
    assert result.returncode == 2
    assert "internal key" in result.stderr and "--insecure-kv-transfer" in result.stderr
    short = serve(model, env=dict(env, PYTHONSAFEPATH="1", PDSERVE_INTERNAL_KEY="tiny"))
    assert short.returncode == 2 and "at least 16" in short.stderr
    missing = serve(model, "--internal-key-file", "/nonexistent/key", env=dict(env, PYTHONSAFEPATH="1"))
    assert missing.returncode == 2 and "cannot read" in missing.stderr


def test_an_insecure_engine_starts_and_says_so(model, tmp_path):
    from support.server import run_server

    env = {"PDSERVE_INTERNAL_KEY": None, "PDSERVE_INTERNAL_KEY_FILE": None}
    with run_server(model, "--served-model-name", "tiny", "--max-model-len", "256", "--kv-transfer-config",
                    P2P_CONSUMER, "--insecure-kv-transfer", tmp_path=tmp_path, env=env) as server:
        resp = httpx.post(f"{server.base_url}/completions", json=completion(), timeout=60)
        assert resp.status_code == 200
        assert "WITHOUT the internal key" in server.log()


# -- malformed bodies are 4xx, never 500 ----------------------------------------------------------------


async def test_malformed_bodies_get_a_4xx_not_a_500(engine):
    async def chunks():
        for _ in range(10):
            yield b"x" * 500

    async with asgi_client(build_app(engine, ServerSettings(max_body_bytes=2000))) as client:
        surrogate = await client.post("/v1/completions", content=b'{"model": "tiny", "prompt": "\\ud800", "max_tokens": 2}')
        paired = await client.post("/v1/completions", content=b'{"model": "tiny", "prompt": "\\ud83d\\ude00", "max_tokens": 2}')
        chunked = await client.post("/v1/completions", content=chunks())  # no Content-Length: counted as it comes
    async with asgi_client(build_app(engine, ServerSettings())) as client:
        deep = await client.post("/v1/completions", content=b'{"stop": ' + b"[" * 5000 + b"]" * 5000 + b"}")
        healthy = await client.post("/v1/completions", json=completion())
    assert surrogate.status_code == 400 and "surrogate" in surrogate.json()["error"]["message"]
    assert paired.status_code == 200  # an escaped pair is a real character
    assert chunked.status_code == 413 and chunked.json()["error"]["code"] == "request_too_large"
    assert deep.status_code == 400 and "nested too deeply" in deep.json()["error"]["message"]
    assert healthy.status_code == 200
