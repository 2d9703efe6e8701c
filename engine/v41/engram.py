"""Engram n-gram hashing of DeepSeek-V4.1 and each sequence's hash history.

A token id maps to a compressed id (tokens that normalise alike share one). The n-gram ending at
position t (n = 2..max_ngram_size) hashes as h_n(t) = XOR_{j<n} c[t−j]·mult[layer][j] (int64,
no overflow by construction); head k of that size reads table row h_n(t) mod p + offset, where
the primes p are handed out in order from engram_vocab_size and never reused, and the offsets
are the running sums of a layer's primes. Before the sequence start the look-back reads the pad
token's compressed id.

Image spans (DeepSeek-V4.1 vision) are DEAD for Engram: their positions are recorded as `DEAD`
instead of a compressed id, and an n-gram's look-back stops at the first DEAD position (that
slot and every older one read the pad id), so no n-gram spans an image. A DEAD position's own
hashes are all pad (the layer's gate is shut there anyway, `Engram.mix`).

`EngramHistory` is the per-sequence state: compressed ids by absolute position in a ring of
look-back + slack slots. Writes are by position, so chunked prefill, recompute after
preemption and speculative rollback (recomputing from a lower position) all leave it right.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

TOKEN_MAP_FILE = "engram_token_map.json"


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    d = 2
    while d * d <= n:
        if n % d == 0:
            return False
        d += 1
    return True


def engram_primes(num_layers: int, max_ngram: int, n_heads: int, vocab_size: int) -> list[list[int]]:
    """[engram layer][(n − 2)·heads + k]: per (layer, n-gram size) the search restarts just above
    vocab_size − 1 and takes the next primes not used yet."""
    used: set[int] = set()
    out = []
    for _ in range(num_layers):
        row = []
        for _ in range(max_ngram - 1):
            candidate = vocab_size - 1
            for _ in range(n_heads):
                candidate += 1
                while candidate in used or not _is_prime(candidate):
                    candidate += 1
                used.add(candidate)
                row.append(candidate)
        out.append(row)
    return out


def table_rows(num_layers: int, max_ngram: int, n_heads: int, vocab_size: int) -> list[int]:
    """Rows of each engram layer's table: the sum of its primes."""
    return [sum(row) for row in engram_primes(num_layers, max_ngram, n_heads, vocab_size)]


def multipliers(layer_ids: tuple[int, ...], max_ngram: int, compressed_vocab: int) -> torch.Tensor:
    """int64 [n_engram_layers, max_ngram]: odd draws of numpy's PCG64 seeded 10007·layer, below
    int64_max / compressed_vocab so that id · multiplier cannot overflow."""
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab) // 2)
    rows = [np.random.default_rng(10007 * layer).integers(0, bound, size=max_ngram, dtype=np.int64)
            for layer in layer_ids]
    return torch.from_numpy(np.stack(rows) * 2 + 1)


def load_token_map(model_dir: Path) -> tuple[list[int], int] | None:
    path = Path(model_dir) / TOKEN_MAP_FILE
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    return [int(i) for i in data["token_map"]], int(data["compressed_vocab_size"])


def build_token_map(tokenizer_json: Path) -> tuple[list[int], int]:
    """The compressed map from a tokenizer.json: decode each id alone; key = NFKC, NFD, strip
    accents, lowercase, whitespace runs → one space, strip (a lone space stays a space); a decode
    holding U+FFFD (a partial UTF-8 byte token) is keyed by its raw token string. Distinct keys
    are numbered in id order."""
    from tokenizers import Regex, Tokenizer, normalizers

    lone_space = "\ue000"  # private-use stand-in that Strip() leaves alone
    norm = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), lone_space),
        normalizers.Strip(), normalizers.Replace(lone_space, " "),
    ])
    tok = Tokenizer.from_file(str(tokenizer_json))
    keys: dict[str, int] = {}
    out = []
    for token_id in range(tok.get_vocab_size(with_added_tokens=True)):
        text = tok.decode([token_id], skip_special_tokens=False)
        key = tok.id_to_token(token_id) if "\ufffd" in text else (norm.normalize_str(text) or text)
        out.append(keys.setdefault(key, len(keys)))
    return out, len(keys)


