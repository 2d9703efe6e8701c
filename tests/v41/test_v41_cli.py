"""`ringserve kv-report` and `ringserve make-model --arch v41` on DeepSeek-V4.1 (in-process).

kv-report's global bytes per token are recomputed here from the raw release config: each KV
source of ratio m owns one compressed entry (FP4 e2m1 pairs + an e4m3 scale per 16) and one
index key (FP4 + ue8m0 per 32, or FP8 + one fp32 scale) per m tokens; no other layer adds
global KV. make-model's output is checked against the golden checkpoint made by DeepSeek's
own convert path: the same tensor-name patterns with the same dtypes, block-scale shapes that
cover the weights in 32×32 blocks, FP4 experts two per byte.
"""

from __future__ import annotations

import json
import math
import re

import pytest
from safetensors import safe_open

from engine.config import ModelConfig
from server.cli import main


def kv_report(capsys, *args: str) -> dict:
    assert main(["kv-report", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def expected_bytes_per_token(text: dict, index_key_bytes: int) -> float:
    d = text["head_dim"]
    entry = d // 2 + d // 16  # e2m1 pairs + e4m3 scale per 16
    return sum((entry + index_key_bytes) / text["compress_ratios"][s] for s in text["kv_source_layer_ids"])


@pytest.fixture(scope="module")
def release(golden_root):
    path = golden_root / "release-config.json"
    return path, json.loads(path.read_text())["text_config"]


def test_kv_report_of_released_v41_flash(capsys, release):
    path, text = release
    di = text["index_head_dim"]
    fp4 = kv_report(capsys, str(path), "--kv-dtype", "fp8", "--context", "1000")
    assert fp4["global_bytes_per_token"] == expected_bytes_per_token(text, di // 2 + di // 32) == 890
    fp8 = kv_report(capsys, str(path), "--kv-dtype", "fp8", "--index-dtype", "fp8")
    assert fp8["global_bytes_per_token"] == expected_bytes_per_token(text, di + 4) == 1050
    # the fixed state: every layer's and every DSpark stage's window (e4m3 + ue8m0 per 32), the
    # ratio-2 sources' one pending fp32 [kv | score] row, the Engram n-gram history
    w, d = text["sliding_window"], text["head_dim"]
    row = d + d // 32
    ratio2 = sum(text["compress_ratios"][s] == 2 for s in text["kv_source_layer_ids"])
    state = sum(item["bytes"] for item in fp4["fixed_state"])
    assert state == fp4["per_sequence_bytes"] == (
        (text["num_hidden_layers"] + text["num_nextn_predict_layers"]) * w * row + ratio2 * 2 * d * 4
        + (text["engram_max_ngram_size"] - 1) * 8)
    assert fp4["total_bytes_at_context"] == 890 * 1000 + state


def test_kv_report_pools_have_no_waste(capsys, release):
    """Full pools are written only by the KV sources, one record per m tokens, at the record
    formats' own sizes (no padding)."""
    path, text = release
    report = kv_report(capsys, str(path), "--kv-dtype", "fp8")
    sources = text["kv_source_layer_ids"]
    for pool in report["pools"]:
        if pool["group"] == "full":
            m = pool["tokens_per_record"]
            assert pool["layers"] == sum(text["compress_ratios"][s] == m for s in sources)
            assert pool["record_bytes"] == pool["width"] // 2 + pool["width"] // (16 if pool["name"][0] == "c" else 32)


def _dtype_patterns(path) -> dict[str, tuple[str, ...]]:
    with safe_open(str(path), "pt") as f:
        out: dict[str, set[str]] = {}
        for name in f.keys():
            out.setdefault(re.sub(r"\.\d+\.", ".N.", name), set()).add(str(f.get_slice(name).get_dtype()))
    return {k: tuple(sorted(v)) for k, v in out.items()}


def test_make_model_writes_the_release_format(capsys, tmp_path, golden_root):
    out = tmp_path / "m"
    assert main(["make-model", str(out), "--arch", "v41", "--preset", "tiny", "--quantize", "fp8-fp4"]) == 0
    assert "V4.1" in capsys.readouterr().out
    raw = json.loads((out / "config.json").read_text())
    assert raw["model_type"] == "deepseek_v41" and "text_config" in raw and "quantization_config" in raw
    assert ModelConfig.from_model_dir(out).arch == "v41"
    assert (out / "tokenizer.json").exists() and (out / "engram_token_map.json").exists()
    mine = _dtype_patterns(out / "model.safetensors")
    assert mine == _dtype_patterns(golden_root / "c1" / "model.safetensors")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        for name in f.keys():
            if not name.endswith(".scale"):
                continue
            weight = f.get_slice(name[: -len("scale")] + "weight")
            rows, cols = weight.get_shape()
            scale = f.get_slice(name).get_shape()
            if str(weight.get_dtype()) == "I8":  # FP4 experts: two per byte, one scale per 32 along K
                assert scale == [rows, 2 * cols // 32], name
            elif ".engram.embed." in name:  # Engram tables: one scale per row per 32
                assert scale == [rows, cols // 32], name
            else:
                assert scale == [math.ceil(rows / 32), math.ceil(cols / 32)], name


def test_make_model_v41_rejects_v4_only_flags(capsys, tmp_path):
    assert main(["make-model", str(tmp_path / "x"), "--arch", "v41", "--dtype", "fp32"]) != 0
    assert "--dtype do not apply" in capsys.readouterr().err and not (tmp_path / "x").exists()


@pytest.mark.parametrize("flags,mode", [([], "exact"), (["--decoder-tail", "approx"], "approx")])
def test_decoder_tail_flag_reaches_the_engine_config(flags, mode):
    from server.cli import build_parser, engine_config_from

    args = build_parser().parse_args(["generate", "some-model", "--prompt", "x", *flags])
    assert engine_config_from(args).decoder_tail == mode


def test_pd_transfer_is_accepted_for_v41(golden_root):
    """V4.1 PD moves only global rows and replays the rest (tests/v41/test_pd_v41.py): the
    flags give a connector config, its replay left to the connector (0 = exact)."""
    from server.cli import build_parser
    from server.pd import kv_transfer_config_from

    model = golden_root / "c1"
    args = build_parser().parse_args(["serve", str(model), "--kv-role", "prefill", "--kv-transfer", "nixl"])
    config = kv_transfer_config_from(args, model)
    assert config.role == "prefill" and config.replay_tokens == 0 and config.model_id.startswith("c1@")
