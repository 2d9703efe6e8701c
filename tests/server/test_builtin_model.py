"""The shipped trained built-in model (server/builtin_model/, trained by train/recipe.py) loads,
keeps its config and tokenizer consistent, models held-out documentation text, and writes
English. Skipped in a checkout without it (the built-in is then the random `small` preset)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from engine.config import ModelConfig
from engine.weights import load_model
from ipc.messages import SamplingParams
from reference_driver import generate
from server.builtin import trained_model_dir
from server.tokenizer import Tokenizer
from train import evaluate

DATA = Path(__file__).resolve().parents[1] / "data" / "builtin"
PROMPT = "The function returns"
# The held-out sample is one page of the held-out split, so its loss may differ from the split's
# (recipe.json) by the spread between pages, taken here as at most this many nats/token.
PAGE_SPREAD = 0.5


def builtin_model_dir() -> Path:
    path = trained_model_dir()
    if path is None:
        pytest.skip("no trained built-in model in server/builtin_model/ (train it: ringserve train-builtin "
                    "server/builtin_model --test-data-dir tests/data/builtin)")
    return path


@pytest.fixture(scope="module")
def model():
    return load_model(builtin_model_dir(), dtype=torch.float32, progress=False)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(builtin_model_dir())


def test_builtin_is_a_small_complete_checkpoint(tok):
    path = builtin_model_dir()
    assert (path / "model.safetensors").stat().st_size <= 40 * 2**20
    cfg = ModelConfig.from_model_dir(path)
    assert ModelConfig.from_dict(cfg.to_upstream_dict()) == cfg
    assert ModelConfig.from_dict(cfg.to_transformers_dict()) == cfg
    assert set(cfg.layer_kinds) == {"swa", "csa", "hca"} and any(cfg.hash_layers) and not all(cfg.hash_layers)
    assert cfg.hc_mult > 1 and cfg.num_nextn_predict_layers == 1
    assert cfg.vocab_size == tok.vocab_size
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (tok.bos_id, (tok.eos_id,))
    recipe = json.loads((path / "recipe.json").read_text())
    assert recipe["corpus"]["source"] == "python3.11-doc" and "PSF" in recipe["corpus"]["license"]


def test_builtin_loads_with_its_mtp_layer(model):
    assert len(model.mtp) == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_tokenizer_round_trips_text_and_renders_the_chat_template(tok):
    text = (DATA / "heldout_sample.txt").read_text()
    assert tok.decode(tok.encode(text)) == text
    ids = tok.encode_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}])
    rendered = tok.decode(ids, skip_special_tokens=False)
    assert rendered == "<｜begin▁of▁sentence｜>Be brief.<｜User｜>Hello!<｜Assistant｜>"


def test_heldout_sample_loss_matches_the_recipe_and_beats_guessing(model, tok):
    recipe = json.loads((builtin_model_dir() / "recipe.json").read_text())
    recorded = recipe["heldout"]["ringserve"]["nats_per_token"]
    text = (DATA / "heldout_sample.txt").read_text()
    wins = evaluate.windows([tok.bos_id, *tok.encode(text, add_bos=False), tok.eos_id], 256)
    score = evaluate.score_ringserve(model, wins, tok)
    assert abs(score.nats_per_token - recorded) < PAGE_SPREAD
    assert score.nats_per_token < 0.6 * math.log(tok.vocab_size)  # uniform guessing scores ln V


def test_greedy_continuation_is_mostly_dictionary_words(model, tok):
    words = set((DATA / "words.txt").read_text().split())
    out = generate(model, [tok.encode(PROMPT)], SamplingParams(max_tokens=48, ignore_eos=True))[0]
    text = tok.decode(out.token_ids)
    tokens = [t.strip(".,;:()\"'!?").lower() for t in text.split()]
    tokens = [t for t in tokens if t]
    assert len(tokens) >= 10, text
    known = sum(t in words for t in tokens)
    assert known / len(tokens) >= 0.6, text
    assert len(set(tokens)) >= 5, text  # not one word repeated
    assert re.search(r"[a-z]{3,}", text), text
