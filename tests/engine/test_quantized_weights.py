"""Weights kept as stored (weight_dtype='auto'): dtypes and bytes as in the checkpoint, the same
logits and greedy tokens as the upcast, and per-rank expert loading that reads only its share."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import engine.weights as weights_mod
from engine.config import EngineConfig
from engine.engine import Engine
from engine.linear import QuantWeight
from engine.v4.weight_formats import formats_from_config
from engine.v4.weight_names import export_names
from engine.v4.weights import build_model
from engine.weights import WeightLoadError, load_model
from ipc.messages import SamplingParams
from reference_driver import generate

PROMPTS = [[5, 9, 200, 31, 7, 7, 100], list(range(40, 75)), [3]]
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)
_EXPERT_RE = re.compile(r"^(?:layers|mtp)\.(\d+)\.(?:block\.)?ffn\.experts\.(\d+)\.")


@pytest.fixture(scope="module")
def qpath(checkpoint_factory):
    return checkpoint_factory("tiny-fp8-fp4", dtype=torch.bfloat16, quantize="fp8-fp4", index_topk=64)


@pytest.fixture(scope="module")
def models(qpath):
    return {w: load_model(qpath, dtype=torch.float32, progress=False, weight_dtype=w) for w in ("auto", "bf16")}


def test_auto_keeps_the_stored_dtypes_and_bytes(qpath, models):
    ours = models["auto"]
    stored = load_file(str(qpath / "model.safetensors"))
    state = ours.state_dict()
    quantized = (torch.float8_e4m3fn, torch.int8, torch.float8_e8m0fnu)
    for name, value in state.items():  # quantized tensors exactly as the checkpoint stores them
        for ckpt_name, _, _ in export_names(name, "upstream", ours.cfg.n_routed_experts):
            if stored[ckpt_name].dtype in quantized or value.dtype in quantized:
                assert value.dtype == stored[ckpt_name].dtype, name
    attn = ours.layers[1].attn
    assert attn.wq_a.weight.dtype == torch.float8_e4m3fn and attn.wq_a.scale.dtype == torch.float8_e8m0fnu
    assert attn.wo_a.fmt.kind == "fp8" and ours.mtp[0].e_proj.fmt.kind == "fp8"
    assert ours.layers[1].ffn.shared_w2.fmt.kind == "fp8"
    assert attn.compressor.wkv.fmt.kind == "dense" and attn.indexer.weights_proj.fmt.kind == "dense"
    experts = ours.layers[1].ffn.experts
    assert experts.w13.weight.dtype == torch.int8 and experts.w13.weight.shape == (8, 64, 32)
    # Routed experts in memory are exactly the packed FP4 codes and scales of the checkpoint.
    in_memory = sum(t.nbytes for name, t in state.items() if ".ffn.experts." in name)
    in_file = sum(t.nbytes for name, t in stored.items() if _EXPERT_RE.match(name))
    assert in_memory == in_file
    assert in_memory < sum(t.nbytes for n, t in models["bf16"].state_dict().items() if ".ffn.experts." in n) / 7


def test_the_exported_names_of_the_stored_state_are_the_checkpoint(qpath, models):
    ours = models["auto"]
    names = {n for internal in ours.state_dict() for n, _, _ in export_names(internal, "upstream", 8)}
    with safe_open(str(qpath / "model.safetensors"), "pt") as f:
        assert names == set(f.keys())


def test_config_plan_equals_the_checkpoint_plan(models):
    ours = models["auto"]
    planned = formats_from_config(build_model(ours.cfg, with_mtp=True), ours.cfg)
    loaded = {path: m.fmt for path, m in ours.named_modules() if isinstance(m, QuantWeight) and m.fmt.quantized}
    assert planned == loaded


def _step_logits(model, tokens):
    from engine.attention_backend import SequenceStep, StepSeq

    step = SequenceStep([StepSeq(model.new_state(), 0, tokens)], model.device)
    return model.logits(model(step.token_ids, step.positions, step))


def test_stored_weights_give_the_upcast_logits_and_tokens(models):
    auto, upcast = models["auto"], models["bf16"]
    with torch.inference_mode():
        for prompt in PROMPTS:
            a, b = _step_logits(auto, prompt), _step_logits(upcast, prompt)
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-4), float((a - b).abs().max())
    want = [g.token_ids for g in generate(upcast, PROMPTS, GREEDY)]
    assert [g.token_ids for g in generate(auto, PROMPTS, GREEDY)] == want
    engine = Engine(auto, EngineConfig(max_num_seqs=4, max_num_batched_tokens=16, kv_cache_memory_bytes=4 << 20,
                                       block_size=16))
    for i, p in enumerate(PROMPTS):
        engine.add_request(i, p, GREEDY)
    out: dict[int, list[int]] = {}
    while engine.has_work:
        for d in engine.step().deltas:
            out.setdefault(d.request_id, []).extend(d.token_ids)
    assert [out[i] for i in range(len(PROMPTS))] == want


def test_weight_dtype_is_checked(qpath):
    with pytest.raises(ValueError, match="weight_dtype"):
        load_model(qpath, progress=False, weight_dtype="fp8")


# ---- per-rank expert loading -----------------------------------------------------------------


class _SpyFile:
    """A safe_open handle that records every data read: whole tensors and slices."""

    def __init__(self, real, reads: list):
        self.real, self.reads = real, reads

    def keys(self):
        return self.real.keys()

    def get_tensor(self, name):
        self.reads.append((name, None))
        return self.real.get_tensor(name)

    def get_slice(self, name):
        return _SpySlice(self.real.get_slice(name), name, self.reads)


class _SpySlice:
    def __init__(self, real, name, reads):
        self.real, self.name, self.reads = real, name, reads

    def get_dtype(self):
        return self.real.get_dtype()

    def get_shape(self):
        return self.real.get_shape()

    def __getitem__(self, index):
        self.reads.append((self.name, index))
        return self.real[index]


@pytest.fixture
def reads(monkeypatch):
    log: list = []
    real = weights_mod.safe_open
    monkeypatch.setattr(weights_mod, "safe_open",
                        lambda path, framework: _SpyFile(real(path, framework=framework), log))
    return log


SHARE = {1: [5, 2, 5], 2: [0], 3: [7, 6]}  # layer 0 and the MTP layer (4) hold every expert


def test_a_rank_reads_only_its_experts(qpath, models, reads):
    share = load_model(qpath, dtype=torch.float32, progress=False, experts=SHARE)
    full = models["auto"]
    read_names = [name for name, _ in reads]
    assert len(read_names) == len(set(read_names))  # each tensor once, a replica's too
    for name in read_names:
        m = _EXPERT_RE.match(name)
        if m and int(m.group(1)) in SHARE:
            assert int(m.group(2)) in SHARE[int(m.group(1))], name
    with safe_open(str(qpath / "model.safetensors"), "pt") as f:
        unread = set(f.keys()) - set(read_names)
    assert len(unread) == 2 * 3 * (8 - 2 + 8 - 1 + 8 - 2)  # weight + scale of w1/w2/w3 of each skipped expert
    for layer, ids in SHARE.items():
        got, want = share.layers[layer].ffn.experts, full.layers[layer].ffn.experts
        assert got.logical_ids == tuple(ids)
        for w in ("w13", "w2"):
            for leaf in ("weight", "scale"):
                a, b = getattr(getattr(got, w), leaf), getattr(getattr(want, w), leaf)[ids]
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (layer, w, leaf)
    assert share.layers[0].ffn.experts.holds_all and share.mtp[0].block.ffn.experts.holds_all


def test_stacked_experts_are_read_by_slice(checkpoint_factory, reads):
    path = checkpoint_factory("tiny-bf16-tf", layout="transformers", dtype=torch.bfloat16)
    full = load_model(path, dtype=torch.float32, progress=False, load_mtp=False)
    reads.clear()
    share = load_model(path, dtype=torch.float32, progress=False, load_mtp=False, experts={1: [3, 1]})
    stacked = [(n, i) for n, i in reads if n.startswith("model.layers.1.mlp.experts.")]
    assert sorted(stacked) == sorted((f"model.layers.1.mlp.experts.{w}", slice(e, e + 1))
                                     for w in ("gate_up_proj", "down_proj") for e in (1, 3))
    for w in ("w13", "w2"):
        got = getattr(share.layers[1].ffn.experts, w).weight
        assert torch.equal(got, getattr(full.layers[1].ffn.experts, w).weight[[3, 1]])


def test_a_missing_expert_matters_only_to_its_holder(qpath, tmp_path):
    import shutil

    from safetensors.torch import save_file

    broken = tmp_path / "model"
    shutil.copytree(qpath, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    for leaf in ("weight", "scale"):
        tensors.pop(f"layers.2.ffn.experts.4.w3.{leaf}")
    save_file(tensors, str(broken / "model.safetensors"))
    load_model(broken, dtype=torch.float32, progress=False, experts={2: [0, 1]})  # not this rank's expert
    with pytest.raises(WeightLoadError, match="expert 4 of layers.2.ffn.experts.w13.weight"):
        load_model(broken, dtype=torch.float32, progress=False, experts={2: [4]})
    with pytest.raises(ValueError, match="layers"):
        load_model(broken, dtype=torch.float32, progress=False, experts={9: [0]})
