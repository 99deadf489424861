"""Write a Hugging Face Llama-family checkpoint as a GGUF file that llama.cpp loads (F32, F16, BF16 or Q8_0).

The reverse of `gguf_convert`: config.json becomes llama.cpp's `<arch>.*` metadata, tokenizer.json
its `tokenizer.ggml.*` vocabulary (byte-level BPE only, llama.cpp's "gpt2" tokenizer model), and
each safetensors tensor goes under its llama.cpp name, with Llama's q/k rows permuted into the
order llama.cpp's rope expects. Tensors stream one at a time from the safetensors files to the
GGUF, so memory stays at one tensor whatever the model's size.

Its use: the same weights served by pdserve and by llama-server (benchmarks/bench_peer.py).

    python -m pdserve.engine.model.gguf_write MODEL_DIR OUT.gguf --type bf16
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from pdserve.engine.model.gguf import _GLOBAL_NAMES, _LAYER_NAMES, ARCHITECTURES

log = logging.getLogger("pdserve.engine.gguf")

# HF model_type -> GGUF architecture; both are read back by engine/model/gguf.py.
GGUF_ARCHITECTURES = {spec.model_type: arch for arch, spec in ARCHITECTURES.items()}
_HF_GLOBAL = {hf: g for g, hf in _GLOBAL_NAMES.items()}
_HF_LAYER = {hf: g for g, hf in _LAYER_NAMES.items()}
# Buffers some checkpoints carry that llama.cpp recomputes itself.
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)


def _out_types() -> dict[str, Any]:
    from gguf import GGMLQuantizationType as Q, LlamaFileType as F

    return {"f32": (Q.F32, F.ALL_F32), "f16": (Q.F16, F.MOSTLY_F16), "bf16": (Q.BF16, F.MOSTLY_BF16),
            "q8_0": (Q.Q8_0, F.MOSTLY_Q8_0)}


OUT_TYPES = ("f32", "f16", "bf16", "q8_0")


def gguf_tensor_name(hf_name: str) -> str:
    """`model.layers.3.self_attn.q_proj.weight` -> `blk.3.attn_q.weight`; ValueError if llama.cpp has no place."""
    stem, kind = hf_name.rsplit(".", 1)
    if stem in _HF_GLOBAL:
        return f"{_HF_GLOBAL[stem]}.{kind}"
    parts = stem.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in _HF_LAYER:
        return f"blk.{int(parts[2])}.{_HF_LAYER[parts[3]]}.{kind}"
    raise ValueError(f"tensor {hf_name!r} has no place in a llama.cpp Llama-family model")


def permute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's q/k row order for Llama: inside each head, rows go (pair, half) where HF's go (half, pair).

    HF's rope rotates the two halves of a head, llama.cpp's adjacent pairs; permuting rows makes
    the two compute the same thing. Works on weights (2-D) and biases (1-D) alike."""
    rows = weight.shape[0]
    head_dim = rows // num_heads
    if head_dim * num_heads != rows or head_dim % 2:
        raise ValueError(f"cannot split {rows} q/k rows into {num_heads} heads of even size")
    return (weight.reshape(num_heads, 2, head_dim // 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape).contiguous())


# --- metadata -----------------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _rope_parameters(cfg: dict[str, Any]) -> dict[str, Any]:
    # transformers 5 nests rope settings in rope_parameters; older configs keep rope_theta/rope_scaling flat.
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "linear"):
        raise ValueError(f"rope type {kind!r} is not supported by the GGUF writer (supported: default, linear)")
    params["rope_type"] = kind
    return params


def model_metadata(cfg: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(GGUF architecture, {key without the arch prefix: value}) for a config.json."""
    model_type = cfg.get("model_type")
    if model_type not in GGUF_ARCHITECTURES:
        raise ValueError(f"model_type {model_type!r} cannot be written as GGUF; supported: {sorted(GGUF_ARCHITECTURES)}")
    if cfg.get("mlp_bias"):
        raise ValueError("MLP biases have no place in llama.cpp's Llama graph")
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    rope = _rope_parameters(cfg)
    meta: dict[str, Any] = {
        "context_length": int(cfg.get("max_position_embeddings", 2048)),
        "embedding_length": hidden,
        "block_count": int(cfg["num_hidden_layers"]),
        "feed_forward_length": int(cfg["intermediate_size"]),
        "attention.head_count": heads,
        "attention.head_count_kv": int(cfg.get("num_key_value_heads") or heads),
        "attention.layer_norm_rms_epsilon": float(cfg.get("rms_norm_eps", 1e-6)),
        "rope.freq_base": float(rope["rope_theta"]),
        "rope.dimension_count": head_dim,
        "vocab_size": int(cfg["vocab_size"]),
    }
    if head_dim != hidden // heads:
        meta["attention.key_length"] = meta["attention.value_length"] = head_dim
    if rope["rope_type"] == "linear":
        meta["rope.scaling.type"] = "linear"
        meta["rope.scaling.factor"] = float(rope["factor"])
    return GGUF_ARCHITECTURES[model_type], meta


def _pre_tokenizer_name(spec: dict[str, Any]) -> str:
    """llama.cpp's name for the tokenizer's split rules, from tokenizer.json's structure.

    llama.cpp's own converter tells pre-tokenizers apart by hashing a test string's tokens; the two
    byte-level layouts written here are recognised by shape instead."""
    pre = spec.get("pre_tokenizer") or {}

    def byte_level(p: dict[str, Any]) -> bool:
        return p.get("type") == "ByteLevel" and p.get("use_regex", True) and not p.get("add_prefix_space", False)

    if byte_level(pre):
        return "gpt-2"
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    if (steps and len(steps) == 2 and steps[0].get("type") == "Digits" and steps[0].get("individual_digits")
            and byte_level(steps[1])):
        return "smollm"  # every digit its own piece, then GPT-2's rules: SmolLM's tokenizer
    raise ValueError(f"tokenizer.json's pre-tokenizer {json.dumps(pre)[:200]} has no llama.cpp equivalent the "
                     "GGUF writer knows (supported: GPT-2 byte-level, SmolLM's digits + byte-level)")


def tokenizer_metadata(model_dir: Path, cfg: dict[str, Any]) -> dict[str, Any]:
    """The `tokenizer.*` keys (full names) for the folder's tokenizer.json, padded to the model's vocabulary."""
    from gguf import TokenType

    spec = _read_json(model_dir / "tokenizer.json")
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or (spec.get("decoder") or {}).get("type") != "ByteLevel":
        raise ValueError(f"{model_dir}/tokenizer.json is not a byte-level BPE tokenizer: only those can be written "
                         "as llama.cpp's gpt2 tokenizer")
    pre = _pre_tokenizer_name(spec)
    by_id: dict[int, tuple[str, int]] = {i: (t, TokenType.NORMAL) for t, i in model["vocab"].items()}
    for added in spec.get("added_tokens", []):
        by_id[added["id"]] = (added["content"], TokenType.CONTROL if added["special"] else TokenType.USER_DEFINED)
    vocab_size = int(cfg["vocab_size"])
    if max(by_id) >= vocab_size:
        raise ValueError(f"the tokenizer has token id {max(by_id)} but the model only {vocab_size} embeddings")
    # Rows of the embedding no token uses: llama.cpp needs one vocabulary entry per row.
    tokens = [by_id.get(i, (f"[PAD{i}]", TokenType.UNUSED)) for i in range(vocab_size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]

    tok_cfg = _read_json(model_dir / "tokenizer_config.json")
    gen_cfg = _read_json(model_dir / "generation_config.json")
    ids = {t: i for i, (t, _) in enumerate(tokens)}
    meta: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": [t for t, _ in tokens],
        "tokenizer.ggml.token_type": [int(k) for _, k in tokens],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.add_bos_token": _adds_bos(spec, tok_cfg),
    }
    eos = gen_cfg.get("eos_token_id", cfg.get("eos_token_id"))
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    named = {key: ids.get(tok_cfg[key]) if isinstance(tok_cfg.get(key), str) else None
             for key in ("bos_token", "unk_token", "pad_token")}
    for key, value in (("bos_token_id", cfg.get("bos_token_id", named["bos_token"])),
                       ("eos_token_id", eos[0] if eos else None),
                       ("eot_token_id", eos[1] if len(eos) > 1 else None),
                       ("unknown_token_id", named["unk_token"]),
                       ("padding_token_id", cfg.get("pad_token_id", named["pad_token"]))):
        if value is not None:
            meta[f"tokenizer.ggml.{key}"] = int(value)
    template = tok_cfg.get("chat_template")
    if template is None and (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text()
    if isinstance(template, str):
        meta["tokenizer.chat_template"] = template
    return meta


def _adds_bos(spec: dict[str, Any], tok_cfg: dict[str, Any]) -> bool:
    if "add_bos_token" in tok_cfg:
        return bool(tok_cfg["add_bos_token"])
    post = spec.get("post_processor") or {}
    return post.get("type") == "TemplateProcessing" and any("SpecialToken" in p for p in post.get("single", [])[:1])


# --- tensors ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Entry:
    hf_name: str
    gguf_name: str
    shape: tuple[int, ...]
    file: Path


def _checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return sorted({model_dir / f for f in json.loads(index.read_text())["weight_map"].values()})
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir} holds no .safetensors weights")
    return files


def _entries(model_dir: Path, cfg: dict[str, Any]) -> list[_Entry]:
    from safetensors import safe_open

    tied = bool(cfg.get("tie_word_embeddings", False))
    entries = []
    for file in _checkpoint_files(model_dir):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name.endswith(_SKIPPED_SUFFIXES) or (tied and name == "lm_head.weight"):
                    continue  # a tied lm_head is the embedding: llama.cpp reuses token_embd without output
                shape = tuple(f.get_slice(name).get_shape())
                entries.append(_Entry(name, gguf_tensor_name(name), shape, file))
    names = {e.gguf_name for e in entries}
    if "token_embd.weight" not in names:
        raise ValueError(f"{model_dir} has no model.embed_tokens.weight")
    if not tied and "output.weight" not in names:
        raise ValueError(f"{model_dir} has no lm_head.weight and does not tie it to the embedding")
    return entries


def _stored(entry: _Entry, out_type: Any) -> Any:
    """What a tensor is stored as: 1-D tensors (norms, biases) stay F32, as llama.cpp's converter
    keeps them, and rows that do not split into Q8_0's blocks of 32 are F16."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

    if len(entry.shape) == 1:
        return Q.F32
    block = GGML_QUANT_SIZES[out_type][0]
    return Q.F16 if entry.shape[-1] % block else out_type


def _byte_shape(shape: tuple[int, ...], kind: Any) -> tuple[tuple[int, ...], Any]:
    """The numpy shape and dtype a tensor of `shape` is written as: elements, or a quantized
    type's bytes (each row's blocks)."""
    from gguf import GGML_QUANT_SIZES

    if kind.name in _NUMPY_DTYPES:
        return shape, np.dtype(_NUMPY_DTYPES[kind.name])
    block, block_bytes = GGML_QUANT_SIZES[kind]
    return (*shape[:-1], shape[-1] // block * block_bytes), np.dtype(np.uint8)


def _to_numpy(t: torch.Tensor, kind: Any) -> np.ndarray:
    from gguf import GGMLQuantizationType as Q, quants

    if kind == Q.F32:
        return t.to(torch.float32).numpy()
    if kind == Q.F16:
        return t.to(torch.float16).numpy()
    if kind == Q.Q8_0:  # gguf's encoder, which rounds as llama.cpp's does
        return quants.quantize(t.to(torch.float32).numpy(), kind)
    # BF16 has no numpy dtype: its bits as uint16 (torch rounds to nearest even, as llama.cpp does).
    return t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


_NUMPY_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


def _tensors(entries: list[_Entry], cfg: dict[str, Any], permute: bool) -> Iterator[tuple[_Entry, torch.Tensor]]:
    from safetensors import safe_open

    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    for file in dict.fromkeys(e.file for e in entries):
        with safe_open(str(file), framework="pt") as f:
            for entry in (e for e in entries if e.file == file):
                t = f.get_tensor(entry.hf_name)
                if permute and ".attn_q." in entry.gguf_name:
                    t = permute_qk(t, heads)
                elif permute and ".attn_k." in entry.gguf_name:
                    t = permute_qk(t, kv_heads)
                yield entry, t


def write_gguf(model_dir: str | os.PathLike, out: str | os.PathLike, out_type: str = "bf16",
               name: str | None = None) -> Path:
    """Write the checkpoint in `model_dir` to the GGUF file `out`, matrices stored as `out_type`.

    The file appears complete or not at all: it is written beside `out` and renamed into place."""
    from gguf import GGUFWriter

    if out_type not in OUT_TYPES:
        raise ValueError(f"out_type must be one of {OUT_TYPES}, got {out_type!r}")
    model_dir, out = Path(model_dir), Path(out)
    cfg = _read_json(model_dir / "config.json")
    if not cfg:
        raise ValueError(f"{model_dir} has no config.json")
    arch, meta = model_metadata(cfg)
    tokenizer = tokenizer_metadata(model_dir, cfg)
    entries = _entries(model_dir, cfg)
    qtype, file_type = _out_types()[out_type]

    out.parent.mkdir(parents=True, exist_ok=True)
    fd, staging = tempfile.mkstemp(prefix=f".{out.name}-", dir=out.parent)
    os.close(fd)
    try:
        writer = GGUFWriter(staging, arch)
        writer.add_name(name or model_dir.name)
        writer.add_file_type(int(file_type))
        for key, value in meta.items():
            _add(writer, f"{arch}.{key}", value)
        for key, value in tokenizer.items():
            _add(writer, key, value)
        for e in entries:
            kind = _stored(e, qtype)
            shape, dtype = _byte_shape(tuple(e.shape), kind)
            writer.add_tensor_info(e.gguf_name, shape, dtype, int(np.prod(shape)) * dtype.itemsize, raw_dtype=kind)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for entry, t in _tensors(entries, cfg, ARCHITECTURES[arch].permute_qk):
            writer.write_tensor_data(np.ascontiguousarray(_to_numpy(t, _stored(entry, qtype))))
        writer.close()
        os.chmod(staging, 0o644)  # mkstemp's 0600 would hide the model from other users' servers
        os.replace(staging, out)
    finally:
        if os.path.exists(staging):
            os.unlink(staging)
    log.info("wrote %s (%s, %d tensors)", out, out_type, len(entries))
    return out


def _add(writer: Any, key: str, value: Any) -> None:
    """One metadata value, typed as llama.cpp reads it (counts uint32, ratios float32)."""
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    else:  # lists: strings, or ints stored as int32 (token types)
        writer.add_array(key, value)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.engine.model.gguf_write",
                                description="Write a Hugging Face Llama/Qwen2 checkpoint folder as a GGUF file for llama.cpp.")
    p.add_argument("model", help="checkpoint folder (config.json, safetensors, tokenizer.json), or a built-in name "
                                 "(demo, smollm2)")
    p.add_argument("out", help="the .gguf file to write")
    p.add_argument("--type", choices=OUT_TYPES, default="bf16", help="storage type of the matrices (default bf16); "
                                                                      "norms and biases stay f32")
    args = p.parse_args(argv)
    from pdserve.engine.demo import resolve_model

    write_gguf(resolve_model(args.model), args.out, args.type)
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
