"""How a server loads its tokenizer (engine/frontend/tokenizer.py, AsyncLLM's start).

The tokenizer is what turns a user's prompt into the ids the model sees, so loading it a faster
way must choose exactly what transformers' AutoTokenizer chooses: the same class and the same
ids, for every model family and for the tokenizer classes checkpoints declare (including the
ones transformers corrects, a Llama class over a byte-level tokenizer). And a tokenizer that
cannot load, now that it loads while the engine core starts, must still fail the start with its
own error and leave no core process behind.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from pdserve.engine.config import EngineArgs
from pdserve.engine.frontend.async_llm import AsyncLLM
from pdserve.engine.frontend.tokenizer import auto_tokenizer, light_config

TEXTS = ["Hello, world!", "naïve café — 日本語 2024", "def f(x):\n    return x**2\n",
         "<|im_start|>user\nhi<|im_end|>"]
DECLARED = [None, "PreTrainedTokenizerFast", "LlamaTokenizerFast", "LlamaTokenizer", "GPT2TokenizerFast",
            "Qwen2Tokenizer"]


def tokenizer_folder(source: str, dest: Path, declared: str | None) -> Path:
    """The checkpoint's tokenizer and config files (no weights), with `declared` as its class."""
    dest.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(source) / name, dest / name)
    if declared is not None:
        config = json.loads((dest / "tokenizer_config.json").read_text())
        config["tokenizer_class"] = declared
        (dest / "tokenizer_config.json").write_text(json.dumps(config))
    return dest


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_the_fast_load_chooses_what_auto_tokenizer_chooses(model_dir, tmp_path, family):
    for declared in DECLARED:
        folder = tokenizer_folder(model_dir(family), tmp_path / f"{family}-{declared}", declared)
        reference, ours = AutoTokenizer.from_pretrained(str(folder)), auto_tokenizer(str(folder))
        assert type(ours) is type(reference), (family, declared)
        for text in TEXTS:
            assert ours.encode(text) == reference.encode(text), (family, declared, text)
        messages = [{"role": "user", "content": "hi"}]
        assert (ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
                == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def test_remote_code_and_undeclared_classes_take_the_usual_way(model_dir, tmp_path):
    folder = tokenizer_folder(model_dir("llama"), tmp_path / "remote", "PreTrainedTokenizerFast")
    assert light_config(str(folder)) is not None
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(dict(config, auto_map={"AutoTokenizer": ["x.Y", None]})))
    assert light_config(str(folder)) is None  # trust_remote_code decisions stay transformers'
    del config["tokenizer_class"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert light_config(str(folder)) is None
    assert light_config(str(tmp_path / "missing")) is None


def test_a_tokenizer_that_cannot_load_fails_the_start_and_stops_the_core(model_dir, tmp_path):
    folder = tmp_path / "broken"
    shutil.copytree(model_dir("llama"), folder)
    (folder / "tokenizer.json").write_text("{not json")
    args = EngineArgs(model=str(folder), dtype="float32", num_kv_blocks=64, max_model_len=256)

    async def start() -> None:
        AsyncLLM.from_engine_args(args)

    with pytest.raises(ValueError, match=f"cannot load the tokenizer of {folder}: JSONDecodeError"):
        asyncio.run(start())
    assert not [p for p in multiprocessing.active_children() if p.is_alive()]
