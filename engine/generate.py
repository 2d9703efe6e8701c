"""Offline generation over a batch of prompts: chunked prefill, then batched incremental decode.

Every step is one `DeepseekV4.forward` over the unpadded concatenation of all active
sequences' new tokens. This is the simple driver of the first milestone; the continuous-batching
scheduler reuses the same forward and state contract.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .attention import SeqSlice
from .kv_cache import KVCache
from .model import DeepseekV4
from .sampling import SamplingParams, sample_token, token_logprobs
from .seq_state import SequenceState


@dataclass
class Generation:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class _Active:
    index: int
    params: SamplingParams
    state: SequenceState
    pending: list[int]  # tokens known but not yet run through the model
    generator: torch.Generator | None


def _prefill_order(actives: list[_Active], budget: int) -> list[tuple[_Active, int]]:
    """Greedy token-budget packing: each sequence contributes up to the remaining budget."""
    chosen = []
    for a in actives:
        if budget <= 0:
            break
        take = min(len(a.pending), budget)
        if take:
            chosen.append((a, take))
            budget -= take
    return chosen


@torch.inference_mode()
def generate(model: DeepseekV4, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
             eos_token_ids: tuple[int, ...] = (), max_batched_tokens: int = 2048,
             cache: KVCache | None = None) -> list[Generation]:
    """Generate for every prompt; results in input order. Stops at EOS (kept in token_ids,
    as transformers does), a stop token, or max_tokens.

    With `cache`, every sequence lives in its shared paged pools (blocks are freed as each
    finishes); without, each gets a private dense state."""
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    if len(params_list) != len(prompts):
        raise ValueError("one SamplingParams per prompt")
    results = [Generation(list(p)) for p in prompts]
    actives = []
    for i, (prompt, p) in enumerate(zip(prompts, params_list)):
        if not prompt:
            raise ValueError(f"prompt {i} is empty")
        gen = torch.Generator().manual_seed(p.seed) if p.seed is not None else None
        state = cache.new_sequence() if cache is not None else model.new_state()
        actives.append(_Active(i, p, state, list(prompt), gen))
    try:
        _run(model, actives, results, eos_token_ids, max_batched_tokens, cache)
    finally:
        if cache is not None:
            for a in actives:
                cache.free(a.state)
    return results


def _run(model, actives, results, eos_token_ids, max_batched_tokens, cache) -> None:
    while actives:
        chosen = _prefill_order(actives, max_batched_tokens)
        token_ids, positions, seqs, begin = [], [], [], 0
        for a, take in chosen:
            start = a.state.num_tokens
            if cache is not None and not cache.allocate(a.state, start, start + take):
                raise RuntimeError("KV cache exhausted: give it more blocks or run fewer prompts at once")
            token_ids.extend(a.pending[:take])
            positions.extend(range(start, start + take))
            seqs.append(SeqSlice(a.state, start, begin, take))
            begin += take
        streams = model(torch.tensor(token_ids, device=model.device), torch.tensor(positions, device=model.device), seqs)
        finished_rows = [(a, s.end - 1) for (a, take), s in zip(chosen, seqs) if take == len(a.pending)]
        for a, take in chosen:
            del a.pending[:take]
        if finished_rows:
            logits = model.logits(streams[[row for _, row in finished_rows]])
            for (a, _), row_logits in zip(finished_rows, logits):
                _append_token(a, row_logits, results[a.index], eos_token_ids)
        for a in actives:
            if cache is not None and results[a.index].finish_reason is not None:
                cache.free(a.state)
        actives = [a for a in actives if results[a.index].finish_reason is None]


def _append_token(a: _Active, logits: torch.Tensor, out: Generation, eos_token_ids: tuple[int, ...]) -> None:
    p = a.params
    if not torch.isfinite(logits).all():
        out.finish_reason = "error"
        return
    token = sample_token(logits, p, a.generator)
    out.token_ids.append(token)
    if p.logprobs is not None:
        lp, top = token_logprobs(logits, token, p.logprobs)
        out.logprobs.append(lp)
        out.top_logprobs.append(top)
    if (token in eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
        out.finish_reason = "stop"
    elif len(out.token_ids) >= p.max_tokens:
        out.finish_reason = "length"
    else:
        a.pending.append(token)
