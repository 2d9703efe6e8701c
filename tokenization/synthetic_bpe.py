"""Deterministic synthetic DeepSeek-style byte-level BPE tokenizer for tests and demos.

``write_tokenizer(out_dir, vocab_size)`` writes ``tokenizer.json``,
``tokenizer_config.json`` and ``special_tokens_map.json`` into ``out_dir``.

Invariants:

* The vocabulary has exactly ``vocab_size`` ids, ``0 .. vocab_size - 1``, no holes.
* Ids 0..6 are the special tokens in ``SPECIAL_TOKENS`` order (bos, eos, pad,
  ``<｜User｜>``, ``<｜Assistant｜>``, ``<think>``, ``</think>``); ids 7..262 are
  the 256 single-byte tokens in byte order; every later id is the result of a
  merge, listed in merge-rank order.
* Output is a pure function of ``vocab_size``: the training corpus comes from an
  in-module splitmix64 generator and a fixed word list, the BPE trainer below is
  plain Python with total tie-breaking (count, then the pair's strings), no set or
  hash iteration order is observable, and the JSON is written by ``json.dumps``
  from insertion-ordered dicts with ``"\\n"`` line endings. No network, no clock.
* Vocabularies nest: the merges for a smaller ``vocab_size`` are a prefix of the
  merges for a larger one.
* When the corpus runs out of pairs occurring at least twice, the remaining ids
  are filled with synthetic merges ``token + byte`` enumerated in id order, so
  every id is still reachable by BPE and decodes to real bytes.

The only third-party dependency is ``tokenizers`` (for pre-tokenizing the corpus
with exactly the pre-tokenizer the tokenizer itself uses).
"""

from __future__ import annotations

import functools
import heapq
import json
import logging
import os
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

from tokenizers import Regex, pre_tokenizers

logger = logging.getLogger(__name__)

__all__ = [
    "BOS_TOKEN",
    "EOS_TOKEN",
    "PAD_TOKEN",
    "USER_TOKEN",
    "ASSISTANT_TOKEN",
    "THINK_TOKEN",
    "END_THINK_TOKEN",
    "SPECIAL_TOKENS",
    "CHAT_TEMPLATE",
    "MIN_VOCAB_SIZE",
    "MAX_VOCAB_SIZE",
    "MODEL_MAX_LENGTH",
    "build_pre_tokenizer",
    "write_tokenizer",
]

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
PAD_TOKEN = "<｜▁pad▁｜>"
USER_TOKEN = "<｜User｜>"
ASSISTANT_TOKEN = "<｜Assistant｜>"
THINK_TOKEN = "<think>"
END_THINK_TOKEN = "</think>"

# (content, special). ``special`` tokens are dropped by decode(skip_special_tokens=True);
# the think tags are kept in decoded text so the API layer can split reasoning out.
SPECIAL_TOKENS: tuple[tuple[str, bool], ...] = (
    (BOS_TOKEN, True),
    (EOS_TOKEN, True),
    (PAD_TOKEN, True),
    (USER_TOKEN, True),
    (ASSISTANT_TOKEN, True),
    (THINK_TOKEN, False),
    (END_THINK_TOKEN, False),
)

MIN_VOCAB_SIZE = 512
MAX_VOCAB_SIZE = 131072
MODEL_MAX_LENGTH = 131072

# DeepSeek-V3 style: bos, all system prompts (joined by a blank line), then the
# turns; an assistant turn ends with eos; the generation prompt is the Assistant tag.
# Content may be a string or a list of OpenAI content parts {"type": "text", "text": ...}.
CHAT_TEMPLATE = (
    "{%- macro render_content(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{{- bos_token -}}"
    "{%- set ns = namespace(first=true) -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- if not ns.first -%}{{- '\\n\\n' -}}{%- endif -%}"
    "{{- render_content(message['content']) -}}"
    "{%- set ns.first = false -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}"
    "{{- '" + USER_TOKEN + "' + render_content(message['content']) -}}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- '" + ASSISTANT_TOKEN + "' + render_content(message['content']) + eos_token -}}"
    "{%- elif message['role'] != 'system' -%}"
    "{{- raise_exception('unsupported message role: ' + message['role']) -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '" + ASSISTANT_TOKEN + "' -}}{%- endif -%}"
)

