"""DeepSeek-V4.1's vision input: an image processor, an encoder (ViT + aligner) and the image
spans its outputs fill in the token stream.

The edge's interface (stable; the HTTP front, `ringserve generate --image` and `LLM` use it, no
torch), engine/v41/vision/frontend.py:

    from engine.v41.vision.frontend import VisionFrontend
    frontend = VisionFrontend.from_model_dir(model_dir)   # None: no vision tower in the checkpoint
    image = frontend.preprocess(image_bytes)              # (pixels, n_vit_h, n_vit_w, digest)
    ids, starts = frontend.expand_placeholders(prompt_ids, [image, ...])
    submit_images = frontend.image_data([image, ...], starts)   # list[ipc.messages.ImageData]

`preprocess` raises `ImageError` and `expand_placeholders` `PlaceholderError`, both ValueErrors
whose message names the problem (a 400). The prompt holds one `image_token_id`
(`<｜deepseek_image｜>`) per image; the expanded ids hold the image token at every span position.
The engine takes `Submit.images` and refuses, as a RequestError, images for a model without a
tower or loaded with `EngineConfig.language_model_only`.

The stages are separate modules so that they can sit behind a model-neutral multimodal seam:

  * `config`    — the tower's geometry and the resize rules, parsed from the release config (no torch);
  * `processor` — Pillow: an encoded image → checked RGB → DeepSeek's resize plan → the pixels fed;
  * `spans`     — the token layout of one image and the placeholder expansion of a prompt (no torch);
  * `frontend`, `prompt` — the edge's calls above (no torch);
  * `inputs`    — a request's images as the engine holds them (pixels, span places, content digests);
  * `vit`, `aligner`, `encoder` — the tower: pixels → patches → ViT → aligner → the span's rows;
  * `placement` — the rows of a step that are image positions and what goes there;
  * `requests`  — images onto an engine request (checked: RequestError).

Importing this package loads no torch.
"""
