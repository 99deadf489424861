"""Where one engine step's time goes, per step kind, from torch's profiler.

The model runner is driven directly with hand-built scheduler outputs (a prefill chunk, decode
batches of chosen sizes at a chosen context), so each step kind is measured alone and repeatably.
Time is attributed by where an op runs, not only by its name: while profiling, the model's
modules and the runner's attention, KV-write and sampling calls are wrapped in labelled ranges
(`pdserve::<category>`), so a kernel added later inside RMSNorm or a Linear is counted where it
belongs whatever it is called. Ops outside any label fall back to their names.

The pure parts (categorize, attribute, shares, step_cost) are what the tests check; the driver
(`profile_step_kinds`) needs a loaded ModelRunner.
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Iterator, Protocol, Sequence

# Categories in report order. "python" is what is left of the step's wall time outside every op:
# the interpreter, numpy work, allocations the profiler does not see as ops.
CATEGORIES = ("matmul", "attention", "kv_write", "norm", "rotary", "act", "embed", "sampler", "other_ops", "python")
LABEL_PREFIX = "pdserve::"

# Module class name -> category. Names, not classes, so this module imports without the engine
# and a subclass added later (a quantized Linear) is found by its base classes' names too.
MODULE_CATEGORIES = {
    "ColumnParallelLinear": "matmul", "RowParallelLinear": "matmul", "RMSNorm": "norm",
    "RotaryEmbedding": "rotary", "VocabParallelEmbedding": "embed",
}

# Unlabelled ops by name. Substrings, checked in order: the first that matches wins.
_OP_PATTERNS: tuple[tuple[str, str], ...] = (
    ("write_kv", "kv_write"),
    ("scaled_dot_product", "attention"), ("decode_attention", "attention"), ("attention", "attention"),
    ("linear", "matmul"), ("addmm", "matmul"), ("aten::mm", "matmul"), ("aten::bmm", "matmul"),
    ("matmul", "matmul"), ("int8pack_mm", "matmul"), ("gemm", "matmul"),
    ("rms_norm", "norm"), ("rotary", "rotary"), ("rotate", "rotary"), ("silu", "act"), ("gelu", "act"),
    ("aten::embedding", "embed"),
)


def categorize(name: str) -> str | None:
    """The category of a profiler event by its name; None when its children should decide."""
    if name.startswith(LABEL_PREFIX):
        label = name[len(LABEL_PREFIX):]
        return label if label in CATEGORIES else None
    for pattern, category in _OP_PATTERNS:
        if pattern in name:
            return category
    return None


class Event(Protocol):
    """What attribute() reads of a profiler FunctionEvent (times in microseconds)."""

    name: str
    cpu_time_total: float
    self_cpu_time_total: float
    cpu_children: list


def attribute(events: Iterable[Event]) -> dict[str, float]:
    """Seconds per category over the top-level events (those with no parent).

    The outermost event with a category takes its whole time, children included, so a Linear's
    reshapes count as matmul and attention's gathers as attention. An event with no category
    keeps only its own time (as other_ops) and hands the rest to its children.
    """
    totals = dict.fromkeys(CATEGORIES, 0.0)

    def visit(ev: Event) -> None:
        category = categorize(ev.name)
        if category is not None:
            totals[category] += ev.cpu_time_total * 1e-6
            return
        totals["other_ops"] += ev.self_cpu_time_total * 1e-6
        for child in ev.cpu_children:
            visit(child)

    for ev in events:
        if getattr(ev, "cpu_parent", None) is None:
            visit(ev)
    return totals


def shares(op_seconds: dict[str, float], wall_s: float) -> dict[str, float]:
    """Fractions of `wall_s` per category; what no op covers is python. Never more than the wall:
    if the ops add up to more (overlapping threads, clock granularity), they are scaled down."""
    ops = {c: max(op_seconds.get(c, 0.0), 0.0) for c in CATEGORIES if c != "python"}
    covered = sum(ops.values())
    if wall_s <= 0:
        raise ValueError("wall time must be positive")
    scale = min(1.0, wall_s / covered) if covered else 1.0
    out = {c: v * scale / wall_s for c, v in ops.items()}
    out["python"] = max(0.0, 1.0 - sum(out.values()))
    return out


# -- roofline -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelDims:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def of(cls, model_config: Any) -> "ModelDims":
        mc = model_config
        return cls(mc.hidden_size, mc.num_hidden_layers, mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim,
                   mc.intermediate_size, mc.vocab_size)

    @property
    def linear_params(self) -> int:
        """Weights every token multiplies with: attention and MLP projections, and the LM head."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        per_layer = self.hidden * (q + 2 * kv) + q * self.hidden + 3 * self.hidden * self.intermediate
        return self.layers * per_layer + self.vocab * self.hidden


