"""DeepSeek-V4.1 images through the engine, on a tiny release-format checkpoint with a vision
tower (`write_v41_checkpoint(..., vision=True)`: ViT patch 8, downsample 2, a 48-token image
budget). Row-independent numerics, so a token's result does not depend on what shares its step
and every path must give the plain batched run's tokens and logprobs exactly:
  * the checkpoint loads its tower with no flag; `language_model_only` loads none of it and
    refuses image input (RequestError), also through the worker's loader;
  * chunked prefill (5 tokens a step) across the spans, and an encoder cache that encodes each
    distinct image once although its span is prefilled over several steps and two requests carry it;
  * prefix caching keyed by image content: the same text with another image (same size, so the
    same ids) shares only the blocks before the image, and gives its cold run's output; the same
    image hits and resumes mid-span;
  * preemption and recompute;
  * the worker takes Submit.images; the wire's ImageData survives the ipc codec.
Golden parity against DeepSeek's reference is in test_vision_golden.py."""

from __future__ import annotations

import asyncio
import io

import numpy as np
import pytest
from PIL import Image

from engine.config import EngineConfig, ParallelConfig
from engine.engine import Engine
from engine.request import RequestError
from engine.v41.checkpoint import write_v41_checkpoint
from engine.v41.vision.frontend import VisionFrontend
from engine.weights import load_model
from ipc.codec import decode, encode
from ipc.messages import Finished, SamplingParams, Submit, TokenDelta
from tests.v41.engine_helpers import load

MAX_TOKENS = 4
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=512, num_kv_blocks=96, block_size=16, speculative_tokens=0,
              adaptive_speculation=False, max_model_len=512)


