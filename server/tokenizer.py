"""Tokenizer facade: encode/decode, sandboxed chat templates, streaming detokenization.

Invariants:

* ``Tokenizer.encode(text, add_bos=True)`` is ``[bos_id] + ids(text)``; bos is added
  here, never by the tokenizer.json post-processor, so behaviour does not depend on it.
* ``Tokenizer.encode_chat`` encodes the rendered template without adding bos: the
  template output already starts with it.
* Chat templates are rendered only in a ``jinja2`` ``ImmutableSandboxedEnvironment``
  subclass that (a) raises ``ChatTemplateSecurityError`` (a ``SecurityError`` and a
  ``ValueError``) on any unsafe attribute access instead of rendering it as undefined,
  (b) enforces a wall-clock deadline and an output/intermediate size bound, checked
  on every attribute/item access, call, intercepted operator, filter and output chunk.
  Every failure surfaces as ``ChatTemplateError`` (a ``ValueError``) naming the problem.
* Messages are validated before rendering; content-part lists are flattened to text.
* ``IncrementalDetokenizer``: the concatenation of everything returned by ``push`` and
  ``flush`` equals ``tokenizer.decode(all_ids)``; ``push`` holds back an incomplete
  trailing UTF-8 sequence (it never emits a U+FFFD that a later token could turn into a
  real character); work per push is proportional to the decode window
  ``ids[prefix_offset:]``, which is reset at every clean character boundary.
"""

from __future__ import annotations

import contextvars
import functools
import json
import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

logger = logging.getLogger(__name__)

__all__ = [
    "ChatTemplateError",
    "ChatTemplateSecurityError",
    "IncrementalDetokenizer",
    "Tokenizer",
]

_REPLACEMENT = "\ufffd"
_ROLES = ("system", "user", "assistant")
DEFAULT_RENDER_TIMEOUT_S = 2.0
DEFAULT_MAX_RENDER_CHARS = 4 * 1024 * 1024


class ChatTemplateError(ValueError):
    """The chat template could not be compiled or rendered (bad template or bad input)."""


class ChatTemplateSecurityError(ChatTemplateError, SecurityError):
    """The chat template tried something the sandbox forbids, or exceeded a render bound."""


# ---------------------------------------------------------------------------
# Sandboxed, bounded jinja environment
# ---------------------------------------------------------------------------


@dataclass
class _RenderBudget:
    deadline: float
    max_chars: int


_BUDGET: contextvars.ContextVar[_RenderBudget | None] = contextvars.ContextVar(
    "ringserve_chat_template_budget", default=None
)
# Width/precision of a printf spec ("%-12.3f") or a str.format spec ("{0:>12.3}").
_FORMAT_WIDTH = re.compile(r"(?:%[-#0 +]*|\{[^{}:]*:[^{}\d]*)(\d+)?(?:\.(\d+))?")


def _budget() -> _RenderBudget | None:
    budget = _BUDGET.get()
    if budget is not None and time.monotonic() > budget.deadline:
        raise ChatTemplateSecurityError("chat template render exceeded its time limit")
    return budget


def _check_size(value: Any, budget: _RenderBudget | None) -> Any:
    if budget is not None and isinstance(value, (str, bytes, list, tuple, dict)) and len(value) > budget.max_chars:
        raise ChatTemplateSecurityError(
            f"chat template produced a value of length {len(value)} (limit {budget.max_chars})"
        )
    return value


def _check_args(args: Iterable[Any], budget: _RenderBudget | None) -> None:
    """Reject integer arguments large enough to make a single call blow the size bound."""
    if budget is None:
        return
    for arg in args:
        if isinstance(arg, int) and not isinstance(arg, bool) and abs(arg) > budget.max_chars:
            raise ChatTemplateSecurityError(f"chat template argument {arg} exceeds the size limit")


