"""Held-out loss through the HTTP scoring path: nats/token and bits/character of a text, scored by a
running `ringserve serve` the way lm-evaluation-harness scores (completions with `echo`,
`logprobs` and `max_tokens: 0`).

The text is tokenized by the server (/tokenize) and cut into windows as train/evaluate.py cuts
held-out text (length + 1 tokens, the last of one window the first of the next; a window's first
token is context only), so the figure is comparable with recipe.json's held-out loss.

    python perf/score_api.py --url http://127.0.0.1:8000 --text-file tests/data/builtin/heldout_sample.txt
"""

from __future__ import annotations

import argparse
import json
import urllib.request
from pathlib import Path

from perf.machine import header
from train.score import Score


def _post(url: str, path: str, body: dict, api_key: str | None) -> dict:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def score_text(url: str, text: str, length: int = 256, api_key: str | None = None,
               model: str | None = None) -> Score:
    ids = _post(url, "/tokenize", {"prompt": text}, api_key)["tokens"]
    n = (len(ids) - 1) // length
    if n < 1:
        raise ValueError(f"{len(ids)} tokens do not fill one window of {length + 1}")
    total, tokens, chars = 0.0, 0, 0
    for i in range(n):
        window = ids[i * length: (i + 1) * length + 1]
        body = {"prompt": window, "echo": True, "logprobs": 0, "max_tokens": 0, "temperature": 0,
                **({"model": model} if model else {})}
        lp = _post(url, "/v1/completions", body, api_key)["choices"][0]["logprobs"]
        total -= sum(lp["token_logprobs"][1:])
        tokens += length
        detok = _post(url, "/detokenize", {"tokens": window[1:]}, api_key)
        chars += len(detok["prompt"])
    return Score(total, tokens, chars)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--text-file", default=str(Path(__file__).resolve().parents[1] / "tests" / "data" / "builtin"
                                                   / "heldout_sample.txt"))
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--api-key", default=None)
    args = parser.parse_args()
    print(header("score_api"), flush=True)
    s = score_text(args.url, Path(args.text_file).read_text(), args.length, args.api_key)
    print(f"{s.tokens} tokens, {s.chars} characters: {s.nats_per_token:.4f} nats/token, "
          f"{s.bits_per_char:.4f} bits/character")


if __name__ == "__main__":
    main()
