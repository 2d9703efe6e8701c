"""A chat request's images: found in its messages, placed where the chat format renders them,
loaded, preprocessed at the edge and expanded into the prompt's image spans (DeepSeek-V4.1).

The way of one request (`handlers.prepare_chat`):
  1. `mark_images`: every image content part (`image_url`, `input_image`, `image`) is swapped
     for a text part holding a marker unique to the request and the image. The chat format
     renders markers where it would have rendered `<｜deepseek_image｜>`, so after rendering the
     markers' order is the placeholders' order, whatever the format merged, re-ordered (tool
     results) or dropped; `MarkedImages.placeholders` puts the image token back in their place.
  2. the count is checked against `--limit-mm-per-prompt` before anything is fetched;
  3. `Multimodal.load`: each image's bytes (server/media_fetch.py) and DeepSeek's preprocessing
     (engine/v41/vision: Pillow decode, checks, the resize plan, the pixels the ViT reads) on the
     offload pool, concurrently;
  4. `Multimodal.expand`: the tokenized prompt's placeholders become the images' spans, and the
     images become `Submit.images` (ipc.messages.ImageData).

PD: both legs load the request's images (as vLLM's legs both process them): DeepSeek-V4.1's
decode leg replays the prompt's last positions, which may hold an image span. The prefill leg
answers with each image's grid and digest (`prefilled_images`, which ringserve's proxy passes on)
and the decode leg checks it loaded the same images.

Bad input is a `ProtocolError` (400) naming the image (`messages[i].content[k]`) and the problem.
No torch here.
"""

from __future__ import annotations

import asyncio
import re
import secrets
from dataclasses import dataclass
from typing import Any

from .errors import ProtocolError
from .media_fetch import MediaError, MediaFetcher, MediaPolicy

IMAGE_PART_TYPES = ("image_url", "input_image", "image")
DEFAULT_IMAGE_LIMIT = 8  # images per prompt unless --limit-mm-per-prompt says otherwise
MAX_IMAGE_LIMIT = 256  # ipc.messages.MAX_IMAGES_PER_REQUEST
_MARKER = re.compile(r"\[\[ringserve-image:([0-9a-f]{32}):(\d+)\]\]")


def _bad(message: str, code: str = "invalid_image", param: str = "messages") -> ProtocolError:
    return ProtocolError(message, param, code)


def parse_mm_limit(text: str | None) -> int:
    """`--limit-mm-per-prompt` in vLLM's JSON form ('{"image": 4}'); the image limit."""
    import json

    if text is None:
        return DEFAULT_IMAGE_LIMIT
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise ValueError(f"--limit-mm-per-prompt must be JSON such as '{{\"image\": 4}}', got {text!r}") from None
    if not isinstance(value, dict) or set(value) - {"image"}:
        raise ValueError("--limit-mm-per-prompt: this model takes images only, e.g. '{\"image\": 4}'")
    limit = value.get("image", DEFAULT_IMAGE_LIMIT)
    if isinstance(limit, dict):  # vLLM's newer {"image": {"count": N, ...}} form
        limit = limit.get("count", DEFAULT_IMAGE_LIMIT)
    if isinstance(limit, bool) or not isinstance(limit, int) or not 0 <= limit <= MAX_IMAGE_LIMIT:
        raise ValueError(f"--limit-mm-per-prompt: the image limit must be an integer in [0, {MAX_IMAGE_LIMIT}]")
    return limit


# ---- image parts ---------------------------------------------------------------------------------------


def part_url(part: dict, where: str) -> str:
    """The URL an image content part names (data:, http(s):// or file://). Shapes taken:
    OpenAI chat `{"type": "image_url", "image_url": {"url"} | "url"}`, Responses
    `{"type": "input_image", "image_url": "..."}`, and `{"type": "image", ...}` with `url`,
    `image` (a URL), or `data` (+ `media_type`) base64, or an Anthropic-style `source`."""
    kind = part.get("type")
    url: Any = None
    if kind == "image_url":
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
    elif kind == "input_image":
        if part.get("file_id") is not None and part.get("image_url") is None:
            raise _bad(f"{where}: input_image by file_id needs stored files, which this stateless server has not; "
                       "send image_url", "unsupported")
        url = part.get("image_url")
    else:
        source = part.get("source")
        if isinstance(source, dict):
            url = source.get("url") if source.get("type") == "url" else _data_url(source.get("data"),
                                                                                  source.get("media_type"), where)
        elif isinstance(part.get("data"), str):
            url = _data_url(part["data"], part.get("media_type"), where)
        else:
            url = part.get("url", part.get("image"))
    if not isinstance(url, str) or not url:
        raise _bad(f"{where}: the image part has no URL", "invalid_image_url")
    return url


def _data_url(data: Any, media_type: Any, where: str) -> str:
    if not isinstance(data, str) or not data:
        raise _bad(f"{where}: the image's base64 'data' must be a non-empty string", "invalid_image_data")
    kind = media_type if isinstance(media_type, str) and media_type else "image/*"
    return f"data:{kind};base64,{data}"


@dataclass(frozen=True)
class MarkedImages:
    messages: list[dict]  # the request's messages, image parts swapped for marker text parts
    urls: list[str]  # marker k → its image's URL
    places: list[str]  # marker k → where it is in the request ("messages[1].content[0]")
    nonce: str

    def placeholders(self, text: str, placeholder: str) -> tuple[str, list[int]]:
        """The rendered text with each of this request's markers replaced by `placeholder`, and
        the marker numbers in the order they appear (the images' span order)."""
        order: list[int] = []

        def put(m: re.Match) -> str:
            if m[1] != self.nonce:
                return m[0]  # not ours: text the user typed stays text
            order.append(int(m[2]))
            return placeholder

        return _MARKER.sub(put, text), order


