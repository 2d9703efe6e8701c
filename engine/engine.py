"""The engine of one device: scheduler + KV cache + model runner, stepped by the worker.

`step()` is the three-call loop: schedule → execute → update; it returns the step's token
deltas and finishes as the wire message `StepOutputs`. Modes pick defaults (see
`EngineConfig.resolved`): `throughput` (many users, large budgets) and `single-user` (batch ≤ 4,
speculation on, nothing queued ahead of the user's tokens).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field, replace

import torch

from ipc.messages import Finished, SamplingParams, StepOutputs
from ipc.prompt_checks import PromptRefused, check_prompt

from .batch import Batch, StepOutput
from .config import ConfigError, EngineConfig
from .cuda_graphs import StaticDecodeBackend
from .model_runner import LaunchedStep
from .models import registry
from .prefix_cache import PrefixCache, snapshot_slots
from .request import Request, RequestError
from .scheduler import Scheduler, SchedulerConfig
from .spec_control import SpeculationControl
from .v41.vision.requests import check_images

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    steps: int = 0
    num_preemptions: int = 0
    spec_drafts: int = 0  # verify steps that carried drafts
    spec_draft_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)
    max_step_s: float = 0.0


class Engine:
    def __init__(self, model: torch.nn.Module, config: EngineConfig = EngineConfig()):
        self.config = config = config.resolved()
        self.architecture = arch = registry.of(model.cfg)  # its cache, runner, drafter (engine/models/)
        caps = arch.capabilities
        if config.batch_invariant and not caps.batch_invariant:
            raise ConfigError(f"--batch-invariant is implemented for {registry.having('batch_invariant')} only")
        self.model = model
        max_len = config.context_length(model.cfg)
        if config.batch_invariant:
            model.numerics = replace(model.numerics, row_independent=True)  # the model's mode from now on
        cache_cls = arch.cache_class()
        self.config = config = _without_unsupported_prefix_caching(config)
        slots = snapshot_slots(config.enable_prefix_caching, config.prefix_replay, config.prefix_snapshots,
                               config.max_num_seqs)
        self.cache = cache_cls.for_model(model, config.kv_dtype, config.max_num_seqs, config.max_num_batched_tokens,
                                         num_full_blocks=config.num_kv_blocks,
                                         memory_bytes=config.kv_cache_memory_bytes, block_size=config.block_size,
                                         snapshot_slots=slots)
        k = config.speculative_tokens
        if k > self.cache.manager.slack:
            raise ValueError(f"--speculative-tokens {k} exceeds the KV slack of {self.cache.manager.slack} positions")
        max_len = _fit_context_to_pool(max_len, self.cache.manager, k)
        sched_cfg = SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, max_len, k)
        # ---- prefix caching (engine/prefix_cache.py) ----
        # only MTP drafts read a look-ahead token in their windows (see PrefixCache.for_engine)
        self.prefix_cache = (PrefixCache.for_engine(self.cache, model.cfg, config.kv_dtype, config.prefix_replay,
                                                    k > 0 and caps.drafter == "mtp")
                             if config.enable_prefix_caching else None)
        self.scheduler = Scheduler(sched_cfg, self.cache, model.cfg.eos_token_ids, self.prefix_cache)
        self.static = None
        static = config.static_decode
        if static is None:
            static = static_decode_default(model.device) and not config.enforce_eager
        if caps.own_static_decode:  # e.g. V4.1's (engine/v41/static_decode.py); on a CPU only when asked
            self.static = arch.static_backend(model, self.cache, config, max_len, k)
        elif static and caps.generic_static_decode:
            depths = tuple(range(1, k + 2)) if config.adaptive_speculation else (1, 1 + k)
            sizes = static_batch_sizes(config, model.device)
            self.static = StaticDecodeBackend(model, self.cache, sizes, depths, max_len,
                                              capture=model.device.type == "cuda" and not config.enforce_eager,
                                              draft_steps=k > 0,
                                              decode_steps=config.cpu_decode_steps if model.device.type == "cpu" else 1)
            if self.static.capture:
                _check_capturable_dispatch(model)
            self.static.capture_all()
        self.runner = arch.runner(model, self.cache, config, k, self.static)
        self.spec_control = SpeculationControl(k) if k and config.adaptive_speculation else None
        self.stats = EngineStats(spec_accepted_per_position=[0] * k)
        self.connector = None  # [kv-connector] PD disaggregation: engine.kv_connector.attach_connector sets it
        self.async_scheduling = _async_scheduling(config, k, arch, self.static is not None)
        if _greedy_decode_steps(config, k, caps, self.static, self.async_scheduling):
            self.scheduler.allow_decode_steps(config.cpu_decode_steps)
        self._in_flight: tuple[LaunchedStep, float] | None = None  # async scheduling: step t, its start
        self.grammars = None  # structured outputs: GrammarCache, made at the first request with a grammar
        self.on_grammar_ready = None  # called (from the compile thread) when a grammar compile ends

    @property
    def max_model_len(self) -> int:
        return self.scheduler.config.max_model_len

    def add_request(self, request_id: int, prompt_token_ids: list[int], params: SamplingParams,
                    kv_transfer_params=None, images=()) -> Request:
        """Queue a request; RequestError if it breaks an invariant the edge should have enforced
        (the worker turns that into a refused request, never a crash). `images`: the prompt's
        images (ipc.messages.ImageData, span order; engine/v41/vision/requests.py)."""
        try:  # the edge validator; past here (scheduler.add) a prompt that does not fit is a bug
            check_prompt(prompt_token_ids, params.max_tokens, vocab_size=self.model.cfg.vocab_size,
                         max_model_len=self.max_model_len)
        except PromptRefused as exc:
            raise RequestError(str(exc)) from None
        decode_leg = kv_transfer_params is not None and kv_transfer_params.do_remote_prefill
        multimodal = check_images(self.model, prompt_token_ids, list(images), decode_leg)
        if kv_transfer_params is not None:  # [kv-connector] a leg of a PD request
            if self.connector is None:
                raise RequestError("kv_transfer_params need a server started with --kv-transfer")
            req = self.connector.add_request(request_id, list(prompt_token_ids), params, kv_transfer_params,
                                             multimodal)
            if params.structured is not None:  # the prefill samples its first token under the grammar, the
                req.grammar = self.grammar_for(params)  # decode leg's matcher starts from that token
            return req
        req = Request(request_id, list(prompt_token_ids), params)
        req.multimodal = multimodal
        if params.structured is not None:
            req.grammar = self.grammar_for(params)
        self.scheduler.add(req)
        return req

    def grammar_for(self, params: SamplingParams):
        """The request's grammar state (engine/structured/); its compile starts now, off the step
        loop. RequestError when this engine cannot do structured outputs."""
        from .structured import RequestGrammar

        spec = params.structured
        if self.grammars is None:
            self.grammars = self._grammar_cache()
        if spec.start_after is not None and not 0 <= spec.start_after < self.model.cfg.vocab_size:
            raise RequestError(f"structured output start token {spec.start_after} is outside the vocabulary")
        return RequestGrammar(self.grammars.get(spec), spec.start_after)

    def _grammar_cache(self):
        import importlib.util

        from .structured import GrammarCache

        source = getattr(self.model, "source_dir", None)
        if source is None or not (source / "tokenizer.json").exists():
            raise RequestError("structured outputs need the model's tokenizer.json (none next to the checkpoint)")
        if importlib.util.find_spec("xgrammar") is None:
            raise RequestError("structured outputs need xgrammar (pip install xgrammar)")
        cfg = self.model.cfg
        return GrammarCache(source, cfg.vocab_size, list(cfg.eos_token_ids),
                            on_ready=lambda: self.on_grammar_ready and self.on_grammar_ready())

    def settle_grammars(self) -> list[Finished]:
        """Start the matchers of waiting requests whose grammar compile ended; those whose
        compile failed (or whose output so far breaks it) finish with a 400 error, those whose
        output so far already ends it finish with stop."""
        failed = []
        for req in [r for r in self.scheduler.waiting if r.grammar is not None and r.grammar.matcher is None]:
            if not req.grammar.ready:
                continue
            error = req.grammar.error()
            if error is None:
                try:
                    req.grammar.start(req.token_ids[req.num_prompt_tokens:])
                except ValueError as exc:
                    error = str(exc)
            if error is not None:
                failed.append(self.scheduler.fail_waiting(req, error))
            elif req.grammar.terminated:  # its output so far (a PD decode leg's first token) ended it
                failed.append(self.scheduler.finish_waiting(req))
        return failed

    @property
    def waits_on_grammars_only(self) -> bool:
        """Every request waits for its grammar's compile: no step to run until one ends."""
        return self._in_flight is None and self.scheduler.waits_on_grammars_only

    def abort(self, request_id: int) -> Finished | None:
        done = self.scheduler.abort(request_id)
        if self.connector is not None:  # [kv-connector] a request waiting for remote KV
            done = self.connector.abort(request_id) or done
        return done

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._in_flight is not None

    def step(self) -> StepOutputs:
        """One schedule → execute → update round; empty outputs when there is nothing to run."""
        if self.async_scheduling and self.connector is None:
            return self._step_ahead()
        t0 = time.perf_counter()
        loaded = self.kv_tick()  # [kv-connector]
        failed = self.settle_grammars() if self.grammars is not None else []
        if failed:
            loaded = StepOutputs(loaded.deltas if loaded else [], (loaded.finished if loaded else []) + failed)
        batch = self.scheduler.schedule()
        if not batch:
            return loaded or StepOutputs([], [])
        out = self.run(batch, self.draft_wish(batch), t0=t0)
        return StepOutputs(loaded.deltas + out.deltas, loaded.finished + out.finished) if loaded else out

    def _step_ahead(self) -> StepOutputs:
        """Async scheduling: schedule and launch step t + 1 while step t is in flight (its
        sampled tokens are placeholders on the host, read by t + 1 on the device), then wait for
        step t and fold it into the requests. On a GPU the host's read, update and scheduling then
        overlap the device's next step; on a CPU the launch runs the step, so nothing overlaps,
        but the tokens are the same as without it. Returns step t's outputs."""
        t0 = time.perf_counter()
        failed = self.settle_grammars() if self.grammars is not None else []
        prev, self._in_flight = self._in_flight, None
        ahead = prev[0] if prev is not None else None
        if ahead is None:
            batch = self.scheduler.schedule()
        else:
            drafts = _drafts_of(ahead) if self.runner.k else None
            batch = self.scheduler.schedule(ahead=ahead.batch, ahead_drafts=drafts)
            if batch and (not self.runner.runs_ahead(batch)
                          or any(s.request.grammar is not None for s in ahead.batch.scheduled)):
                # e.g. no static shape holds it, or a grammar's next bitmask needs step t's tokens
                # on the host: step t is completed first (grammars then step every time, in sync)
                batch = Batch()
        if batch:
            self._in_flight = (self.runner.launch(batch, self.draft_wish(batch), ahead=ahead), t0)
        if prev is None:
            return StepOutputs([], failed)
        out = self._complete(ahead.batch, self.runner.finish(ahead), prev[1])
        return StepOutputs(out.deltas, out.finished + failed) if failed else out

    def kv_tick(self) -> StepOutputs | None:
        """[kv-connector] Advance KV transfers: the first tokens and failures of remote-prefilled
        requests whose loads ended (None: nothing to report, or no connector)."""
        return self.connector.tick() if self.connector is not None else None

    def draft_wish(self, batch: Batch) -> int:
        """Drafts to propose after this batch (the speculation controller's choice, or k)."""
        if self.spec_control is not None and batch:
            return self.spec_control.choose(len(batch.scheduled))
        return self.runner.k

    def run(self, batch: Batch, num_drafts: int, allow_static: bool = True, lockstep: bool = False,
            t0: float | None = None) -> StepOutputs:
        """Execute a scheduled batch and fold its results into the requests. Under lockstep an
        empty batch is a dummy step (zero tokens through every collective of a real one)."""
        t0 = time.perf_counter() if t0 is None else t0
        step = self.runner.execute(batch, num_drafts, allow_static=allow_static, lockstep=lockstep)
        if not batch:
            return StepOutputs([], [])
        return self._complete(batch, step, t0)

    def _complete(self, batch: Batch, step: StepOutput, t0: float) -> StepOutputs:
        """Fold a step's results into its requests: their token deltas and finishes."""
        control = self.spec_control
        if self.connector is not None:  # [kv-connector] hold remote-decode blocks before update frees them
            self.connector.before_update(batch, step)
        deltas, finished = self.scheduler.update(batch, step)
        if self.connector is not None:  # [kv-connector] their kv_transfer_params onto their Finished
            finished = self.connector.attach(finished)
        if self.runner.k:
            self._count_acceptance(batch, step)
        if control is not None:
            self._observe(control, batch, step, time.perf_counter() - t0)
        if self.scheduler.config.decode_steps > 1 and batch.uniform_decode == 1 and step.outputs:
            self._pace_decode_steps(step, time.perf_counter() - t0)
        self.stats.steps += 1
        self.stats.num_preemptions = self.scheduler.num_preemptions
        self.stats.max_step_s = max(self.stats.max_step_s, time.perf_counter() - t0)
        return StepOutputs(deltas, finished)

    def _pace_decode_steps(self, step: StepOutput, seconds: float) -> None:
        """Set how many greedy steps the next call may run from this decode step's time per
        token (steps_within_budget)."""
        tokens = max(len(out.accepted) for out in step.outputs.values()) or 1
        sched = self.scheduler
        sched.steps_per_call = steps_within_budget(seconds / tokens, sched.config.decode_steps)

    def _count_acceptance(self, batch: Batch, step: StepOutput) -> None:
        for s in batch.scheduled:
            out = step.outputs.get(s.request.request_id) if s.num_draft else None
            if out is None or out.error:
                continue
            self.stats.spec_drafts += 1
            self.stats.spec_draft_tokens += s.num_draft
            for i in range(len(out.accepted) - 1):
                self.stats.spec_accepted_per_position[i] += 1

    @staticmethod
    def _observe(control: SpeculationControl, batch: Batch, step: StepOutput, seconds: float) -> None:
        """Feed the controller this step's verifications and, for a pure decode/verify step of
        one depth (the steps its choice is about), the step's time."""
        for s in batch.scheduled:
            out = step.outputs.get(s.request.request_id)
            if s.num_draft and out is not None and not out.error:
                control.observe_verification(s.num_draft, len(out.accepted) - 1)
        q = batch.uniform_decode
        if q is not None:
            control.observe_step_time(len(batch.scheduled), q - 1, seconds)