def step_cost(dims: ModelDims, elem_bytes: int, query_lens: Sequence[int], seq_lens: Sequence[int],
              sampled_rows: int | None = None) -> tuple[float, float]:
    """(bytes read, FLOPs) of one step: the weights once, each request's KV context once, and
    the matmul and attention arithmetic. The LM head runs only for rows that sample (one per
    request unless `sampled_rows` says otherwise)."""
    tokens = sum(query_lens)
    rows = len(query_lens) if sampled_rows is None else sampled_rows
    kv_width = dims.kv_heads * dims.head_dim
    context = sum(seq_lens)
    bytes_read = dims.linear_params * elem_bytes + context * 2 * dims.layers * kv_width * elem_bytes
    body_params = dims.linear_params - dims.vocab * dims.hidden
    flops = 2.0 * tokens * body_params + 2.0 * rows * dims.vocab * dims.hidden
    # q·k and p·v over the keys each query sees (causal within this step's own tokens).
    attended = sum(q * (s - q) + q * (q + 1) / 2 for q, s in zip(query_lens, seq_lens))
    flops += 4.0 * attended * dims.layers * dims.heads * dims.head_dim
    return float(bytes_read), flops


def roofline_s(bytes_read: float, flops: float, bandwidth: float, flops_rate: float) -> tuple[float, str]:
    """The least time the step could take, and which of memory or compute bounds it."""
    t_mem, t_compute = bytes_read / bandwidth, flops / flops_rate
    return max(t_mem, t_compute), ("memory" if t_mem >= t_compute else "compute")


# -- labelling ----------------------------------------------------------------------------------

def labelled(fn: Callable, category: str) -> Callable:
    """`fn` run inside a profiler range named for `category`."""
    from torch.autograd.profiler import record_function

    name = LABEL_PREFIX + category

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with record_function(name):
            return fn(*args, **kwargs)
    wrapper.only_labels = True  # changes nothing it wraps: decode_call may look through it
    return wrapper


def module_category(module: Any) -> str | None:
    for klass in type(module).__mro__:
        if klass.__name__ in MODULE_CATEGORIES:
            return MODULE_CATEGORIES[klass.__name__]
    return None


@contextlib.contextmanager
def labels(runner: Any) -> Iterator[None]:
    """Label the runner's model modules, attention backend and sampler for the profiler; undone after."""
    from torch.autograd.profiler import record_function

    handles = []
    for module in runner.model.modules():
        category = module_category(module)
        if category is None:
            continue
        ranges: list[Any] = []

        def enter(mod, args, name=LABEL_PREFIX + category, ranges=ranges):
            r = record_function(name)
            r.__enter__()
            ranges.append(r)

        def leave(mod, args, output, ranges=ranges):
            ranges.pop().__exit__(None, None, None)

        handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    backend, sampler = runner.backend, runner.sample_fn
    runner.backend = type(backend)(backend.plan, labelled(backend.attend, "attention"),
                                   labelled(backend.write_kv, "kv_write"))
    runner.sample_fn = labelled(sampler, "sampler")
    try:
        yield
    finally:
        runner.backend, runner.sample_fn = backend, sampler
        for h in handles:
            h.remove()


# -- driving the runner ---------------------------------------------------------------------------

@dataclass
class StepKind:
    """A step to measure: `batch` requests with `query_len` new tokens each over `context` earlier
    ones (query_len 1 is a decode batch; context 0 a fresh prompt)."""

    name: str
    batch: int
    query_len: int
    context: int


@dataclass
class StepProfile:
    kind: StepKind
    ms_per_step: float  # unprofiled, the fastest of the timed steps (the least disturbed)
    shares: dict[str, float]  # fraction of the fastest profiled step per category
    prepare_ms: float  # the runner's own timing of building the batch (part of python)
    sample_ms: float  # sampling and recording, as the runner times it
    bytes_read: float
    flops: float
    samples: list[float] = field(default_factory=list)
    # The machine's read rate (bytes/s) measured next to these steps, where profile_step_kind had a way to
    # measure it: a shared VM's bandwidth moves from minute to minute (a 2-core Zen 5 guest read 39-82
    # GB/s within an hour), so a roofline from a rate measured minutes earlier says little of a step.
    read_rate: float | None = None


