"""Run llama.cpp's own `convert_hf_to_gguf.py` on a ringserve checkpoint (used by perf/peer_llamacpp.py).

    python perf/peer_gguf_convert.py LLAMA_CPP_DIR [--tokenizer-pre NAME] -- CONVERTER_ARGS...

The converter identifies a BPE tokenizer's pre-tokenizer by hashing the ids it gives for a fixed
text, and refuses vocabularies it has no hash for. `ringserve make-model` writes a fresh random
vocabulary whose pre-tokenizer is DeepSeek-V3's split (digits in groups of 1-3, CJK runs, then a
GPT-2 style word split), so its hash is unknown; this wrapper answers that one question with
`--tokenizer-pre` (default `deepseek-v3`) and leaves every other step of the converter as shipped.
Imports the converter from LLAMA_CPP_DIR (with its `gguf-py`); never imported by ringserve.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _patch_pre_tokenizer(name: str) -> None:
    from conversion import base

    original = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return original(self, tokenizer)
        except NotImplementedError:  # unknown hash: a random make-model vocabulary
            return name

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rest: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, rest = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("llama_cpp_dir", help="llama.cpp source tree (holds convert_hf_to_gguf.py and gguf-py/)")
    ap.add_argument("--tokenizer-pre", default="deepseek-v3", help="llama.cpp pre-tokenizer for unknown vocabularies")
    a = ap.parse_args(argv)
    src = Path(a.llama_cpp_dir).resolve()
    sys.path[:0] = [str(src), str(src / "gguf-py")]
    _patch_pre_tokenizer(a.tokenizer_pre)
    import convert_hf_to_gguf

    sys.argv = [str(src / "convert_hf_to_gguf.py"), *rest]
    convert_hf_to_gguf.main()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
