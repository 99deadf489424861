"""Synthetic workloads: random prompts of chosen token lengths, output budgets, arrival times.

Everything is drawn from numpy generators derived from the seed, one independent stream per
quantity, so the lengths and arrivals for a seed stay the same whether or not a tokenizer is used,
and the warm-up requests never shift the measured ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from pdserve.bench.loadgen import LoadConfig

# Short, common English words: each is one token (with its leading space) in the usual BPE
# vocabularies, so without a tokenizer "N words" is a fair stand-in for "N tokens".
WORDS: tuple[str, ...] = tuple(dict.fromkeys("""
the of and to in is was for on that with as by at from his he it an were are which this be or
has had but not first one their its new after who they have her she two been other when there all
during into school time may years more most only over city some world would where later up such
used many can state about national out known university united then made age so part under game
him team year three most people well like house them first than film long also high war because
world town work back same while between small south north east west could both each city life
name great group area place water light day night year line side home hand left right point open
""".split()))

ROUND_TRIPS = 8
TOP_UP_MARGIN = 8


@dataclass(frozen=True)
class WorkloadItem:
    index: int
    prompt: str
    # Token count of `prompt` under the tokenizer (no special tokens), or the asked-for length when
    # there is no tokenizer and the words only approximate it.
    prompt_len: int
    max_tokens: int
    # Seconds after the start of the run at which the request is due.
    arrival: float
    prompt_token_ids: tuple[int, ...] | None = None


def parse_range(text: str) -> tuple[int, int]:
    """'32:512' -> (32, 512); '64' -> (64, 64)."""
    lo_text, sep, hi_text = text.partition(":")
    try:
        lo = int(lo_text)
        hi = int(hi_text) if sep else lo
    except ValueError:
        raise ValueError(f"expected MIN:MAX or N, got {text!r}") from None
    check_range(lo, hi, text)
    return lo, hi


def check_range(lo: int, hi: int, what: str) -> None:
    if lo < 1 or hi < lo:
        raise ValueError(f"length range {what}: need 1 <= MIN <= MAX, got {lo}:{hi}")


def poisson_arrivals(n: int, request_rate: float, rng: np.random.Generator) -> list[float]:
    """Arrival offsets of a Poisson process: the first request at 0, then exponential gaps of mean
    1/rate. An infinite rate sends everything at once."""
    if n <= 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * n
    if not request_rate > 0:
        raise ValueError(f"request rate must be > 0 (or inf), got {request_rate}")
    gaps = rng.exponential(1.0 / request_rate, size=n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def build_workload(config: LoadConfig, tokenizer: Any = None) -> list[WorkloadItem]:
    """The measured requests of `config`; deterministic for its seed. `tokenizer` (a Hugging Face
    tokenizer) overrides `config.tokenizer`, which is loaded when given as a path."""
    tokenizer = tokenizer if tokenizer is not None else _load_configured(config)
    return _build(config, tokenizer, config.num_requests, purpose=0, paced=True)


def build_warmup(config: LoadConfig, tokenizer: Any = None) -> list[WorkloadItem]:
    """`config.warmup` requests like the measured ones but drawn from their own stream, all due at 0."""
    tokenizer = tokenizer if tokenizer is not None else _load_configured(config)
    return _build(config, tokenizer, config.warmup, purpose=1, paced=False)


def load_tokenizer(name_or_path: str) -> Any:
    # transformers takes seconds to import; only pay for it when a tokenizer is asked for.
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name_or_path)


def _load_configured(config: LoadConfig) -> Any:
    return load_tokenizer(config.tokenizer) if config.tokenizer else None


def _build(config: LoadConfig, tokenizer: Any, n: int, *, purpose: int, paced: bool) -> list[WorkloadItem]:
    if n < 0:
        raise ValueError(f"request count must be >= 0, got {n}")
    check_range(*config.input_len, "input_len")
    check_range(*config.output_len, "output_len")
    streams = np.random.SeedSequence([config.seed, purpose]).spawn(4)
    in_rng, out_rng, arrival_rng, text_rng = (np.random.default_rng(s) for s in streams)
    input_lens = in_rng.integers(config.input_len[0], config.input_len[1] + 1, size=n).tolist()
    output_lens = out_rng.integers(config.output_len[0], config.output_len[1] + 1, size=n).tolist()
    arrivals = poisson_arrivals(n, config.request_rate, arrival_rng) if paced else [0.0] * n
    vocab = _Vocabulary(tokenizer) if tokenizer is not None else None
    items = []
    for i in range(n):
        if tokenizer is None:
            prompt, ids = _word_prompt(input_lens[i], text_rng), None
            prompt_len = input_lens[i]
        else:
            prompt, token_ids = _token_prompt(tokenizer, input_lens[i], text_rng, vocab)
            ids, prompt_len = tuple(token_ids), len(token_ids)
        items.append(WorkloadItem(index=i, prompt=prompt, prompt_len=prompt_len, max_tokens=output_lens[i],
                                  arrival=arrivals[i], prompt_token_ids=ids))
    return items


def _word_prompt(length: int, rng: np.random.Generator) -> str:
    return " ".join(WORDS[j] for j in rng.integers(0, len(WORDS), size=length))


class _Vocabulary:
    """Token ids to draw prompts from: no special tokens (they decode to markers like "</s>" that
    servers treat specially), and no tokens that decode to invalid text on their own (stray UTF-8
    bytes), whose replacement characters re-encode to more tokens and keep lengths from settling.
    Each id is checked the first time it is drawn, since decoding a whole 150k vocabulary up front
    would cost more than the prompts."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self.ids = np.array([i for i in range(tokenizer.vocab_size) if i not in special], dtype=np.int64)
        if not len(self.ids):
            raise ValueError("the tokenizer has no ordinary tokens to build prompts from")
        self.pieces: dict[int, str | None] = {}

    def piece(self, token_id: int) -> str | None:
        """The text of one token, or None when it is unusable on its own."""
        if token_id not in self.pieces:
            text = self.tokenizer.decode([token_id])
            self.pieces[token_id] = text if text and "\ufffd" not in text else None
        return self.pieces[token_id]

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        out: list[int] = []
        for _ in range(64):
            if len(out) >= n:
                break
            out.extend(t for t in rng.choice(self.ids, size=2 * (n - len(out)) + 4).tolist() if self.piece(t))
        if len(out) < n:
            raise ValueError("the tokenizer has too few tokens that decode to text on their own")
        return out[:n]


