"""Images through the HTTP front up to the engine's door: the prompt ids and `Submit.images` the
server builds for chat completions (official `openai` client), Anthropic Messages (official
`anthropic` client) and Responses, the PD legs, /tokenize and count_tokens, and the bad inputs
(400s naming the problem, the server serving on). The app is the real one (server/app.py) with a
tiny DeepSeek-V4.1 checkpoint's tokenizer, chat format and vision config; the engine is a stand-in
that records what it is sent (tests/e2e/test_vision_api.py runs the real engine).

The references are independent of the marker mechanism server/multimodal.py uses: the expected
ids are the chat format's own rendering of the image parts (`<｜deepseek_image｜>` where each part
is), tokenized, each placeholder replaced by DeepSeek's span rule computed here from the image's
grid; the grid is the patch-multiple ceiling of the image's size (DeepSeek's plan for images
within the token budget and above min_pixels)."""

from __future__ import annotations

import asyncio
import base64
import io
import math
import struct
import threading
import zlib

import anthropic
import openai
import pytest
from aiohttp import web
from PIL import Image

from ipc.messages import Finished, TokenDelta
from server.app import make_app
from server.chat_render import ChatRenderer
from server.chat_request import parse_chat_request
from server.media_fetch import MediaPolicy
from server.multimodal import Multimodal
from server.state import AppState
from server.tokenizer import Tokenizer

MODEL = "tiny-v41-vision"
LEG2_PARAMS = {"do_remote_prefill": True, "remote_engine_id": "prefill-0", "remote_block_ids": [[1], [2]],
               "remote_host": "127.0.0.1", "remote_port": 9, "remote_request_id": "req-1",
               "remote_blocks_expiry_time": 4e9, "remote_num_tokens": 10, "remote_sliding_first": 0,
               "block_digests": [[0], [0]], "compat_hash": "0" * 64, "remote_first_token": 104,
               "remote_prompt_hash": "0" * 64}


def png(w: int, h: int, color=(200, 30, 30)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (w, h), color).save(out, "PNG")
    return out.getvalue()


def data_url(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64," + base64.b64encode(data).decode()


def png_with_header_size(w: int, h: int) -> bytes:
    """A valid 1×1 PNG whose IHDR claims w × h (a decompression bomb's header, or a zero size)."""
    raw = png(1, 1)
    ihdr = struct.pack(">II", w, h) + raw[24:29]
    return raw[:16] + ihdr + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr)) + raw[33:]


RED, BLUE, GREEN = png(40, 30), png(24, 40, (20, 40, 220)), png(33, 33, (10, 200, 10))


class RecordingEngine:
    """Stand-in for EngineClient: records each request's ids, images and PD params; answers one token."""

    healthy, stuck = True, {}

    def __init__(self):
        self.calls: list[dict] = []

    async def generate(self, prompt_token_ids, params, session=None, kv_transfer_params=None, images=None):
        rid = 1000 + len(self.calls)
        self.calls.append({"ids": list(prompt_token_ids), "images": images, "kv": kv_transfer_params})
        yield TokenDelta(rid, [104])
        held = None
        if kv_transfer_params is not None and kv_transfer_params.do_remote_decode:
            from engine.kv_transfer.protocol import parse_params

            held = parse_params({**LEG2_PARAMS, "remote_num_tokens": len(prompt_token_ids)})
        yield Finished(rid, "length", len(prompt_token_ids), 1, kv_transfer_params=held)

    def abort(self, request_id):
        pass


