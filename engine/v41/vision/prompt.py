"""A prompt with image placeholders + its processed images → ids, token types and the wire's images.

`build_prompt(prompt_ids, processed, image_token_id)`: each `image_token_id` placeholder in
`prompt_ids` is expanded into its image's span (engine/v41/vision/spans.py), with the token type
of every position (what DeepSeek's reference reports), and each image becomes the wire's
`ImageData`. The edge's stable interface is engine/v41/vision/frontend.py (`VisionFrontend`);
this is the same at the level of processor.ProcessedImage (its plan included), for tests and
tools. No torch.
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
