"""The corpus extraction: what of a Sphinx page is kept, the .deb reader, the split, chat pairs."""

from __future__ import annotations

import io
import lzma
import tarfile

from train import corpus

_PAGE = """<html><head><title>t</title><script>var x = 1;</script></head><body>
<div class="sphinxsidebar"><p>Navigation text</p></div>
<div class="body" role="main">
  <section><h1>3.1. Built-in   Types<a class="headerlink" href="#t">¶</a></h1>
  <p>The following   sections describe
     the standard types.</p>
  <div class="highlight"><pre><span>x = [1, 2]</span></pre></div>
  <table><tr><td><p>a link grid</p></td></tr></table>
  <dl><dt class="sig">len(s)<a class="headerlink" href="#len">¶</a></dt>
  <dd><p>Return the length (the number of items) of an object.<br/>It works on sequences.</p></dd></dl>
  <ul><li>First item</li><li>Second <em>item</em></li></ul>
  </section>
</div>
<div class="footer"><p>Copyright footer</p></div></body></html>"""


def test_main_body_prose_is_kept_and_the_rest_dropped():
    paras = corpus.page_paragraphs(_PAGE)
    assert [(p.kind, p.text) for p in paras] == [
        ("h", "3.1. Built-in Types"),
        ("p", "The following sections describe the standard types."),
        ("dt", "len(s)"),
        ("p", "Return the length (the number of items) of an object."),
        ("p", "It works on sequences."),
        ("p", "First item"),
        ("p", "Second item"),
    ]


def _deb(members: dict[str, bytes]) -> bytes:
    """A minimal .deb: an ar archive whose data.tar.xz holds `members`."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo("./" + name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    out = b"!<arch>\n"
    for name, body in (("debian-binary", b"2.0\n"), ("control.tar.xz", lzma.compress(b"")),
                       ("data.tar.xz", lzma.compress(buf.getvalue()))):
        header = f"{name:<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(body):<10}`\n".encode()
        out += header + body + (b"\n" if len(body) % 2 else b"")
    return out


def test_deb_reader_returns_only_the_html_pages(tmp_path):
    root = corpus.HTML_ROOT
    deb = tmp_path / "doc.deb"
    deb.write_bytes(_deb({root + "library/os.html": b"<p>os</p>", root + "tutorial/index.html": b"<p>tut</p>",
                          root + "_static/basic.css": b"css", "usr/share/doc/other/x.html": b"<p>no</p>"}))
    assert corpus.read_html_pages(deb) == {"library/os.html": "<p>os</p>", "tutorial/index.html": "<p>tut</p>"}


def test_index_pages_are_skipped_and_the_split_depends_on_the_path_only():
    html = {"genindex-A.html": _PAGE, "search.html": _PAGE, "library/os.html": _PAGE, "faq/general.html": _PAGE}
    assert [p.path for p in corpus.build_pages(html)] == ["faq/general.html", "library/os.html"]
    paths = [f"library/mod{i}.html" for i in range(4000)]
    held = [p for p in paths if corpus.is_heldout(p)]
    assert 100 <= len(held) <= 220  # 1 in 25 of 4000 is 160; ±4.6 standard deviations
    pages = [corpus.Page(p, (corpus.Paragraph("p", "x"),)) for p in paths]
    train, heldout = corpus.split_pages(pages[::-1])
    assert {p.path for p in heldout} == set(held) and not {p.path for p in train} & set(held)


def test_chat_pairs_come_from_headings_and_signatures_with_text():
    page = corpus.Page("library/x.html", corpus.page_paragraphs(_PAGE))
    pairs = corpus.chat_pairs(page)
    assert len(pairs) == 2
    (q1, a1), (q2, a2) = pairs
    assert "Built-in Types" in q1 and "3.1" not in q1
    assert a1 == "The following sections describe the standard types."
    assert "len(s)" in q2
    assert a2.startswith("Return the length") and a2.endswith("Second item")
    short = corpus.Page("p.html", (corpus.Paragraph("h", "Title"), corpus.Paragraph("p", "Too short.")))
    assert corpus.chat_pairs(short) == []
