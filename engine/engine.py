"""The engine of one device: scheduler + KV cache + model runner, stepped by the worker.

`step()` is the three-call loop: schedule → execute → update; it returns the token deltas of
every request that advanced. Modes pick defaults: `throughput` (many users, large budgets) and
`single-user` (batch ≤ 4, speculation on, nothing queued ahead of the user's tokens).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field, replace

import torch

from .cuda_graphs import DecodeGraphs
from .kv_cache import KVCache
from .model import DeepseekV4
from .model_runner import ModelRunner
from .request import FinishReason, Request
from .sampling import SamplingParams
from .scheduler import Scheduler, SchedulerConfig
from .spec_control import SpeculationControl

logger = logging.getLogger(__name__)

MODES = ("throughput", "single-user")


@dataclass(frozen=True)
class EngineConfig:
    mode: str = "throughput"
    dtype: str = "auto"  # compute dtype: auto = fp32 on CPU, bf16 on GPU
    kv_dtype: str = "auto"  # auto = the compute dtype (exact); bf16 | fp8 | fp4
    max_num_seqs: int | None = None  # None = the mode's default
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None  # None = min(model max, 32768)
    speculative_tokens: int | None = None
    kv_cache_memory_bytes: int = 2 << 30
    num_kv_blocks: int | None = None  # overrides the memory budget for the growable (full) pools
    block_size: int = 256
    cuda_graph_sizes: tuple[int, ...] = ()
    # Static-shape decode/verify steps (captured as CUDA graphs on GPU). None = the device's
    # default: on for CUDA unless enforce_eager, off on CPU (see `static_decode_default`).
    static_decode: bool | None = None
    enforce_eager: bool = False  # never capture CUDA graphs (a static path, if on, runs uncaptured)
    # Verify only as many of the k drafts as pay for themselves (engine/spec_control.py);
    # False = always k.
    adaptive_speculation: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"--mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if any(size < 1 for size in self.cuda_graph_sizes):
            raise ValueError(f"--cuda-graph-sizes must be positive batch sizes, got {list(self.cuda_graph_sizes)}")

    def resolved(self) -> "EngineConfig":
        """Fill the mode-dependent defaults."""
        single = self.mode == "single-user"
        defaults = {
            "max_num_seqs": 4 if single else 64,
            "max_num_batched_tokens": 1024 if single else 2048,
            "speculative_tokens": 3 if single else 0,
            "cuda_graph_sizes": (1, 2, 4) if single else (1, 2, 4, 8, 16, 32, 64),
        }
        values = {k: (getattr(self, k) if getattr(self, k) not in (None, ()) else v) for k, v in defaults.items()}
        if single and values["max_num_seqs"] > 4:
            raise ValueError("--mode single-user runs at most 4 sequences")
        return replace(self, **values)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(slots=True)
class TokenDelta:
    """New output of one request since the last delta."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: str | None = None
    error: str | None = None
    error_code: int = 500  # HTTP-style: 400 = the request was refused, 500 = it failed in the engine
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0


@dataclass
class EngineStats:
    steps: int = 0
    num_preemptions: int = 0
    spec_drafts: int = 0  # verify steps that carried drafts
    spec_draft_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)
    max_step_s: float = 0.0