def _check_format(fmt: Any, budget: _RenderBudget | None) -> None:
    """Reject printf/str.format strings whose widths or precisions exceed the size bound."""
    if budget is None or not isinstance(fmt, str):
        return
    for width, precision in _FORMAT_WIDTH.findall(fmt):
        for number in (width, precision):
            if number and (len(number) > 9 or int(number) > budget.max_chars):
                raise ChatTemplateSecurityError("chat template format width exceeds the size limit")


def _bounded_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(func)  # keeps jinja's pass_context/pass_environment marker
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        if budget is None:
            # jinja's code generator constant-folds filter calls at compile time; refusing
            # here (it catches the error) defers them to render time, inside the budget.
            raise ChatTemplateError(f"filter {name!r} may only run while rendering")
        _check_args(list(args[1:]) + list(kwargs.values()), budget)
        if name == "format":
            _check_format(next((a for a in args if isinstance(a, str)), None), budget)
        return _check_size(func(*args, **kwargs), budget)

    return wrapper


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template raised: {message}")


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """Immutable sandbox that fails loudly and checks the render budget on every hook."""

    intercepted_binops = frozenset({"+", "*", "**", "%", "//"})

    def __init__(self) -> None:
        # optimized=False: no compile-time constant folding, which would run outside the budget.
        super().__init__(
            trim_blocks=True, lstrip_blocks=True, optimized=False, extensions=[jinja2.ext.loopcontrols]
        )
        self.filters = {name: _bounded_filter(name, f) for name, f in self.filters.items()}
        self.globals["raise_exception"] = _raise_exception

    def unsafe_undefined(self, obj: Any, attribute: Any) -> jinja2.Undefined:
        raise ChatTemplateSecurityError(
            f"chat template may not access attribute {attribute!r} of {type(obj).__name__!r} object"
        )

    def getattr(self, obj: Any, attribute: str) -> Any:
        budget = _budget()
        if isinstance(obj, str) and attribute in ("format", "format_map"):
            _check_format(obj, budget)
        return _check_size(super().getattr(obj, attribute), budget)

    def getitem(self, obj: Any, argument: Any) -> Any:
        budget = _budget()
        return _check_size(super().getitem(obj, argument), budget)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        budget = _budget()
        _check_args(list(args) + list(kwargs.values()), budget)
        return _check_size(super().call(__context, __obj, *args, **kwargs), budget)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = _budget()
        if budget is not None:
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > budget.max_chars:
                        raise ChatTemplateSecurityError("chat template repetition exceeds the size limit")
            elif operator == "**":
                if isinstance(right, (int, float)) and right > 64 and isinstance(left, (int, float)) and abs(left) > 1:
                    raise ChatTemplateSecurityError("chat template exponent too large")
            elif operator == "+":
                if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
                    if len(left) + len(right) > budget.max_chars:
                        raise ChatTemplateSecurityError("chat template concatenation exceeds the size limit")
            elif operator == "%":
                _check_format(left, budget)
        return _check_size(super().call_binop(context, operator, left, right), budget)


# ---------------------------------------------------------------------------
# Message validation
# ---------------------------------------------------------------------------


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping):
                raise ValueError(f"{where}: content part {j} must be an object, got {type(part).__name__}")
            if part.get("type") != "text":
                raise ValueError(f"{where}: content part {j} has unsupported type {part.get('type')!r}")
            text = part.get("text")
            if not isinstance(text, str):
                raise ValueError(f"{where}: content part {j} needs a string 'text'")
            texts.append(text)
        return "".join(texts)
    raise ValueError(f"{where}: content must be a string or a list of text parts, got {type(content).__name__}")


def _normalize_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise ValueError(f"messages must be a list, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages must not be empty")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise ValueError(f"{where} must be an object, got {type(message).__name__}")
        if "role" not in message:
            raise ValueError(f"{where} is missing 'role'")
        role = message["role"]
        if role not in _ROLES:
            raise ValueError(f"{where} has unknown role {role!r}; expected one of {', '.join(_ROLES)}")
        if "content" not in message or message["content"] is None:
            raise ValueError(f"{where} is missing 'content'")
        normalized = dict(message)
        normalized["content"] = _content_text(message["content"], where)
        out.append(normalized)
    return out


