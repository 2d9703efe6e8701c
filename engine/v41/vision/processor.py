"""DeepSeek-V4.1's image preprocessing with Pillow: an encoded image → checked RGB → the resize
plan → the pixels the ViT reads.

The plan (DeepSeek's `plan_image_grid` / `safe_resize`), for an image of w × h pixels, patch p,
downsample r and a token budget N per image:
  1. with `max_wh_ratio` set and w > h·ratio, w := h·ratio;
  2. if 0 < w·h < `min_pixels`, both sides scale by √(min_pixels / (w·h)) and truncate;
  3. the pixel size is each side rounded up to a multiple of p, the ViT grid that size / p and
     the LLM grid ⌈ViT grid / r⌉ per side;
  4. if the span h_llm·(w_llm + 1) + 2 exceeds N, the size shrinks, aspect kept, to the largest
     whose grid fits (`_shrink`).
The image then reaches that size by Pillow: a plain resize when `max_wh_ratio` is set and
w ≥ ratio·h (a stretch), else `ImageOps.pad` (aspect-preserving BICUBIC resize, centred on gray
127). Pixels are fed as uint8 RGB; `patches` turns them into what the ViT embeds, as the
reference does: x/255, (x − 0.5)/0.5 in fp32, rounded to bf16, cut into p × p patches in
row-major order, each [3, p, p].

Checks at decode (`ImageError`, naming the problem): bytes that are no image, formats outside
`SUPPORTED_FORMATS`, zero-sized images, more pixels than allowed (a decompression bomb is refused
from its header, before anything is decoded), and images that fail to decode (truncated).
"""

from __future__ import annotations

import io
import math
import warnings
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from .config import VisionConfig
from .inputs import pixel_digest
from .spans import span_length

SUPPORTED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
DEFAULT_MAX_PIXELS = 8192 * 8192  # decoded size of the largest accepted image (a 64 MP photo)
MAX_ENCODED_BYTES = 64 << 20  # the largest encoded image accepted
LETTERBOX_GRAY = (127, 127, 127)
# Pillow refuses (DecompressionBombError) images over twice this and warns over it; decode_image
# turns the warning into a refusal too. Never raised above our own limit.
Image.MAX_IMAGE_PIXELS = min(Image.MAX_IMAGE_PIXELS or DEFAULT_MAX_PIXELS, DEFAULT_MAX_PIXELS)


class ImageError(ValueError):
    """An image that cannot be used; the message names the problem."""


@dataclass(frozen=True)
class ImagePlan:
    """How one image is fed: the pixel size it is brought to and the grids that follow."""

    best_width: int
    best_height: int
    n_llm_h: int
    n_llm_w: int
    patch_size: int
    stretch: bool  # a plain resize to the size (else ImageOps.pad's letterbox)

    @property
    def n_vit_h(self) -> int:
        return self.best_height // self.patch_size

    @property
    def n_vit_w(self) -> int:
        return self.best_width // self.patch_size

    @property
    def span_length(self) -> int:
        return span_length(self.n_llm_h, self.n_llm_w)


