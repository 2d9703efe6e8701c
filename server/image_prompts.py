"""Offline prompts with images (the `LLM` API and `ringserve generate --image`), as vLLM takes them:

    llm.generate({"prompt": "Describe <｜deepseek_image｜>.", "multi_modal_data": {"image": img}})
    llm.generate({"prompt_token_ids": [..., image_token_id, ...], "multi_modal_data": {"image": [a, b]}})

An image is a PIL image, encoded bytes, or a path to an image file. The prompt holds one image
placeholder per image (the `<｜deepseek_image｜>` token, or its id in token-id prompts), in the
images' order; each becomes the image's span (DeepSeek-V4.1's layout) and the image its ipc
`ImageData`. Problems are ValueErrors naming the prompt and the image. No torch.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

PLACEHOLDER = "<｜deepseek_image｜>"


def image_bytes(image: Any, where: str) -> bytes:
    """Encoded bytes of an offline image (PIL images are written as PNG, losslessly)."""
    if isinstance(image, (bytes, bytearray, memoryview)):
        return bytes(image)
    if isinstance(image, (str, Path)):
        path = Path(image)
        if not path.is_file():
            raise ValueError(f"{where}: {path}: no such image file")
        return path.read_bytes()
    if type(image).__module__.startswith("PIL."):
        out = io.BytesIO()
        image.save(out, "PNG")
        return out.getvalue()
    raise ValueError(f"{where}: an image must be a PIL image, bytes or a file path, not {type(image).__name__}")


def images_of(multi_modal_data: Any, index: int) -> list:
    """The `image` entry of a prompt's multi_modal_data, as a list."""
    if multi_modal_data is None:
        return []
    if not isinstance(multi_modal_data, dict) or set(multi_modal_data) - {"image"}:
        raise ValueError(f"prompt {index}: multi_modal_data takes only an 'image' entry (DeepSeek-V4.1 sees images)")
    images = multi_modal_data.get("image", [])
    return list(images) if isinstance(images, (list, tuple)) else [images]


class ImagePrompts:
    """The model's vision frontend and its per-prompt limit, for offline prompts."""

    def __init__(self, model_cfg, language_model_only: bool = False, limit: int | None = None):
        from .multimodal import DEFAULT_IMAGE_LIMIT, Multimodal

        mm = Multimodal.for_model(model_cfg, language_model_only=language_model_only,
                                  limit=DEFAULT_IMAGE_LIMIT if limit is None else limit)
        self.frontend, self.limit, self.refusal, self.submit_bytes = mm.frontend, mm.limit, mm.refusal, mm.submit_bytes

    @property
    def image_token_id(self) -> int | None:
        return self.frontend.image_token_id if self.frontend is not None else None

    def expand(self, ids: list[int], images: list, index: int) -> tuple[list[int], list]:
        """(expanded ids, ImageData list) of one prompt's placeholder ids and images."""
        if not images:
            return ids, []
        if self.refusal is not None:
            raise ValueError(f"prompt {index}: {self.refusal}")
        if len(images) > self.limit:
            raise ValueError(f"prompt {index}: {len(images)} images; at most {self.limit} are allowed per prompt "
                             "(--limit-mm-per-prompt)")
        done = []
        for k, image in enumerate(images):
            where = f"prompt {index}, image {k}"
            try:
                done.append(self.frontend.preprocess(image_bytes(image, where)))
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from None
        try:
            expanded, starts = self.frontend.expand_placeholders(ids, done)
        except ValueError as exc:
            raise ValueError(f"prompt {index}: {exc}") from None
        return expanded, self.frontend.image_data(done, starts)
