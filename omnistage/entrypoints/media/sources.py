"""Where a media part's bytes come from: a base64 payload or ``data:`` URL, a ``file://`` URL
under ``--allowed-local-media-path``, an ``http(s)://`` URL on a host of
``--allowed-media-domains``. Each is bounded by ``--max-media-bytes`` as early as the bytes
allow (a payload's length, a file's size, a download while it streams); a download also by
``--media-fetch-timeout-s``. Every refusal is an ``InvalidRequestError`` naming the field.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urljoin, urlsplit

from omnistage.entrypoints.media.policy import MediaPolicy, too_many_bytes
from omnistage.errors import InvalidRequestError
from omnistage.models.media import Modality

if TYPE_CHECKING:
    import ssl

# Redirects followed for one http(s) URL (each to an allowed host).
MAX_REDIRECTS = 5


def base64_size(data: str) -> int:
    """The decoded size of a base64 string, from its length (whitespace and padding aside)."""
    chars = len(data) - sum(data.count(c) for c in " \t\r\n")
    return chars * 3 // 4 - min(data.rstrip().count("=", -2), 2)


def base64_bytes(data: str, where: str) -> bytes:
    """Standard or URL-safe base64, line breaks allowed, padding optional."""
    text = "".join(data.split()) if any(c in data for c in " \t\r\n") else data
    text = text.rstrip("=")
    text += "=" * (-len(text) % 4)
    try:
        if "-" in text or "_" in text:
            return base64.urlsafe_b64decode(text.encode("ascii"))
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError(where, "is not valid base64") from None


def data_url_payload(url: str, where: str, modality: Modality) -> str:
    """The base64 payload of ``data:<modality>/<subtype>;base64,...`` (mime type checked)."""
    header, sep, payload = url.partition(",")
    if not sep:
        raise InvalidRequestError(where, "is not a data URL (data:<mime type>;base64,<data>)")
    params = header[len("data:") :].split(";")
    mime = params[0].strip().lower()
    if "base64" not in (p.strip().lower() for p in params[1:]):
        raise InvalidRequestError(where, "only base64 data URLs are accepted (data:...;base64,...)")
    if mime.split("/", 1)[0] != modality:
        raise InvalidRequestError(
            where, f"mime type {mime or '(none)'!r} is not {modality}/*, as a {modality} needs"
        )
    return payload


def read_file(url: str, where: str, policy: MediaPolicy) -> bytes:
    """A ``file://`` URL's bytes, when it resolves (symlinks, ``..``) to a regular file under
    ``allowed_local_media_path``; what lies outside is refused without saying whether it
    exists."""
    root = policy.allowed_local_media_path
    if root is None:
        raise InvalidRequestError(
            where,
            "file:// URLs are not allowed on this server (start it with "
            "--allowed-local-media-path DIR to allow the files under DIR)",
        )
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise InvalidRequestError(where, f"file:// URL names a remote host {parts.netloc!r}")
    path = unquote(parts.path)
    if not path.startswith("/") or "\x00" in path:
        raise InvalidRequestError(where, "file:// URL must hold an absolute path")
    resolved = Path(path).resolve()
    if not resolved.is_relative_to(root.resolve()):
        raise InvalidRequestError(
            where, "the file is outside the folder allowed by --allowed-local-media-path"
        )
    try:
        # Non-blocking, so that a FIFO is refused instead of waiting for a writer.
        fd = os.open(resolved, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise InvalidRequestError(where, "does not name a regular file")
            if info.st_size > policy.max_media_bytes:
                raise too_many_bytes(where, info.st_size, policy)
            raw = f.read(policy.max_media_bytes + 1)
    except OSError as exc:
        raise InvalidRequestError(where, f"cannot read the file: {exc.strerror}") from None
    if len(raw) > policy.max_media_bytes:  # it grew since fstat
        raise too_many_bytes(where, len(raw), policy)
    return raw


def _check_host(url: str, where: str, policy: MediaPolicy, what: str = "URL") -> None:
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise InvalidRequestError(where, f"{what} is not a valid URL: {exc}") from None
    if parts.scheme.lower() not in ("http", "https"):
        raise InvalidRequestError(where, f"{what} is not an http(s) URL")
    host = (parts.hostname or "").lower().removesuffix(".")
    if host not in policy.allowed_media_domains:
        raise InvalidRequestError(
            where,
            f"{what} host {host!r} is not allowed; the server fetches media only from the "
            "hosts of --allowed-media-domains"
            + ("" if policy.allowed_media_domains else " (none given)"),
        )


@functools.lru_cache(maxsize=1)
def _ssl_context() -> ssl.SSLContext:
    """One TLS context for every fetch (building one loads the CA bundle: milliseconds)."""
    import httpx

    return httpx.create_ssl_context()


async def fetch(url: str, where: str, policy: MediaPolicy) -> bytes:
    """An allowed http(s) URL's body: redirects followed only to allowed hosts, the byte limit
    enforced while it streams, the whole fetch bounded by ``media_fetch_timeout_s``."""
    import httpx

    _check_host(url, where, policy)
    limit, timeout = policy.max_media_bytes, policy.media_fetch_timeout_s

    async def get() -> bytes:
        async with httpx.AsyncClient(
            follow_redirects=False, timeout=timeout, verify=_ssl_context()
        ) as client:
            current = url
            for _ in range(MAX_REDIRECTS + 1):
                async with client.stream("GET", current) as resp:
                    if resp.is_redirect:
                        current = urljoin(current, resp.headers["location"])
                        _check_host(current, where, policy, what="redirect target")
                        continue
                    if resp.status_code >= 300:
                        raise InvalidRequestError(
                            where, f"fetching it failed: HTTP {resp.status_code}"
                        )
                    declared = resp.headers.get("content-length", "")
                    if declared.isdigit() and int(declared) > limit:
                        raise too_many_bytes(where, int(declared), policy)
                    body = bytearray()
                    async for chunk in resp.aiter_bytes():
                        body += chunk
                        if len(body) > limit:
                            raise too_many_bytes(where, len(body), policy)
                    return bytes(body)
            raise InvalidRequestError(where, f"more than {MAX_REDIRECTS} redirects")

    try:
        return await asyncio.wait_for(get(), timeout)
    except asyncio.TimeoutError:
        raise InvalidRequestError(
            where, f"fetching it took longer than {timeout:g} s (--media-fetch-timeout-s)"
        ) from None
    except (httpx.HTTPError, httpx.InvalidURL, httpx.StreamError) as exc:
        raise InvalidRequestError(
            where, f"fetching it failed: {type(exc).__name__}: {exc}".rstrip(": ")
        ) from None
