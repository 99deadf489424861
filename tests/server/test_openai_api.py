"""The OpenAI API of `pdserve serve`, through the official openai client, against the offline engine."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import openai
import pytest

from pdserve.engine import LLM, SamplingParams

from support.server import run_server

PROMPTS = ["Hello world", "The license grants permission to copy", "naïve café — 日本語", "def main():\n    return"]
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def model(model_dir):
    return model_dir("llama_long")  # room for a request that outlasts the disconnect test's actions


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    # 4096 blocks (64k tokens) hold the 64 concurrent streams and the 15k-token request; the default
    # (4 GiB: 174k blocks of this small model) took ~20 s of start-up to allocate.
    with run_server(model, "--served-model-name", "tiny", "--num-kv-blocks", "4096",
                    tmp_path=tmp_path_factory.mktemp("srv")) as s:
        yield s


@pytest.fixture(scope="module")
def offline(model):
    return LLM(model, dtype="float32")


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def test_completion_equals_offline_engine_and_usage_is_right(client, offline):
    expected = offline.generate(PROMPTS, greedy(20))
    tokenizer = offline.get_tokenizer()
    for prompt, want in zip(PROMPTS, expected):
        resp = client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0,
                                         extra_body={"ignore_eos": True})
        assert resp.choices[0].text == want.outputs[0].text
        assert resp.choices[0].finish_reason == "length"
        assert resp.usage.prompt_tokens == len(tokenizer.encode(prompt))
        assert resp.usage.completion_tokens == 20
        assert resp.usage.total_tokens == resp.usage.prompt_tokens + 20


def test_streamed_completion_concatenates_to_the_full_text(client):
    full = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True})
    stream = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=24, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    pieces, usage, finish = [], None, None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    assert "".join(pieces) == full.choices[0].text
    assert len(pieces) > 1 and finish == "length"
    assert usage.completion_tokens == 24 and usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_equals_offline_engine_streaming_or_not(client, offline):
    want = offline.chat(MESSAGES, greedy(16))[0].outputs[0].text
    resp = client.chat.completions.create(model="tiny", messages=MESSAGES, max_completion_tokens=16, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == want
    prompt_ids = offline.engine.input_processor.apply_chat_template(MESSAGES)
    assert resp.usage.prompt_tokens == len(prompt_ids) and resp.usage.completion_tokens == 16
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == 16


def test_n_seed_stop_and_logprobs(client, offline):
    resp = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, n=3, temperature=1.0, seed=11,
                                     extra_body={"ignore_eos": True})
    again = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, n=3, temperature=1.0, seed=11,
                                      extra_body={"ignore_eos": True})
    assert sorted(c.index for c in resp.choices) == [0, 1, 2]
    assert [c.text for c in resp.choices] == [c.text for c in again.choices]
    assert resp.usage.completion_tokens == 36

    base = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=20, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base[len(base) // 2:len(base) // 2 + 3]
    stopped = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=20, temperature=0, stop=[stop],
                                        extra_body={"ignore_eos": True}).choices[0]
    assert stopped.finish_reason == "stop" and stopped.text == base[:base.index(stop)]

    lp = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=5, temperature=0, logprobs=3,
                                   extra_body={"ignore_eos": True}).choices[0].logprobs
    offline_lp = offline.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=5, logprobs=3,
                                                             ignore_eos=True))[0].outputs[0]
    assert lp.token_logprobs == pytest.approx([e[t].logprob for t, e in zip(offline_lp.token_ids, offline_lp.logprobs)],
                                              abs=1e-4)
    assert all(len(top) == 3 for top in lp.top_logprobs)

    chat_lp = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, temperature=0,
                                             logprobs=True, top_logprobs=2).choices[0].logprobs
    assert len(chat_lp.content) == 4 and all(len(t.top_logprobs) == 2 for t in chat_lp.content)
    assert all(t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in chat_lp.content)


def test_models_health_and_metrics(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert httpx.get(f"{server.url}/health").status_code == 200
    text = httpx.get(f"{server.url}/metrics").text
    for name in ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
                 "vllm:num_preemptions_total"]:
        assert name in text, name
    assert server.metric("vllm:generation_tokens_total") > 0


def test_a_model_is_retrieved_by_name_and_unknown_routes_get_openai_errors(server, client):
    """The SDK's models.retrieve (GET /v1/models/{id}); an unknown model there, an unknown route and a
    method a route lacks all answer in the OpenAI error format, not FastAPI's {"detail": ...}."""
    card = client.models.retrieve("tiny")
    assert card.id == "tiny" and card.owned_by == "pdserve"
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-9")
    assert missing.value.body["code"] == "model_not_found"
    for method, path, status in [("GET", "/v1/no-such-route", 404), ("DELETE", "/v1/models", 405)]:
        resp = httpx.request(method, f"{server.url}{path}", headers={"Authorization": f"Bearer {client.api_key}"})
        assert resp.status_code == status, resp.text
        error = resp.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and path in error["message"]
    assert httpx.delete(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {client.api_key}"}
                        ).headers["allow"] == "GET"