class Engine:
    def __init__(self, model: DeepseekV4, config: EngineConfig = EngineConfig()):
        self.config = config = config.resolved()
        self.model = model
        max_len = config.max_model_len or min(model.cfg.max_position_embeddings, 32768)
        self.cache = KVCache.for_model(model, config.kv_dtype, config.max_num_seqs, config.max_num_batched_tokens,
                                       num_full_blocks=config.num_kv_blocks, memory_bytes=config.kv_cache_memory_bytes,
                                       block_size=config.block_size)
        sched_cfg = SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, max_len,
                                    config.speculative_tokens)
        self.scheduler = Scheduler(sched_cfg, self.cache, model.cfg.eos_token_ids)
        k = config.speculative_tokens
        self.graphs = None
        static = config.static_decode
        if static is None:
            static = static_decode_default(model.device) and not config.enforce_eager
        if static:
            depths = tuple(range(1, k + 2)) if config.adaptive_speculation else (1, 1 + k)
            self.graphs = DecodeGraphs(model, self.cache, config.cuda_graph_sizes, depths, max_len,
                                       capture=model.device.type == "cuda" and not config.enforce_eager,
                                       draft_steps=k > 1)
            self.graphs.capture_all()
        self.runner = ModelRunner(model, self.cache, k, self.graphs)
        self.spec_control = SpeculationControl(k) if k and config.adaptive_speculation else None
        self.stats = EngineStats(spec_accepted_per_position=[0] * k)
        self._pending_aborts: list[str] = []

    @property
    def max_model_len(self) -> int:
        return self.scheduler.config.max_model_len

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Request:
        vocab = self.model.cfg.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            from .request import RequestError

            raise RequestError(f"token id {bad} is outside the vocabulary [0, {vocab})")
        req = Request(request_id, list(prompt_token_ids), params)
        self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> TokenDelta | None:
        req = self.scheduler.abort(request_id)
        if req is None:
            return None
        return TokenDelta(request_id, [], finish_reason=FinishReason.ABORT.value, num_prompt_tokens=req.num_prompt_tokens,
                          num_output_tokens=req.num_output_tokens)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list[TokenDelta]:
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        if not batch:
            return []
        control = self.spec_control
        if control is not None:
            self.runner.num_drafts = control.choose(len(batch.scheduled))
        outputs = self.runner.execute(batch)
        self.scheduler.update(batch, outputs)
        if self.runner.k:
            self._count_acceptance(batch, outputs)
        if control is not None:
            self._observe(control, batch, outputs, time.perf_counter() - t0)
        deltas = []
        for s in batch.scheduled:
            req = s.request
            if len(req.token_ids) > len(req.prompt_token_ids) + req.num_emitted or req.finish_reason is not None:
                deltas.append(self._delta(req))
        self.stats.steps += 1
        self.stats.num_preemptions = self.scheduler.num_preemptions
        self.stats.max_step_s = max(self.stats.max_step_s, time.perf_counter() - t0)
        return deltas

    def _count_acceptance(self, batch, outputs) -> None:
        for s in batch.scheduled:
            k = s.num_draft
            out = outputs.get(s.request.request_id) if k else None
            if out is None or out.error:
                continue
            self.stats.spec_drafts += 1
            self.stats.spec_draft_tokens += k
            for i in range(len(out.accepted) - 1):
                self.stats.spec_accepted_per_position[i] += 1

    @staticmethod
    def _observe(control: SpeculationControl, batch, outputs, seconds: float) -> None:
        """Feed the controller this step's verifications and, for a pure decode/verify step of
        one depth (the steps its choice is about), the step's time."""
        depth = batch.scheduled[0].num_draft
        uniform = True
        for s in batch.scheduled:
            out = outputs.get(s.request.request_id)
            if s.num_draft and out is not None and not out.error:
                control.observe_verification(s.num_draft, len(out.accepted) - 1)
            uniform = uniform and s.reaches_end and s.num_draft == depth and s.num_tokens == depth + 1
        if uniform:
            control.observe_step_time(len(batch.scheduled), depth, seconds)

    def _delta(self, req: Request) -> TokenDelta:
        lo = req.num_emitted
        new = req.token_ids[len(req.prompt_token_ids) + lo :]
        num_prompt = len(req.prompt_token_ids)
        delta = TokenDelta(req.request_id, new, None, None,
                           req.finish_reason.value if req.finish_reason is not None else None, req.error,
                           num_prompt_tokens=num_prompt, num_output_tokens=len(req.token_ids) - num_prompt)
        if req.params.logprobs is not None:
            delta.logprobs = req.logprobs[lo : lo + len(new)]
            delta.top_logprobs = req.top_logprobs[lo : lo + len(new)]
        req.num_emitted += len(new)
        return delta


def static_decode_default(device: torch.device) -> bool:
    """CUDA: on (graph replay removes the per-kernel launch cost that dominates decode). CPU: off;
    with no launch cost to save, the per-sequence path reads only the entries each sequence
    has instead of a padded context bucket (`perf/bench_cuda_graphs.py` measures both)."""
    return device.type == "cuda"


def default_dtype(config: EngineConfig, device: str) -> torch.dtype:
    if config.dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[config.dtype]
