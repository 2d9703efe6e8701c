"""The edge's image input (engine/v41/vision/frontend.py, processor.py): bad images are refused
with a ValueError naming the problem (the server's 400), before anything large is decoded; the
frontend reads a model directory without torch; placeholders and images must pair up; the
engine re-checks what it is sent (RequestError).

The resize plan and the span layout themselves are checked against DeepSeek's reference outputs in
test_vision_golden.py."""

from __future__ import annotations

import io
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
from PIL import Image

from engine.v41.vision import processor
from engine.v41.vision.config import VisionConfig, parse_vision, vision_to_release
from engine.v41.vision.frontend import ImageError, PlaceholderError, VisionFrontend
from engine.v41.vision.inputs import check_request_images
from engine.v41.vision.spans import IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_START, TEXT

ROOT = Path(__file__).resolve().parents[2]
CFG = VisionConfig(n_layers=1, dim=32, n_heads=2, inter_dim=64, patch_size=8, rope_theta=10000.0,
                   downsample_ratio=2, max_n_token=48, min_pixels=1200, max_wh_ratio=4.0)
IMAGE_TOKEN = 7


def _encoded(size=(40, 24), fmt="PNG", color=(200, 30, 60)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, fmt)
    return out.getvalue()


def _png_claiming(width: int, height: int) -> bytes:
    """A valid 4x4 PNG whose header claims width x height (CRC fixed): what a bomb looks like
    before decoding."""
    data = bytearray(_encoded((4, 4)))
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


@pytest.fixture
def frontend() -> VisionFrontend:
    return VisionFrontend(CFG, IMAGE_TOKEN)


@pytest.mark.parametrize("data, words", [
    (b"", "empty"),
    (b"definitely not an image", "not an image"),
    (_png_claiming(0, 4), "not an image"),  # Pillow cannot identify a zero-width PNG
    (_png_claiming(20000, 20000), "decompression bomb"),  # over twice Pillow's limit: its error
    (_png_claiming(9000, 9000), "decompression bomb"),  # over Pillow's limit: its warning, made an error
    (_encoded(fmt="TIFF"), "unsupported image format TIFF"),
    (_encoded(fmt="PNG")[:60], "does not decode"),  # truncated
])
def test_bad_images_are_refused_by_name(frontend, data, words):
    with pytest.raises(ImageError, match=words) as info:
        frontend.preprocess(data)
    assert isinstance(info.value, ValueError)


def test_pixel_limit_and_encoded_size(monkeypatch):
    small = VisionFrontend(CFG, IMAGE_TOKEN, max_pixels=500)
    with pytest.raises(ImageError, match="40x24 = 960 pixels, more than the 500 allowed"):
        small.preprocess(_encoded())
    monkeypatch.setattr(processor, "MAX_ENCODED_BYTES", 100)
    with pytest.raises(ImageError, match="more than the 100 allowed"):
        VisionFrontend(CFG, IMAGE_TOKEN).preprocess(_encoded((64, 64), "BMP"))


def test_preprocess_and_expand(frontend):
    a = frontend.preprocess(_encoded((40, 24)))  # 960 px < min_pixels: scaled up first
    b = frontend.preprocess(_encoded((300, 40), "JPEG"))  # wider than 4:1: stretched
    for im in (a, b):
        assert len(im.pixels) == im.n_vit_h * 8 * im.n_vit_w * 8 * 3 and len(im.digest) == 32
    assert a.digest != b.digest and frontend.preprocess(_encoded((40, 24))).digest == a.digest
    prompt = [3, IMAGE_TOKEN, 4, 5, IMAGE_TOKEN, 6]
    ids, starts = frontend.expand_placeholders(prompt, [a, b])
    assert starts[0] == 1 and ids[:1] == [3]
    for im, start in zip((a, b), starts):
        n = frontend.span_length(im)
        assert n <= CFG.max_n_token and ids[start:start + n] == [IMAGE_TOKEN] * n
    assert ids[starts[0] + frontend.span_length(a):starts[1]] == [4, 5] and ids[-1] == 6
    data = frontend.image_data([a, b], starts)
    checked = check_request_images(data, ids, CFG, IMAGE_TOKEN)
    types = [im.types() for im in checked.images]
    assert types[0][0] == IMAGE_START and types[0][-1] == IMAGE_END and IMAGE in types[0] and IMAGE_NEW_LINE in types[0]
    assert TEXT not in types[0]
    with pytest.raises(PlaceholderError, match="1 image placeholder"):
        frontend.expand_placeholders([3, IMAGE_TOKEN], [a, b])


