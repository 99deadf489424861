"""An in-process stand-in for AsyncLLM with the real tokenizer and input processor, for HTTP-layer tests."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import httpx

from pdserve.engine.config import ModelConfig
from pdserve.engine.frontend.async_llm import RequestOutputCollector
from pdserve.engine.frontend.input_processor import InputProcessor
from pdserve.engine.frontend.tokenizer import load_tokenizer
from pdserve.engine.outputs import CompletionOutput, RequestOutput


class RecordingInputProcessor(InputProcessor):
    """The real input processor, noting which thread renders and tokenizes."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.threads: dict[str, int] = {}

    def apply_chat_template(self, *args, **kwargs):
        self.threads["chat_template"] = threading.get_ident()
        return super().apply_chat_template(*args, **kwargs)

    def tokenize(self, prompt):
        self.threads["tokenize"] = threading.get_ident()
        return super().tokenize(prompt)


class FakeEngine:
    """What the HTTP layer needs of an AsyncLLM, answering every request with one finished token.

    In-process, so a test can see the event loop's thread and inject a failure; the engine core
    itself is covered by the subprocess tests above and in test_openai_api.py."""

    def __init__(self, model_path: str) -> None:
        self.model_name = "tiny"
        mc = ModelConfig.from_pretrained(model_path, dtype="float32", max_model_len=256)
        self.config = SimpleNamespace(model=mc, cache=SimpleNamespace(block_size=16),
                                      parallel=SimpleNamespace(data_parallel_size=1))
        self.tokenizer = load_tokenizer(model_path)
        self.input_processor = RecordingInputProcessor(mc, self.tokenizer)
        self.stats_listeners: list = []
        self.errored = False
        self.request_ids: list[str] = []
        self.kv_transfer_params: list = []  # what reached the engine, per request

    async def add_request(self, request_id, prompt, params, **kwargs):
        self.request_ids.append(request_id)
        self.kv_transfer_params.append(kwargs.get("kv_transfer_params"))
        collector = RequestOutputCollector(params.output_kind)
        collector.put(RequestOutput(request_id, prompt.get("prompt"), prompt["prompt_token_ids"],
                                    [CompletionOutput(0, "x", [5], finish_reason="length")], finished=True))
        return collector

    async def abort(self, request_id: str) -> None:
        pass

    def liveness(self) -> list:
        return []  # no engine core, so no heartbeats to judge

    def unresponsive_reason(self) -> str | None:
        return None


def asgi_client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
                             base_url="http://test")
