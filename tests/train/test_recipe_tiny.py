"""The recipe end to end at tiny size (synthetic Sphinx pages, a few steps): the checkpoint it
exports loads in ringserve with the training model's logits, main model and MTP layer alike."""

from __future__ import annotations

import argparse
import json
import random
import shutil

import pytest
import torch

from engine.v4.attention import SeqSlice, SequenceContext
from engine.weights import load_model
from server.tokenizer import Tokenizer
from safetensors.torch import load_file

from train import corpus, recipe, resume, v4

pytest.importorskip("transformers")

_WORDS = ("the function returns a list of values when an argument is given and each object in the standard "
          "library module provides classes methods attributes for strings numbers files").split()


def _write_pages(root, n_pages: int = 10) -> None:
    rng = random.Random(3)

    def para() -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(10, 30))).capitalize() + "."

    paths = [f"library/page{i}.html" for i in range(200)]
    held = [p for p in paths if corpus.is_heldout(p)][:2]  # two pages certainly held out
    for path in [p for p in paths if p not in held][:n_pages] + held:
        sections = "".join(f"<section><h2>{j}. Topic {rng.choice(_WORDS)}</h2>" + "".join(f"<p>{para()}</p>"
                           for _ in range(4)) + f"<dl><dt>f{j}(x)</dt><dd><p>{para()}</p></dd></dl></section>"
                           for j in range(3))
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(f'<html><body><div class="body" role="main"><h1>Page</h1>{sections}</div></body></html>')


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    base = tmp_path_factory.mktemp("recipe")
    _write_pages(base / "html")
    return recipe.run(_tiny_args(base, "model", "work"), []), base / "model"


def _tiny_args(base, out: str, work: str, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    recipe.add_arguments(parser)
    return parser.parse_args([str(base / out), "--html-dir", str(base / "html"), "--work-dir", str(base / work),
                              "--geometry", "tiny",
                              "--vocab-size", "600", "--steps", "12", "--batch-size", "2", "--seq-len", "32",
                              "--warmup", "3", "--log-every", "4", "--export-dtype", "fp32", "--eval-windows", "4",
                              "--precision", "fp32", "--device", "cpu", "--checkpoint-every", "5", *extra])


def test_a_run_resumed_from_its_saved_state_ends_with_the_same_weights(trained):
    result, path = trained
    base = path.parent
    state = base / "work" / resume.STATE_FILE  # saved at step 10 of 12 (not at the end)
    (base / "work2").mkdir()
    shutil.copy(state, base / "work2" / resume.STATE_FILE)
    again = recipe.run(_tiny_args(base, "model2", "work2", "--resume"), [])
    log = [json.loads(line) for line in (base / "work2" / "train-log.jsonl").read_text().splitlines()]
    assert log[0] == {"resumed_at_step": 10} and [r["step"] for r in log if "step" in r] == [12]
    first, second = load_file(path / "model.safetensors"), load_file(base / "model2" / "model.safetensors")
    assert first.keys() == second.keys()
    for name in first:
        torch.testing.assert_close(second[name], first[name], rtol=0, atol=0, msg=name)
    # A run stopped at its last save exports that state as it is.
    stopped = recipe.run(_tiny_args(base, "model3", "work2", "--export-saved-state"), [])
    final = stopped.recipe["final_training"]
    assert (final["step"], final["of_steps"], final["stopped_early"]) == (10, 12, True)
    assert not torch.equal(load_file(base / "model3" / "model.safetensors")["embed.weight"], second["embed.weight"])
    # A state is only continued by the run that wrote it.
    other = resume.fingerprint(_tiny_args(base, "x", "y", "--lr", "1e-3"), result.data.tokenizer.to_str())
    with pytest.raises(ValueError, match="other arguments"):
        resume.load(state, again.lm, again.mtp, recipe._optimizer(again.lm, again.mtp, again.recipe and
                    _tiny_args(base, "x", "y")), torch.Generator(), other)


@torch.no_grad()
def test_exported_checkpoint_reproduces_the_training_logits(trained):
    result, path = trained
    ours = load_model(path, dtype=torch.float32, progress=False)
    assert len(ours.mtp) == 1
    ids = torch.tensor(result.data.heldout_ids[:40])
    probes = v4.Probes().attach(result.lm, result.mtp)
    want = result.lm(input_ids=ids[None]).logits[0]  # [S, V]
    want_mtp = result.mtp(result.lm, probes.streams[:, :-1], ids[None, 1:])[0]  # [S-1, V]
    probes.detach_hooks()

    state = ours.new_state()
    rows = torch.arange(len(ids))
    streams = ours(ids, rows, SequenceContext([SeqSlice(state, 0, 0, len(ids))]))
    got = ours.logits(streams)
    m = len(ids) - 1
    mtp_out = ours.mtp[0](ours, streams[:m], ids[1:], rows[:m], SequenceContext([SeqSlice(state, 0, 0, m)]))
    got_mtp = ours.mtp[0].logits(ours, mtp_out)
    assert (got - want).abs().max().item() <= 1e-4
    assert (got_mtp - want_mtp).abs().max().item() <= 1e-4


def test_recipe_json_records_the_run_and_both_scorers_agree(trained):
    result, path = trained
    saved = json.loads((path / "recipe.json").read_text())
    assert saved["arguments"]["steps"] == 12 and saved["arguments"]["seed"] == 0
    assert saved["corpus"]["heldout_pages"] == 2 and saved["corpus"]["license"].startswith("PSF License")
    ours, ref = saved["heldout"]["ringserve"], saved["heldout"]["transformers"]
    assert abs(ours["nats_per_token"] - ref["nats_per_token"]) <= 1e-4
    assert ours["tokens"] == ref["tokens"] == 4 * 32
    steps = [json.loads(line) for line in (path.parent / "work" / "train-log.jsonl").read_text().splitlines()]
    losses = [s["lm"] for s in steps if "lm" in s]
    assert len(losses) == 3 and losses[-1] < losses[0]  # it learns something even in 12 steps


def test_exported_tokenizer_serves_text_and_the_chat_template(trained):
    result, path = trained
    tok = Tokenizer.from_dir(path)
    text = "The function returns a list of values."
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id == 0 and tok.eos_id == 1 and tok.decode(ids) == text
    chat = tok.encode_chat([{"role": "user", "content": "Hello!"}])
    assert chat[:2] == [0, tok.token_to_id("<｜User｜>")] and chat[-1] == tok.token_to_id("<｜Assistant｜>")
    assert tok.decode([tok.token_to_id("<think>")]) == "<think>"  # think tags are not special
    assert json.loads((path / "config.json").read_text())["vocab_size"] == tok.vocab_size
