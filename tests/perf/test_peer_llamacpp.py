"""The llama.cpp peer of perf/compare_peer.py without building llama.cpp: command lines, the
converter's pre-tokenizer fallback, the side-by-side table, and /tokenize in llama-server's shape."""

from __future__ import annotations

import asyncio
import sys
import types
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from perf import compare_peer, peer_gguf_convert, peer_llamacpp
from perf.serving import server_api


def test_server_command_gives_every_slot_its_context() -> None:
    cmd = peer_llamacpp.server_command(Path("/b/llama-server"), Path("/m.gguf"), 18401, 2, 16, 512, "tiny")
    opt = {cmd[i]: cmd[i + 1] for i in range(1, len(cmd) - 1) if cmd[i].startswith("-")}
    assert cmd[0] == "/b/llama-server"
    assert opt["-m"] == "/m.gguf" and opt["--port"] == "18401" and opt["--host"] == "127.0.0.1"
    assert opt["--threads"] == opt["--threads-batch"] == "2"
    assert int(opt["--ctx-size"]) == 16 * 512 and opt["--parallel"] == "16"
    assert "--cont-batching" in cmd and "--no-repack" in cmd and opt["--alias"] == "tiny"


def test_build_commands_target_only_the_server(tmp_path: Path) -> None:
    cm = peer_llamacpp.cmake_command(tmp_path / "src", tmp_path / "build")
    assert cm[:5] == ["cmake", "-S", str(tmp_path / "src"), "-B", str(tmp_path / "build")]
    assert "-DLLAMA_CURL=OFF" in cm and "-DLLAMA_BUILD_TESTS=OFF" in cm
    nj = peer_llamacpp.ninja_command(tmp_path / "build", 3)
    assert nj[-1] == "llama-server" and "-j3" in nj and nj[nj.index("-C") + 1] == str(tmp_path / "build")


def test_convert_command_runs_the_wrapper_on_the_vendored_converter(tmp_path: Path) -> None:
    cmd = peer_llamacpp.convert_command(tmp_path / "llama.cpp", tmp_path / "model", tmp_path / "out.gguf")
    assert Path(cmd[1]).name == "peer_gguf_convert.py" and cmd[2] == str(tmp_path / "llama.cpp")
    assert cmd[cmd.index("--") + 1:] == [str(tmp_path / "model"), "--outfile", str(tmp_path / "out.gguf")]


def test_model_key_changes_with_the_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 6}')
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    first = peer_llamacpp._model_key(tmp_path)
    assert peer_llamacpp._model_key(tmp_path) == first
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 4}')
    assert peer_llamacpp._model_key(tmp_path) != first


def test_fetch_is_skipped_when_the_tree_is_cached(tmp_path: Path) -> None:
    src = peer_llamacpp.llama_src(tmp_path)
    src.mkdir(parents=True)
    (src / "CMakeLists.txt").write_text("")
    assert peer_llamacpp.fetch_sdist(tmp_path) == src


def test_pre_tokenizer_fallback_only_for_unknown_vocabularies(monkeypatch: pytest.MonkeyPatch) -> None:
    class TextModel:
        def get_vocab_base_pre(self, tokenizer) -> str:
            if tokenizer == "known":
                return "llama-bpe"
            raise NotImplementedError("BPE pre-tokenizer was not recognized")

    base = types.ModuleType("conversion.base")
    base.TextModel = TextModel
    pkg = types.ModuleType("conversion")
    pkg.base = base
    monkeypatch.setitem(sys.modules, "conversion", pkg)
    monkeypatch.setitem(sys.modules, "conversion.base", base)
    peer_gguf_convert._patch_pre_tokenizer("deepseek-v3")
    assert TextModel().get_vocab_base_pre("known") == "llama-bpe"
    assert TextModel().get_vocab_base_pre("random make-model vocab") == "deepseek-v3"


def _doc(tok_s: float, tpot: float, ttft: float, user: float | None) -> dict:
    return {"output_throughput": tok_s, "tpot_ms": {"mean": 0.0, "p50": tpot}, "ttft_ms": {"p50": ttft},
            "interactivity_tok_s_per_user": {"p50": 0.0, "p90": user}}


def test_table_row_puts_ringserve_over_peer() -> None:
    row = compare_peer.table_row(16, _doc(300.0, 40.0, 90.0, None), _doc(600.0, 20.0, 30.0, 50.0)).split()
    assert row[0] == "16"
    assert row[1:4] == ["300.0", "600.0", "0.50x"]
    assert row[4:7] == ["40.00", "20.00", "2.00x"]
    assert row[7:10] == ["90.0", "30.0", "3.00x"]
    assert row[10:13] == ["n/a", "50.0", "n/a"]
    assert len(compare_peer.table_header().split()) > 0


def test_cpu_model_is_one_line() -> None:
    name = compare_peer.cpu_model()
    assert name and "\n" not in name


async def _llama_shaped_side_endpoints(text_to_ids: dict[str, list[int]]) -> tuple[list[int] | None, str | None]:
    """/tokenize and /detokenize answering only llama-server's field names ("content")."""

    async def tokenize(req: web.Request) -> web.Response:
        body = await req.json()
        if "content" not in body or body.get("add_special") is not False:
            return web.json_response({"error": "content required"}, status=400)
        return web.json_response({"tokens": text_to_ids[body["content"]]})

    async def detokenize(req: web.Request) -> web.Response:
        ids = (await req.json())["tokens"]
        return web.json_response({"content": next(t for t, v in text_to_ids.items() if v == ids)})

    app = web.Application()
    app.add_routes([web.post("/tokenize", tokenize), web.post("/detokenize", detokenize)])
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        async with aiohttp.ClientSession() as http:
            url = f"http://127.0.0.1:{port}"
            ids = await server_api.tokenize(http, url, "m", "hello world", {})
            text = await server_api.detokenize(http, url, "m", [7, 8, 9], {})
    finally:
        await runner.cleanup()
    return ids, text


def test_side_endpoints_speak_llama_server_fields() -> None:
    ids, text = asyncio.run(_llama_shaped_side_endpoints({"hello world": [5, 6], "abc": [7, 8, 9]}))
    assert ids == [5, 6] and text == "abc"


def test_prompt_counts_per_concurrency_level() -> None:
    ns = lambda **kw: types.SimpleNamespace(**{"num_prompts": None, "prompts_per_concurrency": 8,  # noqa: E731
                                               "concurrency": "1,16", **kw})
    assert [compare_peer.prompts_at(ns(), c) for c in (1, 16)] == [8, 128]
    assert [compare_peer.prompts_at(ns(num_prompts="32"), c) for c in (1, 16)] == [32, 32]
    assert [compare_peer.prompts_at(ns(num_prompts="4,16"), c) for c in (1, 16)] == [4, 16]
    with pytest.raises(compare_peer.CompareError):
        compare_peer.prompts_at(ns(num_prompts="4,16,64"), 1)
