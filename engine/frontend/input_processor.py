"""Turns a user's prompt and sampling settings into a validated EngineCoreRequest."""

from __future__ import annotations

import time
from typing import Any, Union

from pdserve.engine.config import ModelConfig
from pdserve.engine.frontend.limits import LimitError
from pdserve.engine.frontend.template_kwargs import check_chat_template_kwargs
from pdserve.engine.protocol import EngineCoreRequest
from pdserve.engine.sampling_params import SamplingParams

PromptType = Union[str, list[int], dict[str, Any]]
PRIORITY_MIN, PRIORITY_MAX = -(1 << 63), (1 << 63) - 1

class InputProcessor:
    def __init__(self, model_config: ModelConfig, tokenizer: Any) -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer
        eos = getattr(tokenizer, "eos_token_id", None)
        self.eos_token_id = eos if eos is not None else (model_config.eos_token_ids or [None])[0]
        # Other end-of-sequence ids from the generation config (e.g. a chat turn's end) stop too.
        self.extra_stop_ids = [t for t in model_config.eos_token_ids if t != self.eos_token_id]
        # Tokens of KV the engine's cache holds; set by the owner once the core reports its size.
        self.kv_capacity_tokens: int | None = None

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, list(self.tokenizer.encode(prompt))
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self.tokenize(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"unsupported prompt type {type(prompt).__name__}")

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        mc = self.model_config
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_token_ids) >= mc.max_model_len:
            raise ValueError(f"the prompt is {len(prompt_token_ids)} tokens long, but this model's maximum context "
                             f"length is {mc.max_model_len} tokens (prompt plus at least one generated token)")
        if any((not isinstance(t, int)) or t < 0 or t >= mc.vocab_size for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {mc.vocab_size})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > mc.max_logprobs:
                raise LimitError(name, f"{name}={value} exceeds the maximum of {mc.max_logprobs}")
        if params.stop_token_ids and max(params.stop_token_ids) >= mc.vocab_size:
            raise LimitError("stop_token_ids", f"stop_token_ids must be in [0, {mc.vocab_size})")
        if params.logit_bias and any(int(t) < 0 or int(t) >= mc.vocab_size for t in params.logit_bias):
            raise LimitError("logit_bias", f"logit_bias keys must be token ids in [0, {mc.vocab_size})")
        # The core refuses such a request too, but only after accepting it (an aborted output).
        capacity = self.kv_capacity_tokens
        needed = min(len(prompt_token_ids) + (params.max_tokens or mc.max_model_len), mc.max_model_len)
        if capacity is not None and needed > capacity:
            raise ValueError(f"the request may need {needed} tokens of KV cache (prompt plus max_tokens), but "
                             f"this engine's cache holds {capacity}; lower max_tokens or shorten the prompt")

    def process(self, request_id: str, prompt: PromptType, params: SamplingParams, *, arrival_time: float | None = None,
                priority: int = 0, kv_transfer_params: dict[str, Any] | None = None,
                cache_salt: str | None = None) -> tuple[str | None, EngineCoreRequest]:
        # It crosses to the engine as msgpack's int64: a bigger one failed to encode after the
        # request was accepted (a 500).
        if isinstance(priority, bool) or not isinstance(priority, int) or not PRIORITY_MIN <= priority <= PRIORITY_MAX:
            raise ValueError(f"priority must be an integer in [{PRIORITY_MIN}, {PRIORITY_MAX}], got {priority!r}")
        text, ids = self.tokenize(prompt)
        self.validate(ids, params)
        if self.extra_stop_ids and not params.ignore_eos:
            params = params.clone(stop_token_ids=sorted({*(params.stop_token_ids or ()), *self.extra_stop_ids}))
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=ids,
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            arrival_time=arrival_time if arrival_time is not None else time.time(),
            priority=priority,
            kv_transfer_params=kv_transfer_params,
            cache_salt=cache_salt,
        )
        return text, request

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            chat_template: str | None = None, **kwargs: Any) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None) and chat_template is None:
            raise ValueError("this model's tokenizer has no chat template")
        check_chat_template_kwargs(kwargs)
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                                 chat_template=chat_template, **kwargs)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)
