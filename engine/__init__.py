"""pdserve's LLM engine (vLLM V1 design): scheduler, paged KV cache, model runner, frontends."""

from pdserve.engine.config import EngineArgs
from pdserve.engine.outputs import CompletionOutput, Logprob, RequestOutput
from pdserve.engine.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM", "EngineArgs", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "RequestOutputKind"]


def __getattr__(name: str):
    # LLM pulls in torch and transformers; import it only when asked for.
    if name == "LLM":
        from pdserve.engine.frontend.llm import LLM

        return LLM
    raise AttributeError(name)
