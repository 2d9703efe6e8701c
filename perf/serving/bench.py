"""One `bench serve` run from parsed arguments: discover the model, build the workload, run,
summarise. Shared by `serve`, `sweep` and `perf/compare_peer.py`."""

from __future__ import annotations

import argparse
import dataclasses
import math
import uuid
from typing import Any

from perf.serving import agentx, conversation, report, runner, server_api, textgen, trace, weka, workloads
from perf.serving.client import ApiConfig
from perf.serving.records import RequestSpec


class BenchError(Exception):
    """A user-facing failure (server unreachable, bad trace …)."""


def parse_pair(text: str) -> tuple[float, float]:
    """'LO,HI' → (LO, HI)."""
    lo, hi = (float(x) for x in text.split(","))
    if hi < lo:
        raise ValueError(f"range {text!r}: HI < LO")
    return lo, hi


def parse_goodput(text: str | None) -> dict[str, float] | None:
    """'ttft:500,tpot:50' → {'ttft': 500.0, 'tpot': 50.0} (ms)."""
    if not text:
        return None
    out = {}
    for item in text.split(","):
        name, value = item.split(":")
        if name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"goodput metric {name!r} is not ttft, tpot or e2el")
        out[name] = float(value)
    return out


def agentx_params(args: argparse.Namespace) -> agentx.AgentXParams:
    """The preset with every flag the user gave applied."""
    pairs = ("turns", "first_turn_tokens", "append_tokens", "short_output", "long_output", "think_s",
             "subagent_turns", "subagent_first_tokens")
    over: dict[str, Any] = {k: (parse_pair(getattr(args, k)) if getattr(args, k) else None) for k in pairs}
    for k in ("num_sessions", "max_context", "long_share", "fork_prob", "max_subagents", "block_size", "tool_use_share",
              "thinking_share"):
        over[k] = getattr(args, k)
    over["seed"] = args.seed
    return agentx.params_from(args.agentx_preset, **over)


def run_config(args: argparse.Namespace, api: ApiConfig) -> runner.RunConfig:
    return runner.RunConfig(api=api, max_concurrency=args.max_concurrency, request_rate=args.request_rate,
                            burstiness=args.burstiness, seed=args.seed, show_progress=not args.disable_tqdm,
                            metrics_interval_s=args.metrics_interval, request_timeout_s=args.request_timeout,
                            duration_s=args.duration, think_time_scale=args.think_time_scale)


CONTEXT_MARGIN = 0.9


async def _api(args: argparse.Namespace) -> ApiConfig:
    """The API config; fills the model name and, for agentx, caps `max_context` to the server's.

    The cap keeps 10% headroom because block text only approximates token counts.
    """
    api = ApiConfig(base_url=args.url, model=args.model or "", endpoint=args.endpoint, api_key=args.api_key,
                    ignore_eos=args.ignore_eos, temperature=args.temperature,
                    continuous_usage=not args.no_continuous_usage)
    async with runner.http_session(run_config(args, api)) as http:
        listed = await server_api.first_model(http, args.url, api.headers())
    if not api.model:
        if listed is None:
            raise BenchError(f"cannot list models at {args.url}/v1/models; is the server up? (or pass --model)")
        api.model = listed[0]
    if listed and listed[1] and args.workload == "agentx" and args.max_context is None:
        preset = agentx.PRESETS[args.agentx_preset].max_context
        args.max_context = min(preset, int(listed[1] * CONTEXT_MARGIN))
    return api


async def _text_tools(args: argparse.Namespace, api: ApiConfig, http) -> tuple[Any, Any, float]:
    headers = api.headers()

    async def tok(text: str) -> list[int] | None:
        return await server_api.tokenize(http, args.url, api.model, text, headers)

    async def detok(ids: list[int]) -> str | None:
        return await server_api.detokenize(http, args.url, api.model, ids, headers)

    tpw = await textgen.calibrate_tokens_per_word(tok, args.seed) or textgen.DEFAULT_TOKENS_PER_WORD
    return tok, detok, tpw


