"""Engram n-gram hashing of DeepSeek-V4.1 (REF `inference/engram.py` semantics).

A token id first maps to a compressed id (tokens that normalise alike share one). The n-gram
ending at position t (n = 2..max_ngram_size) hashes as
    h_n(t) = XOR_{j < n} ( c[t - j] · mult[layer][j] )   (int64, no overflow by construction)
and head k of that n-gram size looks up row  h_n(t) mod p[layer][n][k] + offset[layer][n][k]
of the layer's table, where the primes p are handed out in order and never reused, and the
offsets are the running sums of the layer's primes (each (n, k) owns a disjoint row range).
Look-back stops at the sequence start: c[t - j] for t - j < 0 (and everything further back)
is the compressed id of the pad token.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from .release_checkpoint import V41Config


def is_prime(n: int) -> bool:
    if n < 2:
        return False
    d = 2
    while d * d <= n:
        if n % d == 0:
            return False
        d += 1
    return True


def engram_primes(cfg: V41Config) -> list[list[list[int]]]:
    """[engram layer][n-gram size - 2][head] moduli: for each (layer, n-gram size) the search
    restarts just above engram_vocab_size - 1 and takes the next primes not yet used."""
    used: set[int] = set()
    layers = []
    for _ in cfg.engram_layer_ids:
        per_ngram = []
        for _ in range(cfg.engram_max_ngram_size - 1):
            heads, candidate = [], cfg.engram_vocab_size - 1
            for _ in range(cfg.engram_n_heads):
                candidate += 1
                while not is_prime(candidate) or candidate in used:
                    candidate += 1
                used.add(candidate)
                heads.append(candidate)
            per_ngram.append(heads)
        layers.append(per_ngram)
    return layers


def hash_multipliers(layer_ids: tuple[int, ...], max_ngram_size: int, compressed_vocab: int) -> torch.Tensor:
    """int64 [n_engram_layers, max_ngram_size]: odd values from numpy's PCG64 seeded 10007·layer,
    below int64_max / compressed_vocab so that id · multiplier never overflows."""
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab) // 2)
    rows = [np.random.default_rng(10007 * layer).integers(0, bound, size=max_ngram_size, dtype=np.int64)
            for layer in layer_ids]
    return torch.from_numpy(np.stack(rows) * 2 + 1)


def load_token_map(path: Path) -> tuple[list[int], int]:
    """REF's compressed-vocab map as shipped next to a checkpoint (`engram_token_map.json`)."""
    data = json.loads(Path(path).read_text())
    return list(data["token_map"]), int(data["compressed_vocab_size"])


def build_token_map(tokenizer_path: Path) -> tuple[list[int], int]:
    """Rebuild the map from `tokenizer.json`: decode each id alone, normalise (NFKC, NFD, strip
    accents, lowercase, whitespace runs → one space, strip; a token that is exactly one space
    stays one space), and number the distinct keys in id order. A decode containing U+FFFD (a
    partial UTF-8 byte token) is keyed by its raw token string instead."""
    from tokenizers import Regex, Tokenizer, normalizers

    keep_space = "\ue000"  # private use: shields a lone space from Strip()
    normalizer = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), keep_space),
        normalizers.Strip(), normalizers.Replace(keep_space, " "),
    ])
    tok = Tokenizer.from_file(str(tokenizer_path))
    ids: dict[str, int] = {}
    token_map = []
    for token_id in range(tok.get_vocab_size(with_added_tokens=True)):
        text = tok.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tok.id_to_token(token_id)
        else:
            key = normalizer.normalize_str(text) or text
        token_map.append(ids.setdefault(key, len(ids)))
    return token_map, len(ids)


class EngramHasher:
    """Stateless: hash ids of positions [start, end) given the compressed-id history [0, end).

    multipliers: int64 [L, max_ngram_size]; primes: int64 [L, (max_ngram_size - 1)·n_heads]
    (n-gram size major, head minor); pad: the compressed id standing in before the start."""

    def __init__(self, multipliers: torch.Tensor, primes: torch.Tensor, n_heads: int, pad: int,
                 token_map: list[int]):
        self.multipliers, self.primes, self.n_heads, self.pad = multipliers, primes, n_heads, pad
        self.offsets = torch.cumsum(primes, dim=1) - primes  # exclusive running sum per layer
        self.token_map = torch.tensor(token_map, dtype=torch.int64)

    @classmethod
    def for_config(cls, cfg: V41Config, token_map: list[int]) -> "EngramHasher":
        primes = torch.tensor([[p for heads in layer for p in heads] for layer in engram_primes(cfg)])
        multipliers = hash_multipliers(cfg.engram_layer_ids, cfg.engram_max_ngram_size,
                                       cfg.engram_compressed_vocab_size)
        return cls(multipliers, primes, cfg.engram_n_heads, token_map[cfg.engram_pad_id], token_map)

    def compress(self, token_ids: list[int]) -> list[int]:
        return self.token_map[torch.tensor(token_ids, dtype=torch.int64)].tolist()

    def hash_ids(self, history: list[int], start: int, end: int) -> torch.Tensor:
        """int64 [end - start, n_engram_layers, n_hash_cols] (columns: n-gram size major, head minor)."""
        n_max = self.multipliers.shape[1]
        hist = torch.tensor(history[:end], dtype=torch.int64)
        pos = torch.arange(start, end)
        # look-back ids [T, n_max]: column j is the token j places back, pad before the start
        back = torch.stack([torch.where(pos - j >= 0, hist[(pos - j).clamp_min(0)], self.pad)
                            for j in range(n_max)], dim=-1)
        products = back[:, None, :] * self.multipliers[None]  # [T, L, n_max]
        rolling, cols = products[..., 0], []
        for n in range(2, n_max + 1):  # after XOR-ing look-back n-1, rolling hashes the n-gram
            rolling = rolling ^ products[..., n - 1]
            cols.append(rolling[..., None].expand(-1, -1, self.n_heads))
        hashed = torch.cat(cols, dim=-1)  # [T, L, cols]
        return hashed % self.primes[None] + self.offsets[None]
