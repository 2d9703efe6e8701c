"""Where a request's images come from: the bytes behind an image URL, under the operator's policy.

Three kinds of URL, as vLLM takes them:
  * `data:image/...;base64,...` — decoded here (strict base64; the media type must be an image);
  * `file://` paths — only with `--allowed-local-media-path DIR`, and only files whose real path
    (symlinks resolved) lies under that directory's real path;
  * `http(s)://` — fetched with aiohttp under a byte cap and one deadline for the whole fetch,
    redirects followed by hand (at most `max_redirects`), every hop checked.

Addresses. A URL host must resolve to public (global unicast) addresses only: loopback, private,
link-local (cloud metadata services), shared, multicast and reserved addresses are refused on
every hop, for IP literals before connecting and for names inside the resolver the connection
uses, so the address checked is the address connected to (no DNS-rebinding window). Hosts the
operator lists in `--allowed-media-domains` are the only ones taken when the list is given, and
they may resolve anywhere (that is how an intranet image server, or a test's loopback server, is
allowed). Proxy environment variables are ignored.

Every refusal is a `MediaError` whose message names the URL's problem (never the fetched body).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import ipaddress
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult

DEFAULT_MAX_BYTES = 20 << 20  # one downloaded or local image file
DEFAULT_TIMEOUT_S = 5.0  # vLLM's VLLM_IMAGE_FETCH_TIMEOUT
DEFAULT_MAX_REDIRECTS = 3
REDIRECTS = (301, 302, 303, 307, 308)
_URL_IN_MESSAGES = 120  # characters of a URL quoted in an error


class MediaError(ValueError):
    """An image source that cannot be used; `code` is the error body's code."""

    def __init__(self, message: str, code: str = "invalid_image_url"):
        super().__init__(message)
        self.code = code


def shown(url: str) -> str:
    """A URL as error messages quote it (data URLs by their head only)."""
    if url.startswith("data:"):
        return url[: url.find(",") + 1 if "," in url[:100] else 30] + "..."
    return url if len(url) <= _URL_IN_MESSAGES else url[:_URL_IN_MESSAGES] + "..."


@dataclass(frozen=True)
class MediaPolicy:
    allowed_local_media_path: Path | None = None  # resolved; None: no file:// URLs
    allowed_domains: frozenset[str] | None = None  # lower-case host names / IP literals; None: any public host
    max_bytes: int = DEFAULT_MAX_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S
    max_redirects: int = DEFAULT_MAX_REDIRECTS

    @classmethod
    def from_flags(cls, local_path: str | None, domains: list[str] | None, max_bytes: int = DEFAULT_MAX_BYTES,
                   timeout_s: float = DEFAULT_TIMEOUT_S, max_redirects: int = DEFAULT_MAX_REDIRECTS) -> "MediaPolicy":
        """ValueError naming the flag for a bad value."""
        root = None
        if local_path:
            root = Path(local_path).resolve()
            if not root.is_dir():
                raise ValueError(f"--allowed-local-media-path {local_path}: not an existing directory")
        if max_bytes < 1:
            raise ValueError("--media-max-bytes must be ≥ 1")
        if not 0 < timeout_s <= 3600:
            raise ValueError("--media-fetch-timeout must be in (0, 3600] seconds")
        if max_redirects < 0:
            raise ValueError("--media-max-redirects must be ≥ 0")
        allowed = frozenset(d.strip().lower().strip("[]") for d in domains if d.strip()) if domains else None
        return cls(root, allowed, max_bytes, timeout_s, max_redirects)


def public_address(address: str) -> bool:
    """Whether an IP address is one a media URL may reach without the operator listing its host:
    global unicast only (an IPv4-mapped IPv6 address is judged as the IPv4 address it carries)."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


def _is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


# ---- data: and file:// ---------------------------------------------------------------------------------


def decode_data_url(url: str, max_bytes: int) -> bytes:
    head, comma, payload = url.partition(",")
    if not comma:
        raise MediaError("a data URL needs a ',' before its data", "invalid_image_data")
    params = head[len("data:"):].split(";")
    media_type = params[0].strip().lower()
    if "base64" not in (p.strip().lower() for p in params[1:]):
        raise MediaError("an image data URL must be base64-encoded (data:image/png;base64,...)", "invalid_image_data")
    if media_type and not media_type.startswith("image/"):
        raise MediaError(f"the data URL's media type {media_type!r} is not an image", "invalid_image_data")
    if len(payload) > 4 * (max_bytes // 3 + 1) + 1024:  # before decoding anything
        raise MediaError(f"the data URL's image is larger than {max_bytes} bytes", "image_too_large")
    try:
        data = base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("the data URL's base64 data is malformed", "invalid_image_data") from None
    if len(data) > max_bytes:
        raise MediaError(f"the data URL's image is {len(data)} bytes, more than the {max_bytes} allowed",
                         "image_too_large")
    return data


def read_local_file(url: str, policy: MediaPolicy) -> bytes:
    """A file:// URL's bytes, if its real path lies under the allowed directory (blocking I/O)."""
    root = policy.allowed_local_media_path
    if root is None:
        raise MediaError("local files cannot be read: the server was not started with --allowed-local-media-path",
                         "local_media_not_allowed")
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise MediaError(f"file URL {shown(url)} names a host; only local paths are read", "invalid_image_url")
    path = Path(unquote(parts.path))
    try:
        real = path.resolve(strict=True)
    except (OSError, RuntimeError):  # missing, or a symlink loop
        raise MediaError(f"no such file under the allowed local media path: {shown(url)}",
                         "local_media_not_found") from None
    if not real.is_relative_to(root):
        raise MediaError(f"file URL {shown(url)} is outside the allowed local media path", "local_media_not_allowed")
    if not real.is_file():
        raise MediaError(f"file URL {shown(url)} is not a regular file", "local_media_not_found")
    with open(real, "rb") as f:
        data = f.read(policy.max_bytes + 1)
    if len(data) > policy.max_bytes:
        raise MediaError(f"the file {shown(url)} is larger than {policy.max_bytes} bytes", "image_too_large")
    return data


