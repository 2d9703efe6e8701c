"""The `ringserve` command line: make-model, generate, kv-report, memory-report, train-builtin, serve, bench,
warm-kernels, cluster-key, systemd-unit.

Every user error (bad flag value, unreadable checkpoint, invalid sampling parameter) ends as
one line `ringserve: error: …` on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from engine.models import registry  # torch-free: the architectures' names and capabilities
from server.engine_args import add_engine_args, engine_config_from, parallel_config_from

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C


class CliError(Exception):
    """A user-facing error; printed as one line."""


def _add_make_model(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-model", help="write a random-weight checkpoint with a tokenizer")
    p.add_argument("out_dir")
    p.add_argument("--arch", default="v4", choices=registry.names(),
                   help="model architecture: v4 = DeepSeek-V4, v41 = DeepSeek-V4.1 (release format: FP8 32x32 "
                        "blocks and FP4 experts with --quantize fp8-fp4, BF16 without)")
    p.add_argument("--preset", default="tiny", choices=["tiny", "small"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quantize", choices=["fp8-fp4"], default=None,
                   help="store dense projections as FP8 and routed experts as FP4, as released")
    p.add_argument("--layout", choices=["upstream", "transformers"], default="upstream",
                   help="tensor names and config keys: upstream (released checkpoints) or transformers")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="dtype of unquantized tensors")
    p.add_argument("--vision", action="store_true",
                   help="with --arch v41: add the preset's vision tower (ViT, aligner, image token), so the "
                        "checkpoint takes images")
    p.set_defaults(func=_cmd_make_model)


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="offline generation through the engine")
    p.add_argument("model_dir", nargs="?", default=None, help="Hugging Face-format directory (default: built-in model)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (tokenized with the model's tokenizer)")
    src.add_argument("--prompt-ids", help="comma-separated token ids, e.g. 1,2,3")
    src.add_argument("--prompts-file", help="JSONL file: one object per line with 'prompt' or 'prompt_ids'")
    p.add_argument("--chat", action="store_true", help="wrap text prompts in the model's chat template")
    p.add_argument("--image", action="append", default=None, metavar="FILE",
                   help="an image for the prompt (repeatable, in order; DeepSeek-V4.1): --prompt holds one "
                        "<｜deepseek_image｜> per image, or --prompt-ids one image token id per image")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--logprobs", type=int, default=None, metavar="K",
                   help="report each generated token's logprob (and K alternatives)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt, in input order")
    add_engine_args(p)
    p.set_defaults(func=_cmd_generate)


def _add_kv_report(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("kv-report", help="KV bytes per token of every pool, per-sequence state, total at a context")
    p.add_argument("model", help="model directory, config.json path, or a known name (deepseek-v4-flash)")
    p.add_argument("--kv-dtype", choices=["bf16", "fp8", "fp4"], default="fp8",
                   help="KV record format (default fp8: e4m3 entries + fp4 index keys, the GPU deployment)")
    p.add_argument("--context", type=int, default=131072, help="tokens for the total line")
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--index-dtype", choices=["fp4", "fp8"], default="fp4",
                   help="V4.1 index keys: fp4 (the model's own, 68 B) or fp8 (132 B, vLLM's indexer_kv_dtype fp8; "
                        "reported only, the engine stores fp4)")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.set_defaults(func=_cmd_kv_report)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ringserve", description="DeepSeek-V4 serving engine")
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_make_model(sub)
    _add_generate(sub)
    _add_kv_report(sub)
    from server.memory_report import add_memory_report_parser

    add_memory_report_parser(sub)
    from server.serve import add_serve_parser

    add_serve_parser(sub, add_engine_args)
    from server.proxy import add_proxy_parser

    add_proxy_parser(sub)
    p = sub.add_parser("bench", help="serving benchmark client: bench serve | sweep | plot | gen-trace",
                       add_help=False)
    p.add_argument("bench_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_cmd_bench)
    p = sub.add_parser("train-builtin", help="train the built-in model (a small V4 on the Python docs; "
                       "--arch v41: a small V4.1 with DSpark): train-builtin OUT_DIR [--arch v41] [--steps N …]",
                       add_help=False)
    p.add_argument("train_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_cmd_train_builtin)
    p = sub.add_parser("systemd-unit", help="print a systemd unit that runs `ringserve serve` with these flags")
    p.add_argument("--user", default=None, help="run as this account (default: DynamicUser)")
    p.add_argument("--watchdog-sec", type=float, default=60.0)
    p.add_argument("--role", choices=["server", "head", "headless", "prefill", "decode", "proxy"], default=None,
                   help="one node (server), a multi-node group's head / headless node, a PD prefill or decode "
                        "server (--kv-role), or the PD proxy (then the flags are ringserve proxy's) "
                        "(default: from the serve flags)")
    p.add_argument("--cluster-key-file", default=None, metavar="PATH",
                   help="the cluster key's absolute path on the node: the unit hands it over with LoadCredential=")
    p.add_argument("serve_args", nargs=argparse.REMAINDER, help="flags for ringserve serve (or proxy)")
    p.set_defaults(func=_cmd_systemd_unit)
    p = sub.add_parser("cluster-key", help="make the secret the nodes of a group (and a PD pair) share; printed once")
    p.add_argument("--out", type=Path, default=None,
                   help="also write it to this new file, mode 0600 (never overwrites)")
    p.set_defaults(func=_cmd_cluster_key)
    p = sub.add_parser("warm-kernels", help="compile the CPU kernels into numba's cache now (scripts/setup.sh runs "
                       "it), so that a first serve does not wait for the compiler")
    p.add_argument("model_dirs", nargs="*", type=Path,
                   help="checkpoints to warm (default: the built-in model and tiny V4 / V4.1 release-format ones)")
    p.set_defaults(func=_cmd_warm_kernels)
    return parser


def _cmd_warm_kernels(args: argparse.Namespace) -> int:
    from server.warm_kernels import warm_all

    for d in args.model_dirs:
        if not d.is_dir():
            raise CliError(f"{d}: not a directory")
    for what, seconds in warm_all(args.model_dirs):
        print(f"warmed the CPU kernels of {what} in {seconds:.1f} s", flush=True)
    return 0


def _cmd_make_model(args: argparse.Namespace) -> int:
    from server.builtin import make_model_dir

    try:  # the architecture refuses an option it does not take (e.g. --vision for V4) before writing
        out = make_model_dir(args.out_dir, args.preset, seed=args.seed, layout=args.layout, dtype=args.dtype,
                             quantize=args.quantize, arch=args.arch, vision=args.vision)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    tower = " with a vision tower" if args.vision else ""
    print(f"wrote {args.preset} {registry.get(args.arch).display_name} checkpoint{tower} to {out}")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from perf.serving.cli import main as bench_main

    return bench_main(list(args.bench_args))


def _cmd_train_builtin(args: argparse.Namespace) -> int:
    from train.recipe import main as train_main

    return train_main(list(args.train_args))


def _cmd_cluster_key(args: argparse.Namespace) -> int:
    from ipc.cluster_auth import generate_key, write_key_file

    key = generate_key()
    if args.out is not None:
        write_key_file(args.out, key)  # ClusterKeyError (one line) if it exists
        print(f"ringserve: wrote a new cluster key to {args.out} (mode 0600); copy that file to every node of the "
              f"group or PD pair (e.g. /etc/ringserve/cluster.key) and pass it with --cluster-key-file",
              file=sys.stderr)
    else:
        print("ringserve: a new cluster key; it is not stored anywhere and will not be shown again",
              file=sys.stderr)
    print(key, flush=True)
    return 0


def _cmd_systemd_unit(args: argparse.Namespace) -> int:
    import shutil

    from server.systemd import render_unit, unit_warnings

    serve_args = [a for a in args.serve_args if a != "--"]
    if any(a == "--cluster-key-file" or a.startswith("--cluster-key-file=") for a in serve_args):
        raise CliError("give the key as `systemd-unit --cluster-key-file PATH -- FLAGS`: the unit loads it as a "
                       "credential (LoadCredential=) instead of naming it in ExecStart")
    key_file = args.cluster_key_file
    if key_file is not None and not Path(key_file).is_absolute():
        raise CliError(f"--cluster-key-file must be an absolute path on the node, got {key_file!r}")
    exec_path = shutil.which("ringserve") or str(Path(sys.executable).with_name("ringserve"))
    if args.role == "proxy":
        probe = build_parser().parse_args(["proxy", *serve_args])  # validate the flags now, not at boot
        _warn(unit_warnings(serve_args, "proxy", None))
        print(render_unit(serve_args, exec_path=exec_path, user=args.user, drain_timeout_s=probe.drain_timeout,
                          watchdog_s=args.watchdog_sec, role="proxy", command="proxy"), end="")
        return 0
    if args.role == "headless" and "--headless" not in serve_args:
        serve_args.append("--headless")
    probe = build_parser().parse_args(["serve", *serve_args])  # validate the flags now, not at boot
    parallel = parallel_config_from(probe)  # raises ConfigError naming a bad flag
    from server.pd import kv_transfer_config_from

    kv_transfer_config_from(probe, None)  # ValueError naming a bad --kv-* flag
    role = "headless" if probe.headless else "head" if parallel.multi_node else "server"
    if role == "server" and probe.kv_role != "both":
        role = probe.kv_role  # a PD side on one node
    if args.role is not None and args.role != role:
        raise CliError(f"--role {args.role} does not match the serve flags, which describe a {role} "
                       f"(a head runs ranks from 0 with --data-parallel-size-local < --data-parallel-size; "
                       f"a prefill or decode server has --kv-role prefill|decode --kv-transfer nixl)")
    _warn(unit_warnings(serve_args, role, key_file))
    print(render_unit(serve_args, exec_path=exec_path, user=args.user, drain_timeout_s=probe.drain_timeout,
                      watchdog_s=args.watchdog_sec, role=role, cluster_key_file=key_file), end="")
    return 0


def _warn(lines: list[str]) -> None:
    for line in lines:
        print(f"ringserve: warning: {line}", file=sys.stderr)


def _cmd_kv_report(args: argparse.Namespace) -> int:
    from engine.config import ModelConfig
    from engine.kv_layout import build_layout

    known = Path(__file__).resolve().parents[1] / "engine" / "configs" / f"{args.model}.json"
    source = known if not Path(args.model).exists() and known.exists() else Path(args.model)
    cfg = ModelConfig.from_model_dir(source)
    if args.context < 0:
        raise CliError("--context must be ≥ 0")
    layout = build_layout(cfg, args.kv_dtype, "bf16", args.block_size, index_dtype=args.index_dtype)
    pools = [{"name": p.name, "group": p.group, "format": p.fmt, "width": p.width, "record_bytes": p.record_bytes,
              "tokens_per_record": p.tokens_per_record, "layers": len(p.layers), "window_tokens": p.window,
              "bytes_per_token": p.bytes_per_token, "per_sequence_bytes": p.per_sequence_bytes}
             for p in layout.pools]
    report = {"model": str(source), "kv_dtype": args.kv_dtype, "block_size": args.block_size, "pools": pools,
              "global_bytes_per_token": layout.global_bytes_per_token,
              "per_sequence_bytes": layout.per_sequence_bytes, "context": args.context,
              "total_bytes_at_context": layout.global_bytes_per_token * args.context + layout.per_sequence_bytes}
    fixed = registry.of(cfg).fixed_state(cfg, layout)  # state beyond the pools' windows (V4.1's)
    if fixed is not None:
        report["fixed_state"] = fixed
        report["per_sequence_bytes"] = sum(item["bytes"] for item in report["fixed_state"])
        report["total_bytes_at_context"] = layout.global_bytes_per_token * args.context + report["per_sequence_bytes"]
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"{source} --kv-dtype {args.kv_dtype}")
    print(f"{'pool':16} {'group':8} {'format':13} {'record B':>9} {'layers':>6} {'tok/rec':>7} "
          f"{'B/token':>10} {'per-seq B':>12}")
    for p in pools:  # full pools grow per token; sliding pools are a fixed per-sequence window
        per_token = f"{p['bytes_per_token']:10.2f}" if p["group"] == "full" else f"{'-':>10}"
        per_seq = f"{p['per_sequence_bytes']:12,d}" if p["group"] == "sliding" else f"{'-':>12}"
        print(f"{p['name']:16} {p['group']:8} {p['format']:13} {p['record_bytes']:9d} {p['layers']:6d} "
              f"{p['tokens_per_record']:7d} {per_token} {per_seq}")
    print(f"global KV (grows with context): {layout.global_bytes_per_token:,.2f} B/token "
          f"({layout.global_bytes_per_token / 1024:.2f} KiB)")
    if fixed is not None:
        print("fixed per-sequence state:")
        for item in report["fixed_state"]:
            print(f"  {item['what']:58} {item['bytes']:>12,d} B")
    print(f"fixed per-sequence state (window + compressor rows): {report['per_sequence_bytes'] / 2**20:.2f} MiB")
    print(f"total at {args.context:,} tokens: {report['total_bytes_at_context'] / 2**20:,.1f} MiB per sequence")
    return 0


def _read_prompts(args: argparse.Namespace, tokenizer) -> list[list[int]]:
    def from_text(text: str) -> list[int]:
        if tokenizer is None:
            raise CliError("this model directory has no tokenizer.json; use --prompt-ids")
        if args.chat:
            return tokenizer.encode_chat([{"role": "user", "content": text}])
        return tokenizer.encode(text)

    if args.prompt is not None:
        return [from_text(args.prompt)]
    if args.prompt_ids is not None:
        return [_parse_ids(args.prompt_ids, "--prompt-ids")]
    prompts = []
    path = Path(args.prompts_file)
    if not path.exists():
        raise CliError(f"--prompts-file {path}: no such file")
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CliError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
        if not isinstance(obj, dict) or ("prompt" in obj) == ("prompt_ids" in obj):
            raise CliError(f"{path}:{lineno}: expected an object with exactly one of 'prompt' or 'prompt_ids'")
        if "prompt" in obj:
            if not isinstance(obj["prompt"], str):
                raise CliError(f"{path}:{lineno}: 'prompt' must be a string")
            prompts.append(from_text(obj["prompt"]))
        else:
            ids = obj["prompt_ids"]
            if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise CliError(f"{path}:{lineno}: 'prompt_ids' must be a list of integers")
            prompts.append(ids)
    if not prompts:
        raise CliError(f"{path}: no prompts")
    return prompts


def _parse_ids(text: str, flag: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise CliError(f"{flag}: expected comma-separated integers, got {text!r}") from None


def _cmd_generate(args: argparse.Namespace) -> int:
    from ipc.codec import InvalidField, check
    from ipc.messages import SamplingParams
    from engine.config import ModelConfig
    from server.builtin import builtin_model_dir
    from server.image_prompts import ImagePrompts
    from server.llm import LLM, validate_request
    from server.multimodal import parse_mm_limit

    model_dir = Path(args.model_dir) if args.model_dir else builtin_model_dir()
    if not model_dir.is_dir():
        raise CliError(f"{model_dir}: not a directory")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, logprobs=args.logprobs, ignore_eos=args.ignore_eos)
    try:
        check(params)
    except InvalidField as exc:
        flag = "--" + exc.field.replace("_", "-")
        raise CliError(f"{exc.field} ({flag}): {exc.reason}, got {getattr(params, exc.field)!r}") from None
    prompts = _read_prompts(args, _load_tokenizer(model_dir))
    config = engine_config_from(args)
    if args.dp < 1:
        raise CliError("--dp must be ≥ 1")
    model_cfg = ModelConfig.from_model_dir(model_dir)
    limit = parse_mm_limit(args.limit_mm_per_prompt)
    requests = _with_images(args, prompts, ImagePrompts(model_cfg, args.language_model_only, limit))
    for i, ids in enumerate(prompts):  # every prompt checked before a worker starts
        validate_request(model_cfg.vocab_size, config.context_length(model_cfg), ids, params, i)
    llm = LLM(model_dir, parallel=parallel_config_from(args), limit_mm_per_prompt={"image": limit}, **config.to_dict())
    try:
        results = llm.generate(requests, params)
    except KeyboardInterrupt:
        # The workers ignore SIGINT, so stopping them is ours; what their teardown under
        # in-flight requests would log is what the user asked for: quiet.
        for name in ("server", "ipc", "asyncio"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
        raise
    finally:
        llm.close()
    for i, r in enumerate(results):
        if r.error:
            print(f"ringserve: prompt {i}: {r.error}", file=sys.stderr)
        if args.json:
            record: dict[str, Any] = {"index": i, "prompt_tokens": len(r.prompt_token_ids),
                                      "prompt_token_ids": r.prompt_token_ids, "token_ids": r.token_ids,
                                      "text": r.text, "finish_reason": r.finish_reason}
            if args.logprobs is not None:
                record["logprobs"] = r.logprobs
                if args.logprobs:
                    record["top_logprobs"] = [[[t, lp] for t, lp in row] for row in r.top_logprobs]
            print(json.dumps(record), flush=True)
        else:
            print(r.text if r.text is not None else " ".join(map(str, r.token_ids)), flush=True)
    return 0


def _with_images(args: argparse.Namespace, prompts: list[list[int]], images) -> list:
    """The prompts as LLM.generate takes them; with --image, the one prompt's ids checked and
    expanded now (CliError naming the problem before any worker starts)."""
    if not args.image:
        return prompts
    if args.prompts_file is not None:
        raise CliError("--image works with --prompt or --prompt-ids (one prompt), not --prompts-file")
    placeholders = prompts[0]
    try:
        prompts[0] = images.expand(placeholders, args.image, 0)[0]  # checked; the spans' ids for the checks below
    except ValueError as exc:
        raise CliError(f"--image: {exc}") from None
    return [{"prompt_token_ids": placeholders, "multi_modal_data": {"image": args.image}}]


def _load_tokenizer(model_dir: Path):
    if not (model_dir / "tokenizer.json").exists():
        return None
    from server.tokenizer import Tokenizer

    return Tokenizer.from_dir(model_dir)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # its own parser (flags such as --help belong to it)
        from perf.serving.cli import main as bench_main

        return bench_main(argv[1:])
    if argv[:1] == ["train-builtin"]:  # likewise; its parser imports torch, so it is built only here
        from train.recipe import main as train_main

        return train_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from engine.config import ConfigError
    from server.engine_client import WorkerDied

    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("ringserve: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (CliError, ConfigError, WorkerDied, ValueError, OSError) as exc:
        message = " ".join(str(exc).split())  # one line, whatever the exception carried
        print(f"ringserve: error: {message}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
