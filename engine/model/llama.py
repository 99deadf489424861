"""Llama-family decoder (Llama, Mistral, Qwen2) over a flat batch of tokens and a paged KV cache.

One forward call takes every scheduled token of every request as one sequence; attention uses
the step's metadata to keep requests apart. Layers are tensor-parallel; with one rank they are
plain linear layers.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from pdserve.engine.attention.metadata import AttentionMetadata
from pdserve.engine.config import ModelConfig
from pdserve.engine.model import decode_call, fused
from pdserve.engine.model.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from pdserve.engine.model.rotary import RotaryEmbedding

# (query, key_cache, value_cache, metadata, scale, key, value) -> attention output
AttentionFn = Callable[..., torch.Tensor]
# (key, value, key_cache, value_cache, slot_mapping) -> None
WriteKVFn = Callable[..., None]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, cfg.attention_bias, cfg.dtype)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, False, cfg.dtype)
        self.rotary = rotary
        self.scale = cfg.head_dim ** -0.5

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                attend: AttentionFn, write_kv: WriteKVFn) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        write_kv(k, v, key_cache, value_cache, meta.slot_mapping)
        out = attend(q, key_cache, value_cache, meta, self.scale, key=k, value=v)
        return self.o_proj(out.reshape(-1, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, False, cfg.dtype)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, False, cfg.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(fused.silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, rotary)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, kv_cache: torch.Tensor,
                meta: AttentionMetadata, attend: AttentionFn, write_kv: WriteKVFn) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, kv_cache, meta, attend, write_kv)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, cfg.dtype)
        # One table of cos/sin shared by every layer.
        rotary = RotaryEmbedding(cfg.head_dim, cfg.hf_config.get("max_position_embeddings", cfg.max_model_len),
                                 cfg.rope_parameters, cfg.dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, rotary) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, attend: AttentionFn, write_kv: WriteKVFn) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        one_call = decode_call.call_for(self, meta, positions, attend, write_kv)
        if one_call is not None:  # a decode step on the CPU: every layer in one C++ call
            plan, paths = one_call
            return plan.run(x, positions, kv_caches, meta, paths)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(positions, x, residual, kv_cache, meta, attend, write_kv)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    # Checkpoint projection name -> (our fused parameter, part)
    FUSED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
             "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, cfg.dtype)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, attend: AttentionFn, write_kv: WriteKVFn) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, meta, attend, write_kv)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.logits(hidden)

    def checkpoint_name_to_param(self, name: str) -> tuple[str, object] | None:
        """Map a checkpoint tensor name to (our parameter name, part); None to skip it."""
        if "rotary_emb.inv_freq" in name:
            return None
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None
        for ckpt, (ours, part) in self.FUSED.items():
            if f".{ckpt}." in name:
                return name.replace(ckpt, ours), part
        return name, None


MODEL_CLASSES = {"LlamaForCausalLM": LlamaForCausalLM, "MistralForCausalLM": LlamaForCausalLM,
                 "Qwen2ForCausalLM": LlamaForCausalLM}