# Pre-tokenization (applied in order, each split keeps all text):
# digits in runs of at most three, CJK/kana/hangul runs, then a GPT-style
# word / punctuation / whitespace split, then the byte-level mapping.
_DIGITS_PATTERN = r"\p{N}{1,3}"
_CJK_PATTERN = r"[\u4e00-\u9fff\u3040-\u30ff\uac00-\ud7af]+"
_WORD_PATTERN = (
    r"'(?i:[sdmt]|ll|ve|re)| ?\p{L}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_CORPUS_SEED = 0x52494E47534552  # "RINGSER"
_CORPUS_DOCUMENTS = 4000
_MIN_PAIR_COUNT = 2
_MASK64 = (1 << 64) - 1

# A fixed, hand-written word list; the corpus is sampled from it.
_WORDS = tuple(
    """
    the of and to in is was for on that with as by at from it be this are or an
    have not which but had they his her were their been has would there one all we
    can more if will when who so no out up about what some into than them only
    time new other could these two may first then do any like my now over such our
    man me even most made after also did many before must through back years where
    much your way well down should because each just those people how too little
    state good very make world still own see men work long get here between both
    life being under never day same another know while last might us great old year
    off come since against go came right used take three small large next early
    young important few public bad able group number part place case week company
    system program question government night point home water room mother area money
    story fact month lot study book eye job word business issue side kind head house
    service friend father power hour game line end member law car city community name
    president team minute idea kid body information school face others level office
    door health person art war history party result change morning reason research
    girl guy moment air teacher force education server request response token model
    engine memory cache kernel thread process queue stream batch layer weight tensor
    matrix vector value index buffer device network client latency throughput prompt
    sequence attention expert router decode prefill schedule sample logits output
    input error message config file path data table record field string integer
    float boolean array list dict object function method class module package import
    return yield async await lambda default global local static const public private
    interface struct union enum template pointer reference iterator generator
    exception handler callback promise future channel socket signal timer clock
    between although however therefore moreover meanwhile instead perhaps quickly
    slowly carefully easily simply clearly really always often sometimes usually
    already almost enough quite rather together without within around across
    beautiful different possible available popular traditional financial similar
    """.split()
)

_CJK_WORDS = ("你好", "世界", "模型", "服务", "分词器", "中文", "东京", "こんにちは", "ありがとう", "안녕하세요")
_EMOJI = ("😀", "🚀", "👍", "🎉", "❤️", "🔥", "🤖", "✨")
_CODE_NAMES = (
    "x", "y", "i", "n", "idx", "buf", "cfg", "req", "resp", "tok", "ids", "out",
    "size", "count", "total", "offset", "limit", "state", "batch", "tokens", "seq_len",
)
_PUNCT_END = (".", ".", ".", "?", "!")


class _SplitMix64:
    """Tiny portable PRNG (splitmix64) so the corpus never depends on ``random``."""

    def __init__(self, seed: int) -> None:
        self._state = seed & _MASK64

    def next(self) -> int:
        self._state = (self._state + 0x9E3779B97F4A7C15) & _MASK64
        z = self._state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        return z ^ (z >> 31)

    def below(self, n: int) -> int:
        return self.next() % n

    def choice(self, items: tuple[str, ...]) -> str:
        return items[self.below(len(items))]


def _sentence(rng: _SplitMix64) -> str:
    words: list[str] = []
    for k in range(3 + rng.below(13)):
        roll = rng.below(100)
        if roll < 4:
            words.append(str(rng.below(10 ** (1 + rng.below(6)))))
        elif roll < 6:
            words.append(f"{1900 + rng.below(200)}")
        elif roll < 7:
            words.append(rng.choice(_CJK_WORDS))
        else:
            word = rng.choice(_WORDS)
            words.append(word.capitalize() if k == 0 else word)
        if k > 1 and rng.below(12) == 0:
            words[-1] += ","
    text = " ".join(words) + rng.choice(_PUNCT_END)
    if rng.below(40) == 0:
        text += " " + rng.choice(_EMOJI)
    return text


def _code(rng: _SplitMix64) -> str:
    a, b, c = rng.choice(_CODE_NAMES), rng.choice(_CODE_NAMES), rng.choice(_WORDS)
    kind = rng.below(4)
    if kind == 0:
        return (
            f"def {c}_{rng.choice(_WORDS)}({a}, {b}):\n"
            f"    if {a} > {rng.below(100)}:\n"
            f"        return {a} + {b}\n"
            f"    return {b} * {rng.below(10)}\n"
        )
    if kind == 1:
        return (
            f"for (int {a} = 0; {a} < {b}; {a}++) {{\n"
            f"    {c}[{a}] = {b} - {rng.below(1000)};\n"
            "}\n"
        )
    if kind == 2:
        return f'{{"{c}": {rng.below(100000)}, "{a}": "{rng.choice(_WORDS)}", "ok": true}}\n'
    return f"self.{a}_{c} = {b}.get('{c}', {rng.below(64)})  # {rng.choice(_WORDS)}\n"


def _digits(rng: _SplitMix64) -> str:
    return (
        f"{2000 + rng.below(30)}-{1 + rng.below(12):02d}-{1 + rng.below(28):02d} "
        f"{rng.below(24):02d}:{rng.below(60):02d} {rng.below(10**9)} "
        f"{rng.below(1000)}.{rng.below(100):02d}%\n"
    )


def _corpus_documents() -> list[str]:
    rng = _SplitMix64(_CORPUS_SEED)
    docs: list[str] = []
    for _ in range(_CORPUS_DOCUMENTS):
        roll = rng.below(10)
        if roll < 6:
            docs.append(" ".join(_sentence(rng) for _ in range(1 + rng.below(5))) + "\n")
        elif roll < 9:
            docs.append(_code(rng))
        else:
            docs.append(_digits(rng))
    return docs


def _pre_tokenizer_json() -> dict[str, Any]:
    def split(pattern: str) -> dict[str, Any]:
        return {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}

    return {
        "type": "Sequence",
        "pretokenizers": [
            split(_DIGITS_PATTERN),
            split(_CJK_PATTERN),
            split(_WORD_PATTERN),
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        ],
    }


def _byte_alphabet() -> list[str]:
    """GPT-2 byte-to-unicode table: printable bytes map to themselves, the rest to U+0100+."""
    printable = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    alphabet: list[str] = []
    shifted = 0
    for b in range(256):
        if b in printable:
            alphabet.append(chr(b))
        else:
            alphabet.append(chr(256 + shifted))
            shifted += 1
    return alphabet


def _word_counts() -> dict[str, int]:
    pre_tok = build_pre_tokenizer()
    counts: dict[str, int] = {}
    for doc in _corpus_documents():
        for piece, _ in pre_tok.pre_tokenize_str(doc):
            counts[piece] = counts.get(piece, 0) + 1
    return counts


def build_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    def split(pattern: str) -> pre_tokenizers.PreTokenizer:
        return pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False)

    return pre_tokenizers.Sequence(
        [
            split(_DIGITS_PATTERN),
            split(_CJK_PATTERN),
            split(_WORD_PATTERN),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _train_merges(word_counts: dict[str, int], min_count: int) -> list[tuple[str, str]]:
    """Classic BPE over a word-frequency table; ties broken by the pair's strings."""
    words = [list(w) for w in word_counts]
    freqs = list(word_counts.values())
    pair_counts: dict[tuple[str, str], int] = defaultdict(int)
    where: dict[tuple[str, str], set[int]] = defaultdict(set)
    for wi, symbols in enumerate(words):
        for pair in zip(symbols, symbols[1:]):
            pair_counts[pair] += freqs[wi]
            where[pair].add(wi)
    heap = [(-count, pair) for pair, count in pair_counts.items()]
    heapq.heapify(heap)
    merges: list[tuple[str, str]] = []
    while heap:
        neg_count, pair = heapq.heappop(heap)
        if pair_counts.get(pair, 0) != -neg_count:
            continue  # stale entry; a fresh one was pushed when the count changed
        if -neg_count < min_count:
            break
        merges.append(pair)
        merged = pair[0] + pair[1]
        touched: dict[tuple[str, str], None] = {}
        for wi in sorted(where.pop(pair)):
            old = words[wi]
            new: list[str] = []
            i = 0
            while i < len(old):
                if i + 1 < len(old) and old[i] == pair[0] and old[i + 1] == pair[1]:
                    new.append(merged)
                    i += 2
                else:
                    new.append(old[i])
                    i += 1
            if len(new) == len(old):
                continue  # stale membership: this word no longer contains the pair
            for p in zip(old, old[1:]):
                pair_counts[p] -= freqs[wi]
                touched[p] = None
            for p in zip(new, new[1:]):
                pair_counts[p] += freqs[wi]
                where[p].add(wi)
                touched[p] = None
            words[wi] = new
        for p in touched:
            count = pair_counts[p]
            if count <= 0:
                del pair_counts[p]
            elif p != pair:
                heapq.heappush(heap, (-count, p))
        pair_counts.pop(pair, None)
    return merges


@functools.lru_cache(maxsize=1)
def _corpus_merges() -> tuple[tuple[str, str], ...]:
    merges = tuple(_train_merges(_word_counts(), _MIN_PAIR_COUNT))
    logger.debug("trained %d corpus merges", len(merges))
    return merges


def _build_vocab(vocab_size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    vocab: dict[str, int] = {}
    for content, _ in SPECIAL_TOKENS:
        vocab[content] = len(vocab)
    alphabet = _byte_alphabet()
    for ch in alphabet:
        vocab[ch] = len(vocab)
    merges: list[tuple[str, str]] = []
    for left, right in _corpus_merges():
        if len(vocab) >= vocab_size:
            break
        vocab[left + right] = len(vocab)
        merges.append((left, right))
    # Synthetic filler: token(i) + byte(b) for i in id order (bytes first), b in byte order.
    tokens = list(vocab)
    i = len(SPECIAL_TOKENS)
    while len(vocab) < vocab_size:
        left = tokens[i]
        for ch in alphabet:
            if len(vocab) >= vocab_size:
                break
            candidate = left + ch
            if candidate not in vocab:
                vocab[candidate] = len(vocab)
                tokens.append(candidate)
                merges.append((left, ch))
        i += 1
    return vocab, merges


def _tokenizer_json(vocab_size: int) -> dict[str, Any]:
    vocab, merges = _build_vocab(vocab_size)
    bos_id = vocab[BOS_TOKEN]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": vocab[content],
                "content": content,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": special,
            }
            for content, special in SPECIAL_TOKENS
        ],
        "normalizer": None,
        "pre_tokenizer": _pre_tokenizer_json(),
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [
                {"SpecialToken": {"id": BOS_TOKEN, "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
            ],
            "pair": [
                {"SpecialToken": {"id": BOS_TOKEN, "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
                {"SpecialToken": {"id": BOS_TOKEN, "type_id": 1}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {BOS_TOKEN: {"id": BOS_TOKEN, "ids": [bos_id], "tokens": [BOS_TOKEN]}},
        },
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [[left, right] for left, right in merges],
        },
    }


def _tokenizer_config_json() -> dict[str, Any]:
    return {
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": {
            str(i): {
                "content": content,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": special,
            }
            for i, (content, special) in enumerate(SPECIAL_TOKENS)
        },
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "legacy": True,
        "model_max_length": MODEL_MAX_LENGTH,
        "padding_side": "left",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
    }


def _special_tokens_map_json() -> dict[str, Any]:
    return {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": [c for c, special in SPECIAL_TOKENS[3:] if special],
    }


def _dump(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj, ensure_ascii=False, indent=2) + "\n").encode("utf-8")


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_tokenizer(out_dir: str | Path, vocab_size: int) -> None:
    """Write a deterministic byte-level BPE tokenizer with exactly ``vocab_size`` ids.

    Raises ``ValueError`` unless ``MIN_VOCAB_SIZE <= vocab_size <= MAX_VOCAB_SIZE``.
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise ValueError(f"vocab_size must be an int, got {type(vocab_size).__name__}")
    if not MIN_VOCAB_SIZE <= vocab_size <= MAX_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be in [{MIN_VOCAB_SIZE}, {MAX_VOCAB_SIZE}], got {vocab_size}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_atomic(out / "tokenizer.json", _dump(_tokenizer_json(vocab_size)))
    _write_atomic(out / "tokenizer_config.json", _dump(_tokenizer_config_json()))
    _write_atomic(out / "special_tokens_map.json", _dump(_special_tokens_map_json()))
    logger.info("wrote %d-token tokenizer to %s", vocab_size, out)
