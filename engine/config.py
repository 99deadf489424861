"""Engine settings: `EngineArgs` as users pass them, `EngineConfig` once resolved against the model."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import platform
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from pdserve.engine import cpu_info
from pdserve.engine.core.liveness import DEFAULT_STEP_TIMEOUT_S

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"}
_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}
log = logging.getLogger("pdserve.engine.config")


@dataclass
class EngineArgs:
    model: str
    tokenizer: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"  # auto: the checkpoint's; on CPU half types become bfloat16 only with AMX, else float32
    # auto (or None): a GGUF's Q8_0 weights stay int8 on the CPU, others float; none: all float;
    # int8: every linear weight int8 with a scale per output row; q8_0: with a scale per 32 weights.
    quantization: str | None = None
    # Round decode steps' activations to int8 too (W8A8, as llama.cpp's Q8_0 dot products): needs
    # int8 weights; faster at a few rows, adds x's rounding to the weight's (engine/model/quant.py).
    int8_activations: bool = False
    device: str = "auto"  # auto: cuda when available, else cpu
    seed: int = 0
    block_size: int = 16
    num_kv_blocks: int | None = None  # override the measured block count
    kv_cache_memory_bytes: int | None = None  # CPU: KV space; default min(4 GiB, 30% of RAM)
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # default max(2048, max_num_seqs)
    long_prefill_token_threshold: int = 0  # 0: no per-request cap within a step
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    scheduling_policy: str = "fcfs"  # fcfs | priority
    tensor_parallel_size: int = 1
    # Data parallelism inside one pod: N engine cores behind one API server (engine/frontend/dp_client.py).
    data_parallel_size: int = 1
    data_parallel_lockstep: bool = False  # the wave protocol: every rank steps while any has work
    max_logprobs: int = 20
    kv_transfer_config: dict[str, Any] | None = None
    # Where this engine sits in a P/D deployment (see DESIGN §4-§5).
    engine_role: str = "both"  # prefill | decode | both
    engine_id: str | None = None  # default: a fresh uuid per start
    coordinator_address: str | None = None  # host:port of the coordinator's stats (PULL) socket
    coordinator_publish_address: str | None = None  # host:port of its PUB socket (the DP client balances by it)
    advertise_address: str | None = None  # host:port of this engine's HTTP API, as routers reach it
    # A step running longer than this makes the core unresponsive (engine/core/liveness.py); 0: never.
    step_timeout: float = DEFAULT_STEP_TIMEOUT_S
    # CUDA: run every step eagerly, without the decode graphs captured at start-up (worker/decode_graphs.py).
    enforce_eager: bool = False

    def create_engine_config(self) -> "EngineConfig":
        from pdserve.engine.demo import resolve_model

        model_path = resolve_model(self.model)
        model_config = ModelConfig.from_pretrained(
            model_path, dtype=self.dtype, device=resolve_device(self.device), max_model_len=self.max_model_len,
            tokenizer=resolve_model(self.tokenizer) if self.tokenizer else model_path,
            served_model_name=self.served_model_name or self.model, seed=self.seed, max_logprobs=self.max_logprobs,
            quantization=self.quantization, int8_activations=self.int8_activations,
        )
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        # A share of the GPU: above 1 the KV cache would be sized past the card and fail to allocate.
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        max_batched = self.max_num_batched_tokens or max(2048, self.max_num_seqs)
        if not self.enable_chunked_prefill:
            max_batched = max(max_batched, model_config.max_model_len)
        if max_batched < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {max_batched}")
        tp = self.tensor_parallel_size
        if tp < 1 or tp & (tp - 1):
            raise ValueError(f"tensor_parallel_size must be a power of two, got {tp}")
        from pdserve.engine.model.layers import check_head_split

        check_head_split(model_config.num_attention_heads, model_config.num_key_value_heads, tp)
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be at least 1, got {self.data_parallel_size}")
        from pdserve.kvstore.config import parse_kv_transfer_config

        parse_kv_transfer_config(self.kv_transfer_config)  # a bad --kv-transfer-config fails here, clearly
        if self.engine_role not in ("prefill", "decode", "both"):
            raise ValueError(f"engine_role must be prefill, decode or both; got {self.engine_role!r}")
        if not self.step_timeout >= 0:  # also refuses NaN
            raise ValueError(f"step_timeout must be 0 (off) or a number of seconds, got {self.step_timeout}")
        return EngineConfig(
            model=model_config,
            cache=CacheConfig(block_size=self.block_size, num_kv_blocks=self.num_kv_blocks,
                              kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                              gpu_memory_utilization=self.gpu_memory_utilization,
                              enable_prefix_caching=self.enable_prefix_caching),
            scheduler=SchedulerConfig(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=max_batched,
                                      long_prefill_token_threshold=self.long_prefill_token_threshold,
                                      enable_chunked_prefill=self.enable_chunked_prefill,
                                      policy=self.scheduling_policy),
            parallel=ParallelConfig(tensor_parallel_size=tp, data_parallel_size=self.data_parallel_size,
                                    data_parallel_lockstep=self.data_parallel_lockstep and self.data_parallel_size > 1),
            kv_transfer=self.kv_transfer_config,
            engine_role=self.engine_role,
            engine_id=self.engine_id or uuid.uuid4().hex,
            coordinator_address=self.coordinator_address,
            coordinator_publish_address=self.coordinator_publish_address,
            advertise_address=self.advertise_address,
            step_timeout=self.step_timeout,
            enforce_eager=self.enforce_eager,
        )

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    # Anything else used to run on the CPU without a word, and "cuda:1" on GPU 0: the worker picks
    # GPUs by rank, and CUDA_VISIBLE_DEVICES is how a process is given other ones.
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda; got {device!r} "
                         f"(choose GPUs with CUDA_VISIBLE_DEVICES)")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device cuda was asked for, but torch {torch.__version__} sees no CUDA GPU here; "
                         f"use device cpu or auto")
    return device


@dataclass
class ModelConfig:
    path: str
    tokenizer: str
    served_model_name: str
    architecture: str
    hf_config: dict[str, Any]
    dtype: torch.dtype
    device: str
    max_model_len: int
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool
    rope_parameters: dict[str, Any]
    eos_token_ids: list[int]
    seed: int = 0
    max_logprobs: int = 20
    quantization: str | None = None  # None, "int8" or "q8_0" (see engine/model/quant.py)
    # Quantize only the linear layers whose checkpoint tensors were Q8_0 in a GGUF file, and only
    # where int8 gives those weights back exactly (`quantization auto`).
    keep_gguf_q8_0: bool = False
    int8_activations: bool = False  # decode steps' rows rounded to int8 as well (quant.Int8Linear)

    @classmethod
    def from_pretrained(cls, path: str, *, dtype: str = "auto", device: str = "cpu", max_model_len: int | None = None,
                        tokenizer: str | None = None, served_model_name: str | None = None, seed: int = 0,
                        max_logprobs: int = 20, quantization: str | None = None,
                        int8_activations: bool = False) -> "ModelConfig":
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise ValueError(f"no config.json in model directory {path!r}")
        cfg = json.loads(config_file.read_text())
        keep_gguf_q8_0 = False
        resolved: torch.dtype | None = None  # dtype resolved, where that had to be done early
        if quantization in (None, "auto"):
            keep_gguf_q8_0 = device == "cpu" and gguf_q8_0_tensors(cfg) > 0
            if keep_gguf_q8_0 and dtype == "auto" and 2 * gguf_q8_0_tensors(cfg) <= len(cfg[GGUF_TYPES_KEY]):
                resolved = _resolve_dtype(dtype, cfg, device)
                # A few Q8_0 tensors among others (the built-in smollm2's embedding, beside 210 Q4_1
                # ones) do not pull the model into float32 where bfloat16 runs faster here.
                keep_gguf_q8_0 = resolved != torch.bfloat16
            if keep_gguf_q8_0 and dtype == "auto":
                dtype, resolved = "float32", None  # the int8 matmuls compute in float32; the rest runs exact alongside
            elif keep_gguf_q8_0 and _DTYPES.get(dtype) != torch.float32:
                # Weights loaded as a half type are rounded already: the file's int8 values are gone.
                log.info("the GGUF's Q8_0 weights stay int8 in float32 only; dtype %s serves them as %s", dtype, dtype)
                keep_gguf_q8_0 = False
            quantization = "q8_0" if keep_gguf_q8_0 else None
        quantization = check_quantization(quantization, device)
        if int8_activations and quantization is None:
            raise ValueError("int8 activations need int8 weights: pass --quantization int8 or q8_0 "
                             "(or serve a GGUF whose weights are Q8_0)")
        if quantization is not None and dtype == "auto":
            resolved = quantized_dtype(_resolve_dtype(dtype, cfg, device), quantization, int8_activations)
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(f"unsupported architecture {archs}; supported: {sorted(SUPPORTED_ARCHITECTURES)}")
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        derived_len = cfg.get("max_position_embeddings", 2048)
        if max_model_len is None:
            max_model_len = derived_len
        elif max_model_len > derived_len:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={derived_len}")
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {max_model_len}")
        return cls(
            path=str(path),
            tokenizer=tokenizer or str(path),
            served_model_name=served_model_name or str(path),
            architecture=arch,
            hf_config=cfg,
            dtype=resolved if resolved is not None else _resolve_dtype(dtype, cfg, device),
            device=device,
            max_model_len=max_model_len,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden // num_heads,
            intermediate_size=cfg["intermediate_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; Llama and Mistral only when the config says so.
            attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            rope_parameters=_rope_parameters(cfg),
            eos_token_ids=_eos_token_ids(Path(path), cfg),
            seed=seed,
            max_logprobs=max_logprobs,
            quantization=quantization,
            keep_gguf_q8_0=keep_gguf_q8_0,
            int8_activations=int8_activations,
        )


QUANTIZATIONS = ("int8", "q8_0")
# config.json key under which gguf_convert records each 2-D tensor's GGUF type (HF name -> type name).
GGUF_TYPES_KEY = "pdserve_gguf_tensor_types"


def gguf_q8_0_tensors(cfg: dict[str, Any]) -> int:
    """How many of a converted GGUF checkpoint's tensors were Q8_0 in the file (0 for other checkpoints)."""
    types = cfg.get(GGUF_TYPES_KEY)
    return sum(t == "Q8_0" for t in types.values()) if isinstance(types, dict) else 0