class Served:
    def __init__(self, model_dir, media_dir):
        from engine.config import ModelConfig

        self.cfg = ModelConfig.from_model_dir(model_dir)
        self.tok = Tokenizer.from_dir(model_dir)
        self.engine = RecordingEngine()
        self.policy = MediaPolicy.from_flags(str(media_dir), ["127.0.0.1"], max_bytes=200_000, timeout_s=1.0)
        self.multimodal = Multimodal.for_model(self.cfg, limit=3, policy=self.policy)
        self.state = AppState(client=self.engine, tokenizer=self.tok, served_names=[MODEL],
                              vocab_size=self.cfg.vocab_size, max_model_len=1024,
                              renderer=ChatRenderer("deepseek_v41", self.tok), multimodal=self.multimodal)
        self.state.ready = True
        self.image_hits: list[str] = []

    def start(self):
        self.loop = asyncio.new_event_loop()
        app = make_app(self.state)

        async def image(request):  # the media server: same host as the API, allowed by the policy
            self.image_hits.append(request.path)
            name = request.match_info["name"]
            if name == "slow.png":  # twice the policy's 1 s timeout
                await asyncio.sleep(2)
            if name == "to-metadata.png":
                raise web.HTTPFound("http://169.254.169.254/latest/meta-data")
            if name == "huge.png":
                return web.Response(body=b"\0" * 300_000, content_type="image/png")
            return web.Response(body={"red.png": RED, "blue.png": BLUE}[name], content_type="image/png")

        app.router.add_get("/media/{name}", image)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self.base = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        return self

    def stop(self):
        asyncio.run_coroutine_threadsafe(self.multimodal.close(), self.loop).result(10)
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    # ---- the references --------------------------------------------------------------------------------
    def expected_ids(self, messages: list[dict], images: list) -> list[int]:
        """The chat format's own rendering (image parts as the image token), each placeholder
        replaced by DeepSeek's span for the image in that place."""
        text = self.state.renderer.render(parse_chat_request({"messages": messages})).text
        ids = self.tok.encode(text, add_bos=False)
        r = self.cfg.v41.vision.downsample_ratio
        image_id = self.cfg.v41.image_token_id
        out, k = [], 0
        for t in ids:
            if t != image_id:
                out.append(t)
                continue
            h, w = math.ceil(images[k].n_vit_h / r), math.ceil(images[k].n_vit_w / r)
            out += [image_id] * (h * (w + 1) + 2)
            k += 1
        assert k == len(images)
        return out


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from engine.v41.checkpoint import write_v41_checkpoint

    root = tmp_path_factory.mktemp("mm-chat")
    model_dir = write_v41_checkpoint(root / "model", "tiny", seed=3, vision=True)
    media = root / "media"
    media.mkdir()
    (media / "green.png").write_bytes(GREEN)
    (root / "outside.png").write_bytes(GREEN)
    s = Served(model_dir, media).start()
    s.media_dir, s.root = media, root
    yield s
    s.stop()


def oai(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.base + "/v1", api_key="unused", max_retries=0, timeout=30)


def post(url: str, body: dict) -> tuple[int, dict]:
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def user(*parts) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


def text(t: str) -> dict:
    return {"type": "text", "text": t}


def image_url(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def last_call(served, before: int) -> dict:
    assert len(served.engine.calls) == before + 1
    return served.engine.calls[-1]


def test_chat_image_url_data_url_becomes_the_span_and_its_pixels(served):
    before = len(served.engine.calls)
    messages = user(text("What is in this picture?"), image_url(data_url(RED)))
    oai(served).chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    call = last_call(served, before)
    [img] = call["images"]
    p = served.cfg.v41.vision.patch_size
    assert (img.n_vit_h, img.n_vit_w) == (math.ceil(30 / p), math.ceil(40 / p))  # 40×30 fed at patch multiples
    assert call["ids"] == served.expected_ids(messages, [img])
    assert call["ids"][img.start] == served.cfg.v41.image_token_id and call["ids"][img.start - 1] != img.start
    frontend = served.multimodal.frontend
    assert img.pixels == frontend.preprocess(RED).pixels and img.digest == frontend.preprocess(RED).digest


def test_images_keep_their_rendered_order_across_messages_and_sorted_tool_results(served):
    """Tool results are re-ordered into the calls' order by the chat format; the images in them follow."""
    before = len(served.engine.calls)
    calls = [{"id": f"call_{n}", "type": "function", "function": {"name": n, "arguments": "{}"}} for n in "ab"]
    messages = [{"role": "user", "content": [image_url(data_url(GREEN)), text("look, then call a and b")]},
                {"role": "assistant", "content": "", "tool_calls": calls},
                {"role": "tool", "tool_call_id": "call_b", "content": [text("b saw"), image_url(data_url(BLUE))]},
                {"role": "tool", "tool_call_id": "call_a", "content": [text("a saw"), image_url(data_url(RED))]}]
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in "ab"]
    oai(served).chat.completions.create(model=MODEL, messages=messages, tools=tools, max_tokens=4)
    call = last_call(served, before)
    frontend = served.multimodal.frontend
    assert [im.digest for im in call["images"]] == [frontend.preprocess(b).digest for b in (GREEN, RED, BLUE)]
    text_ = served.state.renderer.render(parse_chat_request({"messages": messages, "tools": tools})).text
    assert text_.index("a saw") < text_.index("b saw")  # the chat format did re-order them
    starts = [im.start for im in call["images"]]
    assert starts == sorted(starts)


