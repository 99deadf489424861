"""Read a llama.cpp GGUF file as a Hugging Face checkpoint: config, and tensors under HF names.

llama.cpp names Llama-family weights its own way (`blk.3.attn_q.weight`), stores every shape
reversed (innermost dimension first), quantizes most matrices in blocks, and for Llama permutes
the rows of q_proj and k_proj inside each head (its rope rotates adjacent pairs, HF's rotates the
two halves of a head). `GGUFModel` undoes all of that, one tensor at a time, so a converted model
is exactly what transformers' own GGUF loader gives.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

log = logging.getLogger("pdserve.engine.gguf")

_MISSING = object()


@dataclass(frozen=True)
class ArchSpec:
    hf_architecture: str
    model_type: str
    # convert_hf_to_gguf.py permutes q/k rows for its Llama family only (Qwen2 keeps HF's layout).
    permute_qk: bool


ARCHITECTURES: dict[str, ArchSpec] = {
    "llama": ArchSpec("LlamaForCausalLM", "llama", permute_qk=True),
    "qwen2": ArchSpec("Qwen2ForCausalLM", "qwen2", permute_qk=False),
}


def _qtypes(*names: str) -> frozenset:
    from gguf import GGMLQuantizationType

    return frozenset(GGMLQuantizationType[n] for n in names)


# Plain float storage: read as is. Everything else goes through gguf.quants.dequantize.
FLOAT_TYPES = _qtypes("F32", "F16", "BF16")
QUANTIZED_TYPES = _qtypes("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                          "IQ4_NL", "IQ4_XS")
SUPPORTED_TYPES = FLOAT_TYPES | QUANTIZED_TYPES

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL_RE = re.compile(r"(\w+)\.(weight|bias)")


def hf_tensor_name(name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; ValueError if it has no HF place."""
    if m := _LAYER_RE.fullmatch(name):
        layer, part, kind = m.groups()
        if part in _LAYER_NAMES:
            return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    elif (m := _GLOBAL_RE.fullmatch(name)) and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    if name.startswith("rope_freqs"):
        # Llama 3.1-style rope scaling baked into a tensor of per-frequency factors.
        raise ValueError(f"GGUF tensor {name!r} (per-frequency rope factors) is not supported")
    raise ValueError(f"GGUF tensor {name!r} has no place in a Llama-family model")


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: within each head its rows go (pair, half); HF's go (half, pair)."""
    rows = weight.shape[0]
    head_dim = rows // num_heads
    if head_dim * num_heads != rows or head_dim % 2:
        raise ValueError(f"cannot split {rows} q/k rows into {num_heads} heads of even size")
    return (weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape).contiguous())


