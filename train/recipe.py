"""The built-in model's recipe, end to end: corpus → tokenizer → training → export → evaluation.

    ringserve train-builtin OUT_DIR            (or: python scripts/train_builtin.py OUT_DIR)

fetches Debian's python3.11-doc (`apt-get download`, pinned version; run `apt-get update` once
first), extracts its prose, trains the tokenizer and the model (with its MTP layer) for a fixed
number of steps from a fixed seed, and writes a ringserve model directory: config.json,
model.safetensors (bf16, upstream layout), generation_config.json, the tokenizer files and
recipe.json (command, seed, corpus, losses; held-out loss both by transformers and by
ringserve's engine). The defaults fit about an hour of one CPU core; a GPU is used when there
is one (device choice only). `--geometry tiny` with few steps is the seconds-long version the
tests run.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from . import evaluate, export, resume, v4
from .common import (Data, add_arguments, default_work_dir, learning_rate, prepare_data, sample_batch,
                     training_device, write_test_data)
from .geometry import model_config

logger = logging.getLogger("train")


def _precision(args: argparse.Namespace, device: torch.device) -> torch.dtype | None:
    if args.precision == "fp32":
        return None
    if args.precision == "bf16" or device.type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if torch.cpu._is_avx512_bf16_supported() else None


def _optimizer(lm, mtp, args: argparse.Namespace) -> torch.optim.Optimizer:
    """AdamW; matrices decay, vectors (norms, sinks, biases, mHC base/scale) do not."""
    params = [p for p in list(lm.parameters()) + list(mtp.parameters()) if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95), eps=1e-8)


def train(lm, mtp, cfg, data: Data, args: argparse.Namespace, device: torch.device, log, work: Path) -> dict:
    """Fixed-step training, saving its state every --checkpoint-every steps and continuing a
    saved one with --resume; returns the last logged training losses and the wall time."""
    lm.train()
    mtp.train()
    probes = v4.Probes().attach(lm, mtp)
    opt = _optimizer(lm, mtp, args)
    indexer_params = v4.indexer_parameters(lm)
    gen = torch.Generator().manual_seed(args.seed)
    autocast = _precision(args, device)
    state_path, fp = work / resume.STATE_FILE, resume.fingerprint(args, data.tokenizer.to_str())
    if args.export_saved_state:
        summary = resume.export_saved_state(state_path, lm, mtp, fp, args.steps, log)
        probes.detach_hooks()
        lm.eval()
        mtp.eval()
        return summary
    begun = resume.starting_state(state_path, lm, mtp, opt, gen, fp, args.resume, log)
    start, done_s, recent = begun.step, begun.elapsed_s, begun.recent
    t0, last = time.perf_counter() - done_s, {}
    for step in range(start, args.steps):
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, args)
        window = sample_batch(data.train_ids, args, gen).to(device)
        with torch.autocast(device.type, dtype=autocast or torch.float32, enabled=autocast is not None):
            loss = v4.losses(lm, mtp, probes, window)
        if not torch.isfinite(loss.lm + loss.mtp):
            raise FloatingPointError(f"step {step}: non-finite loss (lm {loss.lm.item()}, mtp {loss.mtp.item()})")
        if indexer_params:
            loss.kl.backward(inputs=indexer_params, retain_graph=True)  # the indexer learns from KL only
        (loss.lm + args.mtp_weight * loss.mtp).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(list(lm.parameters()) + list(mtp.parameters()), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        v4.update_router_bias(probes, cfg.n_routed_experts, args.bias_rate)
        recent.append((loss.lm.item(), loss.mtp.item(), loss.kl.item()))
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            lm_l, mtp_l, kl_l = (sum(x) / len(recent) for x in zip(*recent))
            elapsed = time.perf_counter() - t0
            last = {"step": step + 1, "lm": lm_l, "mtp": mtp_l, "indexer_kl": kl_l, "grad_norm": float(grad_norm),
                    "lr": learning_rate(step, args), "elapsed_s": elapsed,
                    "tokens_per_s": (step + 1) * args.batch_size * args.seq_len / elapsed}
            log(last)
            recent = []
        if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0 and step + 1 < args.steps:
            resume.save(state_path, lm, mtp, opt, gen, resume.State(step + 1, time.perf_counter() - t0, recent), fp)
    probes.detach_hooks()
    lm.eval()
    mtp.eval()
    return last


def evaluate_export(out: Path, data: Data, args: argparse.Namespace) -> dict:
    """Held-out nats/token and bits/char of the written checkpoint, by transformers and by ringserve."""
    import transformers

    from engine.weights import load_model

    wins = evaluate.windows(data.heldout_ids, args.seq_len, args.eval_windows or None)
    ref = transformers.DeepseekV4ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    by_transformers = evaluate.score_transformers(ref, wins, data.tokenizer)
    ours = load_model(out, dtype=torch.float32, progress=False)
    by_ringserve = evaluate.score_ringserve(ours, wins, data.tokenizer)
    report = {}
    for name, s in (("transformers", by_transformers), ("ringserve", by_ringserve)):
        report[name] = {"nats_per_token": s.nats_per_token, "bits_per_char": s.bits_per_char, "tokens": s.tokens,
                        "chars": s.chars}
    return report


@dataclass
class Result:
    recipe: dict  # what recipe.json holds
    cfg: object  # engine.config.ModelConfig
    lm: object  # the trained DeepseekV4ForCausalLM (eval mode, CPU)
    mtp: v4.MTPHead
    data: Data


def run(args: argparse.Namespace, argv: list[str] | None = None) -> Result:
    """The whole recipe."""
    out = Path(args.out_dir)
    work = Path(args.work_dir) if args.work_dir else default_work_dir()
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    device = training_device(args)
    log_file = (work / "train-log.jsonl").open("a" if args.resume or args.export_saved_state else "w")

    def log(record: dict) -> None:
        logger.info("%s", record)
        log_file.write(json.dumps(record) + "\n")
        log_file.flush()

    t0 = time.perf_counter()
    data = prepare_data(args, out, work)
    if args.test_data_dir:
        write_test_data(data.heldout_pages, Path(args.test_data_dir))
    cfg = model_config(args.geometry, data.tokenizer.get_vocab_size())
    counts = torch.bincount(data.train_ids, minlength=cfg.vocab_size)
    lm, mtp = v4.build(cfg, args.seed, counts)
    lm.to(device)
    mtp.to(device)
    final = train(lm, mtp, cfg, data, args, device, log, work)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.export_dtype]
    export.export_checkpoint(out, cfg, lm.to("cpu"), mtp.to("cpu"), dtype=dtype)
    heldout = evaluate_export(out, data, args)
    recipe = {"command": "ringserve train-builtin " + " ".join(argv if argv is not None else sys.argv[1:]),
              "arguments": {k: v for k, v in vars(args).items() if k != "func"}, "corpus": data.corpus_info,
              "parameters": sum(p.numel() for p in lm.parameters()) + sum(p.numel() for p in mtp.parameters()),
              "device": str(device), "torch": torch.__version__, "final_training": final, "heldout": heldout,
              "total_time_s": time.perf_counter() - t0}
    (out / "recipe.json").write_text(json.dumps(recipe, indent=2) + "\n")
    log({"heldout": heldout})
    log_file.close()
    return Result(recipe, cfg, lm, mtp, data)


# Architecture (engine/models/ name) → the module of its own recipe (`main(argv)`); V4's is this one.
OTHER_RECIPES = {"v41": "train.v41_recipe"}


def _split_arch(argv: list[str]) -> tuple[str, list[str]]:
    """(--arch's value, default v4; argv without an explicit `--arch v4`, which the V4 parser
    does not know: V4 runs parse, fingerprint and record exactly the arguments they always did)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--arch", choices=["v4", *OTHER_RECIPES], default="v4")
    arch = pre.parse_known_args(argv)[0].arch
    if arch in OTHER_RECIPES:
        return arch, argv
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--arch":
            skip = True
        elif not a.startswith("--arch="):
            out.append(a)
    return arch, out


def main(argv: list[str] | None = None) -> int:
    given = sys.argv[1:] if argv is None else argv
    arch, rest = _split_arch(given)
    if arch in OTHER_RECIPES:  # e.g. v41: DeepSeek-V4.1 with its DSpark stages (train/v41_recipe.py)
        return importlib.import_module(OTHER_RECIPES[arch]).main(rest)
    if rest != given:  # an explicit --arch v4, dropped
        argv = rest
    parser = argparse.ArgumentParser(prog="train-builtin", description=__doc__.splitlines()[0],
                                     epilog="--arch v41 trains a small DeepSeek-V4.1 with its DSpark stages "
                                            "instead (train/v41_recipe.py; --arch v4, this, is the default)")
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    run(args, argv)
    return 0
