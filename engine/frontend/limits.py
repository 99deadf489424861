"""Caps on what one client may ask of a served engine, in one place.

Each cap keeps a single request (or a burst of them) from taking the engine's memory or time
from everyone else. Violations raise before anything is queued: `LimitError` (a ValueError,
answered with 400) names the field; `EngineOverloadedError` (answered with 503 and Retry-After)
tells the client, or a router in front, to come back or go elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.sampling_params import SamplingParams

DEFAULT_MAX_N = 16
DEFAULT_MAX_STOP_STRINGS = 16
DEFAULT_MAX_STOP_STRING_CHARS = 1024
# Four batches of the default --max-num-seqs (256): enough to keep the engine busy through a
# burst, small enough that a queued request still starts within seconds to minutes.
DEFAULT_MAX_WAITING_REQUESTS = 1024
RETRY_AFTER_S = 1


class LimitError(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class EngineOverloadedError(RuntimeError):
    def __init__(self, message: str, retry_after_s: int = RETRY_AFTER_S) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class RequestLimits:
    max_n: int = DEFAULT_MAX_N
    max_stop_strings: int = DEFAULT_MAX_STOP_STRINGS
    max_stop_string_chars: int = DEFAULT_MAX_STOP_STRING_CHARS
    max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS

    def __post_init__(self) -> None:
        for name in ("max_n", "max_stop_strings", "max_stop_string_chars", "max_waiting_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")

    def check_sampling(self, params: SamplingParams) -> None:
        if params.n > self.max_n:
            raise LimitError("n", f"n must be at most {self.max_n}, got {params.n}")
        stop = params.stop or []
        if len(stop) > self.max_stop_strings:
            raise LimitError("stop", f"stop may list at most {self.max_stop_strings} strings, got {len(stop)}")
        longest = max((len(s) for s in stop), default=0)
        if longest > self.max_stop_string_chars:
            raise LimitError("stop", f"each stop string must be at most {self.max_stop_string_chars} characters, "
                                     f"got one of {longest}")

    def check_waiting(self, num_waiting: int) -> None:
        if num_waiting >= self.max_waiting_requests:
            raise EngineOverloadedError(f"The engine has {num_waiting} requests waiting (the limit is "
                                        f"{self.max_waiting_requests}); retry later or on another replica.")
