"""Prefill/decode disaggregation of a DeepSeek-V4.1 checkpoint with real processes on loopback:
`--kv-role prefill` and `--kv-role decode` servers behind `ringserve proxy`, NIXL over UCX tcp,
against a colocated `ringserve serve` of the same weights. Only the global records cross; the
decode replays the rest (tests/v41/test_pd_v41.py proves the in-process hand-off bit for bit).
Boots in ≈ 10 s on 2 shared cores (a tiny V4.1 checkpoint, three servers at once).
"""
from __future__ import annotations

import json
import urllib.request

import pytest

pytest.importorskip("nixl_cu12", reason="nixl-cu12 is not installed: PD disaggregation needs NIXL")

from server_process import API_KEY  # noqa: E402
from test_pd import UCX_ENV, _holds_nothing, _post, _settles, pd_servers  # noqa: E402

# exact fp32 products: outputs are compared across servers (kernels/cpu_precision.py)
COMMON = ("--max-num-seqs", "2", "--kv-transfer-timeout", "10", "--kv-connect-timeout", "5",
          "--cpu-matmul-precision", "fp32")


@pytest.fixture(scope="module")
def v41_dir(tmp_path_factory):
    from engine.v41.checkpoint import write_v41_checkpoint

    return write_v41_checkpoint(tmp_path_factory.mktemp("e2e-v41") / "tiny", "tiny", seed=3, quantize="fp8-fp4")


@pytest.fixture(scope="module")
def pd(v41_dir, monkeypatch_module):
    """(proxy, prefill, decode, colocated), booted together."""
    for k, v in UCX_ENV.items():
        monkeypatch_module.setenv(k, v)  # inherited by every child
    yield from pd_servers(v41_dir, COMMON)


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def _complete(url: str, prompt: list[int]) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    status, out = _post(url + "/v1/completions", body, API_KEY)
    assert status == 200, out
    return out["choices"][0]


def _streamed_text(url: str, prompt: list[int]) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    events = []
    with urllib.request.urlopen(req, timeout=120) as r:
        events = [line[6:].strip() for line in r if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]", events[-2:]
    return "".join(c["text"] for e in events[:-1] for c in json.loads(e)["choices"])


def _global_bytes(model_dir, n: int) -> int:
    """Every complete record of the served layout's full pools (auto KV, blocks of 16)."""
    from engine.config import ModelConfig
    from engine.v41.kv_layout import build_v41_layout

    layout = build_v41_layout(ModelConfig.from_model_dir(model_dir), "auto", 16, num_stages=0)
    return sum(n // p.tokens_per_record * p.record_bytes * len(p.layers) for p in layout.pools if p.group == "full")


# 20: the replay covers the whole prompt; 97: it starts at 32, after the receptive field (63).
@pytest.mark.parametrize("n", [20, 97])
def test_v41_completions_through_the_proxy_equal_colocated(pd, v41_dir, n):
    proxy, pre, dec, col = pd
    prompt = [(7 * i + 3) % 450 + 3 for i in range(n)]
    want = _complete(col.url, prompt)
    loaded = _settles(dec)["loaded"]
    got = _complete(proxy.url, prompt)
    assert got["text"] == want["text"] and got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
    assert got["logprobs"]["token_logprobs"] == pytest.approx(want["logprobs"]["token_logprobs"], abs=1e-4)
    stats = _settles(dec, loaded=loaded + 1)
    assert stats["last_bytes"] == _global_bytes(v41_dir, n)  # only global records crossed
    assert _streamed_text(proxy.url, prompt) == want["text"]  # streamed through both legs as well
    _settles(dec, loaded=loaded + 2)
    _holds_nothing(pre, dec)