def test_anthropic_and_responses_images_equal_the_chat_request(served):
    before = len(served.engine.calls)
    messages = user(text("Describe it."), image_url(data_url(BLUE)))
    oai(served).chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    ac = anthropic.Anthropic(base_url=served.base, api_key="unused", max_retries=0, timeout=30)
    ac.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [
        {"type": "text", "text": "Describe it."},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": base64.b64encode(BLUE).decode()}}]}])
    oai(served).responses.create(model=MODEL, max_output_tokens=4, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Describe it."}, {"type": "input_image", "image_url": data_url(BLUE)}]}])
    chat, anth, resp = served.engine.calls[before:]
    assert anth["ids"] == chat["ids"] == resp["ids"]
    assert anth["images"] == chat["images"] == resp["images"]


def test_http_and_local_file_urls(served):
    before = len(served.engine.calls)
    messages = user(image_url(served.base + "/media/red.png"), text("and"),
                    image_url(f"file://{served.media_dir}/green.png"))
    oai(served).chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    call = last_call(served, before)
    frontend = served.multimodal.frontend
    assert [im.digest for im in call["images"]] == [frontend.preprocess(RED).digest, frontend.preprocess(GREEN).digest]
    assert call["ids"] == served.expected_ids(messages, call["images"])


def test_tokenize_and_count_tokens_count_the_expanded_spans(served):
    before = len(served.engine.calls)
    messages = user(text("Count me."), image_url(data_url(RED)))
    oai(served).chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    ids = last_call(served, before)["ids"]
    _, tokenized = post(served.base + "/tokenize", {"model": MODEL, "messages": messages})
    assert tokenized["tokens"] == ids and tokenized["count"] == len(ids)
    ac = anthropic.Anthropic(base_url=served.base, api_key="unused", max_retries=0, timeout=30)
    counted = ac.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": [
        {"type": "text", "text": "Count me."},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": base64.b64encode(RED).decode()}}]}])
    assert counted.input_tokens == len(ids)


def test_pd_legs_both_carry_the_images_and_the_decode_checks_them(served):
    """A V4.1 decode leg replays the prompt's last positions, which may hold an image span: it is
    sent the images too, after checking they are the ones the prefill answered for."""
    before = len(served.engine.calls)
    body = {"model": MODEL, "messages": user(text("PD?"), image_url(data_url(GREEN))), "max_tokens": 4}
    _, leg1 = post(served.base + "/v1/chat/completions", {**body, "kv_transfer_params": {"do_remote_decode": True}})
    prefill = last_call(served, before)
    [img] = prefill["images"]
    assert leg1["prefilled_images"] == [{"grid": [img.n_vit_h, img.n_vit_w], "digest": img.digest.hex()}]
    leg2 = {**body, "kv_transfer_params": leg1["kv_transfer_params"], "prefilled_images": leg1["prefilled_images"]}
    status, answer = post(served.base + "/v1/chat/completions", leg2)
    assert status == 200, answer
    decode = last_call(served, before + 1)
    assert decode["images"] == prefill["images"] and decode["ids"] == prefill["ids"]
    assert decode["kv"].do_remote_prefill
    other = [{"grid": [img.n_vit_h, img.n_vit_w], "digest": "00" * 32}]
    status, bad = post(served.base + "/v1/chat/completions", {**leg2, "prefilled_images": other})
    assert status == 400 and bad["error"]["param"] == "prefilled_images" and "differ" in bad["error"]["message"]
    status, bad = post(served.base + "/v1/chat/completions", {**body, "prefilled_images": leg1["prefilled_images"]})
    assert status == 400 and bad["error"]["param"] == "prefilled_images"
    assert len(served.engine.calls) == before + 2


# ---- bad input -------------------------------------------------------------------------------------------


def tiff() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 8)).save(out, "TIFF")
    return out.getvalue()


