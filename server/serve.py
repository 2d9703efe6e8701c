"""`ringserve serve`: start the workers, serve HTTP, drain on SIGTERM, exit non-zero if a worker dies.

Lifecycle: load (workers report ready) → READY=1 to systemd and a curl example on stdout →
serve → on SIGTERM/SIGINT: readiness 503 and STOPPING=1 at once, new requests refused with 503,
in-flight requests finish up to --drain-timeout, the rest end with finish_reason "abort", workers
stop, rings are unlinked, exit 0. A dead worker turns /health to 503 and exits with status 1 so
the supervisor restarts the service.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import time
from dataclasses import replace
from pathlib import Path

from aiohttp import web

from ipc import cluster_auth

from . import systemd
from .app import make_app
from .http import Runner
from .metrics import Metrics
from .pd import add_kv_routes, add_pd_args, check_pd_listeners, kv_transfer_config_from
from .protocol import Limits
from .chat_render import TOKENIZER_MODES, ChatRenderer, resolve_mode
from .state import AppState
from .structured import GrammarChecker, StructuredLimits
from .systemd import WatchdogFeeder

logger = logging.getLogger(__name__)


def add_serve_parser(sub: argparse._SubParsersAction, add_engine_args) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    p.add_argument("model_dir", nargs="?", default=None, help="model directory (default: the built-in model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route but health")
    p.add_argument("--served-model-name", default=None, help="model name in the API (default: the directory name)")
    p.add_argument("--max-queued-requests", type=int, default=256,
                   help="requests allowed to wait beyond the running ones; past it: 429 + Retry-After")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds in-flight requests get on SIGTERM")
    p.add_argument("--request-timeout", type=float, default=600.0, help="per-request deadline in seconds")
    p.add_argument("--max-request-bytes", type=int, default=Limits.max_body_bytes)
    p.add_argument("--tokenizer-mode", default="auto", choices=TOKENIZER_MODES,
                   help="chat format: DeepSeek's own encoding (deepseek_v4 / deepseek_v41: thinking, tools, DSML "
                        "tool calls) or the tokenizer's Jinja template (hf); auto: DeepSeek's for DeepSeek checkpoints")
    p.add_argument("--reasoning-parser", default=None, choices=["deepseek_v4", "deepseek_v41"],
                   help="accepted as vLLM spells it: the chat format's own reader always parses reasoning")
    p.add_argument("--tool-call-parser", default=None, choices=["deepseek_v4", "deepseek_v41"],
                   help="accepted as vLLM spells it: the chat format's own reader always parses tool calls")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted as vLLM spells it: tool_choice auto is always served with DeepSeek's format")
    p.add_argument("--structured-outputs-compile-timeout", type=float, default=StructuredLimits.compile_timeout_s,
                   help="seconds a new grammar (JSON Schema, regex, EBNF, ...) may take to compile before the request "
                        "is refused with a 400")
    p.add_argument("--structured-outputs-max-chars", type=int, default=StructuredLimits.max_chars,
                   help="largest structured-output specification accepted (characters)")
    p.add_argument("--max-connections", type=int, default=1024,
                   help="open HTTP connections at once; one more gets 503 and is closed")
    p.add_argument("--header-timeout", type=float, default=20.0,
                   help="seconds a connection may take to send a request's head (also the keep-alive idle time)")
    p.add_argument("--body-timeout", type=float, default=60.0, help="seconds a request may take to send its body")
    p.add_argument("--watchdog-timeout", type=float, default=60.0,
                   help="a worker step that runs no layer for this long is reported stuck (health 503)")
    p.add_argument("--worker-liveness-timeout", type=float, default=5.0,
                   help="a worker whose heartbeats stop for this long is reported stuck (stopped, or holding the GIL)")
    p.add_argument("--threads-per-worker", type=int, default=None)
    p.add_argument("--device", default="cpu", help="cpu, or cuda (one worker per GPU)")
    add_media_args(p)
    add_cluster_args(p)
    add_engine_args(p)
    add_pd_args(p)
    p.set_defaults(func=cmd_serve)


def add_media_args(p: argparse.ArgumentParser) -> None:
    from .media_fetch import DEFAULT_MAX_BYTES, DEFAULT_MAX_REDIRECTS, DEFAULT_TIMEOUT_S

    g = p.add_argument_group("image URLs (DeepSeek-V4.1)")
    g.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                   help="let requests read images from file:// URLs under this directory (symlinks resolved; "
                        "a security risk on shared machines, as in vLLM)")
    g.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="HOST",
                   help="fetch http(s) image URLs from these hosts only; a listed host may resolve to any "
                        "address (loopback and private ones included). Unset: any host whose addresses are public")
    g.add_argument("--media-fetch-timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help="seconds one image URL's fetch may take, redirects included")
    g.add_argument("--media-max-bytes", type=int, default=DEFAULT_MAX_BYTES,
                   help="largest image file fetched or read, in bytes")
    g.add_argument("--media-max-redirects", type=int, default=DEFAULT_MAX_REDIRECTS,
                   help="redirects an image URL may take (each hop's address checked); 0 refuses redirects")


def media_policy_from(args: argparse.Namespace):
    from .media_fetch import MediaPolicy

    return MediaPolicy.from_flags(args.allowed_local_media_path, args.allowed_media_domains, args.media_max_bytes,
                                  args.media_fetch_timeout, args.media_max_redirects)


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("internal channels (multi-node, prefill/decode)")
    g.add_argument("--cluster-key-file", default=None, metavar="PATH",
                   help="the secret every node of the group (and both sides of a PD pair) shares, made by "
                        "`ringserve cluster-key`: authenticates and encrypts the node channel, the rendezvous store "
                        "and the KV side channel, and signs kv_transfer_params (also $RINGSERVE_CLUSTER_KEY_FILE "
                        "or $RINGSERVE_CLUSTER_KEY). Without it those listen on loopback only")
    g.add_argument("--insecure-cluster", action="store_true",
                   help="let the internal channels listen off loopback without a cluster key (trusted networks only)")


def cmd_serve(args: argparse.Namespace) -> int:
    from ipc.loop import new_event_loop

    auth = cluster_auth.configure(args.cluster_key_file, args.insecure_cluster)  # ClusterKeyError: one line
    if _has_internal_channels(args):
        print(f"ringserve: {auth.describe()}", flush=True)
    loop = new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(serve_headless(args) if args.headless else serve(args))
    finally:
        loop.close()


def _has_internal_channels(args: argparse.Namespace) -> bool:
    """Whether this server listens for other processes than its own workers and HTTP clients."""
    multi_node = args.headless or (args.data_parallel_size_local or args.dp) < args.dp
    return multi_node or args.enable_expert_parallel or args.kv_transfer is not None


async def serve_headless(args: argparse.Namespace) -> int:
    """A node other than the head: join it, run this node's ranks, relay their messages."""
    from server.builtin import builtin_model_dir
    from server.engine_args import engine_config_from, parallel_config_from
    from server.node import HeadlessNode

    model_dir = Path(args.model_dir) if args.model_dir else builtin_model_dir()
    parallel = parallel_config_from(args)
    config = replace(engine_config_from(args), kv_transfer=kv_transfer_config_from(args, model_dir))
    check_pd_listeners(args, config.kv_transfer, cluster_auth.current())
    from engine.config import ModelConfig
    from server.engine_args import multimodal_from

    images = multimodal_from(args, ModelConfig.from_model_dir(model_dir))
    node = HeadlessNode(model_dir, config.resolved(), parallel, device=args.device,
                        threads_per_worker=args.threads_per_worker, auth=cluster_auth.current(),
                        image_bytes=images.submit_bytes)
    ranks = f"ranks {parallel.local_ranks.start}-{parallel.local_ranks.stop - 1}"
    head = f"{parallel.data_parallel_address}:{parallel.data_parallel_rpc_port}"
    feeder = WatchdogFeeder(lambda: node.healthy)
    node.on_ready.append(lambda: (systemd.notify_ready(f"{ranks} ready, head {head}"),
                                  print(f"ringserve headless node: {ranks} of {parallel.data_parallel_size} ready "
                                        f"(head {head})", flush=True)))
    feeder.start()
    try:
        code = await node.run()  # a node that cannot join raises NodeError (one line)
    finally:
        await feeder.stop()
    systemd.notify_stopping("node stopped")
    if code:
        logger.error("headless node stopped: %s", node.failure or "a rank exited")
    return code


