"""The training corpus: the Python 3.11 documentation from Debian's `python3.11-doc` package.

The documentation is licensed under the PSF License Version 2 (its code examples also under the
Zero-Clause BSD licence); the package is fetched with `apt-get download` at a pinned version and
read in memory (ar archive → data.tar.xz → the HTML pages), so nothing is installed.

Each page's main body becomes plain prose: code blocks (`<pre>`), tables, scripts and permalink
marks are dropped, every block element (paragraph, heading, list item, definition term) becomes
one paragraph with its whitespace collapsed. Pages are split into training and held-out
sets by a hash of their path, so the split never depends on file order or on the rest of the
corpus. Sections (a heading or an API signature followed by its text) also become chat pairs,
so the model learns what the chat template's Assistant turn is for.
"""

from __future__ import annotations

import hashlib
import io
import lzma
import re
import subprocess
import tarfile
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

DOC_PACKAGE = "python3.11-doc"
DOC_VERSION = "3.11.2-6+deb12u8"
DOC_LICENSE = ("PSF License Version 2 (Python documentation, Copyright 2001-2023 Python Software Foundation); "
               "code examples additionally under the Zero-Clause BSD License")
HTML_ROOT = "usr/share/doc/python3.11/html/"
# Index, search and changelog pages are lists of links or issue numbers, not prose.
_SKIP_PAGE = re.compile(r"^(genindex.*|py-modindex|search|contents|index|whatsnew/changelog)\.html$")
HELDOUT_MODULUS = 25  # one page in 25 (by path hash) is held out

_BLOCK_TAGS = frozenset({"p", "h1", "h2", "h3", "h4", "h5", "h6", "li", "dt", "dd", "div", "section",
                         "blockquote", "ul", "ol", "dl", "br"})
# Code blocks, and tables (in these pages mostly link grids and option lists), are not prose.
_SKIP_TAGS = frozenset({"pre", "script", "style", "table"})


@dataclass(frozen=True)
class Paragraph:
    kind: str  # 'h' heading, 'dt' API signature (definition term), 'p' anything else
    text: str


@dataclass(frozen=True)
class Page:
    path: str  # relative to the HTML root, e.g. 'library/functions.html'
    paragraphs: tuple[Paragraph, ...]

    @property
    def text(self) -> str:
        return "\n\n".join(p.text for p in self.paragraphs)


def fetch_deb(work_dir: Path, version: str = DOC_VERSION) -> Path:
    """`apt-get download` the pinned docs package into work_dir (reused when already there)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    found = sorted(work_dir.glob(f"{DOC_PACKAGE}_*.deb"))
    if not found:
        subprocess.run(["apt-get", "download", f"{DOC_PACKAGE}={version}"], cwd=work_dir, check=True)
        found = sorted(work_dir.glob(f"{DOC_PACKAGE}_*.deb"))
    if not found:
        raise RuntimeError(f"apt-get download {DOC_PACKAGE}={version} left no .deb in {work_dir}")
    return found[0]


def _ar_member(data: bytes, prefix: str) -> bytes:
    """The first member of an ar archive (a .deb) whose name starts with `prefix`."""
    if not data.startswith(b"!<arch>\n"):
        raise ValueError("not an ar archive")
    pos = 8
    while pos + 60 <= len(data):
        header = data[pos:pos + 60]
        name = header[:16].decode().strip().rstrip("/")
        size = int(header[48:58].decode().strip())
        body = data[pos + 60:pos + 60 + size]
        if name.startswith(prefix):
            return body
        pos += 60 + size + (size & 1)  # members are 2-byte aligned
    raise ValueError(f"no {prefix}* member in the archive")


def read_html_pages(deb: Path) -> dict[str, str]:
    """Relative path → HTML text of every documentation page in the .deb."""
    payload = _ar_member(deb.read_bytes(), "data.tar")
    pages: dict[str, str] = {}
    with tarfile.open(fileobj=io.BytesIO(lzma.decompress(payload)), mode="r:") as tar:
        for member in tar:
            name = member.name.removeprefix("./")
            if member.isfile() and name.startswith(HTML_ROOT) and name.endswith(".html"):
                pages[name[len(HTML_ROOT):]] = tar.extractfile(member).read().decode("utf-8")
    return pages


def read_html_dir(root: Path) -> dict[str, str]:
    """The same from an extracted documentation tree (tests, or an installed python3-doc)."""
    return {p.relative_to(root).as_posix(): p.read_text(encoding="utf-8") for p in sorted(root.rglob("*.html"))}


class _MainBodyText(HTMLParser):
    """Collects the paragraphs of a Sphinx page's `<div role="main">`."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.paragraphs: list[Paragraph] = []
        self._div_depth = 0  # > 0 while inside the main body (counts its nested divs)
        self._skip: list[str] = []  # open tags whose content is dropped
        self._kind = "p"
        self._buf: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if self._div_depth == 0:
            if tag == "div" and a.get("role") == "main":
                self._div_depth = 1
            return
        if tag == "div":
            self._div_depth += 1
        if self._skip or tag in _SKIP_TAGS or (tag == "a" and "headerlink" in (a.get("class") or "")):
            if tag != "br":
                self._skip.append(tag)
            return
        if tag in _BLOCK_TAGS:
            self._flush()
            self._kind = "h" if tag[0] == "h" and tag[1:].isdigit() else ("dt" if tag == "dt" else "p")

    def handle_endtag(self, tag: str) -> None:
        if self._div_depth == 0:
            return
        if self._skip:
            if tag == self._skip[-1]:
                self._skip.pop()
        elif tag in _BLOCK_TAGS:
            self._flush()
        if tag == "div":
            self._div_depth -= 1
            if self._div_depth == 0:
                self._flush()

    def handle_data(self, data: str) -> None:
        if self._div_depth and not self._skip:
            self._buf.append(data)

    def _flush(self) -> None:
        text = " ".join("".join(self._buf).replace("¶", " ").split())
        if text:
            self.paragraphs.append(Paragraph(self._kind, text))
        self._buf = []
        self._kind = "p"