def _token_prompt(tokenizer: Any, length: int, rng: np.random.Generator,
                  vocab: _Vocabulary) -> tuple[str, list[int]]:
    """Text that encodes to exactly `length` tokens (no special tokens added).

    Random ids are decoded and re-encoded; re-encoding merges or splits pieces, so the count is
    trimmed or topped up with fresh ids and the round trip repeated, which settles in a round or
    two for most tokenizers. When it keeps oscillating, `_top_up` finishes the job one token at a
    time from a slightly shorter prefix."""
    ids = vocab.sample(rng, length)
    encoded: list[int] = []
    for _ in range(ROUND_TRIPS):
        text = tokenizer.decode(ids)
        encoded = list(tokenizer.encode(text, add_special_tokens=False))
        if len(encoded) == length:
            return text, encoded
        if len(encoded) > length:
            ids = encoded[:length]
        else:
            ids = encoded + vocab.sample(rng, length - len(encoded))
    return _top_up(tokenizer, length, rng, vocab, encoded)


def _top_up(tokenizer: Any, length: int, rng: np.random.Generator, vocab: _Vocabulary,
            start: list[int]) -> tuple[str, list[int]]:
    def count(t: str) -> int:
        return len(tokenizer.encode(t, add_special_tokens=False))

    keep = min(len(start), length)
    while True:
        keep = max(0, keep - TOP_UP_MARGIN)
        text = tokenizer.decode(start[:keep]) if keep else ""
        n = count(text)
        if n < length or keep == 0:
            break
    # Appending one token's text adds one token to the count nearly always; when it merges with
    # the end (adds none) or splits (adds two past the goal), another piece is tried instead.
    for _ in range(4 * (length - n) + 64):
        if n == length:
            break
        piece = vocab.piece(vocab.sample(rng, 1)[0])
        candidate = text + (piece or "")
        m = count(candidate)
        if n < m <= length:
            text, n = candidate, m
    return text, list(tokenizer.encode(text, add_special_tokens=False))
