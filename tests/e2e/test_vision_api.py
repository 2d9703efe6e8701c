"""DeepSeek-V4.1 sees images through `ringserve serve`: a tiny release-format checkpoint with a
vision tower (`write_v41_checkpoint(..., vision=True)`), the official `openai` client (chat
`image_url` data URLs, streamed and whole) and `anthropic` client (`image` blocks), images from a
local HTTP server and from --allowed-local-media-path, and the bad inputs as 400s.

References: the prompt ids are checked against the chat format's own rendering (image parts as
`<｜deepseek_image｜>`) with DeepSeek's span rule applied here; the generated tokens against the
engine run on the same expanded ids through the offline `LLM` (its own worker); the two APIs
against each other (greedy). Prefix caching is off on both sides so that each request runs cold."""

from __future__ import annotations

import asyncio
import base64
import io
import math
import threading

import pytest
from aiohttp import web
from PIL import Image

from server_process import API_KEY, Server, free_port

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

MAX_TOKENS = 8
ENGINE_FLAGS = ("--max-num-seqs", "4", "--no-enable-prefix-caching")


def png(w: int, h: int, seed: int) -> bytes:
    import numpy as np

    pixels = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


CAT, DOG = png(40, 30, 1), png(24, 56, 2)


def data_url(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64," + base64.b64encode(data).decode()


class MediaServer:
    """An image host on loopback, in a thread: /cat.png, and /sneaky.png redirecting to a link-local address."""

    def __init__(self):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "MediaServer":
        async def cat(request):
            return web.Response(body=CAT, content_type="image/png")

        async def sneaky(request):
            raise web.HTTPFound("http://169.254.169.254/latest/meta-data/")

        self.loop = asyncio.new_event_loop()
        app = web.Application()
        app.add_routes([web.get("/cat.png", cat), web.get("/sneaky.png", sneaky)])
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", self.port).start())
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from engine.v41.checkpoint import write_v41_checkpoint

    return write_v41_checkpoint(tmp_path_factory.mktemp("e2e-vision") / "tiny-vision", "tiny", seed=7, vision=True)


@pytest.fixture(scope="module")
def media(model_dir):
    folder = model_dir.parent / "media"
    folder.mkdir()
    (folder / "dog.png").write_bytes(DOG)
    (model_dir.parent / "private.png").write_bytes(DOG)
    with MediaServer() as m:
        m.folder = folder
        yield m


@pytest.fixture(scope="module")
def served(model_dir, media):
    s = Server(model_dir, *ENGINE_FLAGS, "--limit-mm-per-prompt", '{"image": 2}', "--allowed-local-media-path",
               str(media.folder), "--allowed-media-domains", "127.0.0.1", "--media-fetch-timeout", "5")
    yield s
    assert s.stop() == 0, s.output()


@pytest.fixture(scope="module")
def chat(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(served):
    return anthropic.Anthropic(base_url=served.url, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def engine(model_dir):
    """The engine's own run of a prompt with images: the offline LLM, its own worker."""
    from server.llm import LLM

    with LLM(model_dir, threads_per_worker=1, max_num_seqs=4, kv_cache_memory_bytes=int(0.05 * 2**30),
             block_size=16, enable_prefix_caching=False) as llm:
        yield llm


def expected_prompt(model_dir, messages: list[dict], images: list[bytes]) -> list[int]:
    """The chat format's rendering (image parts as the image token), tokenized, each image token
    replaced by DeepSeek's span for its image: ⌈(size rounded up to patches) / patch / r⌉ per side,
    h·(w + 1) + 2 positions. The test images lie within the budget and above min_pixels."""
    from engine.config import ModelConfig
    from server.chat_render import ChatRenderer
    from server.chat_request import parse_chat_request
    from server.tokenizer import Tokenizer

    cfg = ModelConfig.from_model_dir(model_dir)
    vision, image_id = cfg.v41.vision, cfg.v41.image_token_id
    assert all(w * h >= vision.min_pixels for w, h in (Image.open(io.BytesIO(b)).size for b in images))
    tok = Tokenizer.from_dir(model_dir)
    text = ChatRenderer("deepseek_v41", tok).render(parse_chat_request({"messages": messages})).text
    out, sizes = [], iter(Image.open(io.BytesIO(b)).size for b in images)
    for t in tok.encode(text, add_bos=False):
        if t != image_id:
            out.append(t)
            continue
        w, h = next(sizes)
        cells = [math.ceil(math.ceil(side / vision.patch_size) / vision.downsample_ratio) for side in (h, w)]
        out += [image_id] * (cells[0] * (cells[1] + 1) + 2)
    return out


def post(server, path: str, body: dict) -> tuple[int, dict]:
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(server.url + path, json.dumps(body).encode(),
                                 {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def user(*parts) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_chat_with_an_image_equals_the_engine_on_the_expanded_prompt(served, chat, engine, model_dir):
    from ipc.messages import SamplingParams

    messages = user({"type": "text", "text": "What is this?"}, image_part(data_url(CAT)))
    expected = expected_prompt(model_dir, messages, [CAT])
    status, tokenized = post(served, "/tokenize", {"model": "tiny-vision", "messages": messages})
    assert status == 200 and tokenized["tokens"] == expected

    answer = chat.chat.completions.create(model="tiny-vision", messages=messages, max_tokens=MAX_TOKENS,
                                          temperature=0, logprobs=True)
    assert answer.usage.prompt_tokens == len(expected)
    placeholders = _one_placeholder_per_span(expected, engine.images.image_token_id)
    [reference] = engine.generate({"prompt_token_ids": placeholders, "multi_modal_data": {"image": [CAT]}},
                                  SamplingParams(max_tokens=MAX_TOKENS))
    assert reference.prompt_token_ids == expected and reference.error is None
    pieces = [engine.tokenizer.decode([t], skip_special_tokens=False) for t in reference.token_ids]
    assert len(pieces) == MAX_TOKENS
    assert [c.token for c in answer.choices[0].logprobs.content] == pieces

    streamed = chat.chat.completions.create(model="tiny-vision", messages=messages, max_tokens=MAX_TOKENS,
                                            temperature=0, stream=True)
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in streamed if c.choices)
    assert reasoning == (answer.choices[0].message.reasoning_content or "")


def _one_placeholder_per_span(expanded: list[int], image_id: int) -> list[int]:
    """Expanded ids back to placeholder ids (the test's spans are never adjacent)."""
    return [t for k, t in enumerate(expanded) if t != image_id or k == 0 or expanded[k - 1] != image_id]


def test_anthropic_image_block_answers_as_the_chat_image_url(chat, claude):
    text = "Describe the picture."
    answer = chat.chat.completions.create(model="tiny-vision", max_tokens=MAX_TOKENS, temperature=0, messages=user(
        {"type": "text", "text": text}, image_part(data_url(DOG))))
    message = claude.messages.create(model="tiny-vision", max_tokens=MAX_TOKENS, extra_body={"temperature": 0},
                                     messages=[{"role": "user", "content": [
                                         {"type": "text", "text": text},
                                         {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                      "data": base64.b64encode(DOG).decode()}}]}])
    assert message.usage.input_tokens == answer.usage.prompt_tokens
    assert message.content[0].thinking == answer.choices[0].message.reasoning_content
    assert message.usage.output_tokens == answer.usage.completion_tokens == MAX_TOKENS


def test_images_by_http_and_local_file_urls(chat, media):
    by_data = chat.chat.completions.create(model="tiny-vision", max_tokens=MAX_TOKENS, temperature=0, messages=user(
        image_part(data_url(CAT)), image_part(data_url(DOG))))
    by_url = chat.chat.completions.create(model="tiny-vision", max_tokens=MAX_TOKENS, temperature=0, messages=user(
        image_part(media.url + "/cat.png"), image_part(f"file://{media.folder}/dog.png")))
    assert by_url.usage.prompt_tokens == by_data.usage.prompt_tokens
    assert by_url.choices[0].message.reasoning_content == by_data.choices[0].message.reasoning_content


def _tiff() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 8)).save(out, "TIFF")
    return out.getvalue()


def _bomb() -> bytes:
    """A 1×1 PNG whose header claims 30000 × 30000 pixels."""
    import struct
    import zlib

    raw = png(1, 1, 0)
    ihdr = struct.pack(">II", 30000, 30000) + raw[24:29]
    return raw[:16] + ihdr + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr)) + raw[33:]


