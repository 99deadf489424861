"""Bad input gets its documented status and a clear OpenAI-format error; the next request still works."""

from __future__ import annotations

import httpx
import pytest

GOOD = {"model": "tiny", "prompt": "Hello world", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server  # tests/server/conftest.py: max-model-len 256, a 1 MiB body limit, key "sekret"


AUTH = {"Authorization": "Bearer sekret"}


def post(server, path: str, *, json=None, content=None, headers=None) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=json, content=content, timeout=60,
                      headers={**AUTH, "Content-Type": "application/json", **(headers or {})})


CASES = [
    # (name, path, body (dict → JSON, bytes → raw), status, message fragment, param)
    ("malformed json", "/completions", b'{"model": "tiny", "prompt": ', 400, "not valid JSON", None),
    ("not an object", "/completions", b'[1, 2, 3]', 400, "JSON object", None),
    ("wrong prompt type", "/completions", {"model": "tiny", "prompt": 123}, 400, "prompt", "prompt"),
    ("wrong max_tokens type", "/completions", dict(GOOD, max_tokens="ten"), 400, "max_tokens", "max_tokens"),
    ("missing messages", "/chat/completions", {"model": "tiny"}, 400, "messages", "messages"),
    ("bad role", "/chat/completions", {"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, 400,
     "role", "messages"),
    ("unknown model", "/completions", dict(GOOD, model="gpt-9"), 404, "does not exist", "model"),
    ("prompt over the context", "/completions", dict(GOOD, prompt="hello " * 400), 400, "maximum context length",
     "prompt"),
    ("prompt plus max_tokens over the context", "/completions", dict(GOOD, max_tokens=260), 400,
     "maximum context length", "prompt"),
    ("max_tokens 0", "/completions", dict(GOOD, max_tokens=0), 400, "max_tokens", "max_tokens"),
    ("n 0", "/completions", dict(GOOD, n=0), 400, "n must be", "n"),
    ("negative temperature", "/completions", dict(GOOD, temperature=-1), 400, "temperature", "temperature"),
    # JSON's 1e999 decodes to inf: with it, a grammar's -inf mask became NaN and token 0 was sampled.
    ("infinite temperature", "/completions", b'{"model": "tiny", "prompt": "Hello", "temperature": 1e999}', 400,
     "finite", "temperature"),
    ("infinite temperature with a choice", "/chat/completions",
     b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": 1e999,'
     b' "structured_outputs": {"choice": ["yes", "no"]}}', 400, "finite", "temperature"),
    ("infinite repetition_penalty", "/completions",
     b'{"model": "tiny", "prompt": "Hello", "repetition_penalty": 1e999}', 400, "finite", "repetition_penalty"),
    # Past 64 bits a seed cannot cross to the engine: it was a 500 after the request was accepted.
    ("seed over 64 bits", "/completions", dict(GOOD, seed=1 << 80), 400, "seed must be", "seed"),
    ("priority over 64 bits", "/completions", dict(GOOD, priority=10**30), 400, "priority must be", None),
    # Python reads at most 4300 digits of an integer: past that json.loads raised a plain ValueError.
    ("an integer of 5000 digits", "/completions", b'{"model": "tiny", "prompt": "Hi", "max_tokens": ' + b"9" * 5000 + b"}",
     400, "number too long", None),
    ("top_p above 1", "/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                            "top_p": 1.5}, 400, "top_p", "top_p"),
    ("empty prompt", "/completions", dict(GOOD, prompt=""), 400, "empty", "prompt"),
    ("invalid utf-8", "/completions", b'{"model": "tiny", "prompt": "\xff\xfe bad"}', 400, "UTF-8", None),
    ("body over the limit", "/completions", b'{"model": "tiny", "prompt": "' + b"a" * (10 << 20) + b'"}', 413,
     "too large", None),
]


@pytest.mark.parametrize("name, path, body, status, fragment, param", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_its_status_and_the_server_keeps_serving(server, name, path, body, status, fragment, param):
    if isinstance(body, bytes):
        resp = post(server, path, content=body)
    else:
        resp = post(server, path, json=body)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert fragment.lower() in error["message"].lower(), error
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param
    after = post(server, "/completions", json=GOOD)
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 4


def test_wrong_or_missing_api_key_is_401_but_health_and_metrics_stay_open(server):
    for headers in ({"Authorization": "Bearer nope"}, {"Authorization": ""}):
        resp = httpx.post(f"{server.base_url}/completions", json=GOOD, headers=headers, timeout=30)
        assert resp.status_code == 401 and "API key" in resp.json()["error"]["message"]
    assert httpx.get(f"{server.base_url}/models", timeout=30).status_code == 401
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    assert httpx.get(f"{server.url}/metrics", timeout=30).status_code == 200


def test_streaming_request_with_bad_input_fails_before_the_stream(server):
    resp = post(server, "/completions", json=dict(GOOD, stream=True, temperature=-3))
    assert resp.status_code == 400 and "temperature" in resp.json()["error"]["message"]