def page_paragraphs(html: str) -> tuple[Paragraph, ...]:
    parser = _MainBodyText()
    parser.feed(html)
    parser.close()
    return tuple(parser.paragraphs)


def build_pages(html_pages: dict[str, str]) -> list[Page]:
    """Prose pages in path order; pages with no main-body text are dropped."""
    pages = []
    for path in sorted(html_pages):
        if _SKIP_PAGE.match(path):
            continue
        paragraphs = page_paragraphs(html_pages[path])
        if paragraphs:
            pages.append(Page(path, paragraphs))
    return pages


def is_heldout(path: str) -> bool:
    digest = hashlib.sha256(path.encode()).digest()
    return int.from_bytes(digest[:8], "little") % HELDOUT_MODULUS == 0


def split_pages(pages: list[Page]) -> tuple[list[Page], list[Page]]:
    """(training pages, held-out pages)."""
    return [p for p in pages if not is_heldout(p.path)], [p for p in pages if is_heldout(p.path)]


_QUESTIONS = ("Tell me about {}.", "What is {}?", "Explain {}.", "Can you describe {}?", "{}")
_SIGNATURE_QUESTIONS = ("What does {} do?", "Describe {}.", "How do I use {}?", "Explain {}.")
_SECTION_NUMBER = re.compile(r"^[\d.]+\s+")
_MAX_ANSWER_CHARS = 700


def _answer(paragraphs: list[str]) -> str:
    """The section's first paragraphs, at most about _MAX_ANSWER_CHARS, cut at a sentence."""
    out: list[str] = []
    for text in paragraphs:
        if out and sum(len(t) + 2 for t in out) + len(text) > _MAX_ANSWER_CHARS:
            break
        out.append(text)
    answer = "\n\n".join(out)
    if len(answer) > 2 * _MAX_ANSWER_CHARS:
        cut = answer.rfind(". ", 0, 2 * _MAX_ANSWER_CHARS)
        answer = answer[: cut + 1] if cut > 0 else answer[: 2 * _MAX_ANSWER_CHARS]
    return answer


def _pick(templates: tuple[str, ...], key: str) -> str:
    return templates[hashlib.sha256(key.encode()).digest()[0] % len(templates)]


def chat_pairs(page: Page) -> list[tuple[str, str]]:
    """(question, answer) per heading or API signature that is followed by text."""
    pairs: list[tuple[str, str]] = []
    head: Paragraph | None = None
    body: list[str] = []

    def close() -> None:
        if head is not None and body and len(body[0]) >= 40:
            if head.kind == "h":
                topic = _SECTION_NUMBER.sub("", head.text)
                question = _pick(_QUESTIONS, page.path + topic).format(topic)
            else:
                question = _pick(_SIGNATURE_QUESTIONS, page.path + head.text).format(head.text)
            pairs.append((question, _answer(body)))

    for para in page.paragraphs:
        if para.kind in ("h", "dt"):
            close()
            head, body = para, []
        else:
            body.append(para.text)
    close()
    return pairs
