"""Image sources under the media policy (server/media_fetch.py), against a real aiohttp HTTP
server this test starts on loopback: fetches, the byte cap, the deadline, redirects (every hop's
address checked), allowed domains, data URLs and local files under --allowed-local-media-path."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import socket

import pytest
from aiohttp import web
from PIL import Image

from server.media_fetch import MediaError, MediaFetcher, MediaPolicy, decode_data_url, public_address


def _png(w: int = 20, h: int = 12) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (w, h), (10, 200, 30)).save(out, "PNG")
    return out.getvalue()


PNG = _png()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ImageServer:
    """Routes: /img.png, /big (chunked, no length), /big-declared, /slow, /missing (404),
    /to/<path> (302 to the path on this server), /out?to=URL (302 anywhere), /loop (302 to itself)."""

    def __init__(self):
        self.port = _port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.hits: list[str] = []

    async def __aenter__(self) -> "ImageServer":
        async def image(request):
            return web.Response(body=PNG, content_type="image/png")

        async def big(request):
            resp = web.StreamResponse()
            await resp.prepare(request)
            for _ in range(64):
                await resp.write(b"\0" * 65536)
            await resp.write_eof()
            return resp

        async def big_declared(request):
            return web.Response(body=b"\0" * (1 << 20), content_type="image/png")

        async def slow(request):  # well past the 0.3 s timeout of test_a_slow_server_times_out
            await asyncio.sleep(1)
            return web.Response(body=PNG)

        async def to(request):
            raise web.HTTPFound("/" + request.match_info["path"])

        async def out(request):
            raise web.HTTPFound(request.query["to"])

        async def loop(request):
            raise web.HTTPFound("/loop")

        @web.middleware
        async def record(request, handler):
            self.hits.append(request.path)
            return await handler(request)

        app = web.Application(middlewares=[record])
        app.add_routes([web.get("/img.png", image), web.get("/big", big), web.get("/big-declared", big_declared),
                        web.get("/slow", slow), web.get("/to/{path:.*}", to), web.get("/out", out),
                        web.get("/loop", loop)])
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.runner.cleanup()


def _run(policy: MediaPolicy, fn):
    async def main():
        fetcher = MediaFetcher(policy)
        try:
            async with ImageServer() as srv:
                return await fn(fetcher, srv)
        finally:
            await fetcher.close()

    return asyncio.run(main())


def _refusal(policy: MediaPolicy, url_of) -> MediaError:
    async def go(fetcher, srv):
        with pytest.raises(MediaError) as info:
            await fetcher.load(url_of(srv))
        return info.value, srv.hits

    return _run(policy, go)


LOOPBACK_OK = MediaPolicy(allowed_domains=frozenset({"127.0.0.1"}), max_bytes=256 << 10, timeout_s=1.0)


def test_fetches_an_image_from_an_allowed_host():
    async def go(fetcher, srv):
        return await fetcher.load(srv.base + "/img.png")

    assert _run(LOOPBACK_OK, go) == PNG


def test_follows_redirects_within_the_allowed_hosts():
    async def go(fetcher, srv):
        return await fetcher.load(srv.base + "/to/img.png"), srv.hits

    data, hits = _run(LOOPBACK_OK, go)
    assert data == PNG and hits == ["/to/img.png", "/img.png"]


def test_loopback_is_refused_unless_the_operator_lists_it():
    err, hits = _refusal(MediaPolicy(timeout_s=1.0), lambda s: s.base + "/img.png")
    assert err.code == "media_address_not_allowed" and "non-public address" in str(err)
    assert hits == []  # refused before connecting


def test_a_name_resolving_to_loopback_is_refused_by_the_resolver():
    err, hits = _refusal(MediaPolicy(timeout_s=2.0), lambda s: f"http://localhost:{s.port}/img.png")
    assert err.code == "media_address_not_allowed" and hits == []


@pytest.mark.parametrize("target", ["http://169.254.169.254/latest/meta-data/", "http://10.0.0.1/x.png",
                                    "http://[::1]:{port}/img.png", "http://localhost:{port}/img.png",
                                    "http://[::ffff:127.0.0.1]:{port}/img.png"])
def test_a_redirect_to_a_private_address_is_refused(target):
    def url(s):
        return s.base + "/out?to=" + target.format(port=s.port)

    err, hits = _refusal(LOOPBACK_OK, url)
    assert err.code in ("media_address_not_allowed", "media_domain_not_allowed"), err
    assert hits == ["/out"]  # the first hop only: nothing was fetched from the target


def test_a_redirect_to_a_private_address_is_refused_without_an_allow_list():
    """Every hop is checked: a public first hop cannot hand the fetch to a private one (the first
    hop here is loopback only because the test has no public server; the check is per hop)."""
    policy = MediaPolicy(timeout_s=1.0)
    fetcher = MediaFetcher(policy)
    with pytest.raises(MediaError) as info:
        fetcher._check_host("http://169.254.169.254/latest")
    assert info.value.code == "media_address_not_allowed"
    assert fetcher._check_host("http://93.184.216.34/x.png") == "93.184.216.34"


def test_hosts_outside_the_allowed_domains_are_refused():
    policy = MediaPolicy(allowed_domains=frozenset({"images.example.com"}), timeout_s=1.0)
    err, hits = _refusal(policy, lambda s: f"http://localhost:{s.port}/img.png")
    assert err.code == "media_domain_not_allowed" and hits == []
    err, hits = _refusal(policy, lambda s: s.base + "/img.png")  # an unlisted private literal: named as such
    assert err.code == "media_address_not_allowed" and hits == []


def test_redirect_limits():
    err, _ = _refusal(LOOPBACK_OK, lambda s: s.base + "/loop")
    assert err.code == "too_many_redirects"
    no_redirects = MediaPolicy(allowed_domains=frozenset({"127.0.0.1"}), timeout_s=1.0, max_redirects=0)
    err, hits = _refusal(no_redirects, lambda s: s.base + "/to/img.png")
    assert err.code == "too_many_redirects" and hits == ["/to/img.png"]


def test_the_download_is_capped_with_and_without_a_declared_length():
    for path in ("/big", "/big-declared"):
        err, _ = _refusal(LOOPBACK_OK, lambda s: s.base + path)
        assert err.code == "image_too_large", path
        assert str(256 << 10) in str(err)


def test_a_slow_server_times_out():
    policy = MediaPolicy(allowed_domains=frozenset({"127.0.0.1"}), timeout_s=0.3)
    err, _ = _refusal(policy, lambda s: s.base + "/slow")
    assert err.code == "image_fetch_timeout" and "0.3 s" in str(err)


def test_http_errors_and_other_schemes():
    err, _ = _refusal(LOOPBACK_OK, lambda s: s.base + "/missing")
    assert err.code == "image_fetch_failed" and "HTTP 404" in str(err)
    for url in ("ftp://example.com/a.png", "gopher://x", "no-scheme"):
        err, _ = _refusal(LOOPBACK_OK, lambda s: url)
        assert err.code == "invalid_image_url", url


def test_public_address_classes():
    for addr in ("127.0.0.1", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254", "100.64.0.1", "0.0.0.0",
                 "::1", "fe80::1", "fc00::1", "::ffff:10.0.0.1", "224.0.0.1", "255.255.255.255"):
        assert not public_address(addr), addr
    for addr in ("93.184.216.34", "8.8.8.8", "2606:4700::1111"):
        assert public_address(addr), addr


# ---- data: URLs ------------------------------------------------------------------------------------------


def test_data_urls():
    url = "data:image/png;base64," + base64.b64encode(PNG).decode()
    assert decode_data_url(url, 1 << 20) == PNG
    wrapped = "data:image/png;base64," + "\n".join(base64.b64encode(PNG).decode()[i:i + 76]
                                                   for i in range(0, 400, 76))
    assert decode_data_url(wrapped, 1 << 20) == base64.b64decode(base64.b64encode(PNG)[:400])
    cases = {"data:image/png;base64,@@@notbase64": ("invalid_image_data", "malformed"),
             "data:image/png;base64,QUI": ("invalid_image_data", "malformed"),
             "data:text/plain;base64,QUJD": ("invalid_image_data", "not an image"),
             "data:image/png,rawbytes": ("invalid_image_data", "base64"),
             "data:image/png;base64": ("invalid_image_data", "','"),
             "data:image/png;base64," + base64.b64encode(b"\0" * 5000).decode(): ("image_too_large", "4096")}
    for url, (code, words) in cases.items():
        with pytest.raises(MediaError) as info:
            decode_data_url(url, 4096)
        assert info.value.code == code and words in str(info.value), url


# ---- file:// URLs ----------------------------------------------------------------------------------------


def test_local_files_only_under_the_allowed_path(tmp_path):
    root = tmp_path / "media"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "a.png").write_bytes(PNG)
    (tmp_path / "secret.png").write_bytes(PNG)
    os.symlink(tmp_path / "secret.png", root / "escape.png")
    os.symlink(root / "sub" / "a.png", root / "inside.png")
    policy = MediaPolicy.from_flags(str(root), None)

    async def load(p: MediaPolicy, url: str):
        fetcher = MediaFetcher(p)
        try:
            return await fetcher.load(url)
        finally:
            await fetcher.close()

    assert asyncio.run(load(policy, f"file://{root}/sub/a.png")) == PNG
    assert asyncio.run(load(policy, f"file://{root}/inside.png")) == PNG  # a symlink that stays inside
    refusals = {f"file://{tmp_path}/secret.png": "local_media_not_allowed",
                f"file://{root}/../secret.png": "local_media_not_allowed",
                f"file://{root}/escape.png": "local_media_not_allowed",  # a symlink out of the directory
                f"file://{root}/nope.png": "local_media_not_found",
                f"file://{root}/sub": "local_media_not_found",
                f"file://otherhost{root}/sub/a.png": "invalid_image_url"}
    for url, code in refusals.items():
        with pytest.raises(MediaError) as info:
            asyncio.run(load(policy, url))
        assert info.value.code == code, url
    with pytest.raises(MediaError) as info:  # no --allowed-local-media-path: no local files at all
        asyncio.run(load(MediaPolicy(), f"file://{root}/sub/a.png"))
    assert info.value.code == "local_media_not_allowed" and "--allowed-local-media-path" in str(info.value)
    with pytest.raises(MediaError) as info:
        asyncio.run(load(MediaPolicy.from_flags(str(root), None, max_bytes=10), f"file://{root}/sub/a.png"))
    assert info.value.code == "image_too_large"


def test_policy_flags_are_checked(tmp_path):
    with pytest.raises(ValueError, match="--allowed-local-media-path"):
        MediaPolicy.from_flags(str(tmp_path / "missing"), None)
    with pytest.raises(ValueError, match="--media-fetch-timeout"):
        MediaPolicy.from_flags(None, None, timeout_s=0)
    assert MediaPolicy.from_flags(None, ["Images.Example.com", "[::1]"]).allowed_domains == {"images.example.com",
                                                                                            "::1"}