def static_decode_default(device: torch.device) -> bool:
    """On for both devices. CUDA: graph replay removes the per-kernel launch cost that dominates
    decode. CPU: the static forward runs a few fused numba kernels per layer (kernels/cpu_decode.py)
    where the per-sequence path runs ~100 torch ops per sequence and layer; on tiny6 it measured
    faster at batch 1 and 16 (`perf/bench_cpu_decode.py --variants static`)."""
    return device.type in ("cuda", "cpu")


def static_batch_sizes(config: EngineConfig, device: torch.device) -> tuple[int, ...]:
    """Batch sizes the static path runs. CUDA: the captured sizes (a batch pads up to the next).
    CPU: every size up to max_num_seqs, since nothing is captured and a padding row would only
    cost its share of each GEMM and of the MoE (its token is routed like a real one)."""
    if device.type == "cpu":
        return tuple(range(1, config.max_num_seqs + 1))
    return config.cuda_graph_sizes


def default_dtype(config: EngineConfig, device: str) -> torch.dtype:
    if config.dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[config.dtype]


def _async_scheduling(config: EngineConfig, num_drafts: int, arch, static: bool) -> bool:
    """--async-scheduling, where a step's inputs never need its predecessor's results on the
    host. Not for an architecture without the capability (V4.1: its runner takes no
    device-side tokens yet), nor with speculation
    outside the static decode path (a step after a verification starts at a position known on
    the device only): there it is turned off, said once. PD roles and expert-parallel lockstep
    run the synchronous step (see Engine.step, worker.py)."""
    if not config.async_scheduling:
        return False
    why = None
    if not arch.capabilities.async_scheduling:
        why = arch.display_name
    elif num_drafts and not static:
        why = "--speculative-tokens without the static decode path"
    if why is not None:
        logger.info("async scheduling is off: not supported with %s yet", why)
        return False
    return True


