"""OpenAI request parsing and validation (no aiohttp here): JSON bodies → typed requests, or a
`ProtocolError` that becomes HTTP 400 with an OpenAI-style error body naming the parameter.

Documented caps (each tested at the cap and just over it) live in `Limits`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from msgspec.structs import replace

from ipc.codec import InvalidField, check
from ipc.messages import SamplingParams

from .chat_request import ChatRequest, parse_chat_request
from .errors import ProtocolError
from .structured import StructuredLimits, parse_structured


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 4 << 20  # request body
    max_field_bytes: int = 8190  # one header line / field (aiohttp's parser limit)
    max_headers: int = 100
    max_n: int = 16  # choices per request
    max_logprobs: int = 20  # top_logprobs / completions logprobs
    max_stop: int = 16  # stop strings
    max_stop_chars: int = 256  # characters per stop string
    max_prompts: int = 32  # prompts in one completions request
    max_stop_token_ids: int = 64
    max_user_chars: int = 256  # the `user` identifier (also the session-affinity key)
    structured: StructuredLimits = field(default_factory=StructuredLimits)  # grammars (server/structured.py)


@dataclass
class GenerationRequest:
    """What both endpoints reduce to."""

    model: str
    prompts: list[str | list[int]]  # completions: text or token ids (chat: empty; the renderer makes the prompt)
    chat: ChatRequest | None  # chat only: messages, tools, tool choice, reasoning switches
    params: SamplingParams
    n: int
    stream: bool
    include_usage: bool
    stop: list[str]
    continuous_usage: bool = False  # vLLM extension: usage on every streamed chunk
    echo: bool = False
    logprobs: int | None = None  # completions: top-N alternatives; chat: top_logprobs when logprobs=true
    user: str | None = None
    max_tokens_given: bool = True
    extra: dict[str, Any] = field(default_factory=dict)
    # Scoring (completions): `max_tokens: 0` generates nothing (the engine still samples one
    # token, which the response leaves out); vLLM's `prompt_logprobs` field returns prompt scores
    # in each choice's "prompt_logprobs". `echo` with `logprobs` puts them in "logprobs" too.
    score_only: bool = False
    prompt_logprobs: int | None = None
    kv_transfer_params: Any = None  # PD disaggregation: ipc.kv_transfer_params.KVTransferParams
    # Images (chat, DeepSeek-V4.1): the prompt's ipc ImageData in span order, set by prepare_chat;
    # on a PD prefill leg also what its decode leg needs (multimodal.PrefilledImage); on a decode
    # leg the prefill's answer for them (`prefilled_images`).
    images: list = field(default_factory=list)
    prefilled_images: list | None = None


# ---- field readers ---------------------------------------------------------------------------


def _get(body: dict, name: str, kinds: tuple[type, ...], default: Any = None, nullable: bool = True) -> Any:
    if name not in body or (body[name] is None and nullable):
        return default
    value = body[name]
    if isinstance(value, bool) and bool not in kinds:
        raise ProtocolError(f"'{name}' must be of type {_names(kinds)}, got a boolean", name, "invalid_type")
    if not isinstance(value, kinds):
        raise ProtocolError(f"'{name}' must be of type {_names(kinds)}, got {type(value).__name__}", name,
                            "invalid_type")
    if isinstance(value, float) and not math.isfinite(value):
        raise ProtocolError(f"'{name}' must be a finite number", name, "invalid_value")
    return value


def _names(kinds: tuple[type, ...]) -> str:
    return " or ".join({int: "integer", float: "number", str: "string", bool: "boolean", list: "array",
                        dict: "object"}.get(k, k.__name__) for k in kinds)


def _number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    value = float(_get(body, name, (int, float), default))
    if not lo <= value <= hi:
        raise ProtocolError(f"'{name}' must be between {lo} and {hi}, got {value}", name, "invalid_value")
    return value


def _int(body: dict, name: str, default: int | None, lo: int, hi: int | None = None) -> int | None:
    value = _get(body, name, (int,), default)
    if value is None:
        return None
    if value < lo or (hi is not None and value > hi):
        bound = f"between {lo} and {hi}" if hi is not None else f"at least {lo}"
        raise ProtocolError(f"'{name}' must be {bound}, got {value}", name, "invalid_value")
    return value


def _stop(body: dict, limits: Limits) -> list[str]:
    stop = _get(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > limits.max_stop:
        raise ProtocolError(f"'stop' holds at most {limits.max_stop} strings, got {len(stop)}", "stop", "too_many")
    for s in stop:
        if not isinstance(s, str) or not s:
            raise ProtocolError("'stop' entries must be non-empty strings", "stop", "invalid_value")
        if len(s) > limits.max_stop_chars:
            raise ProtocolError(f"a 'stop' string is at most {limits.max_stop_chars} characters, got {len(s)}",
                                "stop", "too_long")
    return stop


def _user(body: dict, limits: Limits) -> str | None:
    user = _get(body, "user", (str,), None)
    if user is not None and len(user) > limits.max_user_chars:
        raise ProtocolError(f"'user' is at most {limits.max_user_chars} characters, got {len(user)}", "user",
                            "too_long")
    return user


def _token_ids(value: Any, name: str) -> list[int]:
    if not value or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise ProtocolError(f"'{name}' token arrays must be non-empty lists of non-negative integers", name,
                            "invalid_value")
    return list(value)


def _common(body: dict, limits: Limits, max_tokens_field: str, logprobs: int | None, n: int,
            min_tokens: int = 1) -> SamplingParams:
    max_tokens = _int(body, max_tokens_field, None, min_tokens)
    if max_tokens_field == "max_completion_tokens" and max_tokens is None:
        max_tokens = _int(body, "max_tokens", None, 1)
    stop_ids = _get(body, "stop_token_ids", (list,), [])
    if len(stop_ids) > limits.max_stop_token_ids or not all(isinstance(t, int) and not isinstance(t, bool)
                                                            for t in stop_ids):
        raise ProtocolError(f"'stop_token_ids' must be at most {limits.max_stop_token_ids} integers",
                            "stop_token_ids", "invalid_value")
    top_k = _int(body, "top_k", 0, -1)
    params = SamplingParams(
        max_tokens=max_tokens or 1,  # the handler fills the real default from the context
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0) or 1e-9,
        top_k=max(top_k, 0),
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        seed=_int(body, "seed", None, -(2**63), 2**63 - 1),
        logprobs=logprobs,
        stop_token_ids=tuple(stop_ids),
        ignore_eos=bool(_get(body, "ignore_eos", (bool,), False)),
        cache_salt=_get(body, "cache_salt", (str,), None) or None,  # vLLM's name: prefix-cache tenant
        structured=parse_structured(body, limits.structured),  # response_format / structured_outputs
    )
    return checked(params, {"max_tokens": max_tokens_field, "logprobs": "top_logprobs"
                            if max_tokens_field == "max_completion_tokens" else "logprobs"})


def checked(params: SamplingParams, api_names: dict[str, str] | None = None) -> SamplingParams:
    """The wire type's own limits (ipc.messages) on what the API accepted: 400 naming the field."""
    try:
        return check(params)
    except InvalidField as exc:
        name = (api_names or {}).get(exc.field, exc.field)
        raise ProtocolError(f"'{name}' is out of range: {exc.reason}", name or None, "invalid_value") from None