def png(width: int, height: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_v41_checkpoint(tmp_path_factory.mktemp("v41vision") / "tiny", "tiny", seed=5, quantize="fp8-fp4",
                                vision=True)


@pytest.fixture(scope="module")
def model(model_dir):
    return load(model_dir, row_independent=True)


@pytest.fixture(scope="module")
def frontend(model_dir) -> VisionFrontend:
    return VisionFrontend.from_model_dir(model_dir)


@pytest.fixture(scope="module")
def images(frontend):
    """x and y: the same size (so the same span and ids), different pixels; z: another size."""
    return {name: frontend.preprocess(png(*size, seed)) for name, size, seed in
            (("x", (64, 48), 1), ("y", (64, 48), 2), ("z", (30, 90), 3))}


def request(frontend, text_before: list[int], pictures: list, text_after: list[int]):
    """(expanded ids, Submit.images) of text, one placeholder per picture, text."""
    prompt = text_before + [frontend.image_token_id] * len(pictures) + text_after
    if len(pictures) == 2:  # the second image between the two texts' halves
        half = len(text_after) // 2
        prompt = text_before + [frontend.image_token_id] + text_after[:half] + [frontend.image_token_id] + \
            text_after[half:]
    ids, starts = frontend.expand_placeholders(prompt, pictures)
    return ids, frontend.image_data(pictures, starts)


def words(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 500, n).tolist()


def run(engine: Engine, requests: list[tuple[list[int], list]], first_id: int = 0, handles: list | None = None):
    """Greedy tokens and chosen-token logprobs of every request, all added at once (`handles`
    collects the engine's Request objects)."""
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    for i, (ids, imgs) in enumerate(requests):
        req = engine.add_request(first_id + i, ids, params, images=imgs)
        if handles is not None:
            handles.append(req)
    out = {first_id + i: ([], []) for i in range(len(requests))}
    while engine.has_work:
        for d in engine.step().deltas:
            out[d.request_id][0].extend(d.token_ids)
            out[d.request_id][1].extend(d.logprobs)
    return [out[first_id + i] for i in range(len(requests))]


@pytest.fixture(scope="module")
def prompts(frontend, images):
    return [request(frontend, words(20, 1), [images["x"]], words(20, 2)),
            request(frontend, words(3, 3), [images["z"], images["x"]], words(6, 4)),
            request(frontend, words(20, 1), [images["y"]], words(20, 2))]


@pytest.fixture(scope="module")
def batched(model, prompts):
    return run(Engine(model, EngineConfig(**{**ENGINE, "enable_prefix_caching": False})), prompts)


def test_tower_loads_without_a_flag_and_language_model_only_skips_it(model_dir, model, prompts):
    from engine.worker_process import _load

    assert model.encoder is not None and model.encoder.image_token_id == model.cfg.vocab_size - 1
    text = load_model(model_dir, progress=False, load_mtp=False, language_model_only=True)
    assert text.encoder is None and not any(n.startswith("encoder.") for n, _ in text.named_parameters())
    engine = Engine(text, EngineConfig(**ENGINE))
    ids, imgs = prompts[0]
    with pytest.raises(RequestError, match="language-model-only"):
        engine.add_request(0, ids, SamplingParams(max_tokens=2), images=imgs)
    assert not engine.has_work
    via_worker, _ = _load(str(model_dir), EngineConfig(**ENGINE, language_model_only=True), ParallelConfig(),
                          "cpu", None)
    assert via_worker.encoder is None and via_worker.encoder_skipped


def test_chunked_prefill_across_spans_and_one_encoding_per_image(model, prompts, batched):
    engine = Engine(model, EngineConfig(**{**ENGINE, "max_num_batched_tokens": 5, "enable_prefix_caching": False}))
    assert run(engine, prompts) == batched
    cache = engine.runner.encoder_cache
    assert cache.encoded == 3  # x (in two requests, each span over several steps), y, z
    assert batched[0] != batched[2]  # another image, the same ids: another output


def test_prefix_cache_keys_blocks_by_image_content(model, prompts, batched):
    """x's request first; then the same ids with y (only the text block before the image may be
    shared) and with x again (hits through the span, resumes inside it)."""
    engine = Engine(model, EngineConfig(**ENGINE))
    assert prompts[0][0] == prompts[2][0] and prompts[0][1][0].digest != prompts[2][1][0].digest
    assert run(engine, [prompts[0]]) == [batched[0]]
    start = prompts[0][1][0].start
    held: list = []
    assert run(engine, [prompts[2]], 10, held) == [batched[2]]
    assert held[0].num_cached_tokens <= start // 16 * 16  # nothing from the block holding the span start on
    assert run(engine, [prompts[0]], 20, held) == [batched[0]]
    assert held[1].num_cached_tokens >= 3 * 16 > start  # through the span: resumed inside or after it
    assert engine.runner.encoder_cache.encoded == 2  # x once (the hit's replay re-read it), y once


def test_preempted_and_recomputed_with_images(model, prompts, batched):
    """12 blocks of 8 and 16 tokens a step: all three start, and the newest is preempted
    (its blocks freed) as the others grow, then recomputed through its spans."""
    engine = Engine(model, EngineConfig(**{**ENGINE, "num_kv_blocks": 12, "block_size": 8,
                                           "max_num_batched_tokens": 16, "enable_prefix_caching": False}))
    assert run(engine, prompts) == batched
    assert engine.stats.num_preemptions >= 1


def test_worker_takes_submit_images(model, prompts, batched):
    from engine.worker import Worker
    from ipc.loop import new_event_loop

    ids, imgs = prompts[0]
    wire = decode(encode(Submit(7, ids, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0),
                                None, imgs)), "to_worker")
    assert wire.images == imgs
    engine = Engine(model, EngineConfig(**{**ENGINE, "enable_prefix_caching": False}))
    got: list = []
    worker = Worker(engine, lambda out: got.extend(out.deltas + out.finished))

    async def main():
        task = asyncio.ensure_future(worker.run())
        worker.submit(wire.request_id, wire.prompt_token_ids, wire.params, wire.kv_transfer_params, wire.images)
        worker.submit(8, ids, SamplingParams(max_tokens=2), None, imgs[:0])  # the image token without its image
        while sum(isinstance(d, Finished) for d in got) < 2:
            await asyncio.sleep(0.01)
        worker.stop()
        await task

    loop = new_event_loop()
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
        worker.close()
    deltas = [d for d in got if isinstance(d, TokenDelta) and d.request_id == 7]
    assert ([t for d in deltas for t in d.token_ids], [x for d in deltas for x in d.logprobs]) == batched[0]
    refused = next(d for d in got if isinstance(d, Finished) and d.request_id == 8)
    assert refused.reason == "error" and refused.error_code == 400 and "no image was given" in refused.error
    assert engine.cache.manager.full.num_used == 0
