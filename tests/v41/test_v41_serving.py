"""DeepSeek-V4.1 through the serving stack: `LLM` over two data-parallel worker processes, with
DSpark drafting, chosen from the checkpoint's config alone, gives DeepSeek's greedy tokens for
every golden prompt of c1 (expert parallelism: tests/v41/test_v41_expert_parallel.py). The workers
keep the Engram tables in host memory (`--engram-tables host`), which reaches them through the
engine config."""

from __future__ import annotations

import json

from ipc.messages import SamplingParams
from server.llm import LLM

# exact fp32 products in the workers: compared with golden tokens (kernels/cpu_precision.py)
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=512, kv_cache_memory_bytes=64 * 2**20, block_size=16,
              max_model_len=512, cpu_matmul_precision="fp32")


def test_llm_dp2_with_dspark_gives_the_golden_tokens(golden_root):
    d = golden_root / "c1"
    g = json.loads((d / "golden.json").read_text())
    k = json.loads((d / "config.json").read_text())["text_config"]["dspark_block_size"]
    params = SamplingParams(max_tokens=g["max_new_tokens"], ignore_eos=True)
    with LLM(d, dp=2, threads_per_worker=1, speculative_tokens=k, adaptive_speculation=False, engram_tables="host",
             **ENGINE) as llm:
        outs = llm.generate(g["prompts"], params)
    assert [o.error for o in outs] == [None] * len(outs)
    assert [o.token_ids for o in outs] == g["tokens"]