# A multi-step call's time budget: a request that arrives during a call waits for its end before
# its prefill, so calls stay around this long. Where one step takes longer, the host's work per
# step (~0.15 ms at batch 1, ~1 ms at 16) is a small share of it, and a call runs one step.
CALL_BUDGET_S = 0.02


def steps_within_budget(step_s: float, most: int) -> int:
    """Greedy steps one call may run (1 ≤ n ≤ most) when a step takes `step_s` seconds: as
    many as fit CALL_BUDGET_S."""
    return max(1, min(most, int(CALL_BUDGET_S / max(step_s, 1e-9))))


def _greedy_decode_steps(config: EngineConfig, num_drafts: int, caps, static, async_scheduling: bool) -> bool:
    """Whether plain greedy decodes may run --cpu-decode-steps steps per call: on a CPU, whose
    compiled step (kernels/cpu_step.py) runs them, on the generic static decode path, without
    speculation or async scheduling (whose steps read their predecessor's results). Expert-
    parallel lockstep steps run one step each (ModelRunner.launch)."""
    return (config.cpu_decode_steps > 1 and static is not None and not caps.own_static_decode
            and static.fused is not None and torch.device(static.cache.device).type == "cpu"
            and not num_drafts and not async_scheduling)


def _drafts_of(launched: LaunchedStep) -> dict[int, int]:
    """Request id → drafts a launched step proposes for it (async scheduling with speculation)."""
    drafts = launched.drafts
    if drafts is None:
        return {}
    return {launched.pending[i].sched.request.request_id: drafts.tokens.shape[1] for i in drafts.live}


