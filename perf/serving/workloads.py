"""The fixed-length workload (InferenceX / `vllm bench serve --dataset-name random` style).

Input and output lengths are drawn uniformly from [L·(1 − r), L·(1 + r)] (vLLM's symmetric
`--random-range-ratio`, r in [0, 1)); r = 0 gives exactly L. Prompts are random token ids
turned into text by the server (/tokenize + /detokenize) when it has those endpoints, else
random words at the calibrated tokens-per-word ratio. The input length counts the prompt text
(tag included); the chat template adds its few tokens on top, as in InferenceX. Lengths are deterministic for a seed; the
text depends on the server's tokenizer. Each prompt starts with a short unique tag so no two
prompts (and no two runs) share a cacheable prefix.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np

from perf.serving import textgen
from perf.serving.records import RequestSpec


@dataclass(frozen=True, slots=True)
class FixedParams:
    """Sizes of the fixed workload."""

    input_len: int = 128
    output_len: int = 32
    range_ratio: float = 0.0
    num_prompts: int = 64
    seed: int = 0


def sample_lengths(p: FixedParams, n: int, stream: int = 0) -> list[tuple[int, int]]:
    """`n` (input, output) length pairs; `stream` separates e.g. warm-ups from measured prompts."""
    if not 0.0 <= p.range_ratio < 1.0:
        raise ValueError("range ratio must be in [0, 1)")
    rng = np.random.default_rng([p.seed, stream, 7])

    def draw(length: int) -> np.ndarray:
        lo = max(1, int(length * (1 - p.range_ratio)))
        hi = max(lo, int(length * (1 + p.range_ratio)))
        return rng.integers(lo, hi + 1, size=n)

    ins, outs = draw(p.input_len), draw(p.output_len)
    return [(int(a), int(b)) for a, b in zip(ins, outs)]


async def build_fixed(p: FixedParams, n: int, nonce: str, tokenize: textgen.TokenizeFn,
                      detokenize: textgen.DetokenizeFn, tokens_per_word: float, stream: int = 0,
                      parallel: int = 16) -> list[RequestSpec]:
    """`n` fixed-workload requests (see the module docstring)."""
    lengths = sample_lengths(p, n, stream)
    pool = await textgen.token_id_pool(tokenize, p.seed)
    tag_ids = await tokenize(f"[{nonce}-{stream}-{n}] ") if pool else None
    tag_len = len(tag_ids) if tag_ids else 0
    sem = asyncio.Semaphore(parallel)

    async def one(i: int, in_len: int, out_len: int) -> RequestSpec:
        rng = np.random.default_rng([p.seed, stream, i])
        tag = f"[{nonce}-{stream}-{i}]"
        text = None
        if pool:
            async with sem:
                text = await textgen.random_token_text(rng, max(1, in_len - tag_len), pool, tokenize, detokenize)
        if text is None:
            text = textgen.random_words(rng, max(1, round(in_len / tokens_per_word)))
        return RequestSpec(prompt=f"{tag} {text}", max_tokens=out_len, input_length=in_len)

    return list(await asyncio.gather(*(one(i, a, b) for i, (a, b) in enumerate(lengths))))