def _model(body: dict, served: list[str]) -> str:
    model = _get(body, "model", (str,), None)
    if model is None:
        return served[0]
    if model not in served:
        raise ProtocolError(f"the model '{model}' does not exist; this server serves {', '.join(served)}", "model",
                            "model_not_found", status=404, err_type="not_found_error")
    return model


def _stream_opts(body: dict) -> tuple[bool, bool, bool]:
    """(stream, include_usage, continuous_usage_stats)."""
    stream = bool(_get(body, "stream", (bool,), False))
    opts = _get(body, "stream_options", (dict,), {})
    flags = []
    for key in ("include_usage", "continuous_usage_stats"):
        value = opts.get(key, False)
        if not isinstance(value, bool):
            raise ProtocolError(f"'stream_options.{key}' must be a boolean", "stream_options", "invalid_type")
        flags.append(value)
    if opts and not stream:
        raise ProtocolError("'stream_options' is only allowed when 'stream' is true", "stream_options",
                            "invalid_value")
    return stream, flags[0], flags[1]


def _kv_transfer_params(body: dict, n_prompts: int, n: int, stream: bool):
    """`kv_transfer_params` (vLLM's two-leg PD protocol), validated; None when absent."""
    raw = body.get("kv_transfer_params")
    if raw is None:
        return None
    from engine.kv_transfer.protocol import ProtocolError as KVProtocolError, parse_params

    try:
        kv = parse_params(raw)
    except KVProtocolError as exc:
        raise ProtocolError(str(exc), "kv_transfer_params", "invalid_value") from None
    if n_prompts != 1 or n != 1:
        raise ProtocolError("kv_transfer_params need exactly one prompt and n = 1", "kv_transfer_params",
                            "invalid_value")
    if kv.do_remote_decode and stream:
        raise ProtocolError("a prefill for a remote decode (do_remote_decode) must not stream", "stream",
                            "invalid_value")
    return kv


