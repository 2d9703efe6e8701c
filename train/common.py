"""What the built-in recipes share (train/recipe.py for V4, train/v41_recipe.py for V4.1): the
command-line arguments, the corpus and tokenizer preparation, the training batches, the learning-
rate schedule, the test data the built-in's tests read, and the work and device defaults."""

from __future__ import annotations

import argparse
import hashlib
import logging
import math
import os
import random
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from . import bpe, corpus, evaluate, resume
from .geometry import GEOMETRIES

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


def learning_rate(step: int, args: argparse.Namespace) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio · lr at the last step."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    floor = args.min_lr_ratio
    return args.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def sample_batch(stream: torch.Tensor, args: argparse.Namespace, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - args.seq_len - 1, (args.batch_size,), generator=gen)
    return torch.stack([stream[s: s + args.seq_len + 1] for s in starts.tolist()])  # [B, L+1]


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


def default_work_dir() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(cache) / "ringserve" / "train-work"


def training_device(args: argparse.Namespace) -> torch.device:
    """--device: auto = the GPU when torch sees one, else the CPU."""
    return torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