def has_images(messages: Any) -> bool:
    return isinstance(messages, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list)
        and any(isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES for p in m["content"])
        for m in messages)


def mark_images(messages: list[dict]) -> MarkedImages:
    """Swap every image part for a marker (URLs checked for presence only; nothing loaded)."""
    nonce = secrets.token_hex(16)
    urls: list[str] = []
    places: list[str] = []
    out = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            out.append(m)
            continue
        parts = []
        for k, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES:
                where = f"messages[{i}].content[{k}]"
                urls.append(part_url(part, where))
                places.append(where)
                part = {"type": "text", "text": f"[[ringserve-image:{nonce}:{len(urls) - 1}]]"}
            parts.append(part)
        out.append({**m, "content": parts})
    return MarkedImages(out, urls, places, nonce)


# ---- loading and expansion -----------------------------------------------------------------------------


@dataclass(frozen=True)
class PrefilledImage:
    """An image a PD prefill leg processed: what its decode leg needs to expand the same span."""

    n_vit_h: int
    n_vit_w: int
    digest: bytes

    def to_json(self) -> dict:
        return {"grid": [self.n_vit_h, self.n_vit_w], "digest": self.digest.hex()}


class Multimodal:
    """The server's image input: the model's vision frontend (None: a text-only model), the
    reason images are refused when they are, the per-prompt limit and the media policy."""

    def __init__(self, frontend, limit: int = DEFAULT_IMAGE_LIMIT, policy: MediaPolicy | None = None,
                 refusal: str | None = None):
        self.frontend = frontend  # engine.v41.vision.frontend.VisionFrontend | None
        self.limit = limit
        self.fetcher = MediaFetcher(policy or MediaPolicy())
        self.refusal = refusal or (None if frontend is not None else "this model takes no image input")

    @classmethod
    def for_model(cls, model_cfg, *, language_model_only: bool = False, limit: int = DEFAULT_IMAGE_LIMIT,
                  policy: MediaPolicy | None = None) -> "Multimodal":
        from engine.models import registry

        arch = registry.of(model_cfg)  # its multimodal input stage, if any (engine/models/base.py)
        frontend = arch.input_processor(model_cfg)
        refusal = None
        if frontend is None:
            refusal = arch.images_refusal(model_cfg)
        elif language_model_only:
            refusal = "this model was started with --language-model-only: image input is disabled"
        return cls(frontend, limit, policy, refusal)

    @property
    def image_token_id(self) -> int:
        return self.frontend.image_token_id

    @property
    def max_image_bytes(self) -> int:
        """The most pixel bytes one preprocessed image can carry (its token budget's patches)."""
        return 0 if self.frontend is None else self.frontend.max_image_bytes

    @property
    def submit_bytes(self) -> int:
        """What a request ring's slot must hold for one prompt's images (0: images refused)."""
        if self.refusal is not None:
            return 0
        return self.limit * (self.max_image_bytes + 1024)  # + each ImageData's other fields

    def check_accepts(self, count: int, param: str = "messages") -> None:
        if count and self.refusal is not None:
            raise _bad(self.refusal, "images_not_supported", param)
        if count > self.limit:
            raise _bad(f"the prompt has {count} images; at most {self.limit} are allowed per prompt "
                       "(--limit-mm-per-prompt)", "too_many_images", param)

    async def load(self, urls: list[str], places: list[str]) -> list:
        """Each image fetched and preprocessed (frontend.PreprocessedImage), in the given order."""
        from . import offload

        async def one(url: str, where: str):
            try:
                data = await self.fetcher.load(url)
            except MediaError as exc:
                raise _bad(f"{where}: {exc}", exc.code) from None
            try:
                return await offload.run(self.frontend.preprocess, data)
            except ValueError as exc:  # engine.v41.vision ImageError
                raise _bad(f"{where}: {exc}", "invalid_image") from None

        tasks = [asyncio.ensure_future(one(u, w)) for u, w in zip(urls, places)]
        try:
            return await asyncio.gather(*tasks)
        finally:
            for t in tasks:  # the first failure answers; the other fetches stop
                t.cancel()

    def expand(self, ids: list[int], images: list, param: str = "messages") -> tuple[list[int], list]:
        """(expanded ids, Submit.images); a 400 when placeholders and images do not pair up."""
        try:
            expanded, starts = self.frontend.expand_placeholders(ids, images)
            return expanded, self.frontend.image_data(images, starts)
        except ValueError as exc:  # PlaceholderError
            raise _bad(str(exc), "invalid_image", param) from None

    async def close(self) -> None:
        await self.fetcher.close()


def parse_prefilled(raw: Any) -> list[PrefilledImage] | None:
    """The `prefilled_images` field of a PD decode leg (set by ringserve's proxy), checked."""
    if raw is None:
        return None
    if not isinstance(raw, list) or len(raw) > MAX_IMAGE_LIMIT:
        raise _bad(f"'prefilled_images' must be an array of at most {MAX_IMAGE_LIMIT} images", "invalid_value",
                   "prefilled_images")
    out = []
    for i, item in enumerate(raw):
        grid = item.get("grid") if isinstance(item, dict) else None
        digest = item.get("digest") if isinstance(item, dict) else None
        ok = (isinstance(grid, list) and len(grid) == 2
              and all(isinstance(g, int) and not isinstance(g, bool) and 1 <= g <= 65535 for g in grid)
              and isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest))
        if not ok:
            raise _bad(f"prefilled_images[{i}] must be {{\"grid\": [rows, cols], \"digest\": 64 hex digits}}",
                       "invalid_value", "prefilled_images")
        out.append(PrefilledImage(grid[0], grid[1], bytes.fromhex(digest)))
    return out
