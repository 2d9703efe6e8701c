"""The V4.1 recipe end to end at tiny size (synthetic Sphinx pages, a few steps): the release
checkpoint it exports loads in ringserve's engine with the training model's logits and DSpark
drafts; training lowers the loss; a resumed run ends with the same weights."""

from __future__ import annotations

import argparse
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from engine.weights import load_model
from tests.train.test_recipe_tiny import _write_pages
from train import recipe, resume, v41, v41_dspark, v41_eval, v41_model, v41_recipe

# The training forward of one sequence runs the engine's operations on the engine's shapes; the
# one difference is the head, one GEMM over all rows here and one row at a time in the engine
# (fp32 results depend on the row count): a few fp32 ulps of the logits.
LOGIT_ATOL = 1e-4


def _args(base, out: str, work: str, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    v41_recipe.add_arguments(parser)
    return parser.parse_args([str(base / out), "--html-dir", str(base / "html"), "--work-dir", str(base / work),
                              "--geometry", "tiny", "--vocab-size", "600", "--steps", "12", "--batch-size", "2",
                              "--seq-len", "32", "--warmup", "3", "--log-every", "4", "--eval-windows", "2",
                              "--checkpoint-every", "5", "--dspark-anchors", "8", *extra])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    base = tmp_path_factory.mktemp("recipe_v41")
    _write_pages(base / "html")
    torch.set_num_threads(1)
    result, model, data = v41_recipe.run(_args(base, "model", "work"), [])
    return result, model, data, base / "model"


@pytest.fixture(scope="module")
def engine_model(trained):
    return load_model(trained[3], progress=False)


@torch.no_grad()
def test_exported_checkpoint_reproduces_the_training_logits(trained, engine_model):
    _, model, data, path = trained
    assert engine_model.cfg.arch == "v41" and len(engine_model.mtp) == model.cfg.num_nextn_predict_layers
    assert json.loads((path / "config.json").read_text())["quantization_config"]["expert_dtype"] == "fp4"
    ids = torch.tensor(data.heldout_ids[:40])  # 20 ratio-2 entries > top-6: the selection is a real choice
    w = v41_model.effective_weights(model.params)
    ours = v41_model.forward(model.cfg, w, model.hasher, ids[None], exact=True)
    got, _, out = v41_eval.engine_prefill(engine_model, ids)
    assert torch.equal(ours.main_hidden[0], out.main_hidden)  # every layer's bf16 stream, bit for bit
    assert (ours.logits[0] - got).abs().max().item() <= LOGIT_ATOL
    assert torch.equal(ours.logits[0].argmax(-1), got.argmax(-1))


@torch.no_grad()
def test_engine_dspark_drafts_equal_the_training_models(trained, engine_model):
    _, model, data, _ = trained
    w = v41_model.effective_weights(model.params)
    ids = data.heldout_ids
    for length in (5, 23):  # a window still filling, then a full window read in ring order (window 8)
        prefix = torch.tensor(ids[:length])
        main = v41_model.forward(model.cfg, w, model.hasher, prefix[None], exact=True).main_hidden
        want, want_conf = v41_dspark.greedy_draft(model.cfg, w, main, ids[length])
        got, got_conf = v41_eval.engine_draft(engine_model, prefix, ids[length])
        assert got == want and len(got) == model.cfg.v41.dspark_block_size
        assert torch.equal(got_conf, want_conf)  # one anchor: the engine's shapes, so its bits


def test_a_few_steps_lower_the_loss_on_a_fixed_batch(trained):
    _, _, data, path = trained
    geo = v41.geometry("tiny", path / "tokenizer.json")
    model = v41.build(geo, seed=1)
    window = torch.stack([data.train_ids[i: i + 33] for i in (0, 100)])  # [2, 33]
    opt = torch.optim.AdamW([p for p in model.params.parameters() if p.requires_grad], lr=3e-3)
    first = None
    for _ in range(6):
        loss = v41.losses(model, window, anchors=0)
        total = loss.lm + loss.dspark + loss.confidence + loss.kl
        first = first or (loss.lm.item(), loss.dspark.item(), loss.kl.item())
        total.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        v41.update_router_bias(model, loss.router_picks, 1e-3)
    assert loss.lm.item() < first[0] - 0.5 and loss.dspark.item() < first[1] - 0.5
    assert all(p.grad is None for name, p in model.params.named_parameters() if name.endswith("gate.bias"))


def test_the_indexer_learns_from_its_kl_only(trained):
    """The selection is discrete: the LM loss gives the indexer no gradient, the KL only it."""
    _, _, data, path = trained
    model = v41.build(v41.geometry("tiny", path / "tokenizer.json"), seed=2)
    loss = v41.losses(model, data.train_ids[:33][None], anchors=4)
    indexer = v41.indexer_parameters(model)
    others = [p for p in model.params.parameters() if all(p is not q for q in indexer)]
    loss.lm.backward(retain_graph=True)
    assert all(p.grad is None or not p.grad.any() for p in indexer)
    after_lm = [None if p.grad is None else p.grad.clone() for p in others]
    assert loss.kl.item() > 0
    loss.kl.backward()
    assert all(p.grad is not None and p.grad.any() for p in indexer)
    assert all((g is None and p.grad is None) or torch.equal(p.grad, g) for p, g in zip(others, after_lm))


def test_recipe_json_records_the_run_and_both_scorers_agree(trained):
    _, _, _, path = trained
    saved = json.loads((path / "recipe.json").read_text())
    assert saved["arguments"]["arch"] == "v41" and saved["arguments"]["steps"] == 12
    assert saved["corpus"]["heldout_pages"] == 2 and saved["corpus"]["license"].startswith("PSF License")
    ours, ref = saved["heldout"]["ringserve"], saved["heldout"]["training_model"]
    assert abs(ours["nats_per_token"] - ref["nats_per_token"]) <= 1e-4
    assert ours["tokens"] == ref["tokens"] == 2 * 32
    assert len(saved["heldout"]["dspark_teacher_forced_accuracy"]) == 4
    assert saved["final_training"]["step"] == 12 and len(saved["final_training"]["dspark_accuracy"]) == 4


def test_a_run_resumed_from_its_saved_state_ends_with_the_same_weights(trained):
    _, _, _, path = trained
    base = path.parent
    (base / "work2").mkdir()
    shutil.copy(base / "work" / resume.STATE_FILE, base / "work2" / resume.STATE_FILE)  # saved at step 10
    v41_recipe.run(_args(base, "model2", "work2", "--resume"), [])
    log = [json.loads(line) for line in (base / "work2" / "train-log.jsonl").read_text().splitlines()]
    assert log[0] == {"resumed_at_step": 10}
    first, second = load_file(path / "model.safetensors"), load_file(base / "model2" / "model.safetensors")
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name].view(torch.uint8), second[name].view(torch.uint8)), name