def test_bad_images_are_400s_and_the_server_keeps_serving(served, chat, claude, media):
    cases = [(data_url(b"plain text, no picture"), "not an image"),
             (data_url(_bomb()), "decompression bomb"),
             (data_url(_tiff(), "image/tiff"), "unsupported image format"),
             ("data:image/png;base64,%%%%", "base64"),
             (f"file://{media.folder.parent}/private.png", "outside the allowed local media path"),
             (media.url + "/sneaky.png", "non-public address")]
    for url, words in cases:
        with pytest.raises(openai.BadRequestError) as info:
            chat.chat.completions.create(model="tiny-vision", max_tokens=4, messages=user(image_part(url)))
        assert words in info.value.body["message"] and info.value.body["param"] == "messages", (words, info.value.body)
    with pytest.raises(openai.BadRequestError) as info:
        chat.chat.completions.create(model="tiny-vision", max_tokens=4, messages=user(
            *[image_part(data_url(CAT))] * 3))
    assert info.value.body["code"] == "too_many_images"
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(model="tiny-vision", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "bm90IGFuIGltYWdl"}}]}])
    assert info.value.body["type"] == "error" and "not an image" in info.value.body["error"]["message"]
    after = chat.chat.completions.create(model="tiny-vision", max_tokens=4, messages=user(image_part(data_url(CAT))))
    assert after.usage.completion_tokens == 4
    status, health = served.get("/health")
    assert status == 200 and health["status"] == "ok"


