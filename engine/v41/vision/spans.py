"""The token layout of V4.1 image spans (DeepSeek's rule) and placeholder expansion. No torch.

One image whose aligner grid is h × w tokens occupies

    [IMAGE_START] + ([IMAGE] * w + [IMAGE_NEW_LINE]) * h + [IMAGE_END]

positions: h·(w + 1) + 2, a NEW_LINE after every row (the last one included). Every one of them
carries `image_token_id` in the token ids; only the token type tells them apart. The IMAGE
positions take the aligner's rows in row-major order, the delimiters learned vectors.
"""

from __future__ import annotations

from dataclasses import dataclass

TEXT, IMAGE_START, IMAGE, IMAGE_NEW_LINE, IMAGE_END = -1, 0, 1, 2, 3


def span_length(n_llm_h: int, n_llm_w: int) -> int:
    return n_llm_h * (n_llm_w + 1) + 2


def span_types(n_llm_h: int, n_llm_w: int) -> list[int]:
    """Token types of one image's span, in order."""
    return [IMAGE_START] + ([IMAGE] * n_llm_w + [IMAGE_NEW_LINE]) * n_llm_h + [IMAGE_END]


@dataclass(frozen=True)
class Expanded:
    """A prompt with its placeholders expanded: ids, one token type per id, and where each
    image's span starts (images in placeholder order)."""

    token_ids: list[int]
    token_types: list[int]
    span_starts: list[int]


class PlaceholderError(ValueError):
    """The prompt's image placeholders and the images given do not agree."""


def count_placeholders(prompt_ids: list[int], image_token_id: int) -> int:
    return sum(1 for t in prompt_ids if t == image_token_id)


def expand_placeholders(prompt_ids: list[int], grids: list[tuple[int, int]], image_token_id: int) -> Expanded:
    """Replace the k-th `image_token_id` of the prompt by the span of grids[k] = (n_llm_h,
    n_llm_w). As in DeepSeek's reference every occurrence of the id is a placeholder, so their
    count must equal the number of images."""
    found = count_placeholders(prompt_ids, image_token_id)
    if found != len(grids):
        raise PlaceholderError(f"the prompt has {found} image placeholder(s) (token {image_token_id}) but "
                               f"{len(grids)} image(s) were given")
    ids: list[int] = []
    types: list[int] = []
    starts: list[int] = []
    images = iter(grids)
    for token in prompt_ids:
        if token != image_token_id:
            ids.append(token)
            types.append(TEXT)
            continue
        layout = span_types(*next(images))
        starts.append(len(ids))
        ids += [image_token_id] * len(layout)
        types += layout
    return Expanded(ids, types, starts)
