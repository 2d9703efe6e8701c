"""The offline image surfaces against DeepSeek's reference outputs (`shared/golden/deepseek-v4.1-vision/c1`):
the `LLM` with vLLM's prompt dicts (`multi_modal_data` holding the PNG paths) and `ringserve generate
--image` (its own worker) expand every golden prompt to REF's `input_ids` and give REF's 24 greedy
tokens. Exact fp32 products in the workers (kernels/cpu_precision.py), no drafting."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

GOLDEN = Path(__file__).resolve().parents[2].parent / "shared" / "golden" / "deepseek-v4.1-vision" / "c1"
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=512, kv_cache_memory_bytes=64 * 2**20, block_size=16,
              max_model_len=512, cpu_matmul_precision="fp32", speculative_tokens=0)


@pytest.fixture(scope="module")
def golden() -> dict:
    if not (GOLDEN / "golden.json").exists():
        pytest.skip(f"V4.1 vision golden data not found at {GOLDEN}")
    return json.loads((GOLDEN / "golden.json").read_text())


def test_llm_with_image_paths_gives_the_golden_prompts_and_tokens(golden):
    from ipc.messages import SamplingParams
    from server.llm import LLM

    prompts = [{"prompt_token_ids": ids, "multi_modal_data": {"image": [GOLDEN / name for name in names]}}
               for ids, names in zip(golden["prompts"], golden["prompt_images"])]
    with LLM(GOLDEN, threads_per_worker=1, **ENGINE) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=golden["max_new_tokens"], ignore_eos=True))
    assert [o.error for o in outs] == [None] * len(outs)
    assert [o.prompt_token_ids for o in outs] == golden["input_ids"]
    assert [o.token_ids for o in outs] == golden["tokens"]


def test_generate_cli_with_two_images_gives_the_golden_tokens(golden):
    i = next(k for k, names in enumerate(golden["prompt_images"]) if len(names) == 2)
    cmd = [sys.executable, "-m", "server.cli", "generate", str(GOLDEN), "--prompt-ids",
           ",".join(map(str, golden["prompts"][i])), "--max-tokens", str(golden["max_new_tokens"]), "--ignore-eos",
           "--json", "--cpu-matmul-precision", "fp32", "--speculative-tokens", "0", "--kv-cache-memory", "0.0625",
           "--block-size", "16", "--max-model-len", "512"]
    for name in golden["prompt_images"][i]:
        cmd += ["--image", str(GOLDEN / name)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    record = json.loads(run.stdout.splitlines()[-1])
    assert record["prompt_token_ids"] == golden["input_ids"][i]
    assert record["token_ids"] == golden["tokens"][i]