BAD_IMAGES = {
    "not an image": (data_url(b"hello, I am text"), "invalid_image", "not an image"),
    "decompression bomb": (data_url(png_with_header_size(30000, 30000)), "invalid_image", "decompression bomb"),
    "huge image": (data_url(png_with_header_size(9000, 9000)), "invalid_image", "too large"),
    "zero-sized image": (data_url(png_with_header_size(0, 7)), "invalid_image", "not an image"),
    "unsupported format": (data_url(tiff(), "image/tiff"), "invalid_image", "unsupported image format TIFF"),
    "bad base64": ("data:image/png;base64,iVBOR$$w0KGgo", "invalid_image_data", "base64"),
    "not an image media type": ("data:text/plain;base64,aGVsbG8=", "invalid_image_data", "not an image"),
    "file outside the allowed path": (None, "local_media_not_allowed", "outside the allowed local media path"),
    "redirect to a private address": ("/media/to-metadata.png", "media_address_not_allowed", "non-public"),
    "too-large download": ("/media/huge.png", "image_too_large", "200000"),
    "timeout": ("/media/slow.png", "image_fetch_timeout", "longer than 1 s"),
    "unlisted host": ("http://images.example.com/a.png", "media_domain_not_allowed", "allowed-media-domains"),
}


@pytest.mark.parametrize("case", list(BAD_IMAGES))
def test_bad_images_are_400s_naming_the_problem_and_the_server_serves_on(served, case):
    url, code, words = BAD_IMAGES[case]
    if url is None:
        url = f"file://{served.root}/outside.png"
    elif url.startswith("/"):
        url = served.base + url
    before = len(served.engine.calls)
    client = oai(served)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=user(text("hi"), image_url(url)), max_tokens=4)
    err = info.value.body
    assert err["code"] == code and words in err["message"] and err["param"] == "messages", err
    assert "messages[0].content[1]" in err["message"]
    assert "Traceback" not in err["message"] and "hello, I am text" not in err["message"]
    assert len(served.engine.calls) == before  # nothing reached the engine
    client.chat.completions.create(model=MODEL, messages=user(image_url(data_url(RED))), max_tokens=4)
    assert len(served.engine.calls) == before + 1


def test_bad_images_on_messages_are_anthropic_errors(served):
    ac = anthropic.Anthropic(base_url=served.base, api_key="unused", max_retries=0, timeout=30)
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(b"not a picture").decode()}}
    with pytest.raises(anthropic.BadRequestError) as info:
        ac.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [block]}])
    body = info.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "messages[0]" in body["error"]["message"] and "not an image" in body["error"]["message"]
    block["source"]["media_type"] = "image/tiff"
    with pytest.raises(anthropic.BadRequestError, match="media_type must be one of"):
        ac.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [block]}])


def test_more_images_than_allowed_are_refused_before_any_fetch(served):
    hits = len(served.image_hits)
    with pytest.raises(openai.BadRequestError) as info:
        oai(served).chat.completions.create(model=MODEL, max_tokens=4, messages=user(
            *[image_url(served.base + "/media/red.png")] * 4))
    assert info.value.body["code"] == "too_many_images" and "at most 3" in info.value.body["message"]
    assert len(served.image_hits) == hits


@pytest.mark.parametrize("which", ["language_model_only", "text_only_checkpoint"])
def test_images_for_a_text_only_model_are_refused(served, which):
    saved = served.state.multimodal
    if which == "language_model_only":
        served.state.multimodal = Multimodal.for_model(served.cfg, language_model_only=True)
        words = "--language-model-only"
    else:
        served.state.multimodal = Multimodal(None)
        words = "takes no image input"
    try:
        with pytest.raises(openai.BadRequestError) as info:
            oai(served).chat.completions.create(model=MODEL, messages=user(image_url(data_url(RED))), max_tokens=4)
        assert info.value.body["code"] == "images_not_supported" and words in info.value.body["message"]
        oai(served).chat.completions.create(model=MODEL, messages=user(text("text still works")), max_tokens=4)
    finally:
        served.state.multimodal = saved


def test_a_request_ring_slot_holds_a_longest_prompt_with_the_most_and_largest_images(served):
    from ipc.codec import encode
    from ipc.messages import ImageData, SamplingParams, Submit
    from server.engine_client import request_ring

    mm = served.multimodal
    v = mm.frontend.vision
    side = int(math.isqrt(v.max_patches))  # a square grid within the token budget's patch bound
    image = ImageData(0, side, v.max_patches // side, b"\xff" * mm.max_image_bytes, b"\0" * 32)
    max_len = 4096
    ring = request_ring(max_len, mm.submit_bytes)
    submit = Submit(2**40, [2**31 - 1] * max_len, SamplingParams(), None, [image] * mm.limit)
    assert len(encode(submit, max_bytes=ring.payload_bytes)) <= ring.payload_bytes
    assert request_ring(max_len).slot_bytes == 1 << 20  # text only: unchanged
