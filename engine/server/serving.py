"""/v1/completions and /v1/chat/completions on top of AsyncLLM, streaming (SSE) or not."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Mapping, TypeVar

from pdserve.engine.frontend.async_llm import AsyncLLM, RequestOutputCollector
from pdserve.engine.frontend.template_kwargs import check_chat_template_kwargs
from pdserve.engine.frontend.mp_client import EngineDeadError
from pdserve.engine.outputs import CompletionOutput, Logprob, RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.server.completion_logprobs import EchoedPrompt, legacy_logprobs, prompt_only, vllm_prompt_logprobs
from pdserve.engine.server.errors import APIError, new_error_id, unknown_model
from pdserve.engine.server.kv_params import check_blocks_fit_prompt
from pdserve.engine.server.protocol import ChatCompletionRequest, CompletionRequest, _SamplingFields
from pdserve.engine.server import tools
from pdserve.engine.server.tool_parsers import DEFAULT_PARSER, ToolParser, get_parser
from pdserve.engine.server.structured_fields import FieldError, check_spec, structured_outputs_of

log = logging.getLogger("pdserve.server")
T = TypeVar("T")


@dataclass
class Submitted:
    """One prompt submitted to the engine: its collector and what usage needs."""

    request_id: str
    collector: RequestOutputCollector
    prompt_text: str | None
    prompt_token_ids: list[int]
    n: int


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    seen_prompts: set[int] = field(default_factory=set)

    def as_dict(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


def sse(payload: dict[str, Any] | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}\n\n"


class Serving:
    def __init__(self, engine: AsyncLLM, tool_call_parser: str = DEFAULT_PARSER) -> None:
        self.engine = engine
        self.tool_parser = get_parser(tool_call_parser)  # --tool-call-parser
        self.template_knows_tools = tools.template_knows_tools(engine.tokenizer)
        self.model_name = engine.model_name
        self.max_model_len = engine.config.model.max_model_len
        # Templates and long prompts take milliseconds to seconds of CPU: never on the event loop.
        # One thread, since a fast tokenizer must not be used from two threads at once.
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="pdserve-tokenize")

    async def off_loop(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread,
                                                                functools.partial(fn, *args, **kwargs))

    async def tokenize(self, text: str) -> list[int]:
        return (await self.off_loop(self.engine.input_processor.tokenize, text))[1]

    async def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                          template_kwargs: Mapping[str, Any] | None) -> list[int]:
        """The chat's prompt token ids; raises ValueError or TypeError for messages the template refuses."""
        template_kwargs = template_kwargs or {}
        try:
            check_chat_template_kwargs(template_kwargs)
        except ValueError as exc:
            raise APIError(400, str(exc), param="chat_template_kwargs") from None
        return await self.off_loop(self.engine.input_processor.apply_chat_template, messages, add_generation_prompt,
                                   **template_kwargs)

    # -- shared steps ---------------------------------------------------------------------------

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise unknown_model(model)

    def check_length(self, prompt_len: int, max_tokens: int | None, param: str) -> int:
        if prompt_len >= self.max_model_len or (max_tokens is not None and prompt_len + max_tokens > self.max_model_len):
            asked = f"{prompt_len + max_tokens} tokens ({prompt_len} in the {param}, {max_tokens} in the completion)" \
                if max_tokens is not None else f"{prompt_len} tokens in the {param}"
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                                f"requested {asked}. Please reduce the length of the {param} or the completion.",
                           param=param, code="context_length_exceeded")
        return max_tokens if max_tokens is not None else self.max_model_len - prompt_len

    def build_params(self, body: _SamplingFields, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """The request's SamplingParams, output constraint included (checked later, in `submit`)."""
        limit = self.engine.config.model.max_logprobs
        if logprobs is not None and logprobs > limit:
            param = "top_logprobs" if isinstance(body, ChatCompletionRequest) else "logprobs"
            raise APIError(400, f"{param}={logprobs} exceeds this server's maximum of {limit} (--max-logprobs)",
                           param=param)
        try:
            return body.sampling_params(max_tokens, logprobs)
        except ValueError as exc:
            message = str(exc)
            raise APIError(400, message, param=getattr(exc, "param", None) or message.split(" ", 1)[0]) from None

    async def check_constraint(self, params: SamplingParams, body: _SamplingFields) -> None:
        """A 400 naming the field if the output constraint cannot be built or enforced; compiles it on
        the tokenizer thread (a big schema takes a while), before the engine gets the request."""
        spec = params.structured_outputs
        if spec is None:
            return
        found = structured_outputs_of(body)
        # Not from the body's constraint fields: another part of the request (tools) built it.
        param = found[1] if found is not None and found[0] == spec else "tools"
        try:
            await self.off_loop(check_spec, spec, param)
        except FieldError as exc:
            raise APIError(400, str(exc), param=exc.param) from None

    async def submit(self, request_id: str, prompt_text: str | None, token_ids: list[int], params: SamplingParams,
                     body: _SamplingFields, dp_rank: int | None = None) -> Submitted:
        prompt = {"prompt_token_ids": token_ids, "prompt": prompt_text}
        await self.check_constraint(params, body)
        if body.kv_transfer_params is not None:
            check_blocks_fit_prompt(body.kv_transfer_params, len(token_ids), self.engine.config.cache.block_size)
        try:
            collector = await self.engine.add_request(request_id, prompt, params, priority=body.priority,
                                                      kv_transfer_params=body.kv_transfer_params, dp_rank=dp_rank)
        except ValueError as exc:
            raise APIError(400, str(exc), param=getattr(exc, "param", None)) from None
        return Submitted(request_id, collector, prompt_text, token_ids, params.n)

    async def abort_all(self, submitted: list[Submitted]) -> None:
        for s in submitted:
            await self.engine.abort(s.request_id)

    async def collect(self, submitted: list[Submitted], disconnected: Callable[[], Awaitable[None]]
                      ) -> list[RequestOutput]:
        """Final outputs of every prompt; aborts them all if the client goes away first."""
        async def finals() -> list[RequestOutput]:
            results = []
            for s in submitted:
                while True:
                    out = await s.collector.get()
                    if out.finished:
                        check_constraint_compiled(out)
                        results.append(out)
                        break
            return results

        work = asyncio.ensure_future(finals())
        watch = asyncio.ensure_future(disconnected())
        try:
            done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            if work in done:
                try:
                    return work.result()
                except BaseException:  # one prompt failed (e.g. its grammar): the others stop too
                    await self.abort_all(submitted)
                    raise
            raise asyncio.CancelledError("client disconnected")
        finally:
            watch.cancel()
            if not work.done():
                work.cancel()
                await self.abort_all(submitted)

    async def stream(self, submitted: list[Submitted]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of all prompts as they come, tagged with the prompt's position."""
        queue: asyncio.Queue = asyncio.Queue()
        done_marker = object()

        async def pump(position: int, s: Submitted) -> None:
            try:
                while True:
                    out = await s.collector.get()
                    await queue.put((position, out))
                    if out.finished:
                        break
            except Exception as exc:
                await queue.put(exc)
            finally:
                await queue.put(done_marker)

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(submitted)]
        remaining = len(tasks)
        finished_ok = False
        try:
            while remaining:
                item = await queue.get()
                if item is done_marker:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    check_constraint_compiled(item[1])
                    yield item
            finished_ok = True
        finally:
            for t in tasks:
                t.cancel()
            if not finished_ok:  # cancelled by a disconnect, or an error: free the engine's blocks
                await asyncio.shield(self.abort_all(submitted))

    @staticmethod
    def add_usage(usage: Usage, position: int, out: RequestOutput, completions: list[CompletionOutput],
                  delta: bool) -> None:
        if out.finished and position not in usage.seen_prompts:
            usage.seen_prompts.add(position)
            usage.prompt_tokens += len(out.prompt_token_ids)
            usage.cached_tokens += out.num_cached_tokens
        if delta or out.finished:
            usage.completion_tokens += sum(len(c.token_ids) for c in completions)

    @staticmethod
    def token_ids(body: _SamplingFields, generated: list[int], prompt: list[int] | None) -> dict[str, Any]:
        """`return_token_ids` fields of one choice: the ids it generated (streamed: in this chunk)
        and, where given (the whole answer, or a choice's first chunk), the prompt's ids."""
        if not body.return_token_ids:
            return {}
        fields: dict[str, Any] = {"token_ids": list(generated)}
        if prompt is not None:
            fields["prompt_token_ids"] = list(prompt)
        return fields

    # -- completions ----------------------------------------------------------------------------

    async def completions(self, body: CompletionRequest, request_id: str,
                          disconnected: Callable[[], Awaitable[None]], *,
                          dp_rank: int | None = None) -> dict[str, Any] | AsyncIterator[str]:
        self.check_model(body.model)
        if body.suffix is not None:
            raise APIError(400, "suffix is not supported", param="suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise APIError(400, "best_of must equal n when given", param="best_of")
        prompts = body.prompts()
        if not prompts:
            raise APIError(400, "prompt must not be empty", param="prompt")
        tokenized = []
        for p in prompts:
            text, ids = (p, await self.tokenize(p)) if isinstance(p, str) else (None, list(p))
            if not ids:
                raise APIError(400, "the prompt is empty", param="prompt")
            tokenized.append((text, ids))
        # `echo` with `max_tokens: 0` scores the prompt alone; the engine still generates one token.
        echo_only = body.echo and body.max_tokens == 0
        prompt_k = self._prompt_logprobs_wanted(body)
        submitted: list[Submitted] = []
        try:
            for i, (text, ids) in enumerate(tokenized):
                max_tokens = self.check_length(len(ids), 1 if echo_only else body.max_tokens, "prompt")
                params = self.build_params(body, max_tokens, body.logprobs)
                if prompt_k is not None:
                    params = params.clone(prompt_logprobs=prompt_k)
                rid = request_id if len(tokenized) == 1 else f"{request_id}-{i}"
                submitted.append(await self.submit(rid, text, ids, params, body, dp_rank))
        except BaseException:
            await self.abort_all(submitted)
            raise
        created = int(time.time())
        if body.stream:
            return self._completion_stream(body, request_id, created, submitted)
        outputs = await self.collect(submitted, disconnected)
        usage = Usage()
        choices = []
        kv_params = None
        for position, (s, out) in enumerate(zip(submitted, outputs)):
            completions = [prompt_only(c) for c in out.outputs] if echo_only else out.outputs
            self.add_usage(usage, position, out, completions, delta=False)
            kv_params = kv_params or out.kv_transfer_params
            for c in completions:
                text = ((s.prompt_text or self.engine.tokenizer.decode(s.prompt_token_ids)) + c.text) if body.echo else c.text
                choices.append({"index": position * body.n + c.index, "text": text,
                                "logprobs": self._completion_logprobs(c, body, s, out)[0],
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                                **self.token_ids(body, c.token_ids, s.prompt_token_ids),
                                **self._prompt_logprobs_field(body, s, out)})
        response = {"id": request_id, "object": "text_completion", "created": created, "model": self.model_name,
                    "choices": choices, "usage": usage.as_dict()}
        if kv_params is not None:
            response["kv_transfer_params"] = kv_params
        return response

    async def _completion_stream(self, body: CompletionRequest, request_id: str, created: int,
                                 submitted: list[Submitted]) -> AsyncIterator[str]:
        usage = Usage()
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        base = {"id": request_id, "object": "text_completion", "created": created, "model": self.model_name}
        echo_only = body.echo and body.max_tokens == 0
        opened: set[int] = set()  # choices whose first chunk went out (it carries the prompt's ids, and echo)
        text_offsets: dict[int, int] = {}  # per choice: where its next token's text starts
        try:
            async for position, out in self.stream(submitted):
                completions = [prompt_only(c) for c in out.outputs] if echo_only else out.outputs
                self.add_usage(usage, position, out, completions, delta=True)
                for c in completions:
                    index = position * body.n + c.index
                    s = submitted[position]
                    first = index not in opened
                    opened.add(index)
                    text = c.text
                    if body.echo and first:
                        text = (s.prompt_text or self.engine.tokenizer.decode(s.prompt_token_ids)) + text
                    logprobs, text_offsets[index] = self._completion_logprobs(c, body, s, out, first,
                                                                              text_offsets.get(index, 0))
                    ids = self.token_ids(body, c.token_ids, s.prompt_token_ids if first else None)
                    chunk = dict(base, choices=[{"index": index, "text": text, "logprobs": logprobs,
                                                 "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                                                 **ids, **(self._prompt_logprobs_field(body, s, out) if first else {})}])
                    if include_usage:
                        chunk["usage"] = None
                    if out.finished and out.kv_transfer_params is not None:
                        chunk["kv_transfer_params"] = out.kv_transfer_params
                    yield sse(chunk)
            if include_usage:
                yield sse(dict(base, choices=[], usage=usage.as_dict()))
        except APIError as exc:
            yield sse({"error": {"message": exc.message, "type": "BadRequestError", "param": exc.param, "code": exc.status}})
        except Exception as exc:
            yield sse(stream_error(exc))
        yield sse("[DONE]")

    def _prompt_logprobs_wanted(self, body: CompletionRequest) -> int | None:
        """How many alternatives per prompt token the engine computes: `echo` with `logprobs` shows
        the prompt's logprobs, and vLLM's `prompt_logprobs` asks for them outright."""
        if body.prompt_logprobs is not None and not 0 <= body.prompt_logprobs <= self.engine.config.model.max_logprobs:
            raise APIError(400, f"prompt_logprobs must be in [0, {self.engine.config.model.max_logprobs}], got "
                                f"{body.prompt_logprobs}", param="prompt_logprobs")
        wanted = [k for k in (body.prompt_logprobs, body.logprobs if body.echo else None) if k is not None and k >= 0]
        return max(wanted) if wanted else None

    def _completion_logprobs(self, c: CompletionOutput, body: CompletionRequest, s: Submitted, out: RequestOutput,
                             echo: bool = True, offset: int = 0) -> tuple[dict[str, Any] | None, int]:
        """A choice's `logprobs` (with `echo`, the prompt's tokens first when `echo` says this chunk
        opens the choice) and the text offset its next token starts at."""
        if body.logprobs is None:
            return None, offset
        echoed = EchoedPrompt(s.prompt_token_ids, out.prompt_logprobs) if body.echo and echo else None
        return legacy_logprobs(c, body.logprobs, self._token_text, echoed, offset)

    def _prompt_logprobs_field(self, body: CompletionRequest, s: Submitted, out: RequestOutput) -> dict[str, Any]:
        if body.prompt_logprobs is None:
            return {}
        return {"prompt_logprobs": vllm_prompt_logprobs(s.prompt_token_ids, out.prompt_logprobs, body.prompt_logprobs)}

    def _token_text(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id], skip_special_tokens=False)

    # -- chat -----------------------------------------------------------------------------------

    async def chat(self, body: ChatCompletionRequest, request_id: str,
                   disconnected: Callable[[], Awaitable[None]], *,
                   dp_rank: int | None = None) -> dict[str, Any] | AsyncIterator[str]:
        self.check_model(body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
        # Checking the tools' schemas compiles them: off the event loop.
        plan = await self.off_loop(tools.plan, body, self.tool_parser) if body.tools else tools.plan(body, self.tool_parser)
        messages = tools.template_messages(body.messages, self.tool_parser, self.template_knows_tools,
                                           plan.functions if plan else None)
        template_kwargs = dict(body.chat_template_kwargs or {})
        if plan is not None and self.template_knows_tools:
            template_kwargs["tools"] = [f.openai() for f in plan.functions]
        try:
            ids = await self.render_chat(messages, body.add_generation_prompt, template_kwargs)
        except (ValueError, TypeError) as exc:
            raise APIError(400, f"invalid messages: {exc}", param="messages") from None
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        max_tokens = self.check_length(len(ids), requested, "messages")
        params = self.build_params(body, max_tokens, (body.top_logprobs or 0) if body.logprobs else None)
        if plan is not None:
            params = self._tool_params(params, plan)
        submitted = [await self.submit(request_id, None, ids, params, body, dp_rank)]
        created = int(time.time())
        if body.stream:
            return self._chat_stream(body, request_id, created, submitted, plan)
        out = (await self.collect(submitted, disconnected))[0]
        usage = Usage()
        self.add_usage(usage, 0, out, out.outputs, delta=False)
        choices = []
        for c in out.outputs:
            message: dict[str, Any] = {"role": "assistant", "content": c.text}
            finish_reason = c.finish_reason
            if plan is not None:
                parsed = plan.parser.parse(c.text, [f.name for f in plan.functions],
                                           max_calls=None if plan.parallel else 1)
                message["content"] = parsed.content
                if parsed.calls:
                    message["tool_calls"] = [call.openai() for call in parsed.calls]
                    finish_reason = "tool_calls"  # also when the model ended on EOS or a stop string
            choices.append({"index": c.index, "message": message,
                            "logprobs": self._chat_logprobs(c, body.top_logprobs or 0) if body.logprobs else None,
                            "finish_reason": finish_reason, "stop_reason": c.stop_reason,
                            **self.token_ids(body, c.token_ids, submitted[0].prompt_token_ids)})
        response = {"id": request_id, "object": "chat.completion", "created": created, "model": self.model_name,
                    "choices": choices, "usage": usage.as_dict()}
        if out.kv_transfer_params is not None:
            response["kv_transfer_params"] = out.kv_transfer_params
        return response

    @staticmethod
    def _tool_params(params: SamplingParams, plan: tools.ToolPlan) -> SamplingParams:
        """The request's params with the tool plan's constraint: `required` and named calls must
        match the parser's format and the function's schema; `auto` calls too, once opened, where
        the format has an opening marker. A client constraint (response_format, guided_*) is kept
        for `auto` and conflicts with a forced call."""
        changes: dict[str, Any] = {}
        if plan.parser.needs_special_tokens:
            changes["skip_special_tokens"] = False  # the call marker is a special token
        if params.structured_outputs is not None:
            if plan.choice != "auto":
                raise APIError(400, f"tool_choice {plan.named or plan.choice!r} forces a tool call, which cannot "
                                    "also follow response_format / structured_outputs / guided_*: drop one",
                               param="tool_choice")
        else:
            constraint = plan.constraint()
            if constraint is not None:
                changes["structured_outputs"] = constraint
        return params.clone(**changes) if changes else params

    async def _chat_stream(self, body: ChatCompletionRequest, request_id: str, created: int,
                           submitted: list[Submitted], plan: tools.ToolPlan | None = None) -> AsyncIterator[str]:
        usage = Usage()
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        base = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": self.model_name}
        parsers: dict[int, ToolParser] = {}  # per choice, with tools: splits the text into content and calls
        calls_sent: dict[int, int] = {}

        def chunk(choice: dict[str, Any]) -> str:
            return sse(dict(base, choices=[choice], **({"usage": None} if include_usage else {})))

        try:
            for i in range(body.n):  # every choice opens with the assistant role
                yield chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None, **self.token_ids(body, [], submitted[0].prompt_token_ids)})
            async for _, out in self.stream(submitted):
                self.add_usage(usage, 0, out, out.outputs, delta=True)
                for c in out.outputs:
                    logprobs = self._chat_logprobs(c, body.top_logprobs or 0) if body.logprobs else None
                    if plan is None:
                        delta = {"content": c.text} if c.text or not c.finished else {}
                        yield chunk({"index": c.index, "delta": delta, "logprobs": logprobs,
                                     "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                                     **self.token_ids(body, c.token_ids, None)})
                        continue
                    parser = parsers.get(c.index) or parsers.setdefault(c.index, plan.new_parser())
                    settled = parser.feed(c.text)
                    if c.finished:
                        rest = parser.finish()
                        settled.content += rest.content
                        settled.calls += rest.calls
                    deltas: list[dict[str, Any]] = [{"content": settled.content}] if settled.content else []
                    sent = calls_sent.get(c.index, 0)
                    deltas += [{"tool_calls": [entry]} for entry in tools.call_chunks(settled.calls, sent)]
                    calls_sent[c.index] = sent + len(settled.calls)
                    if not deltas and (c.finished or logprobs is not None or body.return_token_ids):
                        deltas = [{}]  # carries the finish reason, logprobs or token ids
                    finish_reason = c.finish_reason
                    if c.finished and parser.made_calls:
                        finish_reason = "tool_calls"
                    for k, delta in enumerate(deltas):
                        last = k == len(deltas) - 1
                        yield chunk({"index": c.index, "delta": delta, "logprobs": logprobs if k == 0 else None,
                                     "finish_reason": finish_reason if last else None,
                                     "stop_reason": c.stop_reason if last else None,
                                     **self.token_ids(body, c.token_ids if k == 0 else [], None)})
            if include_usage:
                yield sse(dict(base, choices=[], usage=usage.as_dict()))
        except APIError as exc:
            yield sse({"error": {"message": exc.message, "type": "BadRequestError", "param": exc.param, "code": exc.status}})
        except Exception as exc:
            yield sse(stream_error(exc))
        yield sse("[DONE]")

    @staticmethod
    def _chat_logprobs(c: CompletionOutput, k: int) -> dict[str, Any] | None:
        """OpenAI chat format: each token with its logprob, and the k most likely alternatives."""
        if c.logprobs is None:
            return None

        def item(lp: Logprob) -> dict[str, Any]:
            token = lp.decoded_token or ""
            return {"token": token, "logprob": lp.logprob, "bytes": list(token.encode())}

        content = []
        for token_id, entry in zip(c.token_ids, c.logprobs):
            chosen = entry.get(token_id) or Logprob(float("nan"))
            top = sorted((lp for lp in entry.values() if lp.rank is not None and lp.rank <= k), key=lambda lp: lp.rank)
            content.append(dict(item(chosen), top_logprobs=[item(lp) for lp in top]))
        return {"content": content}


def check_constraint_compiled(out: RequestOutput) -> None:
    """The engine ends a request whose grammar did not compile with stop_reason "grammar_error: ...".
    The API server checks specs before submitting, so this is rare (a spec xgrammar accepts when
    checked but not when compiled against the vocabulary): the client gets a 400, not an empty 200."""
    for c in out.outputs:
        if isinstance(c.stop_reason, str) and c.stop_reason.startswith("grammar_error:"):
            raise APIError(400, f"the output constraint could not be compiled: "
                                f"{c.stop_reason.removeprefix('grammar_error:').strip()}", param="structured_outputs")


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def stream_error(exc: Exception) -> dict[str, Any]:
    """The error event that ends a stream: a dead engine says so; anything else is logged, and the
    client gets only an id to quote (exception text can carry paths and internals)."""
    if isinstance(exc, EngineDeadError):
        return {"error": {"message": f"The engine is not running: {exc}", "type": "ServiceUnavailableError",
                          "param": None, "code": 503}}
    error_id = new_error_id()
    log.error("stream failed (error id %s)", error_id, exc_info=exc)
    return {"error": {"message": f"Internal server error (error id {error_id}).", "type": "InternalServerError",
                      "param": None, "code": 500}}
