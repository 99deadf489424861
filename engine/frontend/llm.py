"""The offline entry point: `LLM(model).generate(prompts, sampling_params)`."""

from __future__ import annotations

import itertools
from typing import Any, Sequence

from pdserve.engine.config import EngineArgs
from pdserve.engine.frontend.input_processor import PromptType
from pdserve.engine.frontend.llm_engine import LLMEngine
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    """Generate text offline. `model` is a Hugging Face directory or "demo".

    Engine arguments are those of `EngineArgs` (block_size, num_kv_blocks, max_num_seqs,
    max_num_batched_tokens, enable_prefix_caching, max_model_len, dtype, device, ...).
    `multiprocess=True` runs the EngineCore in a background process.
    """

    def __init__(self, model: str, *, multiprocess: bool = False, **engine_args: Any) -> None:
        unknown = set(engine_args) - EngineArgs.field_names()
        if unknown:
            raise TypeError(f"unknown engine arguments: {sorted(unknown)}")
        self.engine = LLMEngine.from_engine_args(EngineArgs(model=model, **engine_args), multiprocess=multiprocess)
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool = False, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = list(sampling_params) if isinstance(sampling_params, Sequence) else [sampling_params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} sampling params for {len(prompts)} prompts")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        ids = [str(next(self._ids)) for _ in prompts]
        added: list[str] = []
        try:
            for i, (request_id, prompt, params) in enumerate(zip(ids, prompts, params_list)):
                params = params.clone(output_kind=RequestOutputKind.FINAL_ONLY)
                self.engine.add_request(request_id, prompt, params, priority=priority[i] if priority else 0)
                added.append(request_id)
        except Exception:
            self.engine.abort_request(added)  # nothing half-submitted stays queued
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             use_tqdm: bool = False, add_generation_prompt: bool = True) -> list[RequestOutput]:
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [{"prompt_token_ids": self.engine.input_processor.apply_chat_template(c, add_generation_prompt)}
                   for c in conversations]  # type: ignore[arg-type]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", unit="req", dynamic_ncols=True)
        try:
            while len(done) < len(ids):
                for output in self.engine.step():
                    if output.finished:
                        done[output.request_id] = output
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return [done[i] for i in ids]

    def stats(self) -> dict[str, Any]:
        return self.engine.get_stats()

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