def test_arch_flag_routes_and_keeps_v4_arguments_unchanged():
    assert recipe._split_arch(["out", "--steps", "3"]) == ("v4", ["out", "--steps", "3"])
    assert recipe._split_arch(["out", "--arch", "v4", "--steps", "3"]) == ("v4", ["out", "--steps", "3"])
    assert recipe._split_arch(["out", "--arch=v4"]) == ("v4", ["out"])
    assert recipe._split_arch(["out", "--arch", "v41"]) == ("v41", ["out", "--arch", "v41"])


def test_a_training_step_makes_every_tensor_on_the_masters_device(trained):
    """--device cuda on a CPU machine: every tensor a step creates takes the masters' device, the
    host-made ones (batch and anchor draws, Engram hashes, RoPE frequencies) say so. With meta as
    the default device, any tensor made without one is a meta tensor, and meeting a CPU master
    raises (as a CPU tensor meeting CUDA masters would); the step must still give the CPU bits."""
    _, _, data, path = trained
    window = torch.stack([data.train_ids[i: i + 33] for i in (0, 100)])  # [2, 33]
    results = []
    for default in ("cpu", "meta"):
        model = v41.build(v41.geometry("tiny", path / "tokenizer.json"), seed=3)
        with torch.device(default):
            loss = v41.losses(model, window, 8, torch.Generator(device="cpu").manual_seed(5), exact=False)
            (loss.lm + loss.dspark + loss.confidence + loss.kl).backward()
            v41.update_router_bias(model, loss.router_picks, 1e-3)
            w = v41_model.effective_weights(model.params)
            main = v41_model.forward(model.cfg, w, model.hasher, window[:1, :20]).main_hidden
            draft = v41_dspark.greedy_draft(model.cfg, w, main, int(window[0, 20]))
        grads = {n: p.grad for n, p in model.params.named_parameters() if p.grad is not None}
        bias = {n: p.detach().clone() for n, p in model.params.named_parameters() if n.endswith("gate.bias")}
        results.append((loss, grads, bias, draft))
    (ref, ref_grads, ref_bias, ref_draft), (got, got_grads, got_bias, got_draft) = results
    for field in ("lm", "dspark", "confidence", "kl", "dspark_accuracy"):
        assert torch.equal(getattr(ref, field), getattr(got, field)), field
    assert ref_grads.keys() == got_grads.keys() and all(torch.equal(ref_grads[n], got_grads[n]) for n in ref_grads)
    assert all(torch.equal(ref_bias[n], got_bias[n]) for n in ref_bias)
    assert ref_draft[0] == got_draft[0] and torch.equal(ref_draft[1], got_draft[1])
