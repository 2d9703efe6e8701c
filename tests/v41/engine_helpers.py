"""Drive a V4.1 engine in-process for the tests: requests in, greedy tokens and logprobs out."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.v41.numerics import Numerics
from engine.weights import load_model
from ipc.messages import SamplingParams


@dataclass
class EngineRun:
    tokens: list[list[int]]
    logprobs: list[list[float]]
    engine: Engine
    traces: list[dict] = field(default_factory=list)  # per step of the traced request: layer → (chosen, scores)


def load(model_dir, row_independent: bool = False, dspark: bool = True):
    model = load_model(model_dir, progress=False, load_mtp=dspark)
    model.numerics = Numerics(row_independent=row_independent)
    return model


def use_static_decode(engine: Engine, sizes: tuple[int, ...] | None = None) -> None:
    """Give a V4.1 engine its static decode path as EngineConfig(static_decode=True) would (the
    backend on the runner; shapes captured on CUDA). `sizes`: only these batch sizes (padding rows
    on a CPU)."""
    from engine.v41.static_decode import build_static_backend

    config = replace(engine.config, static_decode=True)
    backend = build_static_backend(engine.model, engine.cache, config, engine.max_model_len, engine.runner.k,
                                   sizes=sizes)
    engine.static = engine.runner.static = backend


def run_engine(model, prompts: list[list[int]], max_tokens: int, trace_prompt: int | None = None,
               static: bool = False, **config) -> EngineRun:
    """Greedy generation of every prompt at once (ignore_eos), chosen-token logprobs kept.
    `static`: decode/verify steps in static shapes (engine/v41/static_decode.py)."""
    defaults = dict(max_num_seqs=4, max_num_batched_tokens=512, num_kv_blocks=96, block_size=16,
                    speculative_tokens=0, adaptive_speculation=False, max_model_len=512)
    engine = Engine(model, EngineConfig(**{**defaults, **config}))
    if static:
        use_static_decode(engine)
    engine.runner.trace = trace_prompt is not None
    requests = [engine.add_request(i, p, SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=0))
                for i, p in enumerate(prompts)]
    run = EngineRun([[] for _ in prompts], [[] for _ in prompts], engine)
    while engine.has_work:
        out = engine.step()
        if trace_prompt is not None and engine.runner.last_step is not None:
            for chunk in engine.runner.last_step.chunks:
                if chunk.seq is requests[trace_prompt].seq:
                    run.traces.append(chunk.trace)
        for d in out.deltas:
            run.tokens[d.request_id] += d.token_ids
            run.logprobs[d.request_id] += d.logprobs
    return run


def tensor_logprobs(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)