def test_offline_images_as_pil_path_or_bytes_and_generate_cli(engine, model_dir, media):
    """LLM's multi_modal_data takes PIL images, paths and bytes alike; `ringserve generate --image`
    (its own worker) reports the expanded prompt_token_ids and the engine's tokens."""
    import json
    import subprocess
    import sys

    from ipc.messages import SamplingParams

    image_id = engine.images.image_token_id
    text_ids = engine.tokenizer.encode("Two pictures:")
    prompt = text_ids + [image_id, 300, 301, image_id, 302]
    pil = Image.open(io.BytesIO(DOG))
    forms = [[pil, CAT], [str(media.folder / "dog.png"), CAT], [DOG, CAT]]
    outs = engine.generate([{"prompt_token_ids": prompt, "multi_modal_data": {"image": f}} for f in forms],
                           SamplingParams(max_tokens=MAX_TOKENS))
    assert [o.error for o in outs] == [None] * 3
    assert outs[0].token_ids == outs[1].token_ids == outs[2].token_ids
    assert outs[0].prompt_token_ids == outs[1].prompt_token_ids == outs[2].prompt_token_ids
    assert outs[0].prompt_token_ids.count(image_id) > 2 and len(outs[0].prompt_token_ids) > len(prompt)
    cat = model_dir.parent / "cat.png"
    cat.write_bytes(CAT)
    run = subprocess.run([sys.executable, "-m", "server.cli", "generate", str(model_dir), "--prompt-ids",
                          ",".join(map(str, prompt)), "--image", str(media.folder / "dog.png"), "--image", str(cat),
                          "--max-tokens", str(MAX_TOKENS), "--json", "--kv-cache-memory", "0.05", "--block-size", "16",
                          "--no-enable-prefix-caching"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    record = json.loads(run.stdout.splitlines()[-1])
    assert record["prompt_token_ids"] == outs[0].prompt_token_ids and record["token_ids"] == outs[0].token_ids
    bad = subprocess.run([sys.executable, "-m", "server.cli", "generate", str(model_dir), "--prompt-ids", "5,6",
                          "--image", str(cat)], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "0 image placeholder(s)" in bad.stderr and "Traceback" not in bad.stderr


def test_language_model_only_refuses_images_and_serves_text(model_dir):
    """--language-model-only loads no tower: an image is a 400 naming the flag, text is served
    (and `generate --image` refuses before any worker starts)."""
    import subprocess
    import sys

    server = Server(model_dir, *ENGINE_FLAGS, "--language-model-only")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="tiny-vision", max_tokens=4, messages=user(image_part(data_url(CAT))))
        assert "--language-model-only" in info.value.body["message"]
        assert info.value.body["code"] == "images_not_supported"
        text = client.chat.completions.create(model="tiny-vision", max_tokens=4, messages=user(
            {"type": "text", "text": "Just text."}))
        assert text.usage.completion_tokens == 4
    finally:
        assert server.stop() == 0, server.output()
    cat = model_dir.parent / "cat-lmo.png"
    cat.write_bytes(CAT)
    run = subprocess.run([sys.executable, "-m", "server.cli", "generate", str(model_dir), "--prompt",
                          "<｜deepseek_image｜>", "--image", str(cat), "--language-model-only"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "--language-model-only" in run.stderr