def chat_family(args: argparse.Namespace, model_cfg) -> str:
    """The chat format --tokenizer-mode picks for this checkpoint; vLLM's parser flags, when
    given, must name the same format."""
    from engine.models import registry

    family = resolve_mode(args.tokenizer_mode, registry.of(model_cfg).chat_family)
    for flag in ("reasoning_parser", "tool_call_parser"):
        value = getattr(args, flag)
        if value is not None and value != family:
            raise SystemExit(f"--{flag.replace('_', '-')} {value} does not match the chat format {family} "
                             f"(--tokenizer-mode {args.tokenizer_mode})")
    return family


async def serve(args: argparse.Namespace) -> int:
    from engine.config import ModelConfig
    from server.builtin import builtin_model_dir
    from server.engine_args import engine_config_from, multimodal_from, parallel_config_from
    from server.engine_client import EngineClient
    from server.tokenizer import Tokenizer

    model_dir = Path(args.model_dir) if args.model_dir else builtin_model_dir()
    kv_transfer = kv_transfer_config_from(args, model_dir)  # a bad --kv-* flag fails before anything loads
    parallel = parallel_config_from(args)
    auth = cluster_auth.current()
    check_pd_listeners(args, kv_transfer, auth)
    if parallel.multi_node or parallel.grouped:  # the node port, the rendezvous store, gloo/NCCL
        auth.check_listen(parallel.data_parallel_address, f"the head's node port and rendezvous store "
                          f"(--data-parallel-address {parallel.data_parallel_address})")
    model_cfg = ModelConfig.from_model_dir(model_dir)
    tokenizer = Tokenizer.from_dir(model_dir)
    renderer = ChatRenderer(chat_family(args, model_cfg), tokenizer)
    images = multimodal_from(args, model_cfg, media_policy_from(args))  # a bad media flag fails before loading
    config = replace(engine_config_from(args), kv_transfer=kv_transfer).resolved()
    name = args.served_model_name or (model_dir.name if args.model_dir else "ringserve-builtin")
    client = EngineClient(model_dir, config, device=args.device, threads_per_worker=args.threads_per_worker,
                          stuck_after_s=args.watchdog_timeout, liveness_timeout_s=args.worker_liveness_timeout,
                          parallel=parallel, image_bytes=images.submit_bytes)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):  # from the start: a stop while loading stops every worker
        loop.add_signal_handler(sig, stop.set)
    if not await _start_unless_stopped(client, stop):
        logger.warning("stopped while starting: every worker is stopped")
        return 0
    structured = StructuredLimits(max_chars=args.structured_outputs_max_chars,
                                  compile_timeout_s=args.structured_outputs_compile_timeout)
    limits = Limits(max_body_bytes=args.max_request_bytes, structured=structured)
    state = AppState(client, tokenizer, [name], model_cfg.vocab_size, client.max_model_len, limits=limits,
                     api_key=args.api_key, max_running=args.dp * config.max_num_seqs,
                     max_queued_requests=args.max_queued_requests, request_timeout_s=args.request_timeout,
                     body_timeout_s=args.body_timeout, metrics=Metrics(name),
                     grammar_checker=GrammarChecker(model_dir, model_cfg.vocab_size, list(model_cfg.eos_token_ids),
                                                    structured), renderer=renderer, multimodal=images)
    app = make_app(state)
    if config.kv_transfer is not None:
        add_kv_routes(app, client)
    runner = Runner(app, max_connections=args.max_connections, handler_cancellation=True,
                    access_log=None, keepalive_timeout=args.header_timeout, max_line_size=limits.max_field_bytes,
                    max_field_size=limits.max_field_bytes, max_headers=limits.max_headers)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    try:
        await site.start()
    except OSError as exc:
        await client.shutdown()
        raise OSError(f"cannot listen on {args.host}:{args.port}: {exc.strerror}") from None
    state.ready = True
    exit_code = 0

    def on_dead(rank: int) -> None:
        nonlocal exit_code
        exit_code = 1
        stop.set()

    client.on_dead.append(on_dead)
    stats_task = asyncio.ensure_future(_publish_stats(state, client))
    feeder = WatchdogFeeder(lambda: client.healthy and not client.stuck)  # hung or dead worker: stop feeding
    feeder.start()
    role = f", KV role {config.kv_transfer.role}" if config.kv_transfer is not None else ""
    systemd.notify_ready(f"serving {name} with {args.dp} worker(s){role}")
    host = "localhost" if args.host in ("127.0.0.1", "0.0.0.0") else args.host
    auth = f' -H "Authorization: Bearer {args.api_key}"' if args.api_key else ""
    print(f"ringserve serving {name} on http://{args.host}:{args.port} ({args.dp} worker(s))\n"
          f"try: curl http://{host}:{args.port}/v1/chat/completions -H 'Content-Type: application/json'{auth} "
          f"-d '{{\"model\": \"{name}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}], "
          f"\"max_tokens\": 32}}'", flush=True)
    await stop.wait()
    state.draining = True
    systemd.notify_stopping("draining")
    logger.warning("draining: %d requests in flight, up to %.0f s", state.in_flight, args.drain_timeout)
    deadline = time.monotonic() + args.drain_timeout
    while state.in_flight and time.monotonic() < deadline and exit_code == 0:
        await asyncio.sleep(0.05)
    stats_task.cancel()
    await feeder.stop()
    state.grammar_checker.close()
    await images.close()
    await client.shutdown()  # unfinished requests end with finish_reason "abort" (or a dead rank's cause)
    deadline = time.monotonic() + FLUSH_TIMEOUT_S
    while state.in_flight and time.monotonic() < deadline:  # let their handlers write the last events
        await asyncio.sleep(0.02)
    await runner.cleanup()
    return exit_code