def test_engine_recheck_refuses_inconsistent_images(frontend):
    a = frontend.preprocess(_encoded())
    ids, starts = frontend.expand_placeholders([3, IMAGE_TOKEN, 4], [a])
    good = frontend.image_data([a], starts)
    check_request_images(good, ids, CFG, IMAGE_TOKEN)
    with pytest.raises(ValueError, match="no image input"):
        check_request_images(good, ids, None, IMAGE_TOKEN)
    with pytest.raises(ValueError, match="no image was given"):
        check_request_images([], ids, CFG, IMAGE_TOKEN)
    with pytest.raises(ValueError, match="holds ids other than the image token"):
        check_request_images(frontend.image_data([a], [0]), ids, CFG, IMAGE_TOKEN)
    with pytest.raises(ValueError, match="runs past the prompt"):
        check_request_images(good, ids[:-3], CFG, IMAGE_TOKEN)
    with pytest.raises(ValueError, match="outside the images' spans"):
        check_request_images(good, ids + [IMAGE_TOKEN], CFG, IMAGE_TOKEN)
    im = good[0]
    short = [type(im)(im.start, im.n_vit_h, im.n_vit_w, im.pixels[:-3], im.digest)]
    with pytest.raises(ValueError, match="pixel bytes"):
        check_request_images(short, ids, CFG, IMAGE_TOKEN)
    forged = [type(im)(im.start, im.n_vit_h, im.n_vit_w, bytes(len(im.pixels)), im.digest)]  # another image's key
    with pytest.raises(ValueError, match="digest is not the SHA-256"):
        check_request_images(forged, ids, CFG, IMAGE_TOKEN)


def test_vision_config_and_no_torch_at_the_edge():
    root = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "image_token_id": 11,
            "vision_config": vision_to_release(CFG)}
    assert parse_vision(root) == CFG
    root["vision_config"]["num_hidden_layers"] = 0
    assert parse_vision(root) is None
    code = ("import sys; from engine.v41.vision.frontend import VisionFrontend; "
            "import engine.v41.vision.processor, engine.v41.vision.prompt; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_vision_config_in_refs_flat_names():
    """REF's ModelArgs keys (`vision_n_layers`, `vision_max_n_token`, ...) at the root read the same."""
    flat = {"vision_n_layers": 1, "vision_dim": 32, "vision_n_heads": 2, "vision_inter_dim": 64, "vision_patch_size": 8,
            "vision_rope_theta": 10000.0, "vision_downsample_ratio": 2, "vision_max_n_token": 48,
            "vision_min_pixels": 1200, "vision_max_wh_ratio": 4.0}
    assert parse_vision(flat) == CFG
    assert parse_vision({**flat, "vision_n_layers": 0}) is None and parse_vision({}) is None


def test_images_for_a_model_without_a_tower_are_refused(frontend):
    """A model object without an `encoder` (DeepSeek-V4, a text-only V4.1 checkpoint) refuses
    images by name; its prompts may hold any id as text."""
    from types import SimpleNamespace

    from engine.request import RequestError
    from engine.v41.vision.requests import check_images

    image = frontend.preprocess(_encoded())
    ids, starts = frontend.expand_placeholders([3, IMAGE_TOKEN], [image])
    with pytest.raises(RequestError, match="no vision tower"):
        check_images(SimpleNamespace(encoder=None), ids, frontend.image_data([image], starts))
    assert check_images(SimpleNamespace(encoder=None), ids, []) is None


def test_image_positions_of_a_leg_without_its_images(frontend):
    """A PD decode leg sent without its images knows their positions from the token ids alone
    (Engram's DEAD mask), refuses to place them, and keys no prefix-cache block like another's."""
    from engine.v41.vision.inputs import ImagePositions

    a, b = frontend.preprocess(_encoded()), frontend.preprocess(_encoded((16, 100)))
    ids, starts = frontend.expand_placeholders([3, IMAGE_TOKEN, IMAGE_TOKEN, 4], [a, b])
    full = check_request_images(frontend.image_data([a, b], starts), ids, CFG, IMAGE_TOKEN)
    only = ImagePositions.of_prompt(ids, IMAGE_TOKEN)
    assert only.mask(0, len(ids)) == full.mask(0, len(ids))
    assert only.meets(1, 2) and not only.meets(0, 1) and only.overlapping(0, 1) == []
    with pytest.raises(RuntimeError, match="not sent"):
        only.overlapping(0, len(ids))
    assert only.digests_starting_in(0, 1) == b"" and len(only.digests_starting_in(0, 16)) == 16
    assert only.digests_starting_in(0, 16) != ImagePositions.of_prompt(ids, IMAGE_TOKEN).digests_starting_in(0, 16)
    assert ImagePositions.of_prompt([3, 4], IMAGE_TOKEN) is None
