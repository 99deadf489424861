"""pdserve's LLM engine (vLLM V1 design): scheduler, paged KV cache, model runner, frontends."""

from pdserve.engine.outputs import CompletionOutput, Logprob, RequestOutput
from pdserve.engine.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM", "EngineArgs", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "RequestOutputKind"]


def __getattr__(name: str):
    # LLM and EngineArgs pull in torch; import them only when asked for, so the coordinator and
    # router can use the engine's wire types without loading torch.
    if name == "LLM":
        from pdserve.engine.frontend.llm import LLM

        return LLM
    if name == "EngineArgs":
        from pdserve.engine.config import EngineArgs

        return EngineArgs
    raise AttributeError(name)
