"""Checkpoint loading: quantized weights decode exactly as transformers decodes them; every
malformed checkpoint is a one-line error naming the problem."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import ConfigError
from engine.linear import QuantWeight
from engine.v4.weight_names import export_names
from engine.weights import WeightLoadError, load_model
from kernels import reference


def _hf_name(internal: str, num_experts: int) -> str:
    return export_names(internal, "transformers", num_experts)[0][0]


def _dense_values(model) -> dict[str, torch.Tensor]:
    """Internal weight name → fp32 values; quantized containers decoded by the kernel reference."""
    out = {name: value.float() for name, value in model.state_dict().items()}
    for path, module in model.named_modules():
        if isinstance(module, QuantWeight) and module.fmt.quantized:
            w, s, block = module.weight, module.scale, module.fmt.block
            decoded = (reference.dequantize_fp8_weight(w, s, block) if module.fmt.kind == "fp8"
                       else reference.dequantize_fp4_weight(w, s, block[1]))
            out[f"{path}.weight"] = decoded
            del out[f"{path}.scale"]
    return out


@pytest.mark.parametrize("weight_dtype", ["bf16", "auto"])
def test_fp8_fp4_checkpoint_decodes_exactly_like_transformers(checkpoint_factory, weight_dtype):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    path = checkpoint_factory("tiny-fp8-fp4", dtype=torch.bfloat16, quantize="fp8-fp4", index_topk=64)
    assert json.loads((path / "config.json").read_text())["quantization_config"]["expert_dtype"] == "fp4"
    stored = load_file(str(path / "model.safetensors"))
    assert stored["layers.1.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert stored["layers.1.ffn.experts.0.w1.weight"].dtype == torch.int8
    ours = load_model(path, dtype=torch.float32, progress=False, weight_dtype=weight_dtype)
    # bf16 decodes at load; auto keeps the stored codes, whose decode must give the same values.
    assert (ours.layers[1].attn.wq_a.fmt.kind == "fp8") == (weight_dtype == "auto")
    ref = transformers.DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    compared = 0
    for name, value in _dense_values(ours).items():
        if name.startswith("mtp."):
            continue  # transformers drops MTP weights
        expected = ref[_hf_name(name, ours.cfg.n_routed_experts)]
        assert torch.equal(value, expected.float()), name
        compared += 1
    assert compared == len(ref)


def test_both_layouts_load_to_the_same_weights(checkpoint_factory):
    a = load_model(checkpoint_factory("tiny-bf16-up", dtype=torch.bfloat16), dtype=torch.bfloat16, progress=False)
    b = load_model(checkpoint_factory("tiny-bf16-tf", layout="transformers", dtype=torch.bfloat16),
                   dtype=torch.bfloat16, progress=False)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert a.layers[0].ffn.experts.w13.weight.dtype == torch.bfloat16 and a.layers[0].attn_norm.dtype == torch.float32


@pytest.fixture
def broken(tmp_path, checkpoint_factory):
    src = checkpoint_factory("tiny-bf16-up", dtype=torch.bfloat16)
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def _one_line_error(path, exc_type) -> str:
    with pytest.raises(exc_type) as info:
        load_model(path, progress=False)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_truncated_safetensors_is_named(broken):
    f = broken / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    assert "model.safetensors" in _one_line_error(broken, WeightLoadError)


def _rewrite(path, edit) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def test_wrong_shape_is_named(broken):
    _rewrite(broken, lambda t: t.update({"layers.2.attn.wkv.weight": torch.zeros(3, 64, dtype=torch.bfloat16)}))
    message = _one_line_error(broken, WeightLoadError)
    assert "layers.2.attn.wkv.weight" in message and "(3, 64)" in message


def test_missing_tensor_is_named(broken):
    _rewrite(broken, lambda t: t.pop("layers.3.attn.indexer.weights_proj.weight"))
    assert "layers.3.attn.indexer.weights_proj" in _one_line_error(broken, WeightLoadError)


def test_unexpected_tensor_is_named(broken):
    _rewrite(broken, lambda t: t.update({"layers.0.attn.bogus.weight": torch.zeros(2)}))
    assert "layers.0.attn.bogus.weight" in _one_line_error(broken, WeightLoadError)


def test_missing_expert_is_named(broken):
    _rewrite(broken, lambda t: t.pop("layers.1.ffn.experts.5.w3.weight"))
    assert "expert 5" in _one_line_error(broken, WeightLoadError)


def test_unknown_model_type_is_named(broken):
    cfg = json.loads((broken / "config.json").read_text())
    cfg["model_type"] = "llama"
    (broken / "config.json").write_text(json.dumps(cfg))
    assert "'llama'" in _one_line_error(broken, ConfigError)