def write_token_map(model_dir: Path, token_map: list[int], size: int) -> None:
    (Path(model_dir) / TOKEN_MAP_FILE).write_text(json.dumps({"compressed_vocab_size": size,
                                                              "token_map": token_map}) + "\n")


class EngramHasher:
    """Hash ids of a chunk from its look-back and its own compressed ids."""

    DEAD = -1  # an image-span position in the history

    def __init__(self, cfg, token_map: list[int]):
        v = cfg.v41
        self.n_max, self.n_heads = v.engram_max_ngram_size, v.engram_n_heads
        primes = engram_primes(len(v.engram_layer_ids), self.n_max, self.n_heads, v.engram_vocab_size)
        self.primes = torch.tensor(primes, dtype=torch.int64)  # [L, cols]
        self.offsets = torch.cumsum(self.primes, dim=1) - self.primes
        self.mult = multipliers(v.engram_layer_ids, self.n_max, v.engram_compressed_vocab_size)  # [L, n_max]
        self.token_map = torch.tensor(token_map, dtype=torch.int64)
        self.pad = int(self.token_map[v.engram_pad_id])

    @property
    def lookback(self) -> int:
        return self.n_max - 1

    def compress(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.token_map[token_ids]

    def record_ids(self, token_ids: torch.Tensor, dead: torch.Tensor | None = None) -> torch.Tensor:
        """What the history records for these tokens: compressed ids, DEAD where `dead`."""
        ids = self.compress(token_ids)
        return ids if dead is None else torch.where(dead, self.DEAD, ids)

    def hash_ids(self, back: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """back: compressed ids of the `lookback` positions before the chunk (pad before the
        start); ids: the chunk's [T] → int64 [T, n_engram_layers, cols]."""
        hist = torch.cat([back, ids])  # positions start − lookback .. start + T − 1
        t, lb = ids.shape[0], self.lookback
        # column j: the id j places back from each chunk position
        look = torch.stack([hist[lb - j: lb - j + t] for j in range(self.n_max)], dim=-1)  # [T, n_max]
        blocked = (look == self.DEAD).cummax(dim=-1).values  # at or past the nearest DEAD position
        look = torch.where(blocked, self.pad, look)
        prod = look[:, None, :] * self.mult[None]  # [T, L, n_max]
        rolling, cols = prod[..., 0], []
        for n in range(2, self.n_max + 1):
            rolling = rolling ^ prod[..., n - 1]
            cols.append(rolling[..., None].expand(-1, -1, self.n_heads))
        return torch.cat(cols, dim=-1) % self.primes[None] + self.offsets[None]

    def step_ids(self, history: "EngramHistory", start: int, token_ids: torch.Tensor,
                 dead: torch.Tensor | None = None) -> torch.Tensor:
        """Hash ids [T, n_engram_layers, cols] of host token ids [T] at positions start.. of a
        sequence, recording their compressed ids (DEAD where `dead` [T] bool) in its history."""
        ids = self.record_ids(token_ids, dead)
        out = self.hash_ids(history.look_back(start, self.lookback), ids)
        history.write(start, ids)
        return out


class EngramHistory:
    """A sequence's compressed ids by position (slot = position mod capacity)."""

    def __init__(self, capacity: int, pad: int):
        self.capacity, self.pad = capacity, pad
        self.ids = torch.full((capacity,), pad, dtype=torch.int64)

    def look_back(self, start: int, count: int) -> torch.Tensor:
        """Ids of positions [start − count, start); pad before position 0."""
        pos = torch.arange(start - count, start)
        return torch.where(pos >= 0, self.ids[pos.remainder(self.capacity)], self.pad)

    def write(self, start: int, ids: torch.Tensor) -> None:
        keep = min(ids.shape[0], self.capacity)
        pos = torch.arange(start + ids.shape[0] - keep, start + ids.shape[0])
        self.ids[pos.remainder(self.capacity)] = ids[-keep:] if keep else ids[:0]