# ---------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json stores special tokens as strings or AddedToken dicts."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _select_template(config: Mapping[str, Any], model_dir: Path) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    if isinstance(template, str):
        return template
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    return None


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus its tokenizer_config.json (special tokens, chat template)."""

    def __init__(
        self,
        backend: _HFTokenizer,
        config: Mapping[str, Any],
        chat_template: str | None = None,
        *,
        render_timeout_s: float = DEFAULT_RENDER_TIMEOUT_S,
        max_render_chars: int = DEFAULT_MAX_RENDER_CHARS,
    ) -> None:
        self._backend = backend
        self._config = dict(config)
        self._render_timeout_s = render_timeout_s
        self._max_render_chars = max_render_chars
        self._bos_token = _token_content(config.get("bos_token"))
        self._eos_token = _token_content(config.get("eos_token"))
        self._pad_token = _token_content(config.get("pad_token"))
        self._bos_id = self._require_id(self._bos_token, "bos_token")
        self._eos_id = self._require_id(self._eos_token, "eos_token")
        pad_id = backend.token_to_id(self._pad_token) if self._pad_token is not None else None
        self._pad_id = self._eos_id if pad_id is None else pad_id
        self._chat_template_source = chat_template
        self._env = _BoundedSandbox()
        self._template: jinja2.Template | None = None
        if chat_template is not None:
            try:
                self._template = self._env.from_string(chat_template)
            except jinja2.TemplateSyntaxError as exc:
                raise ChatTemplateError(f"chat template has a syntax error at line {exc.lineno}: {exc.message}") from exc

    def _require_id(self, token: str | None, name: str) -> int:
        token_id = self._backend.token_to_id(token) if token is not None else None
        if token_id is None:
            raise ValueError(f"tokenizer_config.json {name} {token!r} is not in the vocabulary")
        return token_id

    @classmethod
    def from_dir(cls, model_dir: str | Path, **limits: Any) -> Tokenizer:
        """Load ``tokenizer.json`` and ``tokenizer_config.json`` from ``model_dir``."""
        directory = Path(model_dir)
        backend = _HFTokenizer.from_file(str(directory / "tokenizer.json"))
        config_path = directory / "tokenizer_config.json"
        config: dict[str, Any] = {}
        if config_path.is_file():
            config = json.loads(config_path.read_text(encoding="utf-8"))
        template = _select_template(config, directory)
        logger.debug("loaded tokenizer from %s (chat template: %s)", directory, template is not None)
        return cls(backend, config, template, **limits)

    # -- properties -----------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_id(self) -> int:
        return self._bos_id

    @property
    def eos_id(self) -> int:
        return self._eos_id

    @property
    def pad_id(self) -> int:
        """The pad token id, or eos_id when the config defines no pad token."""
        return self._pad_id

    @property
    def bos_token(self) -> str:
        assert self._bos_token is not None
        return self._bos_token

    @property
    def eos_token(self) -> str:
        assert self._eos_token is not None
        return self._eos_token

    @property
    def chat_template(self) -> str | None:
        return self._chat_template_source

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    # -- encode / decode ------------------------------------------------

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = self._backend.encode(text, add_special_tokens=False).ids
        return [self._bos_id, *ids] if add_bos else ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # -- chat -----------------------------------------------------------

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """Render ``messages`` with the model's chat template inside the bounded sandbox."""
        if self._template is None:
            raise ChatTemplateError("this tokenizer has no chat template")
        normalized = _normalize_messages(messages)
        budget = _RenderBudget(time.monotonic() + self._render_timeout_s, self._max_render_chars)
        token = _BUDGET.set(budget)
        try:
            chunks: list[str] = []
            size = 0
            for chunk in self._template.generate(
                messages=normalized,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._bos_token,
                eos_token=self._eos_token,
                pad_token=self._pad_token,
            ):
                size += len(chunk)
                if size > budget.max_chars:
                    raise ChatTemplateSecurityError(
                        f"chat template output exceeds {budget.max_chars} characters"
                    )
                _budget()
                chunks.append(chunk)
            return "".join(chunks)
        except ChatTemplateError:
            raise
        except SecurityError as exc:
            raise ChatTemplateSecurityError(f"chat template violated the sandbox: {exc}") from exc
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise ChatTemplateError(f"chat template failed to render: {type(exc).__name__}: {exc}") from exc
        except (RecursionError, MemoryError, OverflowError) as exc:
            raise ChatTemplateSecurityError(f"chat template exceeded a resource limit: {type(exc).__name__}") from exc
        finally:
            _BUDGET.reset(token)

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered conversation (bos comes from the template)."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        return self._backend.encode(text, add_special_tokens=False).ids


