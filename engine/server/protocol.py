"""OpenAI request bodies (plus vLLM's extra sampling fields), and their mapping to SamplingParams."""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pdserve.engine.sampling_params import RequestOutputKind, SamplingParams
from pdserve.engine.server.request_fields import check_messages, check_object, field_error
from pdserve.engine.server.structured_fields import (RESPONSE_FORMAT_TYPES, JsonSchemaFormat, ResponseFormat,
                                                     StructuredOutputsRequest, structured_outputs_of)


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat. A field no model declares is refused (400 naming it),
    unless request_fields.NO_OP_FIELDS says it has no effect here: never silently ignored."""

    model_config = ConfigDict(extra="forbid")

    model: str
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    user: str | None = None  # OpenAI's end-user id for abuse monitoring: accepted, used for nothing
    # Output constraints (structured_fields.py): OpenAI's response_format (completions too, as
    # vLLM), vLLM's structured_outputs and its older guided_* fields; at most one of them.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: Union[dict[str, Any], str, None] = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    priority: int = 0
    # As vLLM: choices also carry the generated token ids (streamed: each chunk's own) and the
    # prompt's; the router resumes a stream elsewhere from exactly these ids.
    return_token_ids: bool = False
    # Set by the P/D router between prefill and decode engines.
    kv_transfer_params: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _known_fields_only(cls, data: Any) -> Any:
        data = check_object(data, cls, no_ops=True)
        if not isinstance(data, dict):
            return data
        if isinstance(data.get("structured_outputs"), dict):
            data["structured_outputs"] = check_object(data["structured_outputs"], StructuredOutputsRequest,
                                                      "structured_outputs.")
        rf = data.get("response_format")
        if isinstance(rf, dict) and rf.get("type") not in RESPONSE_FORMAT_TYPES:
            raise field_error("response_format", f"response_format of type {rf.get('type')!r} is not supported; "
                                                 f"use one of {', '.join(RESPONSE_FORMAT_TYPES)}", rf)
        if isinstance(rf, dict) and isinstance(rf.get("json_schema"), dict):
            data["response_format"] = dict(rf, json_schema=check_object(rf["json_schema"], JsonSchemaFormat,
                                                                        "response_format.json_schema."))
        if "messages" in cls.model_fields:
            data["messages"] = check_messages(data.get("messages"), ChatMessage)
        return data

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises ValueError naming the bad field."""
        bias = None
        if self.logit_bias:
            try:
                bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except ValueError:
                raise ValueError("logit_bias keys must be token ids") from None
            if any(not -100.0 <= v <= 100.0 for v in bias.values()):
                raise ValueError("logit_bias values must be in [-100, 100]")
        constraint = structured_outputs_of(self)  # raises structured_fields.FieldError naming the field
        extra = {"kv_transfer_params": self.kv_transfer_params} if self.kv_transfer_params else None
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            logit_bias=bias,
            structured_outputs=constraint[0] if constraint else None,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
            extra_args=extra,
        )


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    # vLLM's: each prompt token's logprob and the top-k alternatives, as `prompt_logprobs` on the choice.
    prompt_logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(t, int) for t in p):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None
    # Tool calling (checked in tools.py, which names the bad field): an assistant turn's calls
    # (its content may then be null), and the call a role "tool" message answers.
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.type != "text":
                raise ValueError(f"content parts of type {part.type!r} are not supported")
            parts.append(part.text or "")
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # Tool calling, checked in tools.py (a 400 naming tools[i]... or tool_choice).
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool = True
