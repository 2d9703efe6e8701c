"""A request's images as the engine holds them, checked against its prompt and the model.

`RequestImages` is built once, when the request is added (`check_request_images`), from the wire's
`ImageData` (ipc/messages.py): for each image its span [start, end) in the prompt, its grids and
its pixels and content digest. Every other part of the engine asks it about positions:
  * the image mask of any position range (MoE routing with `gate.bias_vl`, Engram DEAD positions);
  * the images a range overlaps (the embeddings a prefill chunk places);
  * the digests of the images that begin in a block (folded into the prefix-cache block keys).
The positions are prompt positions; generated tokens are always text (DeepSeek's decode steps
pass no token types).

It hangs on the request as `request.multimodal` and on its KV sequence as `seq.multimodal` (the
model's forward and the Engram history rebuild see sequences, not requests).
"""

from __future__ import annotations

import bisect
import hashlib
import math
import os
from dataclasses import dataclass, field

from ipc.messages import ImageData

from .config import VisionConfig
from .spans import span_length, span_types


def pixel_digest(pixels, height: int, width: int) -> bytes:
    """The content key of fed pixels (encoder cache, prefix-cache block keys): SHA-256 of the
    size and the uint8 RGB bytes (`pixels`: bytes or a numpy array)."""
    h = hashlib.sha256()
    h.update(height.to_bytes(4, "little") + width.to_bytes(4, "little"))
    h.update(pixels if isinstance(pixels, (bytes, bytearray, memoryview)) else pixels.tobytes())
    return h.digest()


@dataclass(frozen=True)
class SpanImage:
    """One image of a request: its data and where its span lies."""

    data: ImageData
    n_llm_h: int
    n_llm_w: int

    @property
    def start(self) -> int:
        return self.data.start

    @property
    def length(self) -> int:
        return span_length(self.n_llm_h, self.n_llm_w)

    @property
    def end(self) -> int:
        return self.data.start + self.length

    @property
    def digest(self) -> bytes:
        return self.data.digest

    def types(self) -> list[int]:
        return span_types(self.n_llm_h, self.n_llm_w)


@dataclass(frozen=True)
class RequestImages:
    images: tuple[SpanImage, ...]  # ascending, disjoint spans

    def overlapping(self, start: int, end: int) -> list[SpanImage]:
        """Images whose span meets positions [start, end)."""
        return [im for im in self.images if im.start < end and im.end > start]

    def meets(self, start: int, end: int) -> bool:
        """Whether [start, end) holds an image-span position."""
        return bool(self.overlapping(start, end))

    def mask(self, start: int, end: int) -> list[bool]:
        """Per position of [start, end): inside an image span."""
        out = [False] * max(0, end - start)
        for im in self.overlapping(start, end):
            for p in range(max(start, im.start), min(end, im.end)):
                out[p - start] = True
        return out

    def digests_starting_in(self, start: int, end: int) -> bytes:
        """The digests of the images whose span starts in positions [start, end), concatenated."""
        starts = [im.start for im in self.images]
        lo, hi = bisect.bisect_left(starts, start), bisect.bisect_left(starts, end)
        return b"".join(im.digest for im in self.images[lo:hi])