# ---------------------------------------------------------------------------
# Streaming detokenization
# ---------------------------------------------------------------------------


class IncrementalDetokenizer:
    """Turns a growing token stream into text deltas without splitting characters.

    State: ``ids[prefix:read]`` is the context whose text (``prefix_len`` chars) was
    emitted by earlier windows; ``sent`` counts chars of ``decode(ids[prefix:])``
    already emitted. Offsets only move to token boundaries where the decoded text
    ends in a complete character, so decoding a window from ``prefix`` gives exactly
    the corresponding slice of the full decode.
    """

    # A window that stays unresolved this long is re-anchored at a verified boundary.
    _MAX_WINDOW = 32
    _ANCHOR_CANDIDATES = 8
    _TRIM_AT = 1024

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self._prefix_len = 0
        self._sent = 0

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip)

    def push(self, token_ids: Iterable[int]) -> str:
        """Append tokens; return the newly completed text (possibly empty)."""
        self._ids.extend(token_ids)
        text = self._decode(self._prefix)
        if text.endswith(_REPLACEMENT):
            # Everything before the last character is final; the last one may still
            # be an incomplete multi-byte sequence.
            stable = len(text) - 1
            delta = text[self._sent : stable] if stable > self._sent else ""
            self._sent = max(self._sent, stable)
            if len(self._ids) - self._prefix > self._MAX_WINDOW:
                self._reanchor(text)
            return delta
        delta = text[self._sent :]
        new_prefix_len = len(text) - self._prefix_len
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_len = self._sent = new_prefix_len
        if self._prefix > self._TRIM_AT:  # drop consumed history; amortised O(1) per token
            del self._ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        return delta

    def _reanchor(self, text: str) -> None:
        """Move the window start to a recent boundary proven not to split a character.

        Boundary ``j`` is accepted when the tokens after it decode to something non-empty
        and ``decode(ids[prefix:j]) + decode(ids[j:]) == decode(ids[prefix:])``: if the
        bytes before ``j`` ended in an unfinished sequence continued after ``j``, the split
        decode would contain extra replacement characters.
        """
        end = len(self._ids)
        for j in range(end - 1, max(self._read, end - self._ANCHOR_CANDIDATES), -1):
            tail = self._decode(j)
            if not tail:
                continue
            head = self._decode(self._prefix, j)
            if head + tail == text:
                # _sent >= len(text) - 1 >= len(head): all of head was already emitted.
                self._prefix = self._read = j
                self._prefix_len = 0
                self._sent -= len(head)
                return

    def flush(self) -> str:
        """Return whatever is held back (an unfinished sequence decodes to U+FFFD) and reset."""
        text = self._decode(self._prefix)
        delta = text[self._sent :]
        self._ids.clear()
        self._prefix = self._read = self._prefix_len = self._sent = 0
        return delta
