"""The Triton paged-attention kernels checked against the torch reference, case by case.

Runs as its own process because TRITON_INTERPRET must be set (or unset) before triton is first
imported. Three modes:

    --device cpu    the kernels run in the Triton interpreter on CPU tensors (CI)
    --compile       no GPU needed: compile the kernels with real Triton for sm_90 (H100/H200), as
                    the JIT would for the launches paged_attention makes, and check each fits the
                    shared-memory limit; reports registers and spills (CI)
    --device cuda   on a GPU machine, by hand: compiled kernels vs the reference, with --large
                    serving-sized shapes as well:

    PYTHONSAFEPATH=1 .venv/bin/python tests/engine/triton_cases.py --device cuda --large [--bench]

(--bench adds milliseconds per call of the kernel and of the torch path on the same inputs.)

It prints one line per case and exits 1 if any case fails; --json PATH also writes the results.
Importing this module only defines the cases (no triton), so pytest can list them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.engine.attention import torch_paged
from pdserve.engine.attention.metadata import AttentionMetadata

# Max abs error allowed against the fp32 reference, by input dtype. 16-bit inputs are compared with
# the reference run on the same (rounded) inputs in fp32; what remains is the kernel's rounding of
# the probabilities to 16 bits before P@V and of the output.
TOLERANCE = {"float32": 2e-5, "float16": 4e-3, "bfloat16": 3e-2}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class AttentionCase:
    name: str
    # (query_len, context_len) per request; requests with query_len 1 come first and are the
    # decodes, unless num_decodes says otherwise.
    reqs: tuple[tuple[int, int], ...]
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    block_size: int = 16
    dtype: str = "float32"
    num_decodes: int | None = None
    num_segments: int | None = None
    # Query as a view into a wider qkv tensor, output into a slice of a larger buffer.
    strided: bool = False
    large: bool = False  # only with --large (too slow for the interpreter)
    seed: int = 0


@dataclass(frozen=True)
class WriteKVCase:
    name: str
    num_tokens: int
    num_kv_heads: int = 2
    head_dim: int = 32
    block_size: int = 16
    num_blocks: int = 12
    dtype: str = "float32"
    strided: bool = False  # key/value as views into a qkv tensor, as the model produces them
    padding_tokens: int = 0  # tokens with slot -1, which must be skipped
    large: bool = False
    seed: int = 0


ATTENTION_CASES = [
    AttentionCase("mixed_gqa4_bs16_fp32", ((1, 37), (1, 5), (1, 0), (7, 0), (13, 21), (40, 3)), num_heads=8),
    AttentionCase("mixed_mha_bs8_fp32", ((1, 29), (1, 64), (70, 0), (9, 50)), num_heads=4, num_kv_heads=4,
                  head_dim=64, block_size=8),
    AttentionCase("mixed_gqa2_bs32_fp32", ((1, 100), (1, 31), (33, 64), (5, 27)), block_size=32),
    AttentionCase("prefill_no_context_fp32", ((17, 0), (32, 0), (3, 0)), head_dim=64),
    # Context a multiple of the block size is a prefix-cache hit; otherwise a chunk continuing.
    AttentionCase("prefill_with_context_fp32", ((24, 48), (16, 16), (20, 37), (1, 70)), num_decodes=0, seed=1),
    AttentionCase("decode_only_fp32", ((1, 15), (1, 16), (1, 17), (1, 90)), num_heads=8),
    AttentionCase("decode_segments_fp32", ((1, 300), (1, 17), (1, 64), (6, 10)), num_heads=8, num_segments=4),
    AttentionCase("mqa_8q_1kv_fp32", ((1, 40), (19, 13)), num_heads=8, num_kv_heads=1),
    AttentionCase("gqa3_6q_2kv_fp32", ((1, 40), (1, 3), (25, 9)), num_heads=6, num_kv_heads=2),
    AttentionCase("head_dim80_fp32", ((1, 33), (12, 20)), head_dim=80),
    AttentionCase("head_dim256_fp32", ((1, 70), (9, 30)), num_heads=2, num_kv_heads=1, head_dim=256),
    AttentionCase("strided_query_out_fp32", ((1, 18), (10, 6)), strided=True),
    AttentionCase("mixed_gqa4_bf16", ((1, 37), (1, 5), (7, 0), (13, 21), (40, 3)), num_heads=8, dtype="bfloat16"),
    AttentionCase("mixed_gqa4_fp16", ((1, 37), (1, 5), (7, 0), (13, 21), (40, 3)), num_heads=8, dtype="float16"),
    AttentionCase("mixed_mha_bs8_fp16", ((1, 29), (70, 0), (9, 50)), num_kv_heads=4, head_dim=64, block_size=8,
                  dtype="float16"),
    AttentionCase("decode_segments_bf16", ((1, 300), (1, 17)), num_heads=8, num_segments=2, dtype="bfloat16"),
    # Serving-sized shapes for a GPU run.
    AttentionCase("large_mixed_gqa4_bf16", tuple([(1, n) for n in (4000, 1, 517, 2048, 63)] +
                                                 [(512, 0), (1000, 3000), (37, 129)]),
                  num_heads=32, num_kv_heads=8, head_dim=128, dtype="bfloat16", large=True),
    AttentionCase("large_decode_auto_segments_fp16", ((1, 8000), (1, 3000)), num_heads=32, num_kv_heads=8,
                  head_dim=128, dtype="float16", large=True),
    AttentionCase("large_mha_fp32", ((1, 700), (300, 200)), num_heads=16, num_kv_heads=16, head_dim=64, large=True),
]

WRITE_KV_CASES = [
    WriteKVCase("write_kv_fp32", num_tokens=20),
    WriteKVCase("write_kv_bf16_strided_bs8", num_tokens=13, head_dim=64, block_size=8, dtype="bfloat16", strided=True),
    WriteKVCase("write_kv_fp16_padding_3kv", num_tokens=9, num_kv_heads=3, dtype="float16", padding_tokens=3),
    WriteKVCase("large_write_kv_bf16", num_tokens=4096, num_kv_heads=8, head_dim=128, num_blocks=512,
                dtype="bfloat16", strided=True, large=True),
]

OTHER_CASES = ["plan_is_shared_not_clobbered", "decode_segment_heuristic"]


@dataclass(frozen=True)
class CompileCase:
    name: str
    kernel: str  # decode | prefill | merge | write_kv
    dtype: str = "bfloat16"
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    num_segments: int = 1


COMPILE_CASES = [
    CompileCase("sm90_decode_bf16_d128_gqa4", "decode"),
    CompileCase("sm90_decode_segments_fp16_d64_mha", "decode", "float16", 16, 16, 64, num_segments=8),
    CompileCase("sm90_prefill_bf16_d128_gqa4", "prefill"),
    CompileCase("sm90_prefill_fp16_d80_gqa3", "prefill", "float16", 12, 4, 80),
    CompileCase("sm90_prefill_fp32_d64_mha", "prefill", "float32", 8, 8, 64),
    CompileCase("sm90_merge_segments_d128", "merge", num_segments=16),
    CompileCase("sm90_write_kv_bf16_d128", "write_kv"),
    CompileCase("sm90_decode_bf16_d256", "decode", num_heads=8, num_kv_heads=1, head_dim=256),
    CompileCase("sm90_prefill_bf16_d256", "prefill", num_heads=8, num_kv_heads=1, head_dim=256),
    CompileCase("sm90_decode_fp32_d128", "decode", "float32"),
    CompileCase("sm90_prefill_fp32_d128", "prefill", "float32"),
    CompileCase("sm90_prefill_fp16_d64_group16", "prefill", "float16", 64, 4, 64, block_size=32),
]


def case_names(large: bool = False) -> list[str]:
    return ([c.name for c in ATTENTION_CASES + WRITE_KV_CASES if large or not c.large]  # type: ignore[operator]
            + OTHER_CASES)


def compile_case_names() -> list[str]:
    return [c.name for c in COMPILE_CASES]


# -- building a step ------------------------------------------------------------------------------


@dataclass
class Step:
    meta: AttentionMetadata
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    scale: float


def build_step(case: AttentionCase, device: str) -> Step:
    """A random step: each request's context and this step's keys already in a shuffled cache."""
    rng = np.random.default_rng(case.seed)
    gen = torch.Generator().manual_seed(case.seed)
    bs, hkv, d = case.block_size, case.num_kv_heads, case.head_dim
    query_lens = np.array([q for q, _ in case.reqs], dtype=np.int64)
    seq_lens = np.array([q + c for q, c in case.reqs], dtype=np.int64)
    num_reqs = len(case.reqs)
    blocks_per_req = -(-seq_lens // bs)
    max_blocks = int(blocks_per_req.max()) + 2  # spare columns: past-the-end entries must not be read
    # Block 0 is the null block (zeros): the reference gathers it for padding. Every other unused
    # slot is NaN, so reading anything outside a request's context poisons the output.
    num_blocks = int(blocks_per_req.sum()) + 5
    ids = rng.permutation(np.arange(1, num_blocks))
    table = np.full((num_reqs, max_blocks), 10**6, dtype=np.int32)  # garbage past each request's blocks
    used = 0
    for r in range(num_reqs):
        table[r, :blocks_per_req[r]] = ids[used:used + blocks_per_req[r]]
        used += blocks_per_req[r]
    key_cache = torch.full((num_blocks, bs, hkv, d), float("nan"))
    value_cache = torch.full((num_blocks, bs, hkv, d), float("nan"))
    key_cache[0] = 0.0
    value_cache[0] = 0.0
    for r in range(num_reqs):
        slots = torch.from_numpy(torch_paged.context_slots(table[r], int(seq_lens[r]), bs))
        key_cache.view(-1, hkv, d)[slots] = torch.randn(len(slots), hkv, d, generator=gen)
        value_cache.view(-1, hkv, d)[slots] = torch.randn(len(slots), hkv, d, generator=gen)

    cu = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(query_lens, out=cu[1:])
    num_tokens = int(cu[-1])
    slot_mapping = np.concatenate([
        torch_paged.context_slots(table[r], int(seq_lens[r]), bs)[seq_lens[r] - query_lens[r]:]
        for r in range(num_reqs)])
    if case.num_decodes is None:
        num_decodes = 0
        while num_decodes < num_reqs and query_lens[num_decodes] == 1:
            num_decodes += 1
    else:
        num_decodes = case.num_decodes

    q = torch.randn(num_tokens, case.num_heads, d, generator=gen)
    dtype = DTYPES[case.dtype]
    if case.strided:
        qkv = torch.randn(num_tokens, (case.num_heads + 2 * hkv) * d, generator=gen)
        qkv[:, :case.num_heads * d] = q.reshape(num_tokens, -1)
        q = qkv.to(device=device, dtype=dtype)[:, :case.num_heads * d].view(num_tokens, case.num_heads, d)
    else:
        q = q.to(device=device, dtype=dtype)

    seq_lens32 = seq_lens.astype(np.int32)
    meta = AttentionMetadata(
        num_reqs=num_reqs, num_decodes=num_decodes, num_tokens=num_tokens,
        max_query_len=int(query_lens.max()), max_seq_len=int(seq_lens.max()), block_size=bs,
        query_start_loc=torch.from_numpy(cu.astype(np.int32)).to(device),
        seq_lens=torch.from_numpy(seq_lens32).to(device),
        block_tables=torch.from_numpy(table).to(device),
        slot_mapping=torch.from_numpy(slot_mapping).to(device),
        query_start_loc_np=cu, seq_lens_np=seq_lens32, block_tables_np=table,
    )
    return Step(meta, q, key_cache.to(device=device, dtype=dtype), value_cache.to(device=device, dtype=dtype),
                scale=d ** -0.5)


def cpu_meta(meta: AttentionMetadata) -> AttentionMetadata:
    return AttentionMetadata(
        num_reqs=meta.num_reqs, num_decodes=meta.num_decodes, num_tokens=meta.num_tokens,
        max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len, block_size=meta.block_size,
        query_start_loc=meta.query_start_loc.cpu(), seq_lens=meta.seq_lens.cpu(),
        block_tables=meta.block_tables.cpu(), slot_mapping=meta.slot_mapping.cpu(),
        query_start_loc_np=meta.query_start_loc_np, seq_lens_np=meta.seq_lens_np,
        block_tables_np=meta.block_tables_np,
    )


def reference(step: Step) -> torch.Tensor:
    """fp32 torch reference on the kernel's own (possibly rounded) inputs."""
    return torch_paged.paged_attention(step.query.float().cpu(), step.key_cache.float().cpu(),
                                       step.value_cache.float().cpu(), cpu_meta(step.meta), step.scale)