def _sessions(args: argparse.Namespace) -> tuple[list[trace.Session], int, str]:
    """(trees, block size, trace format) of a session workload."""
    if args.workload == "trace":
        if not args.trace:
            raise BenchError("--workload trace needs --trace FILE (flat JSONL, or Weka JSONL / .json / directory)")
        try:
            trees, block_size, fmt = weka.read_any(args.trace)
        except (OSError, ValueError) as exc:
            raise BenchError(str(exc)) from exc
        if args.num_sessions:
            trees = trees[: args.num_sessions]
        return trees, args.block_size or block_size or 64, fmt
    p = agentx_params(args)
    return agentx.generate(p), p.block_size, "synthetic"


def _spec_source(args: argparse.Namespace, blocks: textgen.BlockText, nonce: str) -> runner.SpecSource:
    if args.request_shape == "agentx":
        return conversation.Conversations(blocks, nonce, args.reasoning_share, not args.tool_results_as_user)
    return runner.TreeTexts(blocks, nonce)


async def run_one(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark described by `args` and return its result document."""
    if args.request_shape == "agentx" and args.endpoint != "chat":
        raise BenchError("--request-shape agentx sends chat histories: use --endpoint chat")
    if args.request_shape == "agentx" and args.workload == "fixed":
        raise BenchError("--request-shape agentx needs a session workload (--workload agentx or trace)")
    api = await _api(args)
    cfg = run_config(args, api)
    nonce = args.cache_bust or uuid.uuid4().hex[:10]
    async with runner.http_session(cfg) as http:
        tok, detok, tpw = await _text_tools(args, api, http)
        if args.workload == "fixed":
            fp = workloads.FixedParams(args.input_len, args.output_len, args.range_ratio, args.num_prompts, args.seed)
            specs = await workloads.build_fixed(fp, fp.num_prompts, nonce, tok, detok, tpw, stream=0)
            warm = await workloads.build_fixed(fp, args.num_warmups, nonce, tok, detok, tpw, stream=1)
    workload_params: dict[str, Any]
    if args.workload == "fixed":
        result = await runner.run_open_loop(cfg, specs, warm)
        workload_params = {"input_len": args.input_len, "output_len": args.output_len, "range_ratio": args.range_ratio,
                           "num_prompts": args.num_prompts}
        block_size = 64
    else:
        trees, block_size, trace_format = _sessions(args)
        blocks = textgen.BlockText(args.seed, block_size, tpw)
        texts = _spec_source(args, blocks, nonce)
        warm_p = dataclasses.replace(agentx_params(args), num_sessions=args.num_warmups, seed=args.seed + 104729)
        warm_trees = agentx.generate(warm_p) if args.num_warmups else []
        warm = [_warm_spec(_spec_source(args, blocks, nonce + "w"), i, t) for i, t in enumerate(warm_trees)]
        result = await runner.run_sessions(cfg, trees, texts, warm)
        workload_params = (dataclasses.asdict(agentx_params(args)) if args.workload == "agentx"
                           else {"trace": args.trace, "format": trace_format, "num_sessions": len(trees),
                                 "block_size": block_size})
    config = {"label": args.label or args.url, "url": args.url, "model": api.model, "endpoint": args.endpoint,
              "workload": args.workload, "workload_params": workload_params, "max_concurrency": args.max_concurrency,
              "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf", "burstiness": args.burstiness, "seed": args.seed,
              "num_warmups": args.num_warmups, "ignore_eos": args.ignore_eos, "tokens_per_word": tpw,
              "cache_bust": nonce, "request_shape": args.request_shape}
    if args.request_shape == "agentx":
        config.update(reasoning_share=args.reasoning_share, tool_shaped=not args.tool_results_as_user)
    return report.build_document(result, config, num_gpus=args.num_gpus, gpu_hour_usd=args.gpu_hour_usd,
                                 percentiles=args.metric_percentiles, block_size=block_size,
                                 goodput_slo_ms=parse_goodput(args.goodput), detailed=args.save_detailed)


def _warm_spec(texts: runner.SpecSource, i: int, tree: trace.Session) -> RequestSpec:
    """A tree's first turn with a short output: fills caches and connections, not measured."""
    spec = texts.spec(i, tree.requests[0], max_tokens=min(16, tree.requests[0].output_length))
    texts.finish(i, tree.session_id)
    return spec
