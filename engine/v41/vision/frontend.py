"""The edge's half of image input, for the HTTP front, `ringserve generate --image` and `LLM`.

    frontend = VisionFrontend.from_model_dir(model_dir)   # None: the model has no vision tower
    image = frontend.preprocess(image_bytes)              # ValueError (ImageError) naming the problem
    ids, starts = frontend.expand_placeholders(prompt_ids, [image, ...])  # ValueError (PlaceholderError)
    images = frontend.image_data([image, ...], starts)    # -> Submit.images (ipc.messages.ImageData)

`preprocess` runs DeepSeek's image processor (engine/v41/vision/processor.py): it decodes the bytes
with Pillow (PNG, JPEG, WEBP, GIF, BMP; refusing no-image data, zero-sized images, images over
`max_pixels` and decompression bombs), plans the size under the model's token budget and returns
the uint8 RGB pixels the ViT reads, its patch grid and the SHA-256 content digest the engine keys
its encoder cache and prefix cache by. `expand_placeholders` replaces the k-th image token of the
prompt (`image_token_id`, the tokenizer's `<｜deepseek_image｜>`) by image k's span
`IMAGE_START + (IMAGE*w + NEWLINE)*h + IMAGE_END` (every position holds the image token id) and
says where each span starts. The engine re-checks everything it is sent (RequestError).

No torch: this module reads config.json only (engine/config.py, engine/v41/config.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Sequence

from ipc.messages import ImageData

from .config import IMAGE_PLACEHOLDER, VisionConfig
from .processor import DEFAULT_MAX_PIXELS, ImageError, process_image
from .spans import PlaceholderError, expand_placeholders, span_length

__all__ = ["IMAGE_PLACEHOLDER", "ImageError", "PlaceholderError", "PreprocessedImage", "VisionFrontend"]


class PreprocessedImage(NamedTuple):
    """One image as the ViT reads it: uint8 RGB pixels [n_vit_h·p, n_vit_w·p, 3] row-major."""

    pixels: bytes
    n_vit_h: int
    n_vit_w: int
    digest: bytes  # SHA-256 of the size and the pixels (32 bytes)


@dataclass(frozen=True)
class VisionFrontend:
    vision: VisionConfig
    image_token_id: int
    max_pixels: int = DEFAULT_MAX_PIXELS  # decoded size of the largest accepted image

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, max_pixels: int = DEFAULT_MAX_PIXELS) -> "VisionFrontend | None":
        """The frontend of a model directory; None when its checkpoint has no vision tower
        (DeepSeek-V4, or V4.1 with `vision_config.num_hidden_layers` 0)."""
        from engine.config import ModelConfig

        return cls.from_config(ModelConfig.from_model_dir(model_dir), max_pixels)

    @classmethod
    def from_config(cls, cfg, max_pixels: int = DEFAULT_MAX_PIXELS) -> "VisionFrontend | None":
        """The same from an engine ModelConfig."""
        v41 = getattr(cfg, "v41", None)
        if v41 is None or v41.vision is None:
            return None
        return cls(v41.vision, v41.image_token_id, max_pixels)

    @property
    def max_image_bytes(self) -> int:
        """An upper bound on one preprocessed image's pixel bytes under the model's token budget
        (what a request ring's slot must hold per image)."""
        return self.vision.max_patches * self.vision.patch_values

    def preprocess(self, image_bytes: bytes) -> PreprocessedImage:
        """Encoded image bytes → the pixels fed, the patch grid and the digest (ImageError, a
        ValueError naming the problem, for bytes that are no usable image)."""
        done = process_image(image_bytes, self.vision, self.max_pixels)
        return PreprocessedImage(done.pixels, done.plan.n_vit_h, done.plan.n_vit_w, done.digest)

    def span_length(self, image: PreprocessedImage) -> int:
        """Positions the image's span takes in the expanded prompt."""
        r = self.vision.downsample_ratio
        return span_length(math.ceil(image.n_vit_h / r), math.ceil(image.n_vit_w / r))

    def expand_placeholders(self, prompt_ids: Sequence[int],
                            images: Sequence[PreprocessedImage]) -> tuple[list[int], list[int]]:
        """(expanded ids, the start of each image's span); PlaceholderError (a ValueError) when
        the prompt's image tokens and the images differ in number."""
        r = self.vision.downsample_ratio
        grids = [(math.ceil(im.n_vit_h / r), math.ceil(im.n_vit_w / r)) for im in images]
        expanded = expand_placeholders(list(prompt_ids), grids, self.image_token_id)
        return expanded.token_ids, expanded.span_starts

    def image_data(self, images: Sequence[PreprocessedImage], starts: Sequence[int]) -> list[ImageData]:
        """What Submit.images carries (ipc/messages.py), in span order."""
        if len(images) != len(starts):
            raise PlaceholderError(f"{len(images)} image(s) but {len(starts)} span start(s)")
        return [ImageData(start, im.n_vit_h, im.n_vit_w, im.pixels, im.digest) for im, start in zip(images, starts)]
