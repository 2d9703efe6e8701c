"""DeepSeek-V4.1 chat with images through prefill/decode disaggregation, with real processes on
loopback: `--kv-role prefill` and `--kv-role decode` servers behind `ringserve proxy` (NIXL over
UCX tcp) against a colocated `ringserve serve` of the same tiny checkpoint with a vision tower.
The prefill computes the image spans; the decode replays the prompt's last positions, with the
images when that replay reaches a span (an image at the end of the prompt) and without needing
them when it does not (an image followed by a long text). Greedy answers equal the colocated ones."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("nixl_cu12", reason="nixl-cu12 is not installed: PD disaggregation needs NIXL")

from server_process import API_KEY  # noqa: E402
from test_pd import UCX_ENV, _post, pd_servers  # noqa: E402

COMMON = ("--max-num-seqs", "2", "--kv-transfer-timeout", "10", "--kv-connect-timeout", "5",
          "--cpu-matmul-precision", "fp32", "--no-enable-prefix-caching")
LONG_TEXT = " ".join(f"word{i}" for i in range(120))


def _data_url(w: int, h: int, seed: int) -> str:
    pixels = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


@pytest.fixture(scope="module")
def vision_dir(tmp_path_factory):
    from engine.v41.checkpoint import write_v41_checkpoint

    return write_v41_checkpoint(tmp_path_factory.mktemp("e2e-vision-pd") / "tiny", "tiny", seed=3,
                                quantize="fp8-fp4", vision=True)


@pytest.fixture(scope="module")
def pd(vision_dir):
    mp = pytest.MonkeyPatch()
    for k, v in UCX_ENV.items():
        mp.setenv(k, v)  # inherited by every child
    yield from pd_servers(vision_dir, COMMON)
    mp.undo()


def _chat(url: str, content: list[dict]) -> dict:
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 6, "temperature": 0}
    status, out = _post(url + "/v1/chat/completions", body, API_KEY)
    assert status == 200, out
    return out


@pytest.mark.parametrize("where", ["image_then_long_text", "image_last"])
def test_chat_with_an_image_through_the_proxy_equals_colocated(pd, where):
    proxy, _, _, colocated = pd
    image = {"type": "image_url", "image_url": {"url": _data_url(40, 30, 1)}}
    text = {"type": "text", "text": LONG_TEXT if where == "image_then_long_text" else "What is this?"}
    content = [image, text] if where == "image_then_long_text" else [text, image]
    split, whole = _chat(proxy.url, content), _chat(colocated.url, content)
    assert split["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"]
    assert split["choices"][0]["message"] == whole["choices"][0]["message"]
    assert split["usage"]["completion_tokens"] == 6
