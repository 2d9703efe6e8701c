"""No code path that turns bytes into code: scan engine/, ipc/, kernels/ and server/ for it."""
from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "ipc", "kernels", "server")
FORBIDDEN = {
    "pickle": re.compile(r"\bc?pickle\b"),
    "cloudpickle": re.compile(r"cloudpickle"),
    "dill": re.compile(r"\bdill\b"),
    "marshal.loads": re.compile(r"\bmarshal\s*\.\s*loads?\b"),
    "eval(": re.compile(r"(?<![\w.])eval\s*\("),  # the builtin, not model.eval()
    "exec(": re.compile(r"(?<![\w.])exec\s*\("),
}


def scan(root: pathlib.Path) -> list[str]:
    hits = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            for lineno, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
                for name, pattern in FORBIDDEN.items():
                    if pattern.search(line):
                        hits.append(f"{path.relative_to(root)}:{lineno}: {name}: {line.strip()}")
    return hits


def test_no_unsafe_deserialization_anywhere():
    assert (ROOT / "ipc").is_dir()
    hits = scan(ROOT)
    assert not hits, "forbidden serialization/eval found:\n" + "\n".join(hits)


def test_the_scan_catches_what_it_should(tmp_path):
    bad = tmp_path / "server"
    bad.mkdir()
    (bad / "x.py").write_text("import pickle\ny = eval('1')\nmodel.eval()\nexec(code)\nmarshal.loads(b)\n")
    found = scan(tmp_path)
    assert [h.split(": ")[1] for h in found] == ["pickle", "eval(", "exec(", "marshal.loads"]