def test_an_idle_server_maps_its_kv_cache_ahead_and_answers_the_same(server, client):
    """Left idle, the engine maps its KV cache's pages before their first write (on Linux 5.14+; the
    gauge is 1 at once where it cannot); mapped is not used, and answers do not change."""
    prompt = "Mapped ahead or not, the answer is the same:"
    before = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0).choices[0].text
    deadline = time.monotonic() + 60
    while True:
        try:
            if server.metric("pdserve:kv_cache_mapped_ratio") == 1.0:
                break
        except KeyError:  # no stats yet
            pass
        assert time.monotonic() < deadline, "the KV cache was never mapped"
        time.sleep(0.2)
    assert server.metric("vllm:kv_cache_usage_perc") == 0.0
    after = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0).choices[0].text
    assert after == before


def test_prefix_cache_hits_show_in_usage(client):
    prefix = "The license grants permission to copy, modify and distribute the software. " * 4
    client.completions.create(model="tiny", prompt=prefix + "First.", max_tokens=2, temperature=0)
    resp = client.completions.create(model="tiny", prompt=prefix + "Second.", max_tokens=2, temperature=0)
    assert resp.usage.prompt_tokens_details.cached_tokens >= 16


async def test_64_concurrent_streams_and_cancelled_half_frees_the_cache(server, offline):
    rng = random.Random(0)
    prompts = [" ".join(rng.choice(["alpha", "beta", "gamma", "delta", "omega"]) for _ in range(rng.randint(3, 30)))
               for _ in range(64)]
    expected = {p: o.outputs[0].text for p, o in zip(prompts, offline.generate(prompts, greedy(24)))}
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0,
                                http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=100), timeout=120))

    async def run(i: int, prompt: str) -> str | None:
        stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=24 if i % 2 == 0 else 400,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True})
        text = ""
        chunks = 0
        async for chunk in stream:
            text += chunk.choices[0].text
            chunks += 1
            if i % 2 == 1 and chunks == 5:  # the odd half goes away midway
                await stream.close()
                return None
        return text

    results = await asyncio.gather(*(run(i, p) for i, p in enumerate(prompts)))
    for i, (prompt, text) in enumerate(zip(prompts, results)):
        if i % 2 == 0:
            assert text == expected[prompt]
    deadline = asyncio.get_running_loop().time() + 15
    while asyncio.get_running_loop().time() < deadline:
        if server.metric("vllm:kv_cache_usage_perc") == 0 and server.metric("vllm:num_requests_running") == 0:
            break
        await asyncio.sleep(0.2)
    assert server.metric("vllm:kv_cache_usage_perc") == 0.0
    assert server.metric("vllm:num_requests_running") == 0.0
    assert server.metric("vllm:num_requests_waiting") == 0.0


def test_non_streaming_client_disconnect_aborts_the_request(server):
    """The client hangs up while the engine runs its request (seen in the running gauge, not
    guessed from a client timeout, which a fast machine outruns): the request stops early."""
    import json
    import socket
    import time

    max_tokens = 15000
    body = json.dumps({"model": "tiny", "prompt": "long one", "max_tokens": max_tokens, "ignore_eos": True}).encode()
    def metric(name: str) -> float:
        try:
            return server.metric(name)
        except KeyError:  # a labelled series appears with its first value
            return 0.0

    def generated() -> float:
        return metric("vllm:generation_tokens_total")

    generated_before = generated()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    start = time.monotonic()
    while metric("vllm:num_requests_running") == 0 and generated() == generated_before:
        if time.monotonic() - start > 30:
            sock.settimeout(1.0)
            try:
                answer = sock.recv(4096)
            except OSError as exc:
                answer = repr(exc).encode()
            raise AssertionError(f"the request never started running; the server answered {answer!r}")
        time.sleep(0.005)
    sock.close()
    start = time.monotonic()
    while time.monotonic() - start < 15 and server.metric("vllm:num_requests_running") > 0:
        time.sleep(0.05)
    assert server.metric("vllm:num_requests_running") == 0.0
    assert server.metric("vllm:kv_cache_usage_perc") == 0.0
    assert generated() - generated_before < max_tokens  # aborted, not finished
