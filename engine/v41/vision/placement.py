"""Which rows of a forward are image-span positions, and the embeddings they take.

A forward's rows are its chunks' positions, flattened (engine/v41/attention.py `Chunk`). A chunk
may cover any part of a span — prefill is chunked across images as across text — so each chunk
takes the slice of the span rows (`EncoderCache`, engine/v41/vision/encoder.py) that falls in its
positions. The model overwrites the token embedding of those rows with them (the image token id
is looked up first, as in DeepSeek's reference), routes them with `gate.bias_vl` and shuts their
Engram gates (`mask`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepImages:
    mask: torch.Tensor  # [T] bool, device: the row is an image-span position
    host_mask: torch.Tensor  # [T] bool, host: the same (Engram hashes on the host)
    rows: torch.Tensor  # [N] long, device: the image rows
    embeds: torch.Tensor  # [N, dim] bf16, device: what they hold

    def kept(self, rows: torch.Tensor) -> "StepImages":
        """The masks of a subset of rows (the decoder tail keeps the last rows of each chunk);
        the embeddings are placed before any row is dropped, so they are not carried."""
        return StepImages(self.mask[rows], self.host_mask[rows.cpu()], self.rows[:0], self.embeds[:0])


def step_images(chunks, encoder_cache, device: torch.device) -> StepImages | None:
    """The image rows of a forward over `chunks` (None when no chunk meets an image span).
    `encoder_cache`: the EncoderCache that gives each image's span rows (encoding it on first use)."""
    host_mask: list[bool] = []
    rows: list[int] = []
    parts: list[torch.Tensor] = []
    for c in chunks:
        images = getattr(c.seq, "multimodal", None)
        if images is None:
            host_mask += [False] * c.length
            continue
        host_mask += images.mask(c.start, c.end)
        for im in images.overlapping(c.start, c.end):
            if encoder_cache is None:
                raise RuntimeError("a request with images reached a model without its vision tower")
            lo, hi = max(c.start, im.start), min(c.end, im.end)
            parts.append(encoder_cache.rows(im)[lo - im.start: hi - im.start])
            rows.extend(range(c.begin + lo - c.start, c.begin + hi - c.start))
    if not rows:
        return None
    host = torch.tensor(host_mask, dtype=torch.bool)
    return StepImages(host.to(device), host, torch.tensor(rows, dtype=torch.long, device=device),
                      torch.cat(parts).to(device))
