"""Engram hashing: hand-computed n-gram hashes, the prime / row layout, multipliers, token map."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.v41.engram_hash import (EngramHasher, build_token_map, engram_primes, hash_multipliers, is_prime,
                                   load_token_map)
from tests.v41.release_checkpoint import load_config, parse_config


def small_hasher() -> EngramHasher:
    # one engram layer, 2- and 3-grams, one head each: multipliers (3, 5, 7), primes (11, 13),
    # so the 2-gram rows start at 0 and the 3-gram rows at 11; pad id 0; identity token map
    return EngramHasher(torch.tensor([[3, 5, 7]]), torch.tensor([[11, 13]]), n_heads=1, pad=0,
                        token_map=list(range(16)))


def test_hash_ids_hand_computed():
    # history 4, 9, 2 (products id·mult, look-back j uses mult[j]):
    #  t=0: 4·3=12, pad 0, pad 0 → 2-gram 12 % 11 = 1;        3-gram 12 % 13 = 12 → +11 = 23
    #  t=1: 27, 4·5=20, 0      → 27^20 = 15 → 15 % 11 = 4;    15 % 13 = 2 → 13
    #  t=2: 6, 9·5=45, 4·7=28  → 6^45 = 43 → 43 % 11 = 10;    43^28 = 55 → 55 % 13 = 3 → 14
    ids = small_hasher().hash_ids([4, 9, 2], 0, 3)
    assert ids.shape == (3, 1, 2)
    assert ids[:, 0].tolist() == [[1, 23], [4, 13], [10, 14]]


def test_hash_ids_depend_only_on_history():
    h = small_hasher()
    hist = [4, 9, 2, 7, 7, 1]
    full = h.hash_ids(hist, 0, 6)
    assert torch.equal(torch.cat([h.hash_ids(hist, 0, 2), h.hash_ids(hist, 2, 5), h.hash_ids(hist, 5, 6)]), full)
    assert torch.equal(h.hash_ids(hist + [3, 3], 2, 6), full[2:])  # later tokens change nothing


def test_primes_are_handed_out_in_order_and_never_reused():
    layout = SimpleNamespace(engram_layer_ids=(1, 2), engram_max_ngram_size=4, engram_n_heads=2, engram_vocab_size=40)
    # every (n-gram size) restarts its search at 39, but used primes are skipped
    assert engram_primes(layout) == [[[41, 43], [47, 53], [59, 61]], [[67, 71], [73, 79], [83, 89]]]
    assert [is_prime(n) for n in (1, 2, 9, 97, 15999999, 16000057)] == [False, True, False, True, False, True]


def test_multipliers_are_odd_and_cannot_overflow():
    m = hash_multipliers((1, 14), 4, 99092)
    assert m.shape == (2, 4) and m.dtype == torch.int64
    assert bool((m % 2 == 1).all()) and bool((m > 0).all())
    assert int(m.max()) * 99091 < np.iinfo(np.int64).max
    assert torch.equal(m, hash_multipliers((1, 14), 4, 99092))  # seeded by layer id


def test_normalised_token_map(tmp_path):
    from tokenizers import Tokenizer, models

    vocab = {"<s>": 0, "Tok": 1, " tok": 2, "TÖK": 3, "ﬁx": 4, "fix": 5, " ": 6, "\n": 7, "a\ufffd": 8, "b\ufffd": 9}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<s>"))
    tok.save(str(tmp_path / "tokenizer.json"))
    token_map, size = build_token_map(tmp_path / "tokenizer.json")
    # case and accents fold ("Tok", " tok", "TÖK" → "tok"), NFKC folds the ligature, a lone
    # space survives Strip and a newline collapses onto it, U+FFFD tokens keep their raw form
    assert token_map == [0, 1, 1, 1, 2, 2, 3, 3, 4, 5] and size == 6


@pytest.mark.parametrize("name", ["c1", "c2"])
def test_golden_layout_and_token_map(golden_root, name):
    d = golden_root / name
    cfg = load_config(d)
    assert [sum(sum(h) for h in layer) for layer in engram_primes(cfg)] == list(cfg.engram_num_embeddings)
    assert build_token_map(d / "tokenizer.json") == load_token_map(d / "engram_token_map.json")


def test_release_table_rows_follow_from_the_default_vocab(golden_root):
    cfg = parse_config(json.loads((golden_root / "release-config.json").read_text()))
    assert cfg.engram_vocab_size == 16_000_000  # absent from the release text_config
    assert [sum(sum(h) for h in layer) for layer in engram_primes(cfg)] == list(cfg.engram_num_embeddings)
