"""Tests for tokenization.synthetic_bpe and server.tokenizer (CPU only, ~10-20 s)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jinja2.exceptions import SecurityError

from tokenization.synthetic_bpe import (
    ASSISTANT_TOKEN,
    BOS_TOKEN,
    END_THINK_TOKEN,
    EOS_TOKEN,
    PAD_TOKEN,
    THINK_TOKEN,
    USER_TOKEN,
    write_tokenizer,
)
from server.tokenizer import ChatTemplateError, ChatTemplateSecurityError, IncrementalDetokenizer, Tokenizer

REPO_ROOT = Path(__file__).resolve().parents[2]
FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
VOCAB = 4096
BYTE_BASE = 7  # ids 7..262 are the single-byte tokens

# Pinned digests of write_tokenizer(..., 1024): byte-identical output on every machine.
# Changing the corpus, trainer or file layout must update these deliberately.
PINNED_1024 = {
    "tokenizer.json": "396d7c5735d13bac4991b2fcbce8c4865f9e10fc7f5b60ccbb3ea2ae580fedeb",
    "tokenizer_config.json": "be8859d84938137493845dca0a7778cb118e7dd61e21724cbe10db3a3a93dfc3",
    "special_tokens_map.json": "91c6e0adaef48fe1a9d82d7a4c0db0f908f2d188dbc2e6e97f9e737b77f8a0e1",
}

TEXTS = [
    "",
    "Hello world!",
    "  leading and trailing spaces  ",
    "The quick brown fox jumps over the lazy dog. It's 2024-05-17 12:30, price 1234567.89%",
    "def serve(request, tokens):\n    return tokens[:128]  # trim\n\n\tindented\r\n",
    "你好，世界！分词器测试。東京タワー 안녕하세요",
    "emoji 😀🚀👍🏽 family 👨‍👩‍👧 flags 🇯🇵 ❤️",
    "mixed: naïve café Ωμέγα Привет عربى हिन्दी",
    f"{USER_TOKEN}hi{ASSISTANT_TOKEN}{THINK_TOKEN}hmm{END_THINK_TOKEN}ok{EOS_TOKEN}",
    "\x00\x01 control \u200b zero-width \ufeff bom",
]

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "system", "content": [{"type": "text", "text": "Answer in words."}]},
    {"role": "user", "content": [{"type": "text", "text": "And 3+3"}, {"type": "text", "text": "?"}]},
]
EXPECTED_CONVERSATION = (
    f"{BOS_TOKEN}You are terse.\n\nAnswer in words."
    f"{USER_TOKEN}What is 2+2?{ASSISTANT_TOKEN}4{EOS_TOKEN}"
    f"{USER_TOKEN}And 3+3?{ASSISTANT_TOKEN}"
)


def _digests(directory: Path) -> dict[str, str]:
    return {name: hashlib.sha256((directory / name).read_bytes()).hexdigest() for name in FILES}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tok4096")
    write_tokenizer(directory, VOCAB)
    return directory


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def hf_tok(model_dir: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(model_dir))


def _dir_with_template(src: Path, dst: Path, template: str) -> Path:
    shutil.copytree(src, dst)
    config_path = dst / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["chat_template"] = template
    config_path.write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")
    return dst


# ---------------------------------------------------------------------------
# make_tokenizer
# ---------------------------------------------------------------------------


def test_write_is_deterministic_and_pinned(tmp_path: Path) -> None:
    write_tokenizer(tmp_path / "a", 1024)
    write_tokenizer(tmp_path / "b", 1024)
    assert _digests(tmp_path / "a") == _digests(tmp_path / "b") == PINNED_1024


def test_write_is_independent_of_hash_seed(tmp_path: Path) -> None:
    write_tokenizer(tmp_path / "here", 2048)
    code = "import sys; from tokenization.synthetic_bpe import write_tokenizer; write_tokenizer(sys.argv[1], 2048)"
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(REPO_ROOT)}
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "there")], check=True, env=env, cwd=REPO_ROOT)
    assert _digests(tmp_path / "here") == _digests(tmp_path / "there")


@pytest.mark.parametrize("size", [512, 777, 4096, 131072])
def test_exact_vocab_size(tmp_path: Path, size: int) -> None:
    write_tokenizer(tmp_path, size)
    data = json.loads((tmp_path / "tokenizer.json").read_text(encoding="utf-8"))
    assert sorted(data["model"]["vocab"].values()) == list(range(size))
    tokenizer = Tokenizer.from_dir(tmp_path)
    assert tokenizer.vocab_size == size
    # Every id decodes (no holes, byte-level strings only).
    assert isinstance(tokenizer.decode(range(size - 300, size)), str)


def test_vocabularies_nest(tmp_path: Path) -> None:
    write_tokenizer(tmp_path / "small", 600)
    write_tokenizer(tmp_path / "large", 9000)
    small = json.loads((tmp_path / "small" / "tokenizer.json").read_text(encoding="utf-8"))["model"]
    large = json.loads((tmp_path / "large" / "tokenizer.json").read_text(encoding="utf-8"))["model"]
    assert large["merges"][: len(small["merges"])] == small["merges"]
    assert all(large["vocab"][t] == i for t, i in small["vocab"].items())


@pytest.mark.parametrize("size", [0, 511, 131073, 4096.0, True])
def test_rejects_bad_vocab_size(tmp_path: Path, size: object) -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        write_tokenizer(tmp_path, size)  # type: ignore[arg-type]


def test_special_ids(tok: Tokenizer, model_dir: Path) -> None:
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2)
    expected = [BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, USER_TOKEN, ASSISTANT_TOKEN, THINK_TOKEN, END_THINK_TOKEN]
    assert [tok.token_to_id(t) for t in expected] == list(range(7))
    config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["add_bos_token"] is True
    assert (config["bos_token"], config["eos_token"], config["pad_token"]) == (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)
    assert config["model_max_length"] > 0


# ---------------------------------------------------------------------------
# encode / decode
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_roundtrip_and_bos(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id and ids[1:] == tok.encode(text, add_bos=False)
    assert tok.decode(ids, skip_special_tokens=False) == BOS_TOKEN + text
    assert tok.decode(ids) == tok.decode([i for i in ids if i not in (0, 1, 2, 3, 4)], skip_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_transformers_agreement(tok: Tokenizer, hf_tok, text: str) -> None:
    assert hf_tok.encode(text) == tok.encode(text)
    assert hf_tok.encode(text, add_special_tokens=False) == tok.encode(text, add_bos=False)
    ids = tok.encode(text)
    for skip in (True, False):
        assert hf_tok.decode(ids, skip_special_tokens=skip) == tok.decode(ids, skip_special_tokens=skip)
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id, hf_tok.pad_token_id) == (0, 1, 2)
    assert len(hf_tok) == tok.vocab_size


# ---------------------------------------------------------------------------
# chat template
# ---------------------------------------------------------------------------


def test_chat_template_exact(tok: Tokenizer) -> None:
    assert tok.apply_chat_template(CONVERSATION) == EXPECTED_CONVERSATION
    no_prompt = tok.apply_chat_template(CONVERSATION, add_generation_prompt=False)
    assert no_prompt == EXPECTED_CONVERSATION[: -len(ASSISTANT_TOKEN)]


def test_chat_template_matches_transformers(tok: Tokenizer, hf_tok) -> None:
    for prompt in (True, False):
        ours = tok.apply_chat_template(CONVERSATION, add_generation_prompt=prompt)
        theirs = hf_tok.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=prompt)
        assert ours == theirs
    hf_ids = hf_tok.apply_chat_template(CONVERSATION, add_generation_prompt=True)["input_ids"]
    assert tok.encode_chat(CONVERSATION) == hf_ids


def test_encode_chat_single_bos(tok: Tokenizer) -> None:
    ids = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1
    assert ids[1] == tok.token_to_id(USER_TOKEN) and ids[-1] == tok.token_to_id(ASSISTANT_TOKEN)


@pytest.mark.parametrize(
    ("messages", "needle"),
    [
        ([], "empty"),
        ("hello", "list"),
        ([["user", "hi"]], "object"),
        ([{"content": "hi"}], "role"),
        ([{"role": "user"}], "content"),
        ([{"role": "user", "content": None}], "content"),
        ([{"role": "wizard", "content": "hi"}], "unknown role"),
        ([{"role": "user", "content": 42}], "content must be"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "unsupported type"),
        ([{"role": "user", "content": [{"type": "text", "text": 7}]}], "text"),
        ([{"role": "user", "content": ["plain"]}], "object"),
    ],
)
def test_malformed_messages(tok: Tokenizer, messages: object, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        tok.apply_chat_template(messages)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__ }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__.__base__ }}",
        "{{ cycler.__init__.__globals__ }}",
        "{{ messages.append(1) }}",
        "{% set x = messages[0].update({'role': 'x'}) %}",
        "{{ 'a' * 1000000000 }}",
        "{{ '%999999999d' % 1 }}",
        "{{ '{:>999999999}'.format(1) }}",
        "{{ 'x' | center(999999999) }}",
        "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
        "{% for i in range(100000) %}{% for j in range(100000) %}{% for k in range(100000) %}"
        "{% endfor %}{% endfor %}{% endfor %}",
    ],
)
def test_sandbox_blocks_escapes_and_bounds(model_dir: Path, tmp_path: Path, template: str) -> None:
    evil = Tokenizer.from_dir(_dir_with_template(model_dir, tmp_path / "evil", template), render_timeout_s=0.3)
    with pytest.raises(ChatTemplateSecurityError) as info:
        evil.apply_chat_template([{"role": "user", "content": "hi"}])
    assert isinstance(info.value, SecurityError) and isinstance(info.value, ValueError)


def test_template_errors_are_value_errors(model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ChatTemplateError, match="syntax error"):
        Tokenizer.from_dir(_dir_with_template(model_dir, tmp_path / "syntax", "{% if %}"))
    raising = Tokenizer.from_dir(_dir_with_template(model_dir, tmp_path / "raise", "{{ raise_exception('no') }}"))
    with pytest.raises(ChatTemplateError, match="no"):
        raising.apply_chat_template([{"role": "user", "content": "hi"}])


# ---------------------------------------------------------------------------
# incremental detokenizer
# ---------------------------------------------------------------------------


def _stream(tok: Tokenizer, chunks: list[list[int]], skip: bool) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    seen: list[int] = []
    pieces: list[str] = []
    for chunk in chunks:
        piece = detok.push(chunk)
        seen.extend(chunk)
        pieces.append(piece)
        so_far = "".join(pieces)
        full = tok.decode(seen, skip_special_tokens=skip)
        # Everything except (at most) a trailing incomplete character is emitted, and
        # nothing emitted ever differs from the full decode at the same place.
        if full.endswith("\ufffd"):
            assert so_far == full[:-1]
        else:
            assert so_far == full
    return pieces, detok.flush()


def test_detokenizer_streams_multibyte_text(tok: Tokenizer) -> None:
    text = "".join(TEXTS) * 3
    ids = tok.encode(text)
    pieces, tail = _stream(tok, [[i] for i in ids], skip=True)
    assert "".join(pieces) + tail == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces) and tail == ""


def test_detokenizer_is_incremental(tok: Tokenizer) -> None:
    """Total tokens handed to decode stays linear in the stream length (no full re-decodes)."""
    decoded_tokens = 0
    widest = 0
    real_decode = tok.decode

    class Counting:
        def decode(self, ids, skip_special_tokens: bool = True) -> str:
            nonlocal decoded_tokens, widest
            ids = list(ids)
            decoded_tokens += len(ids)
            widest = max(widest, len(ids))
            return real_decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tok.encode(("emoji 😀🚀 and 你好 text " * 200) + "\x80" * 100 + "end")
    ids += [BYTE_BASE + 0x80] * 200  # long run of invalid continuation bytes
    ids += [BYTE_BASE + 0xE4, BYTE_BASE + 0xB8, BYTE_BASE + 0xAD] * 50  # 中 split byte by byte
    detok = IncrementalDetokenizer(Counting(), skip_special_tokens=True)  # type: ignore[arg-type]
    out = "".join(detok.push([i]) for i in ids) + detok.flush()
    assert out == tok.decode(ids)
    assert decoded_tokens < 25 * len(ids)
    assert widest <= 40  # unresolved windows are re-anchored instead of growing


_byte_ids = st.integers(BYTE_BASE + 0x80, BYTE_BASE + 0xFF)  # continuation and lead bytes
_any_ids = st.integers(0, VOCAB - 1)


@st.composite
def _token_chunks(draw: st.DrawFn) -> list[list[int]]:
    ids: list[int] = []
    for _ in range(draw(st.integers(0, 12))):
        kind = draw(st.integers(0, 3))
        if kind == 0:
            ids.extend(draw(st.lists(_any_ids, max_size=8)))
        elif kind == 1:
            ids.extend(draw(st.lists(_byte_ids, max_size=40)))
        else:
            text = draw(st.text(max_size=10))
            ids.extend(BYTE_BASE + b for b in text.encode("utf-8"))  # multi-byte chars split into bytes
    chunks: list[list[int]] = []
    i = 0
    while i < len(ids):
        n = draw(st.integers(1, 4))
        chunks.append(ids[i : i + n])
        i += n
    if draw(st.booleans()):
        chunks.insert(draw(st.integers(0, len(chunks))), [])
    return chunks


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chunks=_token_chunks(), skip=st.booleans())
def test_detokenizer_property(tok: Tokenizer, chunks: list[list[int]], skip: bool) -> None:
    pieces, tail = _stream(tok, chunks, skip)
    ids = [i for chunk in chunks for i in chunk]
    assert "".join(pieces) + tail == tok.decode(ids, skip_special_tokens=skip)