def _require_object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object", None, "invalid_body")
    return body


# ---- endpoints -------------------------------------------------------------------------------


def parse_completion(body: Any, limits: Limits, served: list[str]) -> GenerationRequest:
    body = _require_object(body)
    model = _model(body, served)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompts: list[str | list[int]] = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompts = [_token_ids(prompt, "prompt")]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > limits.max_prompts:
            raise ProtocolError(f"at most {limits.max_prompts} prompts per request, got {len(prompt)}", "prompt",
                                "too_many")
        prompts = [p if isinstance(p, str) else _token_ids(p, "prompt") for p in prompt]
    else:
        raise ProtocolError("'prompt' must be a string, an array of strings, or token id arrays", "prompt",
                            "invalid_value")
    if any(isinstance(p, str) and not p for p in prompts):
        raise ProtocolError("'prompt' must not be empty", "prompt", "invalid_value")
    logprobs = _int(body, "logprobs", None, 0, limits.max_logprobs)
    n = _int(body, "n", 1, 1, limits.max_n)
    stream, include, continuous = _stream_opts(body)
    if _get(body, "best_of", (int,), None) not in (None, 1, n):
        raise ProtocolError("'best_of' other than n is not supported", "best_of", "unsupported")
    if _get(body, "suffix", (str,), None):
        raise ProtocolError("'suffix' is not supported", "suffix", "unsupported")
    echo = bool(_get(body, "echo", (bool,), False))
    params = _common(body, limits, "max_tokens", logprobs, n, min_tokens=0)
    score_only = body.get("max_tokens") == 0
    prompt_lp = _int(body, "prompt_logprobs", None, 0, limits.max_logprobs)
    if stream and (score_only or prompt_lp is not None):
        name = "max_tokens" if score_only else "prompt_logprobs"
        raise ProtocolError(f"'{name}' for scoring is not supported with 'stream'", name, "unsupported")
    wanted = [k for k in (prompt_lp, logprobs if echo and not stream else None) if k is not None]
    if wanted:
        params = checked(replace(params, prompt_logprobs=max(wanted)))
    return GenerationRequest(model, prompts, None, params, n, stream, include, _stop(body, limits), echo=echo,
                             logprobs=logprobs, user=_user(body, limits),
                             max_tokens_given=body.get("max_tokens") is not None, continuous_usage=continuous,
                             score_only=score_only, prompt_logprobs=prompt_lp,
                             kv_transfer_params=_kv_transfer_params(body, len(prompts), n, stream))


def parse_chat(body: Any, limits: Limits, served: list[str]) -> GenerationRequest:
    body = _require_object(body)
    model = _model(body, served)
    chat = parse_chat_request(body)
    if body.get("prompt_logprobs") is not None:
        raise ProtocolError("'prompt_logprobs' is supported on /v1/completions only", "prompt_logprobs",
                            "unsupported")
    want_lp = bool(_get(body, "logprobs", (bool,), False))
    top = _int(body, "top_logprobs", None, 0, limits.max_logprobs)
    if top is not None and not want_lp:
        raise ProtocolError("'top_logprobs' needs 'logprobs': true", "top_logprobs", "invalid_value")
    logprobs = (top or 0) if want_lp else None
    n = _int(body, "n", 1, 1, limits.max_n)
    stream, include, continuous = _stream_opts(body)
    params = _common(body, limits, "max_completion_tokens", logprobs, n)
    given = body.get("max_completion_tokens") is not None or body.get("max_tokens") is not None
    return GenerationRequest(model, [], chat, params, n, stream, include, _stop(body, limits), logprobs=logprobs,
                             user=_user(body, limits), max_tokens_given=given, continuous_usage=continuous,
                             kv_transfer_params=_kv_transfer_params(body, 1, n, stream),
                             prefilled_images=_prefilled_images(body))


def _prefilled_images(body: dict):
    """PD decode leg: the images' grids the prefill leg answered with (ringserve's proxy sets it)."""
    from .multimodal import parse_prefilled

    return parse_prefilled(body.get("prefilled_images"))