class GGUFModel:
    """One GGUF file, memory-mapped; metadata on demand, tensors dequantized one at a time."""

    def __init__(self, path: str | Path) -> None:
        from gguf import GGUFReader

        self.path = Path(path)
        if not self.path.is_file():
            raise ValueError(f"GGUF file {str(self.path)!r} does not exist")
        size = self.path.stat().st_size
        with self.path.open("rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise ValueError(f"{str(self.path)!r} is not a GGUF file: it does not start with the GGUF magic "
                             f"({size} bytes; truncated or another format)")
        try:
            self.reader = GGUFReader(self.path)
        except Exception as e:  # the reader fails on short files with numpy reshape/view/index errors
            raise ValueError(f"cannot read GGUF file {str(self.path)!r} ({size} bytes): it is truncated or "
                             f"corrupt ({type(e).__name__}: {e})") from e
        for t in self.reader.tensors:
            if t.data_offset + t.n_bytes > size:
                raise ValueError(f"GGUF file {str(self.path)!r} is truncated: tensor {t.name!r} ends at byte "
                                 f"{t.data_offset + t.n_bytes} but the file has {size} bytes")
        self.architecture = str(self.meta("general.architecture", ""))
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"GGUF file {str(self.path)!r} has architecture {self.architecture!r}, which is "
                             f"not supported; supported: {sorted(ARCHITECTURES)}")
        self.spec = ARCHITECTURES[self.architecture]
        self.tensors = {t.name: t for t in self.reader.tensors}
        self._check_tensors()

    # --- metadata -------------------------------------------------------------------------------

    def meta(self, key: str, default: Any = _MISSING) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            if default is _MISSING:
                raise ValueError(f"GGUF file {str(self.path)!r} lacks the metadata key {key!r}")
            return default
        return field.contents()

    def arch_meta(self, key: str, default: Any = _MISSING) -> Any:
        return self.meta(f"{self.architecture}.{key}", default)

    def _int(self, key: str, default: Any = _MISSING) -> int:
        value = self.arch_meta(key, default)
        if isinstance(value, list):
            raise ValueError(f"GGUF key {self.architecture}.{key} varies per layer ({value[:4]}...): not supported")
        return int(value)

    def config(self) -> dict[str, Any]:
        """config.json for the equivalent Hugging Face checkpoint."""
        heads = self._int("attention.head_count")
        hidden = self._int("embedding_length")
        head_dim = self._int("attention.key_length", hidden // heads)
        if self._int("attention.value_length", head_dim) != head_dim:
            raise ValueError("GGUF models whose value heads differ in size from key heads are not supported")
        if self._int("rope.dimension_count", head_dim) != head_dim:
            raise ValueError(f"partial rotary embeddings (rope.dimension_count "
                             f"{self._int('rope.dimension_count')} of head size {head_dim}) are not supported")
        embed = self.tensors["token_embd.weight"]
        vocab = self._int("vocab_size", int(embed.shape[1]))
        cfg: dict[str, Any] = {
            "architectures": [self.spec.hf_architecture],
            "model_type": self.spec.model_type,
            "hidden_size": hidden,
            "intermediate_size": self._int("feed_forward_length"),
            "num_hidden_layers": self._int("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": self._int("attention.head_count_kv", heads),
            "head_dim": head_dim,
            "max_position_embeddings": self._int("context_length", 2048),
            "rms_norm_eps": float(self.arch_meta("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_parameters": self._rope_parameters(),
            "vocab_size": vocab,
            "tie_word_embeddings": "output.weight" not in self.tensors,
            "hidden_act": "silu",
            "dtype": self._preferred_dtype(),
        }
        if self.architecture == "llama":
            cfg["attention_bias"] = "blk.0.attn_q.bias" in self.tensors
            cfg["mlp_bias"] = False
        if self.architecture == "qwen2":
            cfg["use_sliding_window"] = False
        for key in ("bos_token_id", "eos_token_id", "padding_token_id"):
            value = self.meta(f"tokenizer.ggml.{key}", None)
            if value is not None:
                cfg[key.replace("padding", "pad")] = int(value)
        return cfg

    def generation_config(self) -> dict[str, Any]:
        eos = [int(self.meta(f"tokenizer.ggml.{key}")) for key in ("eos_token_id", "eot_token_id")
               if self.meta(f"tokenizer.ggml.{key}", None) is not None]
        gen: dict[str, Any] = {"eos_token_id": sorted(set(eos), key=eos.index)}
        for key in ("bos_token_id", "padding_token_id"):
            value = self.meta(f"tokenizer.ggml.{key}", None)
            if value is not None:
                gen[key.replace("padding", "pad")] = int(value)
        return gen

    def _rope_parameters(self) -> dict[str, Any]:
        theta = float(self.arch_meta("rope.freq_base", 10000.0))
        kind = str(self.arch_meta("rope.scaling.type", "none"))
        if kind == "none":
            return {"rope_type": "default", "rope_theta": theta}
        if kind == "linear":
            return {"rope_type": "linear", "rope_theta": theta, "factor": float(self.arch_meta("rope.scaling.factor"))}
        raise ValueError(f"GGUF rope scaling type {kind!r} is not supported (supported: none, linear)")

    def _preferred_dtype(self) -> str:
        """The compute dtype `--dtype auto` should pick: the file's float type, else bfloat16 for quantized files."""
        from gguf import GGMLQuantizationType as Q

        matrices = [t.tensor_type for t in self.reader.tensors if len(t.shape) > 1]
        if matrices and all(q == Q.F32 for q in matrices):
            return "float32"
        if matrices and all(q in (Q.F16, Q.F32) for q in matrices):
            return "float16"
        return "bfloat16"

    # --- tensors --------------------------------------------------------------------------------

    def _check_tensors(self) -> None:
        """Fail before any work on a tensor we cannot place or decode."""
        if "token_embd.weight" not in self.tensors:
            raise ValueError(f"GGUF file {str(self.path)!r} has no token_embd.weight tensor")
        for t in self.reader.tensors:
            hf_tensor_name(t.name)
            if t.tensor_type not in SUPPORTED_TYPES:
                names = ", ".join(sorted(q.name for q in SUPPORTED_TYPES))
                raise ValueError(f"GGUF tensor {t.name!r} uses quantization type {t.tensor_type.name}, which is "
                                 f"not supported; supported: {names}")

    def matrix_types(self) -> dict[str, str]:
        """Each 2-D tensor's storage type (Q8_0, F32, ...), by Hugging Face name."""
        return {hf_tensor_name(t.name): t.tensor_type.name for t in self.reader.tensors if len(t.shape) > 1}

    def hf_shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(self.tensors[name].shape.tolist()))

    def load_tensor(self, name: str) -> torch.Tensor:
        """One tensor, in HF layout: float types keep their dtype, quantized ones become float32."""
        from gguf import GGMLQuantizationType as Q
        from gguf.quants import dequantize

        t = self.tensors[name]
        shape = self.hf_shape(name)
        if t.tensor_type == Q.F32:
            out = torch.from_numpy(np.array(t.data, dtype=np.float32).reshape(shape))
        elif t.tensor_type == Q.F16:
            out = torch.from_numpy(np.array(t.data, dtype=np.float16).reshape(shape))
        elif t.tensor_type == Q.BF16:
            # bfloat16 widened to float32 is exact, so narrowing it back loses nothing.
            out = torch.from_numpy(dequantize(t.data, t.tensor_type).reshape(shape)).to(torch.bfloat16)
        else:
            out = torch.from_numpy(np.ascontiguousarray(dequantize(t.data, t.tensor_type)).reshape(shape))
        if self.spec.permute_qk:
            if ".attn_q." in name:
                out = unpermute_qk(out, self._int("attention.head_count"))
            elif ".attn_k." in name:
                out = unpermute_qk(out, self._int("attention.head_count_kv", self._int("attention.head_count")))
        return out

    def hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.tensors:
            yield hf_tensor_name(name), self.load_tensor(name)
