"""A third architecture added through engine/models/ alone (tests/toy_arch/toy_dense.py): the
registry maps its config.json to it, `load_model` and the Engine serve it, and its greedy tokens
equal a plain-torch recomputation of its forward from the checkpoint's tensors."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "toy_arch"))

import toy_dense  # noqa: E402  (registers the architecture)

from engine.config import ConfigError, EngineConfig, ModelConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.models import registry  # noqa: E402
from engine.weights import load_model  # noqa: E402
from ipc.messages import SamplingParams  # noqa: E402

# the first prompt is longer than the toy's 16-position window, and generation runs past it too
PROMPTS = [[5, 9, 33, 7, 100, 3, 250, 17, 8, 12, 40, 41, 42, 7, 9, 11, 13, 200, 300, 301], [3, 4, 5]]
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory) -> Path:
    return toy_dense.write_checkpoint(tmp_path_factory.mktemp("toy") / "toy", seed=0)


def _reference_greedy(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(toy_dense.reference_logits(model_dir, seq)[-1].argmax()))
    return seq[len(prompt):]


def test_the_registry_maps_the_toy_config_to_its_architecture(toy_dir):
    cfg = ModelConfig.from_model_dir(toy_dir)
    assert cfg.arch == "toy_dense" and registry.of(cfg) is toy_dense.ARCHITECTURE
    assert registry.for_config({"architectures": ["ToyDenseForCausalLM"]}) is toy_dense.ARCHITECTURE
    assert "toy_dense" in registry.names() and registry.get("v41").capabilities.images
    with pytest.raises(ConfigError, match="unsupported model_type 'toy_sparse'.*toy_dense"):
        ModelConfig.from_dict({"model_type": "toy_sparse"})
    with pytest.raises(ValueError, match="already served by toy_dense"):
        registry.register(type("Clash", (toy_dense.ToyDenseArchitecture,), {"name": "clash"})())


@torch.inference_mode()
def test_the_engine_serves_the_toy_token_for_token_with_a_plain_torch_reference(toy_dir):
    model = load_model(toy_dir, dtype=torch.float32, progress=False)
    assert isinstance(model, toy_dense.ToyDense)
    engine = Engine(model, EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, block_size=16,
                                        kv_cache_memory_bytes=4 << 20, max_model_len=256))
    assert engine.static is None and not engine.async_scheduling  # the toy's capabilities
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(i, prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    out: dict[int, list[int]] = {}
    while engine.has_work:
        for delta in engine.step().deltas:
            out.setdefault(delta.request_id, []).extend(delta.token_ids)
    assert [out[i] for i in range(len(PROMPTS))] == [_reference_greedy(toy_dir, p, MAX_TOKENS) for p in PROMPTS]
    assert engine.cache.manager.full.num_used == 0  # every block back


def test_the_toy_refuses_what_its_capabilities_lack(toy_dir):
    model = load_model(toy_dir, dtype=torch.float32, progress=False)
    with pytest.raises(ConfigError, match="--batch-invariant is implemented for DeepSeek-V4.1 only"):
        Engine(model, EngineConfig(max_num_seqs=2, max_num_batched_tokens=32, block_size=16,
                                   kv_cache_memory_bytes=1 << 20, batch_invariant=True))