class _Driver:
    """Feeds a ModelRunner scheduler outputs for fake requests, with block ids of its own.

    The runner never checks block ids against a pool: any distinct ids below the cache's block
    count are a valid layout. The KV contents are whatever the cache holds, which changes no
    timing.
    """

    def __init__(self, runner: Any, num_blocks: int) -> None:
        self.runner = runner
        # The whole cache mapped first, as an idle server has it (engine/worker/kv_memory.py): a
        # step's first write to a fresh page would time the page fault.
        warmer = getattr(runner, "kv_warmer", None)
        if warmer is not None:
            warmer.run(float("inf"))
        self.block_size = runner.block_size
        self.num_blocks = num_blocks
        self.next_block = 0
        self.serial = 0

    def blocks(self, tokens: int) -> list[int]:
        n = -(-tokens // self.block_size)
        if self.next_block + n > self.num_blocks:
            self.next_block = 0  # reuse: the requests that held them are finished
        ids = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return ids

    def start(self, kind: StepKind, vocab: int, max_steps: int):
        from pdserve.engine.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
        from pdserve.engine.sampling_params import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_steps + 1, ignore_eos=True)
        news, sched = [], {}
        for _ in range(kind.batch):
            self.serial += 1
            req_id = f"profile-{self.serial}"
            tokens = [(7 * self.serial + 13 * i) % (vocab - 3) + 3 for i in range(kind.context + kind.query_len)]
            news.append(NewRequestData(req_id, tokens, len(tokens), params,
                                       self.blocks(kind.context + kind.query_len + max_steps), kind.context))
            sched[req_id] = kind.query_len
        return SchedulerOutput(news, CachedRequestData(), sched, sum(sched.values()), set())

    def follow(self, previous) -> Any:
        """The next decode step of the same requests (each one token further)."""
        from pdserve.engine.core.sched_output import CachedRequestData, SchedulerOutput

        ids = list(previous.num_scheduled_tokens)
        computed = [self.runner.requests[r].num_computed_tokens for r in ids]
        cached = CachedRequestData(ids, [[] for _ in ids], computed)
        return SchedulerOutput([], cached, dict.fromkeys(ids, 1), len(ids), set())

    def finish(self, so) -> None:
        from pdserve.engine.core.sched_output import SchedulerOutput

        self.runner.execute_model(SchedulerOutput.empty(set(so.num_scheduled_tokens)))


def _steps_of(driver: _Driver, kind: StepKind, vocab: int, count: int) -> Iterator[Any]:
    """Scheduler outputs of `count` steps of `kind`: decodes continue the same batch; prefills
    start fresh requests each time (and finish the previous ones)."""
    if kind.query_len == 1:
        so = driver.start(kind, vocab, count)
        for _ in range(count):
            yield so
            so = driver.follow(so)
        driver.finish(so)
    else:
        for _ in range(count):
            so = driver.start(kind, vocab, 1)
            yield so
            driver.finish(so)