def check_quantization(quantization: str | None, device: str) -> str | None:
    """The validated quantization method: None (or "none") for full-precision weights, "int8" or "q8_0"."""
    if quantization in (None, "", "none"):
        return None
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be none or one of {', '.join(QUANTIZATIONS)}; got {quantization!r}")
    if device != "cpu":
        # The int8 kernels used (fbgemm, ATen's int8pack) are CPU ones; a GPU path is not built yet.
        raise ValueError(f"quantization {quantization} runs on the CPU only; got device {device!r} "
                         f"(use device cpu, or no quantization on the GPU)")
    return quantization


def cpu_flags() -> frozenset[str]:
    """The CPU feature flags of /proc/cpuinfo (Linux); empty where there is no such file."""
    return cpu_info.flags()


def cpu_has_native_bf16() -> bool:
    """Whether bfloat16 matmuls run in hardware here (AVX512-BF16 or AMX on x86).

    Without either, oneDNN emulates bf16 through fp32 conversions: measured on an AVX2-only
    EPYC, a 32x768x2048 bf16 linear takes 7.7x as long as the same one in float32.
    """
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return True  # no cheap probe elsewhere: keep the checkpoint's dtype
    cpu = torch.cpu
    return any(getattr(cpu, probe, lambda: False)() for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


def cpu_has_amx_bf16() -> bool:
    """Whether this CPU has AMX tiles for bf16 (Sapphire Rapids and later Xeons)."""
    if "amx_bf16" in cpu_flags():
        return True
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def auto_cpu_dtype(checkpoint: torch.dtype, *, machine: str, amx_bf16: bool, native_bf16: bool = False,
                   timed: Callable[[], tuple[bool, str]] | None = None) -> tuple[torch.dtype, str]:
    """What `dtype auto` runs a checkpoint stored in `checkpoint` as on this CPU, and why.

    The rule, from benchmarks/bench_precision.py and the measurements in issue 20: float32
    checkpoints stay float32 (exact, and never slower than a half type). Half checkpoints run in
    bfloat16 where AMX does bf16 matmuls: there they are several times faster than float32.
    Without bf16 hardware (AVX2) our kernels widen bf16 weights in registers: on a Zen 3 EPYC
    (dtype_probe's timing, SmolLM2's shapes) bf16 matmuls ran 1.5-1.6x float32's speed at one row
    and 1.1-1.2x at sixteen, but 0.93-0.95x at 256 (prefill), where the arithmetic is the same and
    the widening is extra: float32, never the slower, stays (dtype bfloat16 gives the faster
    decode). With AVX512-BF16 alone the CPU decides: on an Intel Xeon bf16 decoded 16 streams at
    92 tok/s against float32's 110, on an AMD EPYC (Zen 4) bf16's step matmuls ran 1.9-3.2x
    float32's speed; so there `timed()` (the engine/dtype_probe.py verdict: bf16 faster at decode
    and prefill row counts?) settles it, and without it float32 is kept. float16 never runs fast
    on CPUs. Other architectures (ARM) have no cheap probe: bfloat16, as before.
    """
    if checkpoint == torch.float32:
        return torch.float32, "float32 checkpoint"
    if machine.lower() not in ("x86_64", "amd64"):
        return torch.bfloat16, f"{machine} CPU: half checkpoints run in bfloat16"
    if amx_bf16:
        return torch.bfloat16, "this CPU has AMX, whose bfloat16 matmuls beat float32"
    if not native_bf16:
        return torch.float32, "this CPU has no bfloat16 hardware (bf16 prefill is no faster than float32)"
    if timed is None:
        return torch.float32, "AVX512-BF16 without AMX, not timed: float32 is never the slower"
    faster, why = timed()
    return (torch.bfloat16 if faster else torch.float32), why


def auto_cpu_dtype_here(checkpoint: torch.dtype, cfg: dict[str, Any]) -> tuple[torch.dtype, str]:
    """auto_cpu_dtype on this machine, timing bf16 against float32 on the checkpoint's own layer
    shapes (`cfg`, its config.json) where the hardware leaves it open."""

    def timed() -> tuple[bool, str]:
        from pdserve.engine import dtype_probe

        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            head_dim = int(cfg.get("head_dim") or hidden // heads)
            kv_heads = int(cfg.get("num_key_value_heads") or heads)
            shapes = dtype_probe.shapes(hidden, int(cfg["intermediate_size"]), heads * head_dim, kv_heads * head_dim)
        except (KeyError, TypeError, ValueError, ZeroDivisionError):
            return False, "the config does not give the layer shapes to time: float32 is never the slower"
        verdict = dtype_probe.bf16_beats_float32(tuple(shapes))
        return verdict.bf16_faster, verdict.why()

    return auto_cpu_dtype(checkpoint, machine=platform.machine(), amx_bf16=cpu_has_amx_bf16(),
                          native_bf16=cpu_has_native_bf16(), timed=timed)


_logged_dtype_choices: set[tuple[str, str]] = set()


def quantized_dtype(chosen: torch.dtype, quantization: str, int8_activations: bool) -> torch.dtype:
    """What `dtype auto` runs a model with int8 weights in, given what it picked without them.

    Our int8 kernels take float32 rows, so a half model converts around every int8 matmul and
    leaves the one-call decode loop: float32 is the faster there (on the AMX Xeon, bench model,
    paired: Q8_0 weights in bf16 ran 0.77x float32's decode step at batch 1, 0.89x at 16). The
    exception is bfloat16 on CPUs with AMX with a scale per row and no int8 activations: those
    weights are multiplied by bf16 rows on AMX tiles (engine/model/quant.py), 1.5-3x float32's step.
    """
    if chosen == torch.float32:
        return chosen
    kernels = os.environ.get("PDSERVE_DISABLE_CPU_KERNELS") != "1"
    if chosen == torch.bfloat16 and quantization == "int8" and not int8_activations and cpu_has_amx_bf16() and kernels:
        return chosen
    key = (f"{quantization} weights", "float32")
    if key not in _logged_dtype_choices:
        _logged_dtype_choices.add(key)
        log.info("dtype auto: %s weights%s compute in float32 here, so the model runs in float32 "
                 "(pass dtype to force one)", quantization, " with int8 activations" if int8_activations else "")
    return torch.float32


def _resolve_dtype(dtype: str, cfg: dict[str, Any], device: str) -> torch.dtype:
    if dtype == "auto":
        name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
        resolved = _DTYPES.get(name, torch.float32)
        if device != "cpu" or resolved == torch.float32:
            return resolved  # GPUs run the checkpoint's half type natively
        chosen, why = auto_cpu_dtype_here(resolved, cfg)
        key = (name, str(chosen))
        if key not in _logged_dtype_choices:  # once per process, though configs are resolved several times
            _logged_dtype_choices.add(key)
            log.info("dtype auto: the %s checkpoint runs in %s (%s; pass dtype to force one)",
                     name, str(chosen).removeprefix("torch."), why)
        return chosen
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {dtype!r}")
    return _DTYPES[dtype]


def _rope_parameters(cfg: dict[str, Any]) -> dict[str, Any]:
    """One shape for both config styles: transformers 5 `rope_parameters`, older `rope_scaling` + `rope_theta`."""
    params = dict(cfg.get("rope_parameters") or {})
    if not params:
        params = dict(cfg.get("rope_scaling") or {})
        params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    return params


def _eos_token_ids(path: Path, cfg: dict[str, Any]) -> list[int]:
    ids: list[int] = []
    gen_file = path / "generation_config.json"
    for source in (cfg, json.loads(gen_file.read_text()) if gen_file.is_file() else {}):
        value = source.get("eos_token_id")
        for token in (value if isinstance(value, list) else [value]):
            if isinstance(token, int) and token not in ids:
                ids.append(token)
    return ids


@dataclass
class CacheConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int = 0
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    distributed_init_method: str | None = None
    data_parallel_size: int = 1
    # This engine core's rank among the pod's data-parallel ranks (set per rank by the DP client).
    data_parallel_rank: int = 0
    data_parallel_lockstep: bool = False
    # Where the lock-step ranks meet for their all-reduce (tcp://host:port, chosen by the DP client).
    data_parallel_init_method: str | None = None
    # CPU cores this engine core's workers share; None: every core the process may use. The DP
    # client gives each rank its share, so ranks do not each spin a thread per core.
    cpu_cores: int | None = None


@dataclass
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    kv_transfer: dict[str, Any] | None = None
    engine_role: str = "both"
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    coordinator_address: str | None = None
    coordinator_publish_address: str | None = None
    advertise_address: str | None = None
    step_timeout: float = DEFAULT_STEP_TIMEOUT_S  # seconds; 0: a long step never makes the core unresponsive
    enforce_eager: bool = False  # CUDA: no decode graphs
    # Filled in by the executor once the KV cache is sized.
    num_kv_blocks: int = 0

    @property
    def block_size(self) -> int:
        return self.cache.block_size


def env_flag(name: str, default: bool = False) -> bool:
    value = os.environ.get(name)
    return default if value is None else value.lower() in ("1", "true", "yes", "on")