# ---- http(s) -------------------------------------------------------------------------------------------


class _RefusedAddress(OSError):
    """Raised inside the resolver for a host that resolves to a non-public address."""


class _GuardedResolver(AbstractResolver):
    """The connector's resolver: refuses names that resolve to any non-public address, unless
    the operator listed the host."""

    def __init__(self, allowed: frozenset[str] | None):
        self._inner = aiohttp.ThreadedResolver()
        self._allowed = allowed or frozenset()

    async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
                      ) -> list[ResolveResult]:
        results = await self._inner.resolve(host, port, family)
        if host.lower() not in self._allowed:
            refused = [r["host"] for r in results if not public_address(r["host"])]
            if refused:
                raise _RefusedAddress(f"{host} resolves to a non-public address ({refused[0]})")
        return results

    async def close(self) -> None:
        await self._inner.close()


class MediaFetcher:
    """Loads image URLs under a policy. One aiohttp session per event loop, made on first use."""

    def __init__(self, policy: MediaPolicy):
        self.policy = policy
        self._session: aiohttp.ClientSession | None = None

    async def load(self, url: str) -> bytes:
        """The bytes behind an image URL (MediaError naming the problem)."""
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            return decode_data_url(url, self.policy.max_bytes)
        if scheme == "file":
            from . import offload

            return await offload.run(read_local_file, url, self.policy)
        if scheme in ("http", "https"):
            try:
                async with asyncio.timeout(self.policy.timeout_s):
                    return await self._fetch(url)
            except TimeoutError:
                raise MediaError(f"fetching {shown(url)} took longer than {self.policy.timeout_s:g} s",
                                 "image_fetch_timeout") from None
        raise MediaError(f"unsupported image URL {shown(url)}: use a data:, http(s):// or file:// URL",
                         "invalid_image_url")

    def _check_host(self, url: str) -> str:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise MediaError(f"{shown(url)} is not an http(s) URL with a host", "invalid_image_url")
        host = parts.hostname.lower()
        allowed = self.policy.allowed_domains
        listed = allowed is not None and host in allowed
        if not listed and _is_ip_literal(host) and not public_address(host):
            raise MediaError(f"{shown(url)} points to a non-public address", "media_address_not_allowed")
        if allowed is not None and not listed:
            raise MediaError(f"the host of {shown(url)} is not among --allowed-media-domains",
                             "media_domain_not_allowed")
        return host

    async def _fetch(self, url: str) -> bytes:
        session = self._client()
        for _hop in range(self.policy.max_redirects + 1):
            self._check_host(url)
            try:
                async with session.get(url, allow_redirects=False) as resp:
                    if resp.status in REDIRECTS:
                        target = resp.headers.get("Location")
                        if not target:
                            raise MediaError(f"{shown(url)} redirected without a Location", "image_fetch_failed")
                        url = urljoin(url, target)
                        continue
                    if resp.status != 200:
                        raise MediaError(f"fetching {shown(url)} failed: HTTP {resp.status}", "image_fetch_failed")
                    return await self._read_capped(resp, url)
            except aiohttp.ClientConnectorError as exc:
                if isinstance(exc.os_error, _RefusedAddress):
                    raise MediaError(f"{shown(url)} points to a non-public address", "media_address_not_allowed") \
                        from None
                raise MediaError(f"cannot connect to fetch {shown(url)}", "image_fetch_failed") from None
            except aiohttp.InvalidURL:
                raise MediaError(f"{shown(url)} is not a valid URL", "invalid_image_url") from None
            except aiohttp.ClientError as exc:
                raise MediaError(f"fetching {shown(url)} failed ({type(exc).__name__})", "image_fetch_failed") \
                    from None
        raise MediaError(f"the image URL redirected more than {self.policy.max_redirects} time(s)",
                         "too_many_redirects")

    async def _read_capped(self, resp: aiohttp.ClientResponse, url: str) -> bytes:
        cap = self.policy.max_bytes
        if resp.content_length is not None and resp.content_length > cap:
            raise MediaError(f"the image at {shown(url)} is {resp.content_length} bytes, more than the {cap} allowed",
                             "image_too_large")
        chunks, size = [], 0
        async for chunk in resp.content.iter_chunked(64 << 10):
            size += len(chunk)
            if size > cap:
                raise MediaError(f"the image at {shown(url)} is larger than the {cap} bytes allowed", "image_too_large")
            chunks.append(chunk)
        return b"".join(chunks)

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(resolver=_GuardedResolver(self.policy.allowed_domains),
                                             use_dns_cache=False, limit=32)
            self._session = aiohttp.ClientSession(connector=connector, trust_env=False,
                                                  headers={"User-Agent": "ringserve", "Accept-Encoding": "identity"},
                                                  auto_decompress=False)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