def profile_step_kind(runner: Any, kind: StepKind, num_blocks: int, repeats: int = 5, profiled: int = 2,
                      read_rate: Callable[[], float] | None = None) -> StepProfile:
    """Times `repeats` steps of `kind` (after an untimed one) and profiles `profiled` more. With `read_rate`,
    the machine's read rate is measured right before and right after the timed steps, and the higher kept."""
    import os

    # Kineto prints two lines to stderr per profiled step in this torch ("USDT: ... profiler_start")
    # at its default level: a benchmark's report drowned in them. Read when its logger first starts.
    os.environ.setdefault("KINETO_LOG_LEVEL", "99")
    import torch
    from torch.profiler import ProfilerActivity, profile

    vocab = runner.vocab_size
    driver = _Driver(runner, num_blocks)
    # One untimed step first: a new request's state set-up, first-touch allocations.
    walls, prepare, sample = [], [], []
    rates = [read_rate()] if read_rate is not None else []
    for i, so in enumerate(_steps_of(driver, kind, vocab, repeats + 1)):
        began = time.perf_counter()
        out = runner.execute_model(so)
        if i:
            walls.append(time.perf_counter() - began)
            if out.timing is not None:
                prepare.append(out.timing.prepare_s)
                sample.append(out.timing.sample_s)
    if read_rate is not None:
        rates.append(read_rate())
    # On a shared machine a step can lose the CPU part way through: of the profiled steps keep
    # the fastest, whose shares are the least distorted by waiting.
    best_shares, best_wall = None, float("inf")
    with labels(runner):
        steps = _steps_of(driver, kind, vocab, profiled + 1)
        runner.execute_model(next(steps))
        for so in steps:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                began = time.perf_counter()
                runner.execute_model(so)
                wall = time.perf_counter() - began
            if wall < best_wall:
                best_wall, best_shares = wall, shares(attribute(prof.events()), wall)
    last_query = [kind.query_len] * kind.batch
    seq_lens = [kind.context + kind.query_len + (repeats // 2 if kind.query_len == 1 else 0)] * kind.batch
    elem = torch.empty((), dtype=runner.config.model.dtype).element_size()
    bytes_read, flops = step_cost(ModelDims.of(runner.config.model), elem, last_query, seq_lens)
    return StepProfile(kind, 1e3 * min(walls), best_shares, 1e3 * min(prepare), 1e3 * min(sample),
                       bytes_read, flops, walls, max(rates) if rates else None)


def fastest_round(rounds: Sequence[StepProfile]) -> StepProfile:
    """One kind's profile from several rounds: the round with the fastest step (its shares with it), the
    highest read rate of any round (the roofline then asks the most of the step), every round's samples."""
    if not rounds:
        raise ValueError("no rounds to merge")
    best = min(rounds, key=lambda p: p.ms_per_step)
    rates = [p.read_rate for p in rounds if p.read_rate is not None]
    samples = [s for p in rounds for s in p.samples]
    return replace(best, samples=samples, read_rate=max(rates) if rates else None)


def profile_step_kinds(runner: Any, kinds: Sequence[StepKind], num_blocks: int, repeats: int = 5,
                       profiled: int = 2, read_rate: Callable[[], float] | None = None,
                       rounds: int = 1) -> list[StepProfile]:
    """Each kind profiled `rounds` times, the kinds interleaved, merged by fastest_round. A shared VM
    runs the same step at two speeds for a minute or so at a time (on a 2-core Zen 3 guest the same
    build's decode batch of 16 took 27-30 ms in some minutes and 40-51 ms in others, every step of a
    run alike): steps timed back to back all land in one of them, rounds spread over a few minutes
    find the machine's faster one more often."""
    per_kind: list[list[StepProfile]] = [[] for _ in kinds]
    for _ in range(max(1, rounds)):
        for i, k in enumerate(kinds):
            per_kind[i].append(profile_step_kind(runner, k, num_blocks, repeats, profiled, read_rate))
    return [fastest_round(r) for r in per_kind]


DEFAULT_KINDS = (StepKind("prefill 512", 1, 512, 0), StepKind("decode b1", 1, 1, 256),
                 StepKind("decode b16", 16, 1, 256), StepKind("decode b64", 64, 1, 256))


def report_rows(profiles: Sequence[StepProfile], bandwidth: float | None = None, *, flops_rate: float,
                **extra: Any) -> list[dict]:
    """One table row per step kind: ms per step, % per category, roofline time and fraction. The read rate
    is the one measured next to the kind's steps where there is one, else `bandwidth`."""
    rows = []
    for p in profiles:
        rate = p.read_rate if p.read_rate is not None else bandwidth
        if rate is None:
            raise ValueError(f"{p.kind.name}: no read rate was measured with its steps and none was given")
        floor_s, bound = roofline_s(p.bytes_read, p.flops, rate, flops_rate)
        row: dict[str, Any] = {**extra, "step": p.kind.name, "tokens": p.kind.batch * p.kind.query_len,
                               "ms_per_step": p.ms_per_step}
        row.update({f"{c}_pct": 100 * p.shares[c] for c in CATEGORIES})
        row.update({"prepare_ms": p.prepare_ms, "sample_ms": p.sample_ms, "read_GB_s": rate / 1e9,
                    "matmul_GFLOP_s": flops_rate / 1e9, "bound": bound,
                    "roofline_ms": 1e3 * floor_s, "roofline_fraction": 1e3 * floor_s / p.ms_per_step})
        rows.append(row)
    return rows
