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
import hashlib
import json
import logging
import math
import os
import random
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from . import bpe, corpus, evaluate, export, resume, v4
from .geometry import GEOMETRIES, model_config

logger = logging.getLogger("train")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("out_dir", help="model directory to write")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--deb", help=f"a downloaded {corpus.DOC_PACKAGE} .deb (default: apt-get download it)")
    src.add_argument("--html-dir", help="an extracted documentation tree instead of the .deb")
    p.add_argument("--work-dir", default=None,
                   help="where the .deb and the training log go (default: ~/.cache/ringserve/train-work)")
    p.add_argument("--geometry", choices=sorted(GEOMETRIES), default="builtin")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine decay floor, as a fraction of --lr")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--mtp-weight", type=float, default=0.3, help="weight of the MTP loss (DeepSeek-V3 used 0.3)")
    p.add_argument("--bias-rate", type=float, default=1e-3, help="router selection-bias step (aux-loss-free balancing)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads (1: on a shared 2-core machine two intra-op threads stall on each other)")
    p.add_argument("--device", default="auto", help="auto = cuda when available, else cpu")
    p.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto",
                   help="autocast of matmuls (auto: bf16 on CUDA or a CPU with bf16 instructions)")
    p.add_argument("--export-dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--eval-windows", type=int, default=200, help="held-out windows scored at the end (0 = all)")
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--checkpoint-every", type=int, default=50,
                   help=f"save the training state (WORK_DIR/{resume.STATE_FILE}) every N steps (0 = never)")
    p.add_argument("--resume", action="store_true",
                   help="continue from WORK_DIR's saved training state when there is one (same arguments)")
    p.add_argument("--export-saved-state", action="store_true",
                   help="train no further: export and evaluate WORK_DIR's saved state (a run stopped early)")
    p.add_argument("--test-data-dir", default=None,
                   help="also write a held-out text sample and its word list here (the built-in's tests use them)")


@dataclass
class Data:
    tokenizer: object  # tokenizers.Tokenizer
    train_ids: torch.Tensor  # [N] the training stream
    heldout_ids: list[int]
    heldout_pages: list[corpus.Page]
    corpus_info: dict


def _html_pages(args: argparse.Namespace, work: Path) -> tuple[dict[str, str], dict]:
    if args.html_dir:
        return corpus.read_html_dir(Path(args.html_dir)), {"source": "html-dir"}
    deb = Path(args.deb) if args.deb else corpus.fetch_deb(work)
    info = {"source": corpus.DOC_PACKAGE, "deb": deb.name, "deb_sha256": hashlib.sha256(deb.read_bytes()).hexdigest()}
    return corpus.read_html_pages(deb), info


def _chat_ids(tokenizer, question: str, answer: str) -> list[int]:
    """bos User question Assistant answer eos, rendered by the server's own chat template."""
    return tokenizer.encode_chat([{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
                                 add_generation_prompt=False)


def prepare_data(args: argparse.Namespace, out: Path, work: Path) -> Data:
    from server.tokenizer import Tokenizer

    html, info = _html_pages(args, work)
    train_pages, heldout_pages = corpus.split_pages(corpus.build_pages(html))
    tok = bpe.train_tokenizer((p.text for p in train_pages), args.vocab_size)
    bpe.write_tokenizer_files(tok, out)
    server_tok = Tokenizer.from_dir(out)
    docs = [[0, *e.ids, 1] for e in tok.encode_batch([p.text for p in train_pages], add_special_tokens=False)]
    pairs = [pair for page in train_pages for pair in corpus.chat_pairs(page)]
    docs += [_chat_ids(server_tok, q, a) for q, a in pairs]
    random.Random(args.seed).shuffle(docs)
    train_ids = torch.tensor([t for d in docs for t in d])
    heldout_ids = evaluate.token_stream(tok, (p.text for p in heldout_pages))
    info.update(license=corpus.DOC_LICENSE, train_pages=len(train_pages), heldout_pages=len(heldout_pages),
                train_chars=sum(len(p.text) for p in train_pages), chat_pairs=len(pairs),
                train_tokens=len(train_ids), heldout_tokens=len(heldout_ids),
                heldout_paths=[p.path for p in heldout_pages])
    logger.info("corpus: %s", {k: v for k, v in info.items() if k != "heldout_paths"})
    return Data(tok, train_ids, heldout_ids, heldout_pages, info)


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


def learning_rate(step: int, args: argparse.Namespace) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio · lr at the last step."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    floor = args.min_lr_ratio
    return args.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def _batch(stream: torch.Tensor, args: argparse.Namespace, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - args.seq_len - 1, (args.batch_size,), generator=gen)
    return torch.stack([stream[s: s + args.seq_len + 1] for s in starts.tolist()])  # [B, L+1]


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
        window = _batch(data.train_ids, args, gen).to(device)
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


def _heldout_sample(pages: list[corpus.Page], limit: int = 6000) -> str:
    """Whole paragraphs of the first held-out pages, about `limit` characters."""
    out: list[str] = []
    for para in (p for page in pages for p in page.paragraphs):
        if sum(len(t) + 2 for t in out) + len(para.text) > limit:
            break
        out.append(para.text)
    return "\n\n".join(out) + "\n"


def write_test_data(pages: list[corpus.Page], out: Path) -> None:
    """heldout_sample.txt (a few KB of held-out prose) and words.txt (the held-out split's
    lower-case words seen at least twice)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "heldout_sample.txt").write_text(_heldout_sample(pages), encoding="utf-8")
    counts = Counter(w for page in pages for w in re.findall(r"[a-z]+", page.text.lower()))
    (out / "words.txt").write_text("".join(f"{w}\n" for w in sorted(w for w, c in counts.items() if c >= 2)))


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


def _default_work_dir() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(cache) / "ringserve" / "train-work"


@dataclass
class Result:
    recipe: dict  # what recipe.json holds
    cfg: object  # engine.config.ModelConfig
    lm: object  # the trained DeepseekV4ForCausalLM (eval mode, CPU)
    mtp: v4.MTPHead
    data: Data


def training_device(args: argparse.Namespace) -> torch.device:
    """--device: auto = the GPU when torch sees one, else the CPU."""
    return torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)


def run(args: argparse.Namespace, argv: list[str] | None = None) -> Result:
    """The whole recipe."""
    out = Path(args.out_dir)
    work = Path(args.work_dir) if args.work_dir else _default_work_dir()
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


def _split_arch(argv: list[str]) -> tuple[str, list[str]]:
    """(--arch's value, default v4; argv without an explicit `--arch v4`, which the V4 parser
    does not know: V4 runs parse, fingerprint and record exactly the arguments they always did)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--arch", choices=["v4", "v41"], default="v4")
    arch = pre.parse_known_args(argv)[0].arch
    if arch == "v41":
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
    if arch == "v41":  # DeepSeek-V4.1 with its DSpark stages (train/v41_recipe.py)
        from . import v41_recipe

        return v41_recipe.main(rest)
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