def naive(step: Step) -> torch.Tensor:
    return torch_paged.naive_paged_attention(
        step.query.float().cpu(), step.key_cache.float().cpu(), step.value_cache.float().cpu(),
        step.meta.query_start_loc_np.tolist(), step.meta.seq_lens_np.tolist(),
        torch.from_numpy(step.meta.block_tables_np), step.scale)


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max abs difference; inf when either side has a NaN/inf the other lacks."""
    a, b = a.float().cpu(), b.float().cpu()
    if not torch.isfinite(a).all() or not torch.isfinite(b).all():
        return float("inf")
    return float((a - b).abs().max()) if a.numel() else 0.0


# -- the checks -----------------------------------------------------------------------------------


def check_attention(case: AttentionCase, device: str) -> dict:
    from pdserve.engine.attention import triton_paged

    step = build_step(case, device)
    if case.strided:
        buffer = torch.full((step.meta.num_tokens + 3, case.num_heads, case.head_dim), -7.0, dtype=step.query.dtype,
                            device=device)
        out = triton_paged.paged_attention(step.query, step.key_cache, step.value_cache, step.meta, step.scale,
                                           out=buffer[2:2 + step.meta.num_tokens], num_segments=case.num_segments)
        untouched = bool((buffer[:2] == -7.0).all() and (buffer[2 + step.meta.num_tokens:] == -7.0).all())
        if not untouched or out.data_ptr() != buffer[2].data_ptr():
            return {"ok": False, "message": "out= was not written in place, or rows outside it changed"}
    else:
        out = triton_paged.paged_attention(step.query, step.key_cache, step.value_cache, step.meta, step.scale,
                                           num_segments=case.num_segments)
    if out.dtype != step.query.dtype or out.shape != step.query.shape:
        return {"ok": False, "message": f"out is {out.dtype} {tuple(out.shape)}, query {step.query.dtype}"}
    tol = TOLERANCE[case.dtype]
    result = {"dtype": case.dtype, "tol": tol, "err_vs_reference": max_err(out, reference(step))}
    errs = [result["err_vs_reference"]]
    if case.dtype == "float32" and not case.large:
        result["err_vs_naive"] = max_err(out, naive(step))
        errs.append(result["err_vs_naive"])
    result["ok"] = max(errs) <= tol
    if not result["ok"]:
        result["message"] = f"max abs error {max(errs):.3g} > {tol:g} ({case})"
    if BENCH and device == "cuda":
        result.update(bench_attention(step, case))
    return result


def bench_attention(step: Step, case: AttentionCase, iters: int = 50) -> dict:
    """Milliseconds per call of the Triton kernel and of the torch path on the same GPU inputs."""
    from pdserve.engine.attention import triton_paged

    def triton_call() -> None:
        triton_paged.paged_attention(step.query, step.key_cache, step.value_cache, step.meta, step.scale,
                                     num_segments=case.num_segments)

    torch_meta = cpu_meta(step.meta)
    for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
        setattr(torch_meta, name, getattr(step.meta, name))
    torch_meta.backend_plan = torch_paged.plan(torch_meta)

    def torch_call() -> None:
        torch_paged.paged_attention(step.query, step.key_cache, step.value_cache, torch_meta, step.scale)

    times = {}
    for name, fn in (("triton_ms", triton_call), ("torch_ms", torch_call)):
        for _ in range(3):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        times[name] = round(start.elapsed_time(end) / iters, 4)
    return times


def check_write_kv(case: WriteKVCase, device: str) -> dict:
    from pdserve.engine.attention import triton_paged

    gen = torch.Generator().manual_seed(case.seed)
    dtype = DTYPES[case.dtype]
    hkv, d = case.num_kv_heads, case.head_dim
    total = case.num_tokens + case.padding_tokens
    slots = torch.randperm(case.num_blocks * case.block_size, generator=gen)[:total]
    slots[case.num_tokens:] = -1
    order = torch.randperm(total, generator=gen)
    slots = slots[order]
    if case.strided:
        qkv = torch.randn(total, (2 + 2) * hkv * d, generator=gen).to(device=device, dtype=dtype)
        key = qkv[:, 2 * hkv * d:3 * hkv * d].view(total, hkv, d)
        value = qkv[:, 3 * hkv * d:].view(total, hkv, d)
    else:
        key = torch.randn(total, hkv, d, generator=gen).to(device=device, dtype=dtype)
        value = torch.randn(total, hkv, d, generator=gen).to(device=device, dtype=dtype)
    shape = (case.num_blocks, case.block_size, hkv, d)
    caches = [torch.full(shape, float("nan"), dtype=dtype, device=device) for _ in range(4)]
    triton_paged.write_kv(key, value, caches[0], caches[1], slots.to(device))
    real = slots >= 0
    torch_paged.write_kv(key[real.to(device)], value[real.to(device)], caches[2], caches[3], slots[real].to(device))
    same = all(torch.equal(a.nan_to_num(123.0), b.nan_to_num(123.0)) for a, b in zip(caches[:2], caches[2:]))
    result = {"ok": same, "dtype": case.dtype}
    if not same:
        result["message"] = f"cache after write_kv differs from torch_paged.write_kv ({case})"
    return result


def check_plan_sharing(device: str) -> dict:
    from pdserve.engine.attention import triton_paged

    case = AttentionCase("plan", ((1, 20), (9, 7)))
    step = build_step(case, device)
    first = triton_paged.paged_attention(step.query, step.key_cache, step.value_cache, step.meta, step.scale)
    p = step.meta.backend_plan
    if not isinstance(p, triton_paged.TritonAttentionPlan):
        return {"ok": False, "message": f"plan not stored in meta.backend_plan (found {type(p).__name__})"}
    again = triton_paged.paged_attention(step.query, step.key_cache, step.value_cache, step.meta, step.scale)
    if step.meta.backend_plan is not p or not torch.equal(first, again):
        return {"ok": False, "message": "second layer did not reuse the plan, or gave a different result"}
    foreign = object()
    step.meta.backend_plan = foreign
    third = triton_paged.paged_attention(step.query, step.key_cache, step.value_cache, step.meta, step.scale)
    if step.meta.backend_plan is not foreign:
        return {"ok": False, "message": "another backend's plan was overwritten"}
    if not torch.equal(first, third):
        return {"ok": False, "message": "result changed when planning without storing"}
    return {"ok": True}


def check_segment_heuristic(device: str) -> dict:
    from pdserve.engine.attention.triton_paged import decode_segments

    expectations = [
        ((1, 8, 8000, 132), 16),  # one long decode on an H100: split as far as allowed
        ((1, 8, 1000, 132), 2),  # short context: at least MIN_KEYS_PER_SEGMENT keys each
        ((64, 8, 8000, 132), 1),  # grid already fills the GPU
        ((4, 8, 8000, 132), 8),
        ((3, 8, 100, 132), 1),
        ((0, 8, 0, 132), 1),
    ]
    wrong = [(args, want, decode_segments(*args)) for args, want in expectations if decode_segments(*args) != want]
    return {"ok": not wrong, **({"message": f"(args, expected, got): {wrong}"} if wrong else {})}


# H100/H200 allow 227 KiB of shared memory per block (opt-in maximum).
SM90_MAX_SHARED = 227 * 1024
TRITON_TYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
INDEX_POINTERS = {"block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32",
                  "tile_map_ptr": "*i32", "slot_mapping_ptr": "*i64"}


def compile_sm90(fn, constexprs: dict, dtype: str, num_warps: int, num_stages: int):
    """Compile a @triton.jit kernel for sm_90 as the JIT would: torch's allocations are 16-byte
    aligned and the strides passed here multiples of 16, which the JIT specialises on."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        if name.endswith("_ptr"):
            elem = INDEX_POINTERS.get(name, "*fp32" if name.startswith("part_") else "*" + TRITON_TYPES[dtype])
            signature[name] = elem
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name == "scale_log2":
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            # The block table's row stride is its width, which varies; the rest are head_dim multiples.
            if name.startswith("stride_") and name != "stride_bt":
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def resource_usage(kernel) -> dict:
    """Registers and spill stack of a compiled kernel, from the cuobjdump bundled with Triton."""
    import shutil
    import subprocess
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        tool = shutil.which("cuobjdump") or ""
    if not tool or "cubin" not in kernel.asm:
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    usage = {}
    for key, field in (("registers", "REG:"), ("spill_stack_bytes", "STACK:")):
        if field in text:
            usage[key] = int(text.split(field)[1].split()[0])
    return usage


