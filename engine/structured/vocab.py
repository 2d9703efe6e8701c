"""The model's vocabulary as xgrammar sees it (`xgrammar.TokenizerInfo`), from tokenizer.json.

Built with the `tokenizers` library, not transformers: each token's encoded string (byte-level
BPE: GPT-2 byte characters, as DeepSeek's tokenizers are; byte-fallback and raw vocabularies
too), with every added special token (BOS, the chat markers, ...) given as an empty string,
which xgrammar treats as a special token a grammar never produces — so no JSON string can
contain "<｜User｜>" as a token. The stop tokens (EOS) stay: the grammar allows them where it
may end. Ids past the tokenizer's vocabulary (a model vocab padded up) are never allowed.

`json_text=True` also makes every token holding a C0 control character (U+0000–U+001F, tab
and newlines included) special: JSON allows them only as escapes inside strings, and
xgrammar 0.2's rule for length-bounded strings (minLength/maxLength) lets them through raw,
which made invalid JSON. JSON whitespace keeps the space (and newline-free) tokens.
"""

from __future__ import annotations

import json
from pathlib import Path


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte → character map of byte-level BPE vocabularies: printable Latin-1 bytes map to
    themselves, the other 68 bytes to U+0100 onwards, in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def byte_level(text: str) -> str:
    """`text` as a byte-level BPE vocabulary spells it (how an added token's content must be
    given to xgrammar, which decodes every token of a BYTE_LEVEL vocabulary that way)."""
    chars = _byte_chars()
    return "".join(chars[b] for b in text.encode("utf-8"))


def _has_control(text: str) -> bool:
    return any(ord(c) < 0x20 for c in text)


def vocab_type(tokenizer_json: dict):
    """xgrammar's VocabType for a tokenizer.json: BYTE_LEVEL for a ByteLevel decoder (GPT-2 /
    DeepSeek style), BYTE_FALLBACK for a sentencepiece-style ByteFallback decoder, else RAW."""
    import xgrammar as xgr

    decoder = json.dumps(tokenizer_json.get("decoder") or {})
    if '"ByteLevel"' in decoder:
        return xgr.VocabType.BYTE_LEVEL
    if '"ByteFallback"' in decoder:
        return xgr.VocabType.BYTE_FALLBACK
    return xgr.VocabType.RAW


def tokenizer_info(tokenizer_path: str | Path, vocab_size: int, stop_token_ids: list[int], json_text: bool = False):
    """xgrammar.TokenizerInfo for the model's vocabulary of `vocab_size` ids (see the module
    docstring for `json_text`)."""
    import xgrammar as xgr
    from tokenizers import Tokenizer

    path = Path(tokenizer_path)
    if path.is_dir():
        path = path / "tokenizer.json"
    tok = Tokenizer.from_file(str(path))
    spec = json.loads(path.read_text(encoding="utf-8"))
    kind = vocab_type(spec)
    encoded = [""] * vocab_size
    for token, index in tok.get_vocab(with_added_tokens=False).items():
        if index < vocab_size:
            encoded[index] = token
    for index, added in tok.get_added_tokens_decoder().items():
        if index >= vocab_size:
            continue
        if added.special and index not in stop_token_ids:
            encoded[index] = ""  # never text a grammar produces
        else:  # an added token is its content verbatim: spell it as the vocabulary's other tokens
            encoded[index] = byte_level(added.content) if kind == xgr.VocabType.BYTE_LEVEL else added.content
    if json_text:
        for index in range(vocab_size):
            if index not in stop_token_ids and _has_control(tok.decode([index], skip_special_tokens=False)):
                encoded[index] = ""
    prefix_space = '"add_prefix_space": true' in json.dumps(spec.get("pre_tokenizer") or {})
    return xgr.TokenizerInfo(encoded, kind, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids),
                             add_prefix_space=prefix_space)