def _llm_grid(best_h: int, best_w: int, p: int, r: int) -> tuple[int, int]:
    return math.ceil((best_h // p) / r), math.ceil((best_w // p) / r)


def _shrink(height: float, width: float, p: int, r: int, max_n_token: int) -> tuple[int, int]:
    """The largest aspect-preserving pixel size (h, w), multiples of p, whose LLM grid fits
    max_n_token positions: the real grid width solving h_c·(w_c + 1) + 2 = N with h_c = w_c·h/w,
    w_c = √((N − 2)·w/h + ¼) − ½, floored to whole r × r cells (one row or column at the extremes)."""
    aspect = height / width
    w_cells = math.sqrt((max_n_token - 2) / aspect + 0.25) - 0.5
    h_cells = w_cells * aspect
    cell = p * r
    if w_cells < 1.0:  # very tall: one column of cells
        return (max_n_token - 2) // 2 * cell, cell
    if h_cells < 1.0:  # very wide: one row of cells
        return cell, (max_n_token - 3) * cell
    beta = min(math.floor(w_cells) * cell / width, math.floor(h_cells) * cell / height)
    return math.floor(height * beta / p) * p, math.floor(width * beta / p) * p


def plan_image(width: int, height: int, cfg: VisionConfig) -> ImagePlan:
    """The plan for an image of width × height pixels (a pure function, as DeepSeek's)."""
    p, r = cfg.patch_size, cfg.downsample_ratio
    stretch = cfg.max_wh_ratio is not None and width >= cfg.max_wh_ratio * height
    w: float = width
    h: float = height
    if cfg.max_wh_ratio is not None and w > h * cfg.max_wh_ratio:
        w = h * cfg.max_wh_ratio
    if 0 < w * h < cfg.min_pixels:
        scale = (cfg.min_pixels / (w * h)) ** 0.5
        w, h = int(w * scale), int(h * scale)
    best_w, best_h = math.ceil(w / p) * p, math.ceil(h / p) * p
    n_h, n_w = _llm_grid(best_h, best_w, p, r)
    if span_length(n_h, n_w) > cfg.max_n_token:
        best_h, best_w = _shrink(h, w, p, r, cfg.max_n_token)
        n_h, n_w = _llm_grid(best_h, best_w, p, r)
    if best_w <= 0 or best_h <= 0:
        raise ImageError(f"a {width}x{height} image has too extreme an aspect ratio for this model's "
                         f"{cfg.max_n_token}-token image budget")
    assert span_length(n_h, n_w) <= cfg.max_n_token, (width, height, n_h, n_w)
    return ImagePlan(best_w, best_h, n_h, n_w, p, stretch)


def decode_image(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """Encoded bytes → an RGB image (the first frame of an animation), or ImageError. Pillow's
    own decompression-bomb check (`Image.MAX_IMAGE_PIXELS`, set to DEFAULT_MAX_PIXELS here) is
    an error, not a warning; `max_pixels` can only lower that limit."""
    if not data:
        raise ImageError("the image is empty (0 bytes)")
    if len(data) > MAX_ENCODED_BYTES:
        raise ImageError(f"the image is {len(data)} bytes, more than the {MAX_ENCODED_BYTES} allowed")
    limit = min(max_pixels, DEFAULT_MAX_PIXELS)
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            source = Image.open(io.BytesIO(data))
        except UnidentifiedImageError:
            raise ImageError("the data is not an image Pillow can identify "
                             f"(supported formats: {', '.join(SUPPORTED_FORMATS)})") from None
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            raise ImageError(f"the image is too large, refused as a possible decompression bomb: {exc}") from None
        except (OSError, ValueError, SyntaxError, EOFError) as exc:
            raise ImageError(f"the image cannot be read: {exc}") from None
        with source:
            if source.format not in SUPPORTED_FORMATS:
                raise ImageError(f"unsupported image format {source.format} "
                                 f"(supported: {', '.join(SUPPORTED_FORMATS)})")
            width, height = source.size
            if width <= 0 or height <= 0:
                raise ImageError(f"the image has no pixels ({width}x{height})")
            if width * height > limit:
                raise ImageError(f"the image is {width}x{height} = {width * height} pixels, more than the "
                                 f"{limit} allowed (refused from its header, before decoding)")
            try:
                return source.convert("RGB")
            except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
                raise ImageError(f"the image is too large, refused as a possible decompression bomb: {exc}") from None
            except (OSError, ValueError, SyntaxError, EOFError, MemoryError) as exc:
                raise ImageError(f"the {source.format} image does not decode: {exc}") from None


def fit_image(image: Image.Image, cfg: VisionConfig) -> tuple[np.ndarray, ImagePlan]:
    """An RGB image → (uint8 [best_height, best_width, 3] pixels, its plan)."""
    plan = plan_image(image.width, image.height, cfg)
    size = (plan.best_width, plan.best_height)
    fitted = image.resize(size) if plan.stretch else ImageOps.pad(image, size, color=LETTERBOX_GRAY)
    return np.asarray(fitted, dtype=np.uint8), plan


@dataclass(frozen=True)
class ProcessedImage:
    """One image ready for the engine: its plan, the uint8 RGB pixels fed and their digest."""

    plan: ImagePlan
    pixels: bytes  # best_height · best_width · 3 bytes, row-major RGB
    digest: bytes


def process_image(data: bytes, cfg: VisionConfig, max_pixels: int = DEFAULT_MAX_PIXELS) -> ProcessedImage:
    """Encoded image bytes → what the engine takes (ImageError for an unusable image)."""
    pixels, plan = fit_image(decode_image(data, max_pixels), cfg)
    return ProcessedImage(plan, pixels.tobytes(), pixel_digest(pixels, plan.best_height, plan.best_width))


def patches(pixels, n_vit_h: int, n_vit_w: int, p: int):
    """uint8 RGB [n_vit_h·p, n_vit_w·p, 3] (a tensor, array or bytes) → bf16 patches
    [n_vit_h·n_vit_w, 3, p, p] in row-major patch order, normalised as the reference does."""
    import torch

    if isinstance(pixels, (bytes, bytearray, memoryview)):
        pixels = torch.frombuffer(bytearray(pixels), dtype=torch.uint8)
    elif isinstance(pixels, np.ndarray):
        pixels = torch.from_numpy(np.ascontiguousarray(pixels))
    x = pixels.reshape(n_vit_h * p, n_vit_w * p, 3).permute(2, 0, 1).float() / 255  # [3, H, W]
    x = ((x - 0.5) / 0.5).to(torch.bfloat16)
    return x.reshape(3, n_vit_h, p, n_vit_w, p).permute(1, 3, 0, 2, 4).reshape(n_vit_h * n_vit_w, 3, p, p)