def check_compile(case: CompileCase) -> dict:
    from pdserve.engine.attention import triton_paged

    dtype = DTYPES[case.dtype]
    if case.kernel in ("decode", "prefill"):
        consts, cfg = triton_paged.kernel_constexprs(case.num_heads, case.num_kv_heads, case.head_dim,
                                                     case.block_size, dtype, decode=case.kernel == "decode",
                                                     num_segments=case.num_segments)
        kernel = compile_sm90(triton_paged._paged_attention_kernel, consts, case.dtype, cfg.num_warps, cfg.num_stages)
        result = {"config": f"BLOCK_M={cfg.block_m} TILE_N={cfg.tile_n} warps={cfg.num_warps} "
                            f"stages={cfg.num_stages}"}
    elif case.kernel == "merge":
        consts = dict(NUM_SEGMENTS=case.num_segments, HEAD_DIM=case.head_dim, HEAD_DIM_P=case.head_dim)
        kernel = compile_sm90(triton_paged._merge_segments_kernel, consts, case.dtype, 4, 1)
        result = {}
    else:
        consts = dict(BLOCK_SIZE=case.block_size, HEADS_P=case.num_kv_heads, HEAD_DIM=case.head_dim,
                      HEAD_DIM_P=case.head_dim)
        kernel = compile_sm90(triton_paged._write_kv_kernel, consts, case.dtype, triton_paged.WRITE_KV_NUM_WARPS, 1)
        result = {}
    shared = kernel.metadata.shared
    result.update(resource_usage(kernel), shared_bytes=shared, ok=shared <= SM90_MAX_SHARED)
    if not result["ok"]:
        result["message"] = f"needs {shared} bytes of shared memory, more than sm_90's {SM90_MAX_SHARED}"
    return result


