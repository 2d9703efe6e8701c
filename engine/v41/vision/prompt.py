"""A prompt with image placeholders + its images → what a request carries (the edge's half).

`build_prompt(prompt_ids, processed, cfg)`: each `image_token_id` placeholder in `prompt_ids`
is expanded into its image's span (engine/v41/vision/spans.py), and each image becomes the wire's
`ImageData` (its pixels, grid, digest and where its span starts). Used by the HTTP front
(server/multimodal.py), `ringserve generate --image`, the offline `LLM` and the tests. No torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from ipc.messages import ImageData

from .processor import ProcessedImage
from .spans import expand_placeholders


@dataclass(frozen=True)
class ImagePrompt:
    token_ids: list[int]  # expanded: every span position holds the image token id
    token_types: list[int]  # -1 text, 0..3 the span types
    images: list[ImageData]  # in span order


def build_prompt(prompt_ids: list[int], processed: list[ProcessedImage], image_token_id: int) -> ImagePrompt:
    """PlaceholderError (a ValueError) when the placeholders and images do not pair up."""
    expanded = expand_placeholders(prompt_ids, [(im.plan.n_llm_h, im.plan.n_llm_w) for im in processed],
                                   image_token_id)
    images = [ImageData(start, im.plan.n_vit_h, im.plan.n_vit_w, im.pixels, im.digest)
              for start, im in zip(expanded.span_starts, processed)]
    return ImagePrompt(expanded.token_ids, expanded.token_types, images)
