"""Which chat_template_kwargs a client may send. Torch-free: the router checks them too."""

from __future__ import annotations

from typing import Any, Mapping

# Parameters of the tokenizer's apply_chat_template, not variables of the template: a client
# setting them would swap the Jinja template itself (chat_template: the class of vLLM's
# CVE-2025-61620) or change what the call returns. Anything else (tools, documents,
# enable_thinking, ...) is only a variable the model's own template may read.
RESERVED_CHAT_TEMPLATE_KWARGS = frozenset({
    "chat_template", "conversation", "messages", "add_generation_prompt", "tokenize", "tokenizer",
    "tokenizer_kwargs", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask",
})


def check_chat_template_kwargs(kwargs: Mapping[str, Any]) -> None:
    """Raise ValueError if client-supplied template kwargs name a reserved parameter."""
    reserved = sorted(RESERVED_CHAT_TEMPLATE_KWARGS.intersection(kwargs))
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}: only variables of the "
                         f"model's own chat template can be passed")
