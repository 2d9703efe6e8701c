"""Images onto an engine request: the engine's one call-in point for multimodal input.

`Engine.add_request(..., images=...)` checks a request's images against its prompt and the model
(`check_images`) and hangs the result on the request (`request.multimodal`); the scheduler then
gives it to the request's KV sequence when it makes one. The model's capability is its
`encoder` (None: no vision tower, or one skipped by `language_model_only`).
"""

from __future__ import annotations

from ipc.messages import ImageData

from ...request import RequestError
from .inputs import ImagePositions, RequestImages, check_request_images


def check_images(model, prompt_token_ids: list[int], images: list[ImageData],
                 decode_leg: bool = False) -> RequestImages | ImagePositions | None:
    """The request's images checked against its prompt and the model (RequestError naming the
    problem: a model without a vision tower — a V4 model, a text-only V4.1 checkpoint or one
    loaded with --language-model-only —, grids and pixels that disagree, spans that do not sit
    on the image token, an image token outside every span). `decode_leg`: a PD decode leg, which
    may come without its images (the prefill computed them): then only their positions."""
    encoder = getattr(model, "encoder", None)
    if encoder is None:
        if images:
            why = ("it was loaded with --language-model-only" if getattr(model, "encoder_skipped", False)
                   else "it has no vision tower")
            raise RequestError(f"this model takes no image input ({why})")
        return None
    if decode_leg and not images:
        return ImagePositions.of_prompt(prompt_token_ids, encoder.image_token_id)
    try:
        return check_request_images(images, prompt_token_ids, encoder.cfg, encoder.image_token_id)
    except ValueError as exc:
        raise RequestError(str(exc)) from None
