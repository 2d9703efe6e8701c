"""Prompt text of a given token length, with no client-side tokenizer.

Two sources: (1) random token ids turned into text by the server's /detokenize and trimmed with
/tokenize (used by the fixed workload when the server has both endpoints); (2) random English
words at a calibrated tokens-per-word ratio (one /tokenize call on a sample when available,
else `DEFAULT_TOKENS_PER_WORD`). Block text for a hash id is a pure function of (seed, hash
id), so equal hash ids give equal text and the server's prefix cache can reuse it; blocks join
at spaces, so for whitespace-pretokenized BPE their token counts add up.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

import numpy as np

DEFAULT_TOKENS_PER_WORD = 1.3

WORDS = tuple(dict.fromkeys("""
the of and to in is was for on that with as by at from his it an were are which this be has
had or not but also have its one two new first after their who into time more all other been
when there can would over may only most used made such these they some during year state
between under city world about work through where many then called both while than known
water system house north south east west part people group team school each life since later
before around number high three national long back against same name game based well under
film music river line book history early area family season series could large found small
within following left right often local several power order place public along point form
government station road near still early general million below great main center last took
second court church island union field design report light level early energy market model
value change story study sound party land hand water table paper model river forest stone
metal glass garden window door letter signal memory source engine vector matrix kernel
token cache block queue router worker server client stream batch tensor layer weight
""".split()))

DEFAULT_WORDS_SAMPLE = 2000

TokenizeFn = Callable[[str], Awaitable[list[int] | None]]
DetokenizeFn = Callable[[list[int]], Awaitable[str | None]]


def random_words(rng: np.random.Generator, n: int) -> str:
    """`n` random words joined by single spaces."""
    idx = rng.integers(0, len(WORDS), size=max(0, n))
    return " ".join(WORDS[i] for i in idx)


class BlockText:
    """Deterministic text for hash-identified token blocks (see the module docstring)."""

    def __init__(self, seed: int, block_size: int, tokens_per_word: float = DEFAULT_TOKENS_PER_WORD) -> None:
        self.seed = seed
        self.block_size = block_size
        self.tokens_per_word = tokens_per_word
        self._cache: dict[tuple[int, int], str] = {}

    def words_for(self, tokens: int) -> int:
        """Words that make about `tokens` tokens (at least one)."""
        return max(1, round(tokens / self.tokens_per_word))

    def block(self, hash_id: int, tokens: int) -> str:
        """Text of about `tokens` tokens for block `hash_id` (cached)."""
        key = (hash_id, tokens)
        text = self._cache.get(key)
        if text is None:
            rng = np.random.default_rng([self.seed, hash_id & 0xFFFFFFFFFFFF, tokens])
            text = random_words(rng, self.words_for(tokens))
            self._cache[key] = text
        return text

    def span(self, hash_ids: Sequence[int], start: int, end: int) -> str:
        """Text of about `end - start` tokens standing for prompt positions [start, end) of a prompt
        whose blocks are `hash_ids`: each block's share is a pure function of (hash id, offset,
        length), so equal blocks cut at equal places give equal text. Positions past the last
        id take ids derived from it and the block index."""
        parts = []
        pos = start
        while pos < end:
            j = pos // self.block_size
            stop = min(end, (j + 1) * self.block_size)
            h = hash_ids[j] if j < len(hash_ids) else ((hash_ids[-1] if hash_ids else 0) ^ (j << 24) ^ (1 << 47))
            rng = np.random.default_rng([self.seed, h & 0xFFFFFFFFFFFF, pos - j * self.block_size, stop - pos])
            parts.append(random_words(rng, self.words_for(stop - pos)))
            pos = stop
        return " ".join(parts)

    def prompt(self, marker: str, hash_ids: Sequence[int], input_length: int) -> str:
        """`marker` then the text of `input_length` tokens covered by `hash_ids` in order."""
        parts = [marker] if marker else []
        remaining = input_length
        for h in hash_ids:
            if remaining <= 0:
                break
            take = min(self.block_size, remaining)
            parts.append(self.block(h, take))
            remaining -= take
        return " ".join(parts)


async def calibrate_tokens_per_word(tokenize: TokenizeFn, seed: int = 0) -> float | None:
    """Tokens per word of `WORDS` text under the server's tokenizer, or None."""
    rng = np.random.default_rng(seed)
    sample = random_words(rng, DEFAULT_WORDS_SAMPLE)
    ids = await tokenize(sample)
    if not ids:
        return None
    return len(ids) / DEFAULT_WORDS_SAMPLE


async def token_id_pool(tokenize: TokenizeFn, seed: int = 0) -> list[int] | None:
    """Distinct ordinary (non-special) token ids, learned by tokenizing a word sample."""
    rng = np.random.default_rng(seed + 1)
    ids = await tokenize(random_words(rng, DEFAULT_WORDS_SAMPLE))
    return sorted(set(ids)) if ids else None


async def random_token_text(rng: np.random.Generator, length: int, pool: Sequence[int],
                            tokenize: TokenizeFn, detokenize: DetokenizeFn, rounds: int = 3) -> str | None:
    """Text whose re-tokenization has about `length` tokens, made from random ids of `pool`.

    Detokenized random ids re-tokenize to a different count (BPE merges), so the ids are
    re-tokenized, then topped up with fresh random ids or truncated, up to `rounds` times.
    """
    ids = [int(pool[i]) for i in rng.integers(0, len(pool), size=length)]
    text: str | None = None
    for _ in range(rounds):
        text = await detokenize(ids)
        if text is None:
            return None
        got = await tokenize(text)
        if got is None:
            return text
        if len(got) == length:
            return text
        if len(got) > length:
            ids = got[:length]
        else:
            ids = got + [int(pool[i]) for i in rng.integers(0, len(pool), size=length - len(got))]
    return await detokenize(ids) or text
