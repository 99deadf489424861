"""Mid-stream migration, without I/O: what a stream has said so far, and how it goes on elsewhere.

A streamed request with one choice asks its decode engine for token ids (`return_token_ids`):
every choice then carries the ids generated in its chunk, and the first chunk the prompt's ids.
The router keeps them (and strips them from what the client gets, unless the client asked for
them itself). When the stream breaks, another engine continues it as a plain completion of
prompt + generated ids with the remaining `max_tokens`; its chunks are rewritten into the
client's stream (its id, its format: a chat client keeps getting `chat.completion.chunk` deltas),
so the client sees one stream. Greedy output across the seam equals an uninterrupted run: the
new engine recomputes exactly the context the old one had.

The seam is put after the last token whose text went out: an engine holds back the text of
tokens that end inside a multi-byte character (the chunk carries their ids, no text), and a new
engine given such tokens as prompt could never complete that character. It generates them again
instead (the same ones, greedily); their ids, already sent to a client that asked for ids, are not
sent twice.

Not carried across the seam: a stop string split by it (the new engine sees only its own text),
and sampling state (a seeded sampler restarts; presence/frequency penalties see the old tokens as
prompt).

Not resumable at all (`resume_blocker`): a stream under a constraint (response_format other than
text, structured_outputs, guided_*) or with tools (tool_choice other than "none"). The continuation
is a plain completion of prompt + generated ids: a grammar sent with it would start again from its
first state in the middle of the output, and without one the output could leave the schema; a chat
stream's tool calls are parsed from the whole output by the engine that produced it, and the new
engine's completion chunks carry only text. Either way the client would get output that silently
breaks its contract, so such a stream ends with the SSE error event instead, as an unresumable one
always did. (Resuming them would need the engine to take the generated ids as the grammar's and
the tool parser's starting state, not only as prompt.)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

RETURN_TOKEN_IDS = "return_token_ids"
TOKEN_IDS = "token_ids"
PROMPT_TOKEN_IDS = "prompt_token_ids"
DONE = "[DONE]"

# Request fields the continuation keeps as they are; the rest is rebuilt or does not apply
# (echo: the prompt was already echoed; n/best_of: only single-choice streams migrate).
CONTINUED_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "presence_penalty",
                    "frequency_penalty", "repetition_penalty", "logit_bias", "ignore_eos",
                    "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens", "priority",
                    "user")


def sse(payload: dict[str, Any] | str) -> bytes:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}\n\n".encode()


class EventSplitter:
    """Cuts a byte stream into whole SSE events (each ending with its blank line)."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        self._buffer += chunk.replace(b"\r\n", b"\n") if b"\r" in chunk else chunk
        if b"\n\n" not in self._buffer:
            return []
        *events, self._buffer = self._buffer.split(b"\n\n")
        return [event + b"\n\n" for event in events if event.strip()]


