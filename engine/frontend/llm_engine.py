"""A synchronous engine: add requests, call `step()`, collect RequestOutputs.

The offline `LLM` drives it; tests use it to interleave requests, aborts and steps by hand.
"""

from __future__ import annotations

from typing import Any

from pdserve.engine.config import EngineArgs, EngineConfig
from pdserve.engine.frontend.core_client import EngineCoreClient, InprocClient
from pdserve.engine.frontend.input_processor import InputProcessor, PromptType
from pdserve.engine.frontend.output_processor import OutputProcessor, ParentRequest
from pdserve.engine.frontend.tokenizer import load_tokenizer
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, config: EngineConfig, client: EngineCoreClient | None = None) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config.model.tokenizer)
        self.input_processor = InputProcessor(config.model, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.client = client or InprocClient(config)
        if config.num_kv_blocks:  # set by the core as it sized its cache
            self.input_processor.kv_capacity_tokens = config.num_kv_blocks * config.cache.block_size

    @classmethod
    def from_engine_args(cls, args: EngineArgs, multiprocess: bool = False) -> "LLMEngine":
        config = args.create_engine_config()
        client = None
        if multiprocess:
            from pdserve.engine.frontend.mp_client import SyncMPClient

            client = SyncMPClient(config)
        return cls(config, client)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None, *,
                    priority: int = 0, arrival_time: float | None = None,
                    kv_transfer_params: dict[str, Any] | None = None) -> None:
        """Validate and queue a request; raises ValueError (and queues nothing) on bad input."""
        params = params or SamplingParams()
        if request_id in self.output_processor.children:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.n == 1:
            text, core_req = self.input_processor.process(request_id, prompt, params, arrival_time=arrival_time,
                                                          priority=priority, kv_transfer_params=kv_transfer_params)
            self.output_processor.add_request(core_req, text)
            self.client.add_request(core_req)
            return
        parent = ParentRequest(request_id, params)
        children = [self.input_processor.process(parent.child_id(i), prompt, parent.child_params(params, i),
                                                 arrival_time=arrival_time, priority=priority)
                    for i in range(params.n)]
        for index, (text, core_req) in enumerate(children):
            self.output_processor.add_request(core_req, text, parent, index)
            self.client.add_request(core_req)

    def abort_request(self, request_ids: list[str] | str) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.client.abort_requests(self.output_processor.abort_requests(ids))

    def step(self) -> list[RequestOutput]:
        outputs = self.client.get_output()
        processed = self.output_processor.process_outputs(outputs.outputs)
        if processed.reqs_to_abort:
            self.client.abort_requests(processed.reqs_to_abort)
        return processed.request_outputs

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_stats(self) -> dict[str, Any]:
        return self.client.call_utility("get_stats")

    def reset_prefix_cache(self) -> bool:
        return self.client.call_utility("reset_prefix_cache")

    def shutdown(self) -> None:
        self.client.shutdown()