@dataclass(frozen=True)
class ImagePositions:
    """Where a prompt's image spans are, without the images: a PD decode leg sent no pixels (the
    prefill computed the spans). The runs of the image token in the prompt are exactly its spans'
    positions (checked on the prefill leg), so their masks are known (Engram's DEAD positions);
    placing embeddings is not possible, and the decode side never computes a span position
    (engine/kv_transfer/decode_side.py refuses a replay that would)."""

    runs: tuple[tuple[int, int], ...]  # [start, end) runs of the image token, ascending
    # Stands in for the unknown digests in prefix-cache keys: this request shares no block from
    # its first image on (PD roles run without a prefix cache today; this keeps it safe).
    nonce: bytes = field(default_factory=lambda: os.urandom(16))

    @classmethod
    def of_prompt(cls, prompt_ids: list[int], image_token_id: int) -> "ImagePositions | None":
        runs: list[tuple[int, int]] = []
        for p, t in enumerate(prompt_ids):
            if t != image_token_id:
                continue
            if runs and runs[-1][1] == p:
                runs[-1] = (runs[-1][0], p + 1)
            else:
                runs.append((p, p + 1))
        return cls(tuple(runs)) if runs else None

    def meets(self, start: int, end: int) -> bool:
        return any(lo < end and hi > start for lo, hi in self.runs)

    def overlapping(self, start: int, end: int) -> list[SpanImage]:
        if self.meets(start, end):
            raise RuntimeError(f"positions [{start}, {end}) hold image spans whose images this engine was not sent")
        return []

    def mask(self, start: int, end: int) -> list[bool]:
        out = [False] * max(0, end - start)
        for lo, hi in self.runs:
            for p in range(max(start, lo), min(end, hi)):
                out[p - start] = True
        return out

    def digests_starting_in(self, start: int, end: int) -> bytes:
        return self.nonce if any(start <= lo < end for lo, _ in self.runs) else b""


def multimodal_of(obj) -> RequestImages | None:
    """A request's (or a KV sequence's) images; None for text."""
    return getattr(obj, "multimodal", None)


def attach_to_sequence(req) -> None:
    """Give the request's KV sequence its images (call when the sequence is made)."""
    images = multimodal_of(req)
    if images is not None and req.seq is not None:
        req.seq.multimodal = images


def check_request_images(images: list[ImageData], prompt_ids: list[int], vision: VisionConfig | None,
                         image_token_id: int) -> RequestImages | None:
    """The wire's images of a prompt, checked (ValueError naming the problem): a model with a
    vision tower; each image's pixel size its grids' and within the model's token budget; its
    digest that of its pixels (the caches trust it: another image must never share an entry); spans
    in order, inside the prompt, disjoint, holding only the image token; and no image token
    outside them (as in DeepSeek's reference, every image token id is part of an image)."""
    if not images:
        if vision is not None and image_token_id in prompt_ids:
            raise ValueError(f"the prompt holds the image token {image_token_id} but no image was given")
        return None
    if vision is None:
        raise ValueError("this model takes no image input (no vision tower, or --language-model-only)")
    p, r = vision.patch_size, vision.downsample_ratio
    spans, covered = [], 0
    for k, data in enumerate(images):
        expected = data.n_vit_h * p * data.n_vit_w * p * 3
        if len(data.pixels) != expected:
            raise ValueError(f"image {k}: {len(data.pixels)} pixel bytes for a {data.n_vit_h}x{data.n_vit_w} "
                             f"patch grid (expected {expected})")
        if pixel_digest(data.pixels, data.n_vit_h * p, data.n_vit_w * p) != data.digest:
            raise ValueError(f"image {k}: its digest is not the SHA-256 of its size and pixels")
        im = SpanImage(data, math.ceil(data.n_vit_h / r), math.ceil(data.n_vit_w / r))
        if im.length > vision.max_n_token:
            raise ValueError(f"image {k}: its span of {im.length} tokens exceeds the model's "
                             f"{vision.max_n_token}-token image budget")
        if spans and im.start < spans[-1].end:
            raise ValueError(f"image {k}: its span starts at {im.start}, inside or before the previous one")
        if im.end > len(prompt_ids):
            raise ValueError(f"image {k}: its span [{im.start}, {im.end}) runs past the prompt ({len(prompt_ids)})")
        if any(t != image_token_id for t in prompt_ids[im.start: im.end]):
            raise ValueError(f"image {k}: its span [{im.start}, {im.end}) holds ids other than the image token "
                             f"{image_token_id}")
        spans.append(im)
        covered += im.length
    if sum(1 for t in prompt_ids if t == image_token_id) != covered:
        raise ValueError(f"the prompt holds the image token {image_token_id} outside the images' spans")
    return RequestImages(tuple(spans))
