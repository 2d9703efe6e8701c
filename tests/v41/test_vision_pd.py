"""Prefill/decode disaggregation with images (DeepSeek-V4.1 vision), on a tiny release-format
checkpoint with a vision tower; two engines in this process, each with its own NIXL agent.

The prefill leg runs the encoder. The decode leg READs the global records and replays the
prompt's last positions (its receptive field) to rebuild the window state: where that replay
reaches an image span it needs the image's rows, so a decode leg sent with its images gives the
cold colocated run exactly; one sent without them gives it too when the replay stays clear of
every span (the Engram history below the replay marks the span positions DEAD from the token ids
alone), and is refused with a 400 naming the problem when it would not. Row-independent
numerics, decode pools poisoned (a row the replay should have rebuilt and did not shows up)."""

from __future__ import annotations


import msgspec
import numpy as np
import pytest

pytest.importorskip("nixl_cu12", reason="nixl-cu12 is not installed")

from engine.config import EngineConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.kv_connector import attach_connector  # noqa: E402
from engine.kv_transfer.config import KVTransferConfig  # noqa: E402
from engine.request import RequestError  # noqa: E402
from engine.v41.checkpoint import write_v41_checkpoint  # noqa: E402
from engine.v41.vision.frontend import VisionFrontend  # noqa: E402
from ipc.kv_transfer_params import KVTransferParams  # noqa: E402
from ipc.messages import SamplingParams  # noqa: E402
from pd_engines import collect, poison_pools, ucx_environment, wait_for_leases  # noqa: E402
from tests.v41.engine_helpers import load  # noqa: E402
from tests.v41.test_vision_engine import png  # noqa: E402

B = 16
PARAMS = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=0)
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=512, num_kv_blocks=96, block_size=B, speculative_tokens=0,
              adaptive_speculation=False, max_model_len=512)
LEG1 = KVTransferParams(do_remote_decode=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_v41_checkpoint(tmp_path_factory.mktemp("v41pdv") / "tiny", "tiny", seed=6, quantize="fp8-fp4",
                                vision=True)


@pytest.fixture(scope="module")
def model(model_dir):
    return load(model_dir, row_independent=True)


@pytest.fixture(scope="module")
def prompts(model_dir):
    """'late': the image among the last positions (inside the replay); 'early': the image
    first, then 120 text tokens (the replay starts after its span)."""
    fe = VisionFrontend.from_model_dir(model_dir)
    image = fe.preprocess(png(64, 48, 11))
    rng = np.random.default_rng(4)
    text = lambda n: rng.integers(3, 500, n).tolist()  # noqa: E731
    out = {}
    for name, before, after in (("late", 10, 5), ("early", 3, 120)):
        ids, starts = fe.expand_placeholders(text(before) + [fe.image_token_id] + text(after), [image])
        out[name] = (ids, fe.image_data([image], starts))
    return out


@pytest.fixture(scope="module")
def cold(model, prompts):
    engine = Engine(model, EngineConfig(**ENGINE, enable_prefix_caching=False))
    out = {}
    for i, (name, (ids, images)) in enumerate(prompts.items()):
        engine.add_request(i, ids, PARAMS, images=images)
        out[name] = collect(engine, (), i)[:2]
    return out


@pytest.fixture(scope="module")
def engines(model):
    with ucx_environment():
        kv = KVTransferConfig(model_id="tiny-v41-vision@test", lease_s=3.0, idle_peer_s=60.0)
        pre = Engine(model, EngineConfig(**ENGINE, kv_transfer=msgspec.structs.replace(kv, role="prefill")))
        dec = Engine(model, EngineConfig(**ENGINE, kv_transfer=msgspec.structs.replace(kv, role="decode")))
        for e in (pre, dec):
            attach_connector(e)
        poison_pools(dec)
        try:
            yield pre, dec
        finally:
            for e in (dec, pre):
                e.connector.close()


def _prefill(pre: Engine, dec: Engine, rid: int, ids, images):
    pre.add_request(rid, ids, PARAMS, LEG1, images)
    done = collect(pre, (dec,), rid)[2]
    assert done.reason == "length" and done.kv_transfer_params is not None, done
    return done.kv_transfer_params


def _settled(pre: Engine, dec: Engine) -> None:
    wait_for_leases(pre, dec)
    for e in (pre, dec):
        assert (e.cache.manager.full.num_used, e.cache.manager.sliding.num_used) == (0, 0)


def test_decode_leg_with_its_images_replays_through_the_span(engines, prompts, cold):
    pre, dec = engines
    ids, images = prompts["late"]
    kv = _prefill(pre, dec, 100, ids, images)
    assert dec.connector.ctx.plan(len(ids)).resume_from < images[0].start  # the replay covers the span
    dec.add_request(101, ids, PARAMS, kv, images)
    assert collect(dec, (pre,), 101)[:2] == cold["late"]
    assert pre.runner.encoder_cache.encoded == 1 and dec.runner.encoder_cache.encoded == 1
    _settled(pre, dec)


def test_decode_leg_without_images_when_the_replay_stays_clear(engines, prompts, cold):
    pre, dec = engines
    ids, images = prompts["early"]
    kv = _prefill(pre, dec, 200, ids, images)
    assert dec.connector.ctx.plan(len(ids)).resume_from >= images[0].start + 17  # after the span
    encoded = dec.runner.encoder_cache.encoded
    dec.add_request(201, ids, PARAMS, kv)  # no images: only their positions, from the token ids
    assert collect(dec, (pre,), 201)[:2] == cold["early"]
    assert dec.runner.encoder_cache.encoded == encoded  # the decode never encoded it
    _settled(pre, dec)


def test_decode_leg_without_images_refused_when_the_replay_needs_them(engines, prompts):
    pre, dec = engines
    ids, images = prompts["late"]
    kv = _prefill(pre, dec, 300, ids, images)
    with pytest.raises(RequestError, match="send the images on the decode leg"):
        dec.add_request(301, ids, PARAMS, kv)
    assert not dec.connector.decode.loads
    _settled(pre, dec)  # the prefill's lease expires: nothing is held on either side