async def _start_unless_stopped(client, stop: asyncio.Event) -> bool:
    """Start the engine client; False if `stop` was set first (then the start is cancelled, and
    the client's own clean-up stops every rank it had started: no worker outlives the server)."""
    start = asyncio.ensure_future(client.start())
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait([start, stopped], return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if start.done():
        start.result()  # a failed start raises here
        return True
    start.cancel()
    await asyncio.gather(start, return_exceptions=True)
    await client.shutdown(timeout_s=5.0)  # idempotent: covers a cancel that landed before start's own clean-up
    return False


# After the engine stops, how long handlers get to write their streams' last events (an error
# and [DONE]) before the connections close; a loaded machine can need more than a moment.
FLUSH_TIMEOUT_S = 5.0


async def _publish_stats(state: AppState, client) -> None:
    """Fold the workers' heartbeats into the metrics once a second."""
    while True:
        await asyncio.sleep(1.0)
        beats = [r.last_beat for r in client.ranks if r.alive and r.last_beat is not None]
        used = sum(b.kv_blocks_used for b in beats)
        total = sum(b.kv_blocks_total for b in beats)
        spec = [sum(col) for col in zip(*(b.spec_accepted_per_position for b in beats))] if beats else []
        state.metrics.set_engine_stats(
            running=sum(b.num_running for b in beats), waiting=sum(b.num_waiting for b in beats),
            kv_usage=used / total if total else 0.0, dp_imbalance=client.router.imbalance(),
            loop_pause_s=max((b.loop_pause_max_s for b in beats), default=0.0),
            preemptions_total=sum(b.num_preemptions for b in beats),
            spec_drafts_total=sum(b.spec_drafts for b in beats),
            spec_draft_tokens_total=sum(b.spec_draft_tokens for b in beats), spec_accepted_per_position=spec,
            compute_threads=sum(b.compute_threads for b in beats))
        state.metrics.set_prefix_cache_stats(sum(b.prefix_cache_queries for b in beats),
                                             sum(b.prefix_cache_hits for b in beats))
        grouped = [b for b in beats if b.expert_imbalance]  # every rank of a group reports the same window
        if grouped:
            state.metrics.set_expert_parallel_stats(grouped[0].expert_imbalance,
                                                    max(b.eplb_rebalances for b in grouped))
