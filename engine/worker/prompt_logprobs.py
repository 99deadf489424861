"""Prompt logprobs: for prompt position p >= 1, log P(token p | tokens before p), its rank, the top-k.

The hidden state at position p - 1 predicts token p, so every scheduled prompt position of a chunk
contributes, not only the last one; a chunk's last position predicts the next chunk's first token,
which the runner holds (it keeps the whole prompt). Logits cover the whole vocabulary, so a long
chunk's would be large (2k positions x 128k vocabulary is 1 GiB in fp32): they are made in slices
of a bounded number of rows, each turned into fp32 log_softmax, reduced to the wanted numbers and
dropped before the next.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from pdserve.engine.protocol import PromptLogprobsLists

# Logits per slice (rows x vocabulary): 64 MiB in fp32, plus as much for the log_softmax.
SLICE_ELEMENTS = 1 << 24


@dataclass
class PromptLogprobsJob:
    """One request's share of a step: hidden rows first_row.. predict prompt positions first_position.."""

    req_id: str
    first_row: int
    first_position: int
    target_ids: list[int]  # the prompt tokens at first_position, first_position + 1, ...
    k: int  # top alternatives wanted besides the prompt's own token


def plan_job(req_id: str, token_ids: list[int], num_prompt_tokens: int, start: int, num_scheduled: int,
             first_row: int, k: int) -> PromptLogprobsJob | None:
    """The job for a request whose positions start.. start + num_scheduled - 1 run this step, or
    None when none of them predicts a prompt token (the last prompt position predicts the output)."""
    end = min(start + num_scheduled, num_prompt_tokens - 1)
    if end <= start:
        return None
    return PromptLogprobsJob(req_id, first_row, start + 1, token_ids[start + 1:end + 1], k)


def compute_prompt_logprobs(hidden: torch.Tensor, jobs: list[PromptLogprobsJob],
                            compute_logits: Callable[[torch.Tensor], torch.Tensor], vocab_size: int,
                            driver: bool = True) -> dict[str, PromptLogprobsLists]:
    """Every job's prompt logprobs. With tensor parallelism every rank must call this (making logits
    gathers the vocabulary shards across ranks); only the driver's (`driver`) result is used, so the
    others skip the reductions and return nothing."""
    device = hidden.device
    rows = torch.cat([torch.arange(j.first_row, j.first_row + len(j.target_ids), device=device) for j in jobs])
    targets = torch.tensor([t for j in jobs for t in j.target_ids], dtype=torch.long, device=device)
    max_k = max(j.k for j in jobs)
    per_slice = max(1, SLICE_ELEMENTS // max(vocab_size, 1))
    ids_parts: list[torch.Tensor] = []
    lp_parts: list[torch.Tensor] = []
    rank_parts: list[torch.Tensor] = []
    for begin in range(0, rows.numel(), per_slice):
        logits = compute_logits(hidden[rows[begin:begin + per_slice]])
        if not driver:
            continue
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        del logits
        target = targets[begin:begin + per_slice].unsqueeze(1)
        chosen = logprobs.gather(1, target)
        rank_parts.append((logprobs > chosen).sum(dim=-1) + 1)
        if max_k > 0:
            top_lp, top_ids = logprobs.topk(max_k, dim=-1)
            ids_parts.append(torch.cat([target, top_ids], dim=1))
            lp_parts.append(torch.cat([chosen, top_lp], dim=1))
        else:
            ids_parts.append(target)
            lp_parts.append(chosen)
    if not driver:
        return {}
    all_ids = torch.cat(ids_parts).tolist()
    all_lps = torch.cat(lp_parts).tolist()
    all_ranks = torch.cat(rank_parts).tolist()
    results: dict[str, PromptLogprobsLists] = {}
    at = 0
    for job in jobs:
        n, width = len(job.target_ids), job.k + 1
        results[job.req_id] = PromptLogprobsLists(
            job.first_position,
            [row[:width] for row in all_ids[at:at + n]],
            [row[:width] for row in all_lps[at:at + n]],
            all_ranks[at:at + n],
        )
        at += n
    return results