def event_payload(event: bytes) -> dict[str, Any] | str | None:
    """An event's data: "[DONE]", a JSON object, or None for anything else (passed on unread)."""
    data = b"\n".join(line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:"))
    if not data:
        return None
    if data.strip() == DONE.encode():
        return DONE
    try:
        payload = json.loads(data)
    except ValueError:
        return None
    return payload if isinstance(payload, dict) else None


def server_error(payload: dict[str, Any]) -> bool:
    """An in-stream error event of the engine itself (5xx: e.g. its core died), not of the request."""
    error = payload.get("error")
    if not isinstance(error, dict):
        return False
    code = error.get("code")
    return not isinstance(code, int) or code >= 500


def single_choice_stream(body: dict[str, Any], stream: bool, single_prompt: bool) -> bool:
    """A request whose stream can be continued elsewhere: streamed, one prompt, one choice."""
    def count(name: str) -> int:
        value = body.get(name)
        return value if isinstance(value, int) and not isinstance(value, bool) else 1

    return stream and single_prompt and count("n") == 1 and count("best_of") <= 1


# vLLM's request-level constraints; any of them set (not null) constrains the output.
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")


def resume_blocker(route: str, body: dict[str, Any]) -> str | None:
    """Why a stream of this request cannot be continued elsewhere (see the module's docstring), or None."""
    response_format = body.get("response_format")
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind not in (None, "text") or any(body.get(name) is not None for name in GUIDED_FIELDS):
        return "a stream with structured outputs cannot be continued: its grammar would restart mid-output"
    if route == "chat" and body.get("tools") and body.get("tool_choice", "auto") != "none":
        return "a stream with tools cannot be continued: its tool calls would be lost"
    return None


def requested_max_tokens(route: str, body: dict[str, Any]) -> int | None:
    value = body.get("max_completion_tokens") if route == "chat" else None
    if value is None:
        value = body.get("max_tokens")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def chat_logprobs(logprobs: dict[str, Any] | None, top: int) -> dict[str, Any] | None:
    """Completion-format logprobs (tokens, token_logprobs, top_logprobs) in the chat format."""
    if not isinstance(logprobs, dict):
        return None

    def item(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    content = []
    tops = logprobs.get("top_logprobs") or []
    for i, (token, logprob) in enumerate(zip(logprobs.get("tokens") or [], logprobs.get("token_logprobs") or [])):
        ranked = sorted((tops[i] if i < len(tops) and isinstance(tops[i], dict) else {}).items(),
                        key=lambda kv: -kv[1])[:top]
        content.append(dict(item(token, logprob), top_logprobs=[item(t, lp) for t, lp in ranked]))
    return {"content": content}


@dataclass
class StreamState:
    """One single-choice stream as the client has seen it so far."""

    route: str                      # "completions" or "chat": the client's format
    body: dict[str, Any]            # the client's request body
    client_wants_ids: bool          # the client asked for token ids itself: they stay in its chunks
    include_usage: bool
    prompt_ids: list[int] | None = None
    generated: list[int] = field(default_factory=list)
    clean: int = 0                  # generated tokens whose text went out in full: where a seam goes
    ids_sent: int = 0               # generated ids the client has seen (the continuation repeats some)
    finished: bool = False          # a chunk with a finish_reason went out
    usage_sent: bool = False
    stream_id: str | None = None    # the first chunk's id, created and model: the continuation's too
    created: int | None = None
    model: str | None = None
    cached_tokens: int = 0
    # Why it can never be continued (resume_blocker), though it is still followed: a stream that
    # breaks after its last token is still closed as it should be.
    blocker: str | None = None

    @classmethod
    def for_request(cls, route: str, body: dict[str, Any]) -> "StreamState":
        options = body.get("stream_options")
        return cls(route, body, client_wants_ids=bool(body.get(RETURN_TOKEN_IDS)),
                   include_usage=isinstance(options, dict) and bool(options.get("include_usage")),
                   blocker=resume_blocker(route, body))

    def decode_body(self, body: dict[str, Any]) -> dict[str, Any]:
        return dict(body, **{RETURN_TOKEN_IDS: True})

    @property
    def resumable(self) -> bool:
        return self.prompt_ids is not None

    def remaining(self) -> int | None:
        """Tokens still to generate after the seam (None: up to the context's end)."""
        requested = requested_max_tokens(self.route, self.body)
        return None if requested is None else requested - self.clean

    def seam(self) -> None:
        """Cut the output back to its last clean point, before a continuation (idempotent)."""
        del self.generated[self.clean:]

    # -- the original stream ---------------------------------------------------------------------

    def take(self, payload: dict[str, Any]) -> dict[str, Any]:
        """A chunk of the first engine (already in the client's format): note its ids, strip them."""
        if self.stream_id is None and "id" in payload:
            self.stream_id, self.created, self.model = payload.get("id"), payload.get("created"), payload.get("model")
        for choice in payload.get("choices") or ():
            if isinstance(choice, dict):
                self._note(choice)
        if payload.get("usage") and not payload.get("choices"):
            self.usage_sent = True
        return payload

    def _note(self, choice: dict[str, Any]) -> None:
        ids = choice.get(TOKEN_IDS) if self.client_wants_ids else choice.pop(TOKEN_IDS, None)
        prompt = choice.get(PROMPT_TOKEN_IDS) if self.client_wants_ids else choice.pop(PROMPT_TOKEN_IDS, None)
        if isinstance(ids, list):
            self.generated.extend(ids)
            self.ids_sent = len(self.generated)
        if isinstance(prompt, list) and self.prompt_ids is None:
            self.prompt_ids = list(prompt)
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            self.clean = len(self.generated)
        if choice.get("finish_reason") is not None:
            self.finished = True

    # -- the continuation ------------------------------------------------------------------------

    def continuation_body(self) -> dict[str, Any]:
        assert self.prompt_ids is not None
        self.seam()
        body = {k: self.body[k] for k in CONTINUED_FIELDS if k in self.body}
        body.update(model=self.body.get("model"), prompt=self.prompt_ids + self.generated, stream=True, n=1,
                    **{RETURN_TOKEN_IDS: True})
        remaining = self.remaining()
        if remaining is not None:
            body["max_tokens"] = remaining
        min_tokens = self.body.get("min_tokens")
        if isinstance(min_tokens, int) and min_tokens > 0:
            body["min_tokens"] = max(0, min_tokens - len(self.generated))
        if self.include_usage:
            body["stream_options"] = {"include_usage": True}
        if self.route == "chat":
            if self.body.get("logprobs"):
                body["logprobs"] = self.body.get("top_logprobs") or 0
        elif self.body.get("logprobs") is not None:
            body["logprobs"] = self.body["logprobs"]
        return body

    def convert(self, payload: dict[str, Any]) -> dict[str, Any] | None:
        """A continuation chunk (completions format) as the client's stream goes on; None: nothing to send."""
        if "error" in payload:
            return payload
        choices = [c for c in payload.get("choices") or () if isinstance(c, dict)]
        if not choices:
            usage = payload.get("usage")
            if not isinstance(usage, dict) or not self.include_usage or self.usage_sent:
                return None
            details = usage.get("prompt_tokens_details") or {}
            self.cached_tokens = int(details.get("cached_tokens") or 0)
            self.usage_sent = True
            return self._chunk([], self.usage())
        choice = choices[0]
        choice.pop(PROMPT_TOKEN_IDS, None)  # the continuation's prompt is the old prompt plus output
        ids = choice.pop(TOKEN_IDS, None)
        new_ids: list[int] = []
        if isinstance(ids, list):
            # Tokens past the seam that the client saw before are generated again: not sent twice.
            repeated = max(0, min(len(ids), self.ids_sent - len(self.generated)))
            self.generated.extend(ids)
            new_ids = ids[repeated:]
            self.ids_sent = max(self.ids_sent, len(self.generated))
        text = choice.get("text") or ""
        if text:
            self.clean = len(self.generated)
        finish = choice.get("finish_reason")
        if finish is not None:
            self.finished = True
        return self._chunk([self._choice(text, choice.get("logprobs"), finish, choice.get("stop_reason"), new_ids)],
                           None)

    def _choice(self, text: str, logprobs: Any, finish: str | None, stop_reason: Any,
                ids: list[int] | None) -> dict[str, Any]:
        if self.route == "chat":
            delta = {"content": text} if text or finish is None else {}
            top = self.body.get("top_logprobs") or 0
            choice = {"index": 0, "delta": delta,
                      "logprobs": chat_logprobs(logprobs, top) if self.body.get("logprobs") else None,
                      "finish_reason": finish, "stop_reason": stop_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish,
                      "stop_reason": stop_reason}
        if self.client_wants_ids:
            choice[TOKEN_IDS] = ids or []
        return choice

    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        chunk = {"id": self.stream_id, "object": "chat.completion.chunk" if self.route == "chat" else "text_completion",
                 "created": self.created, "model": self.model, "choices": choices}
        if self.include_usage:
            chunk["usage"] = usage
        return chunk

    def usage(self) -> dict[str, Any]:
        prompt = len(self.prompt_ids or ())
        return {"prompt_tokens": prompt, "completion_tokens": len(self.generated),
                "total_tokens": prompt + len(self.generated),
                "prompt_tokens_details": {"cached_tokens": min(self.cached_tokens, prompt)}}

    def closing(self) -> list[bytes]:
        """What the client still needs when the output is complete but its stream was not: a final
        chunk if no finish_reason went out (max_tokens reached exactly), the usage chunk, [DONE]."""
        events = []
        if not self.finished:
            self.finished = True
            events.append(sse(self._chunk([self._choice("", None, "length", None, [])], None)))
        if self.include_usage and not self.usage_sent:
            self.usage_sent = True
            events.append(sse(self._chunk([], self.usage())))
        events.append(sse(DONE))
        return events