def _check_capturable_dispatch(model) -> None:
    """Expert parallelism under CUDA graphs needs the padded all-to-all: the others read split
    sizes (or the largest batch) on the host, which graph capture forbids."""
    from .distributed.all2all import PaddedA2A

    a2a = next((b.ffn.parallel.a2a for b in model.layers if getattr(b.ffn, "parallel", None) is not None), None)
    if a2a is not None and not isinstance(a2a, PaddedA2A):
        raise ConfigError(f"--all2all-backend {type(a2a).__name__} reads split sizes on the host, which CUDA-graph "
                          "capture forbids: use padded_all_to_all (the default, auto, on CUDA) or --enforce-eager")


def _without_unsupported_prefix_caching(config: EngineConfig) -> EngineConfig:
    """Prefix caching covers V4 and V4.1 engines that own their requests' KV. Not yet: PD roles
    (a decode's blocks arrive over NIXL outside admission, a prefill's stay under a lease after
    the request) — there it is turned off, said once."""
    if not config.enable_prefix_caching or config.kv_transfer is None:
        return config
    why = f"--kv-role {config.kv_transfer.role}"
    logger.info("prefix caching is off: not supported with %s yet", why)
    return dataclasses.replace(config, enable_prefix_caching=False)


def _fit_context_to_pool(max_len: int, manager, num_drafts: int) -> int:
    """The context length one sequence can really reach: a request longer than the full pool
    could never be scheduled (it would wait forever), so cap the length — the edge then refuses
    such requests with a 400 naming the limit — and say so once, as vLLM does at start."""
    # block 0 is the dummy; a verify step writes up to num_drafts positions past the sequence
    fits = (manager.full.num_blocks - 1) * manager.block_size - num_drafts
    if fits >= max_len:
        return max_len
    if fits < 2:
        raise ValueError(f"the KV pool holds {manager.full.num_blocks - 1} blocks of {manager.block_size}: "
                         "not one sequence; give it more memory (--kv-cache-memory)")
    logger.warning("context length capped at %d tokens: the KV pool holds no more for one sequence "
                   "(raise --kv-cache-memory for %d)", fits, max_len)
    return fits