def run_compile(only: set[str] | None) -> list[dict]:
    results = []
    for case in COMPILE_CASES:
        if only and case.name not in only:
            continue
        try:
            result = check_compile(case)
        except Exception:
            result = {"ok": False, "message": traceback.format_exc()}
        result["name"] = case.name
        results.append(result)
        info = " ".join(f"{k}={v}" for k, v in result.items() if k not in ("ok", "name", "message"))
        print(f"{'ok  ' if result['ok'] else 'FAIL'} {case.name} {info} {result.get('message', '')}", flush=True)
    return results


BENCH = False  # set by --bench


def run(device: str, large: bool, only: set[str] | None) -> list[dict]:
    checks = []
    for case in ATTENTION_CASES:
        checks.append((case.name, case.large, lambda c=case: check_attention(c, device)))
    for wcase in WRITE_KV_CASES:
        checks.append((wcase.name, wcase.large, lambda c=wcase: check_write_kv(c, device)))
    checks.append(("plan_is_shared_not_clobbered", False, lambda: check_plan_sharing(device)))
    checks.append(("decode_segment_heuristic", False, lambda: check_segment_heuristic(device)))
    results = []
    for name, is_large, fn in checks:
        if (is_large and not large) or (only and name not in only):
            continue
        try:
            result = fn()
        except Exception:
            result = {"ok": False, "message": traceback.format_exc()}
        result["name"] = name
        results.append(result)
        errs = " ".join(f"{k}={v:.2e}" for k, v in result.items() if k.startswith("err_"))
        errs += "".join(f" {k}={result[k]}" for k in ("triton_ms", "torch_ms") if k in result)
        print(f"{'ok  ' if result['ok'] else 'FAIL'} {name} {errs} {result.get('message', '')}", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="cpu runs the kernels in the Triton interpreter")
    parser.add_argument("--compile", action="store_true", help="compile for sm_90 instead of running (no GPU)")
    parser.add_argument("--large", action="store_true", help="also run serving-sized cases (GPU)")
    parser.add_argument("--bench", action="store_true", help="with --device cuda: also time the kernel vs torch")
    parser.add_argument("--only", nargs="*", help="case names to run")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    only = set(args.only) if args.only else None
    global BENCH
    BENCH = args.bench
    if args.compile:
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") == "1":
            raise SystemExit("triton was imported in interpreter mode; --compile needs the real compiler")
        os.environ.pop("TRITON_INTERPRET", None)
        results = run_compile(only)
    elif args.device == "cpu":
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("triton was imported before TRITON_INTERPRET=1 could be set")
        os.environ["TRITON_INTERPRET"] = "1"
        results = run(args.device, args.large, only)
    else:
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda needs a GPU")
        results = run(args.device, args.large, only)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    failed = [r["name"] for r in results if not r["ok"]]
    print(f"{len(results) - len(failed)}/{len(results)} cases passed" + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
