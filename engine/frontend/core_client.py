"""How a frontend talks to its EngineCore. `InprocClient` calls it directly in this process;
the multi-process clients (same interface) live in mp_client.py."""

from __future__ import annotations

import abc
from typing import Any

from pdserve.engine.config import EngineConfig
from pdserve.engine.protocol import EngineCoreOutputs, EngineCoreRequest


class EngineCoreClient(abc.ABC):
    @abc.abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abc.abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abc.abstractmethod
    def get_output(self) -> EngineCoreOutputs:
        """The next batch of outputs (runs a step in-process; waits for one otherwise)."""

    @abc.abstractmethod
    def call_utility(self, method: str, *args: Any) -> Any: ...

    @abc.abstractmethod
    def shutdown(self) -> None: ...


class InprocClient(EngineCoreClient):
    def __init__(self, config: EngineConfig) -> None:
        from pdserve.engine.core.engine_core import EngineCore

        self.engine_core = EngineCore(config)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.engine_core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        outputs, _ = self.engine_core.step()
        return outputs

    def call_utility(self, method: str, *args: Any) -> Any:
        return getattr(self.engine_core, method)(*args)

    def shutdown(self) -> None:
        self.engine_core.shutdown()
