"""The image encoder: pixels → patches → ViT → aligner → the rows of the image's whole span.

`ImageEncoder.span_rows(image)` is what the language model's embedding takes at the span's
positions ([span length, dim] bf16, in span order): `image_start` at IMAGE_START, the aligner's
rows in row-major order at IMAGE, `image_newline` after each row, `image_end` at IMAGE_END.

`EncoderCache` keeps those rows by image content digest, least recently used first, within a
byte budget, so an image is encoded once per request (the prefill chunks of its span read the
cached rows) and once for all requests in flight that carry the same image. A recompute after
preemption reads them too, or encodes again if they were evicted meanwhile (as vLLM's cache).

Release tensor names (`vision.*`, `aligner.*`, `image_start` / `image_end` / `image_newline`)
live under `encoder.` in the engine (`internal_name` / `release_name`).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from .aligner import Aligner
from .config import VisionConfig
from .inputs import SpanImage
from .processor import patches
from .spans import IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_START
from .vit import ViT

SPAN_VECTORS = ("image_start", "image_end", "image_newline")
PREFIX = "encoder."


def internal_name(release: str) -> str | None:
    """The engine's parameter name of a vision release tensor; None for any other tensor."""
    if release.startswith(("vision.", "aligner.")) or release in SPAN_VECTORS:
        return PREFIX + release
    return None


def release_name(internal: str) -> str | None:
    return internal[len(PREFIX):] if internal.startswith(PREFIX) else None


class ImageEncoder(nn.Module):
    def __init__(self, cfg: VisionConfig, lm_dim: int, image_token_id: int):
        super().__init__()
        self.cfg = cfg
        self.image_token_id = image_token_id  # every span position carries it
        self.vision = ViT(cfg)
        self.aligner = Aligner(cfg, lm_dim)
        for name in SPAN_VECTORS:
            setattr(self, name, nn.Parameter(torch.empty(lm_dim, dtype=torch.bfloat16), requires_grad=False))

    @property
    def device(self) -> torch.device:
        return self.vision.norm.weight.device

    @torch.inference_mode()
    def encode(self, pixel_patches: torch.Tensor, n_vit_h: int, n_vit_w: int) -> torch.Tensor:
        """Patches [n_vit_h·n_vit_w, 3, p, p] bf16 → aligner rows [n_llm_h·n_llm_w, dim] bf16."""
        return self.aligner(self.vision(pixel_patches, n_vit_h, n_vit_w), n_vit_h, n_vit_w)

    @torch.inference_mode()
    def span_rows(self, image: SpanImage) -> torch.Tensor:
        """One image's whole span: [span length, dim] bf16 on the encoder's device."""
        data = image.data
        x = patches(data.pixels, data.n_vit_h, data.n_vit_w, self.cfg.patch_size).to(self.device)
        tokens = self.encode(x, data.n_vit_h, data.n_vit_w)
        types = torch.tensor(image.types(), device=self.device)
        rows = torch.empty(types.shape[0], tokens.shape[-1], dtype=torch.bfloat16, device=self.device)
        rows[types == IMAGE] = tokens
        rows[types == IMAGE_START] = self.image_start
        rows[types == IMAGE_NEW_LINE] = self.image_newline
        rows[types == IMAGE_END] = self.image_end
        return rows


class EncoderCache:
    """Span rows by image digest, least recently used dropped first beyond the byte budget (the
    rows a step is placing are used before anything else is encoded, so eviction never races)."""

    def __init__(self, encoder: ImageEncoder, capacity_bytes: int = 256 << 20):
        self.encoder, self.capacity_bytes = encoder, capacity_bytes
        self._rows: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.encoded = 0  # images run through the tower (the rest were cache hits)
        self.hits = 0

    def rows(self, image: SpanImage) -> torch.Tensor:
        key = image.digest
        rows = self._rows.get(key)
        if rows is None:
            rows = self._rows[key] = self.encoder.span_rows(image)
            self.encoded += 1
            self._evict()
        else:
            self._rows.move_to_end(key)
            self.hits += 1
        return rows

    @property
    def bytes_held(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._rows.values())

    def _evict(self) -> None:
        """Drop the least recently used entries while over the budget (the newest always stays)."""
        held = self.bytes_held
        while held > self.capacity_bytes and len(self._rows) > 1:
            _, t = self._rows.popitem(last=False)
            held -= t.numel() * t.element_size()
