"""The built-in recipe for DeepSeek-V4.1: `ringserve train-builtin OUT_DIR --arch v41`.

The same corpus, tokenizer, schedule, resumable state and recipe.json as the V4 recipe
(train/recipe.py; both take their data preparation, batches and learning-rate schedule from
train/common.py), with the V4.1 model of train/v41.py: the backbone's next-token loss, the DSpark stages' block loss
(weight --mtp-weight; the release calls the stages `mtp.*`) and confidence loss, the indexers'
KL, aux-loss-free router balancing. V4.1's numerics are fixed by the model (bf16 activations,
QAT quantizers), so --precision and --export-dtype do not apply: the export is the release's
storage. It trains on --device (auto: the GPU when there is one); every tensor a step makes
follows the masters' device, while the batch and anchor draws stay on the host generator, so a
run's data order does not depend on the device.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

from . import common, evaluate, resume, v41, v41_eval

logger = logging.getLogger("train")


def add_arguments(p: argparse.ArgumentParser) -> None:
    common.add_arguments(p)
    p.add_argument("--arch", choices=["v41"], default="v41", help="the model family (this parser: V4.1)")
    p.add_argument("--dspark-anchors", type=int, default=64,
                   help="DSpark anchors drawn per training window (0 = every position)")
    p.add_argument("--confidence-weight", type=float, default=0.1, help="weight of the confidence head's loss")
    p.add_argument("--numerics", choices=["fast", "exact"], default="fast",
                   help="training GEMMs: exact = the engine's fp64-formed blocks; fast = one fp32 GEMM of the "
                        "same quantized operands (evaluation and export checks always use exact)")


def _optimizer(model: v41.Model, args: argparse.Namespace) -> torch.optim.Optimizer:
    """AdamW; matrices decay, vectors (norms, sinks, mHC base/scale) do not."""
    params = [p for p in model.params.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95), eps=1e-8)


def _losses_of(model: v41.Model, window: torch.Tensor, args: argparse.Namespace, gen: torch.Generator):
    loss = v41.losses(model, window, args.dspark_anchors, gen, exact=args.numerics == "exact")
    total = loss.lm + args.mtp_weight * loss.dspark + args.confidence_weight * loss.confidence + loss.kl
    return loss, total


def train(model: v41.Model, data: common.Data, args: argparse.Namespace, log, work: Path) -> dict:
    """Fixed-step training with the V4 recipe's save / resume / export-saved-state protocol."""
    params, empty = model.params, torch.nn.Module()  # resume's (lm, mtp) pair: all of V4.1 is one module
    opt = _optimizer(model, args)
    gen = torch.Generator().manual_seed(args.seed)
    state_path, fp = work / resume.STATE_FILE, resume.fingerprint(args, data.tokenizer.to_str())
    if args.export_saved_state:
        return resume.export_saved_state(state_path, params, empty, fp, args.steps, log)
    begun = resume.starting_state(state_path, params, empty, opt, gen, fp, args.resume, log)
    start, done_s, recent = begun.step, begun.elapsed_s, begun.recent
    t0, last = time.perf_counter() - done_s, {}
    for step in range(start, args.steps):
        for group in opt.param_groups:
            group["lr"] = common.learning_rate(step, args)
        window = common.sample_batch(data.train_ids, args, gen)
        loss, total = _losses_of(model, window, args, gen)
        if not torch.isfinite(total):
            raise FloatingPointError(f"step {step}: non-finite loss (lm {loss.lm.item()}, dspark {loss.dspark.item()})")
        total.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_([p for p in params.parameters() if p.requires_grad], 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        v41.update_router_bias(model, loss.router_picks, args.bias_rate)
        recent.append((loss.lm.item(), loss.dspark.item(), loss.kl.item(), loss.confidence.item(),
                       *loss.dspark_accuracy.tolist()))
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            mean = [sum(x) / len(recent) for x in zip(*recent)]
            elapsed = time.perf_counter() - t0
            last = {"step": step + 1, "lm": mean[0], "dspark": mean[1], "indexer_kl": mean[2], "confidence": mean[3],
                    "dspark_accuracy": mean[4:], "grad_norm": float(grad_norm), "lr": common.learning_rate(step, args),
                    "elapsed_s": elapsed, "tokens_per_s": (step + 1) * args.batch_size * args.seq_len / elapsed}
            log(last)
            recent = []
        if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0 and step + 1 < args.steps:
            saved = resume.State(step + 1, time.perf_counter() - t0, recent)
            resume.save(state_path, params, empty, opt, gen, saved, fp)
    return last


@torch.no_grad()
def evaluate_export(out: Path, model: v41.Model, data: common.Data, args: argparse.Namespace) -> dict:
    """Held-out nats/token and bits/char by the engine (the written checkpoint) and by the
    training model, plus DSpark's teacher-forced accuracy per draft position on held-out text."""
    from engine.weights import load_model

    wins = evaluate.windows(data.heldout_ids, args.seq_len, args.eval_windows or None)
    engine_model = load_model(out, progress=False)
    report = {}
    for name, s in (("ringserve", v41_eval.score_engine(engine_model, wins, data.tokenizer)),
                    ("training_model", v41_eval.score_training_model(model, wins, data.tokenizer))):
        report[name] = {"nats_per_token": s.nats_per_token, "bits_per_char": s.bits_per_char, "tokens": s.tokens,
                        "chars": s.chars}
    acc = [v41.losses(model, wins[i: i + 8], 0).dspark_accuracy for i in range(0, len(wins), 8)]
    report["dspark_teacher_forced_accuracy"] = torch.stack(acc).mean(0).tolist()
    return report


def run(args: argparse.Namespace, argv: list[str] | None = None) -> tuple[dict, v41.Model, common.Data]:
    """The whole V4.1 recipe; returns (recipe.json's content, the trained model, the data)."""
    out = Path(args.out_dir)
    work = Path(args.work_dir) if args.work_dir else common.default_work_dir()
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    log_file = (work / "train-log.jsonl").open("a" if args.resume or args.export_saved_state else "w")

    def log(record: dict) -> None:
        logger.info("%s", record)
        log_file.write(json.dumps(record) + "\n")
        log_file.flush()

    t0 = time.perf_counter()
    data = common.prepare_data(args, out, work)
    if args.test_data_dir:
        common.write_test_data(data.heldout_pages, Path(args.test_data_dir))
    device = common.training_device(args)
    model = v41.build(v41.geometry(args.geometry, out / "tokenizer.json"), args.seed, device)
    final = train(model, data, args, log, work)
    v41.export_checkpoint(out, model)  # host tensors, whatever the training device
    heldout = evaluate_export(out, model, data, args)
    result = {"command": "ringserve train-builtin " + " ".join(argv if argv is not None else sys.argv[1:]),
              "arguments": {k: v for k, v in vars(args).items() if k != "func"}, "corpus": data.corpus_info,
              "parameters": sum(p.numel() for p in model.params.parameters()), "device": str(device),
              "torch": torch.__version__, "final_training": final, "heldout": heldout,
              "total_time_s": time.perf_counter() - t0}
    (out / "recipe.json").write_text(json.dumps(result, indent=2) + "\n")
    log({"heldout": heldout})
    log_file.close()
    return result, model, data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="train-builtin --arch v41", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    run(args, argv)
    return 0
