"""The toy architecture (tests/toy_arch/toy_dense.py) through the real CLI and server: a plug-in
named by RINGSERVE_ARCHITECTURES is written by `ringserve make-model --arch toy_dense` and served
by `ringserve serve` (front and worker processes each import it), and the official OpenAI
client's greedy completion equals the plain-torch reference's tokens. No engine or server file
knows the toy."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import openai
import pytest

from server_process import API_KEY, Server

TOY_DIR = Path(__file__).resolve().parents[1] / "toy_arch"
ENV = {"RINGSERVE_ARCHITECTURES": "toy_dense",
       "PYTHONPATH": os.pathsep.join(p for p in (str(TOY_DIR), os.environ.get("PYTHONPATH", "")) if p)}
PROMPT = [5, 9, 33, 7, 100, 3, 250, 17, 8, 12, 40, 41, 42, 7, 9, 11, 13, 200, 300, 301]


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory) -> Path:
    """`ringserve make-model --arch toy_dense` (in this process: the plug-in is imported here too)."""
    sys.path.insert(0, str(TOY_DIR))
    import toy_dense  # noqa: F401  (registers the architecture, as RINGSERVE_ARCHITECTURES does in the server)

    from server.cli import main

    out = tmp_path_factory.mktemp("toy") / "toy"
    assert main(["make-model", str(out), "--arch", "toy_dense"]) == 0
    assert (out / "config.json").exists() and (out / "tokenizer.json").exists()
    return out


def test_serve_answers_a_completion_with_the_reference_tokens(toy_dir):
    import toy_dense

    from server.tokenizer import Tokenizer

    seq = list(PROMPT)
    for _ in range(12):
        seq.append(int(toy_dense.reference_logits(toy_dir, seq)[-1].argmax()))
    expected = Tokenizer.from_dir(toy_dir).decode(seq[len(PROMPT):])
    server = Server(toy_dir, "--max-num-seqs", "2", env=ENV)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY)
        model = client.models.list().data[0].id
        comp = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True})
        assert comp.choices[0].finish_reason == "length" and comp.usage.completion_tokens == 12
        assert comp.choices[0].text == expected
    finally:
        assert server.stop() == 0, server.output()
