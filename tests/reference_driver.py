"""The plain reference driver tests compare the engine against: each request run on its own.

Chunked prefill then token-by-token decode over the model's forward with a private dense
state (or a sequence in a paged cache), nothing shared between requests, no scheduler, no
speculation. Its sampler is deliberately not the engine's: a multinomial draw per token from
the request's own generator, written out plainly, so greedy results check the engine's maths
and sampled results check only distribution-level properties.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.attention_backend import SequenceStep, StepSeq
from engine.kv_cache import KVCache
from engine.v4.model import DeepseekV4
from ipc.messages import SamplingParams


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
    state: object
    num_computed: int  # positions in the state
    pending: list[int]  # tokens known but not yet run through the model
    generator: torch.Generator | None


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from fp32 logits [vocab]: argmax, or temperature / top-k / top-p then multinomial."""
    if params.greedy:
        return int(torch.argmax(logits))
    scaled = logits / params.temperature
    if params.top_k:
        kth = torch.topk(scaled, min(params.top_k, scaled.shape[-1])).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p  # the first token always survives
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


def token_logprobs(logits: torch.Tensor, token: int, top_n: int) -> tuple[float, list[tuple[int, float]]]:
    """(logprob of `token`, top-n (token, logprob) pairs) under the raw distribution."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top: list[tuple[int, float]] = []
    if top_n:
        values, ids = logp.topk(top_n)
        top = list(zip(ids.tolist(), values.tolist()))
    return float(logp[token]), top


@torch.inference_mode()
def generate(model: DeepseekV4, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
             eos_token_ids: tuple[int, ...] = (), max_batched_tokens: int = 2048,
             cache: KVCache | None = None) -> list[Generation]:
    """Generate for every prompt; results in input order. Stops at EOS (kept in token_ids, as
    transformers does), a stop token, or max_tokens. With `cache`, every sequence lives in its
    shared paged pools; without, each gets a private dense state."""
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    assert len(params_list) == len(prompts)
    results = [Generation(list(p)) for p in prompts]
    actives = []
    for i, (prompt, p) in enumerate(zip(prompts, params_list)):
        assert prompt, f"prompt {i} is empty"
        gen = torch.Generator().manual_seed(p.seed) if p.seed is not None else None
        state = cache.new_sequence() if cache is not None else model.new_state()
        actives.append(_Active(i, p, state, 0, list(prompt), gen))
    try:
        while actives:
            _step(model, actives, results, eos_token_ids, max_batched_tokens, cache)
            actives = [a for a in actives if results[a.index].finish_reason is None]
    finally:
        if cache is not None:
            for a in actives:
                cache.free(a.state)
    return results


def _step(model, actives, results, eos_token_ids, max_batched_tokens, cache) -> None:
    """Every active sequence contributes up to the remaining token budget, in order."""
    chosen, budget = [], max_batched_tokens
    for a in actives:
        take = min(len(a.pending), budget)
        if take:
            chosen.append((a, take))
            budget -= take
    rows = []
    for a, take in chosen:
        if cache is not None and not cache.allocate(a.state, a.num_computed, a.num_computed + take):
            raise RuntimeError("KV cache exhausted: give it more blocks or run fewer prompts at once")
        rows.append(StepSeq(a.state, a.num_computed, a.pending[:take]))
    step = SequenceStep(rows, model.device)
    streams = model(step.token_ids, step.positions, step)
    done = [(a, s.end - 1) for (a, take), s in zip(chosen, step.seqs) if take == len(a.pending)]
    for a, take in chosen:
        del a.pending[:take]
        a.num_computed += take
    if done:
        logits = model.logits(streams[[row for _, row in done]])
        for (a, _), row_logits in zip(done, logits):
            _append_token(a, row_logits, results[a.index], eos_token_ids)
    for a, _ in chosen:
        if cache is not None and results[a.index].finish_reason is not None:
            cache.free(a.state)


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
