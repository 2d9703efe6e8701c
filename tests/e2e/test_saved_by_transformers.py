"""A model a user saved with transformers' `save_pretrained` runs through `ringserve generate` and
`ringserve serve`, with transformers' own tokens and logprobs (fp32, greedy)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from server_process import Server

transformers = pytest.importorskip("transformers")

PROMPT = [5, 9, 200, 31, 77, 3, 140]
STEPS = 8


@pytest.fixture(scope="module")
def saved_dir(checkpoint_factory, tmp_path_factory):
    from tokenization.synthetic_bpe import write_tokenizer

    source = checkpoint_factory("tiny-upstream", index_topk=64)  # top-k ≥ entries: no index ties
    model = transformers.DeepseekV4ForCausalLM.from_pretrained(source, dtype=torch.float32)
    out = tmp_path_factory.mktemp("saved") / "tiny-saved"
    model.save_pretrained(out)
    write_tokenizer(out, model.config.vocab_size)
    return out, model.eval()


@pytest.fixture(scope="module")
def expected(saved_dir):
    """transformers' greedy tokens and each one's logprob."""
    _, model = saved_dir
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        full = model.generate(ids, max_new_tokens=STEPS, do_sample=False, eos_token_id=None, pad_token_id=0)
        logp = torch.log_softmax(model(full).logits[0].float(), dim=-1)
    tokens = full[0, len(PROMPT):].tolist()
    logprobs = [logp[len(PROMPT) - 1 + i, t].item() for i, t in enumerate(tokens)]
    return tokens, logprobs


def test_the_saved_file_is_the_mixed_layout(saved_dir):
    path, _ = saved_dir
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "head.weight" in names and "model.embed_tokens.weight" in names
    assert "model.layers.1.attn.norm.weight" in names and "model.layers.1.attn.wq_a.weight" in names


def test_generate_on_a_saved_model(saved_dir, expected):
    path, _ = saved_dir
    proc = subprocess.run([sys.executable, "-m", "server.cli", "generate", str(path), "--prompt-ids",
                           ",".join(map(str, PROMPT)), "--max-tokens", str(STEPS), "--ignore-eos", "--json",
                           "--logprobs", "0", "--dtype", "fp32", "--kv-cache-memory", "0.05", "--block-size", "16"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout)
    tokens, logprobs = expected
    assert record["token_ids"] == tokens
    assert max(abs(a - b) for a, b in zip(record["logprobs"], logprobs)) < 1e-4


def test_serve_on_a_saved_model(saved_dir, expected):
    from server.tokenizer import Tokenizer

    path, _ = saved_dir
    server = Server(path, "--dtype", "fp32", api_key=None)
    try:
        import urllib.request

        body = json.dumps({"prompt": PROMPT, "max_tokens": STEPS, "temperature": 0, "logprobs": 0,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(server.url + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            choice = json.loads(r.read())["choices"][0]
    finally:
        assert server.stop() == 0, server.output()
    tokens, logprobs = expected
    assert choice["text"] == Tokenizer.from_dir(path).decode(tokens)
    got = choice["logprobs"]["token_logprobs"]
    assert len(got) == STEPS and max(abs(a - b) for a, b in zip(got, logprobs)) < 1e-4
