"""DeepSeek-V4.1's captured decode/verify step on a real GPU (skipped without one; run by
scripts/gpu_check.sh). On CPU the same static programs are checked against the golden data
(tests/v41/test_static_decode.py) and dry-run on the fake CUDA device (tests/gpu_dry_run/);
only a GPU can show the numerics of the compiled kernels and of graph replay.

A tiny random V4.1 under row-independent (--batch-invariant) numerics: the captured static
steps give the eager path's tokens and logprobs bit for bit, with and without DSpark, every
decode/verify step replayed from a graph with one host sync (torch.cuda.set_sync_debug_mode).
Where the golden data travels with the checkout (../shared or ./shared), golden c1 / c2 on CUDA
with the engine's defaults there: greedy tokens as REF's, logprobs within the golden bound. (No
test here skips: scripts/gpu_check.sh fails on a skipped gpu test.)
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from safetensors.torch import load_file  # noqa: E402

from engine.config import EngineConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.weights import load_model  # noqa: E402
from ipc.messages import SamplingParams  # noqa: E402

LOGPROB_BOUND = 0.5  # as tests/v41/test_engine_golden.py


ROOT = Path(__file__).resolve().parents[2]
GOLDEN = next((p for p in (ROOT.parent / "shared" / "golden" / "deepseek-v4.1", ROOT / "shared" / "golden" /
                           "deepseek-v4.1") if (p / "c1" / "golden.json").exists()), None)


def _drive(engine: Engine, prompts: list[list[int]], max_tokens: int):
    """Greedy tokens, chosen logprobs and the host syncs of each static (captured) step."""
    for i, p in enumerate(prompts):
        engine.add_request(i, p, SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=0))
    tokens, lps, syncs = [[] for _ in prompts], [[] for _ in prompts], []
    while engine.has_work:
        static_before = engine.runner.num_static_steps
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                out = engine.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        if engine.runner.num_static_steps > static_before:
            syncs.append(sum("synchroniz" in str(w.message) for w in seen))
        for d in out.deltas:
            tokens[d.request_id] += d.token_ids
            lps[d.request_id] += d.logprobs
    return tokens, lps, syncs


def _config(k: int, **kw) -> EngineConfig:
    return EngineConfig(max_num_seqs=4, max_num_batched_tokens=512, num_kv_blocks=96, block_size=16,
                        speculative_tokens=k, adaptive_speculation=False, max_model_len=512,
                        cuda_graph_sizes=(1, 2, 4), **kw)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from engine.v41.checkpoint import write_v41_checkpoint

    path = write_v41_checkpoint(tmp_path_factory.mktemp("v41-gpu") / "tiny", "tiny", seed=3, quantize="fp8-fp4")
    return load_model(path, device="cuda", progress=False)


@pytest.mark.parametrize("dspark", [False, True], ids=["plain", "dspark"])
@torch.inference_mode()
def test_captured_steps_equal_the_eager_path(tiny, dspark):
    k = tiny.cfg.v41.dspark_block_size if dspark else 0
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (60, 23, 5)]
    eager = _drive(Engine(tiny, _config(k, static_decode=False, batch_invariant=True)), prompts, 12)
    engine = Engine(tiny, _config(k, batch_invariant=True))
    assert engine.static is not None and engine.static.capture
    captured = _drive(engine, prompts, 12)
    assert captured[0] == eager[0] and captured[1] == eager[1]
    assert len(captured[2]) >= 3 and all(n == 1 for n in captured[2]), captured[2]
    assert engine.static.num_replays > 0


if GOLDEN is not None:
    @pytest.fixture(scope="module", params=["c1", "c2"])
    def golden(request):
        from dataclasses import replace

        d = GOLDEN / request.param
        model = load_model(d, device="cuda", progress=False)
        model.numerics = replace(model.numerics, exact=True)  # the reference's GEMMs (fp64: fine at this size)
        return json.loads((d / "golden.json").read_text()), load_file(str(d / "logprobs.safetensors")), model

    @pytest.mark.parametrize("dspark", [False, True], ids=["plain", "dspark"])
    @torch.inference_mode()
    def test_captured_steps_keep_the_golden_tokens(golden, dspark):
        g, logprobs, model = golden
        prompts = g["prompts"][:2] if dspark else g["prompts"]
        k = model.cfg.v41.dspark_block_size if dspark else 0
        tokens, lps, syncs = _drive(Engine(model, _config(k)), prompts, g["max_new_tokens"])
        assert tokens == g["tokens"][: len(prompts)]
        for i, t in enumerate(tokens):
            ref = logprobs[f"prompt{i}"].gather(1, torch.tensor(t)[:, None])[:, 0]
            assert float((torch.tensor(lps[i]) - ref).abs().max()) <= LOGPROB_BOUND
        assert len(syncs) >= 3 and all(n == 1 for n in syncs), syncs
