"""The GGUF writer (engine/model/gguf_write.py): a checkpoint written as GGUF and read back by our own
GGUF loader is the same model, and generates token for token what transformers generates from the
original folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.demo import IM_END_ID, EOS_TOKEN_ID, build_random_model, resolve_model
from pdserve.engine.model.gguf import GGUFModel
from pdserve.engine.model.gguf_write import write_gguf

from support.hf_reference import hf_greedy, load_hf_model

gguf = pytest.importorskip("gguf")  # a declared dependency


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(root))
    return root


def expected_tensor(t: torch.Tensor, out_type: str) -> torch.Tensor:
    """What the file should hold: matrices in the chosen type, norms and biases always in float32."""
    if t.dim() == 1 or out_type == "f32":
        return t.float()
    if out_type == "q8_0":  # blocks of 32 (gguf's encoder and decoder), decoded to float32
        kind = gguf.GGMLQuantizationType.Q8_0
        return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(t.float().numpy(), kind), kind))
    return t.to(torch.bfloat16 if out_type == "bf16" else torch.float16).float()


@pytest.mark.parametrize("name, out_type", [("llama", "f32"), ("tied", "bf16"), ("qwen2", "f16"),
                                            ("qwen2", "q8_0")])
def test_tensors_and_config_round_trip_through_our_reader(model_dir, tmp_path, name, out_type):
    original = Path(model_dir(name))
    path = write_gguf(original, tmp_path / f"{name}.gguf", out_type)
    model = GGUFModel(path)
    want = load_file(str(original / "model.safetensors"))
    got = dict(model.hf_tensors())
    assert set(got) == set(want)
    for tensor_name, t in want.items():
        # Exact: q/k rows permuted for llama.cpp's rope are permuted back by the reader.
        torch.testing.assert_close(got[tensor_name].float(), expected_tensor(t, out_type), rtol=0, atol=0,
                                   msg=tensor_name)
    cfg, orig = model.config(), json.loads((original / "config.json").read_text())
    for key in ("architectures", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "tie_word_embeddings", "max_position_embeddings"):
        assert cfg[key] == orig[key], key
    assert cfg["rms_norm_eps"] == pytest.approx(orig["rms_norm_eps"], rel=1e-6)
    assert ("output.weight" in model.tensors) == (not orig["tie_word_embeddings"])
    file_types = {"f32": gguf.LlamaFileType.ALL_F32, "bf16": gguf.LlamaFileType.MOSTLY_BF16,
                  "f16": gguf.LlamaFileType.MOSTLY_F16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}
    assert model.meta("general.file_type") == file_types[out_type]
    # The demo tokenizer as llama.cpp's gpt2 BPE: what llama-server needs to tokenize like we do.
    assert model.meta("tokenizer.ggml.model") == "gpt2"
    assert model.meta("tokenizer.ggml.pre") == "gpt-2"
    assert len(model.meta("tokenizer.ggml.tokens")) == orig["vocab_size"]
    assert model.generation_config()["eos_token_id"] == [EOS_TOKEN_ID, IM_END_ID]
    assert model.meta("tokenizer.ggml.add_bos_token") is False


def test_written_gguf_generates_like_transformers_on_the_original(model_dir, tmp_path, cache):
    original = model_dir("llama")
    path = write_gguf(original, tmp_path / "llama.gguf", "f32")
    prompts = [[5, 17, 300, 2000, 9], list(range(40, 83))]
    expected = hf_greedy(load_hf_model(original), prompts, 16)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outputs] == expected

    # The tokenizer travelled too: rebuilt from the GGUF it splits text as the original does.
    from transformers import AutoTokenizer

    ours, want = AutoTokenizer.from_pretrained(resolve_model(str(path))), AutoTokenizer.from_pretrained(original)
    for text in ["Hello, world!", "def f(x):\n    return x ** 2\n", "<|im_start|>user\nhi<|im_end|>", "  two  spaces 123"]:
        assert ours.encode(text) == want.encode(text), text


def test_vocabulary_is_padded_to_the_embedding_rows(tmp_path):
    # 4100 rows for a 4096-token tokenizer: llama.cpp wants one (unused) entry per row.
    original = build_random_model(tmp_path / "padded", hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                  num_key_value_heads=1, intermediate_size=64, vocab_size=4100)
    model = GGUFModel(write_gguf(original, tmp_path / "padded.gguf", "bf16"))
    tokens, types = model.meta("tokenizer.ggml.tokens"), model.meta("tokenizer.ggml.token_type")
    assert len(tokens) == len(types) == 4100
    assert tokens[4096:] == [f"[PAD{i}]" for i in range(4096, 4100)]
    assert set(types[4096:]) == {gguf.TokenType.UNUSED}
    assert types[EOS_TOKEN_ID] == gguf.TokenType.CONTROL


def test_what_llama_cpp_cannot_load_is_refused_by_name(model_dir, tmp_path):
    with pytest.raises(ValueError, match="rope type 'llama3'"):
        write_gguf(model_dir("llama3_rope"), tmp_path / "rope.gguf")
    folder = tmp_path / "wordpiece"
    folder.mkdir()
    for f in Path(model_dir("llama")).iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["pre_tokenizer"] = {"type": "Whitespace"}
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="pre-tokenizer"):
        write_gguf(folder, tmp_path / "wordpiece.gguf")
    with pytest.raises(ValueError, match="out_type"):
        write_gguf(model_dir("llama"), tmp_path / "q4.gguf", "q4_0")
    assert not list(tmp_path.glob("*.gguf*"))  # nothing half-written left behind
