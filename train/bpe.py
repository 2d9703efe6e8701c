"""A byte-level BPE tokenizer trained on the corpus, in the form the server expects.

Same conventions as tokenization/synthetic_bpe.py (the random models' tokenizer): ids 0..6 are the
special tokens in `SPECIAL_TOKENS` order (bos 0, eos 1, pad 2, User, Assistant, and the think
tags, which are not `special` so they survive decoding), the same pre-tokenizer (digit runs of
at most three, CJK runs, a GPT-style word split, then the byte-level map), a bos-prefixing post
processor, and tokenizer_config.json with the DeepSeek chat template. Only the merges differ:
they are learnt from the corpus by the `tokenizers` library's BPE trainer.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from tokenization.synthetic_bpe import (
    BOS_TOKEN, CHAT_TEMPLATE, EOS_TOKEN, MODEL_MAX_LENGTH, PAD_TOKEN, SPECIAL_TOKENS,
)
# The random models' pre-tokenizer itself, so the two tokenizers can never split text differently.
from tokenization.synthetic_bpe import build_pre_tokenizer

def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """BPE over `texts` with at most `vocab_size` ids (fewer when the corpus runs out of merges)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = build_pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=[content for content, _ in SPECIAL_TOKENS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
                                                       special_tokens=[(BOS_TOKEN, 0)])
    for i, (content, _) in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(content) == i, f"special token {content} got id {tok.token_to_id(content)}"
    return tok


def _tokenizer_json(tok: Tokenizer) -> dict[str, Any]:
    """The trainer marks every added token special; the think tags must not be."""
    raw = json.loads(tok.to_str())
    special = dict(SPECIAL_TOKENS)
    for added in raw["added_tokens"]:
        added["special"] = special[added["content"]]
    return raw


def _tokenizer_config() -> dict[str, Any]:
    decoder = {str(i): {"content": content, "lstrip": False, "normalized": False, "rstrip": False,
                        "single_word": False, "special": special}
               for i, (content, special) in enumerate(SPECIAL_TOKENS)}
    return {"add_bos_token": True, "add_eos_token": False, "added_tokens_decoder": decoder,
            "bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN, "unk_token": None,
            "clean_up_tokenization_spaces": False, "legacy": True, "model_max_length": MODEL_MAX_LENGTH,
            "padding_side": "left", "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE}


def _special_tokens_map() -> dict[str, Any]:
    return {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN,
            "additional_special_tokens": [c for c, special in SPECIAL_TOKENS[3:] if special]}


def write_tokenizer_files(tok: Tokenizer, out_dir: Path) -> None:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json into out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, obj in (("tokenizer.json", _tokenizer_json(tok)), ("tokenizer_config.json", _tokenizer_config()),
                      ("special_tokens_map.json", _special_tokens_map())):
        (out_dir / name).write_text(json.dumps(obj, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
