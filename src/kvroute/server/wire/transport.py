"""The transport seam: every call from the router to a backend goes through :class:`Transport`.

The proxy logic (routing, retries, counters, streaming, error events) only sees this small interface,
so unit tests drive it with an in-memory transport; :class:`AiohttpTransport` is the real one.

Errors: :class:`UpstreamConnectError` means no response was received (connection refused or reset,
connect timeout) — the request may be retried elsewhere; its subclass :class:`UpstreamTimeoutError`
means the request was written and no response head came within the timeout: the engine has the
request and is slow with it (a long non-streamed generation), which is the request's doing, not a
failing backend. :class:`UpstreamBrokenError` means the response broke off after its headers — bytes
may already have reached the client; its subclass :class:`UpstreamStalledError` means no body byte
came within the read timeout (the connection is still up).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import Protocol

import aiohttp

__all__ = [
    "AiohttpTransport",
    "Transport",
    "UpstreamBrokenError",
    "UpstreamConnectError",
    "UpstreamError",
    "UpstreamResponse",
    "UpstreamStalledError",
    "UpstreamTimeoutError",
    "UpstreamTooLargeError",
    "read_capped",
]


class UpstreamError(Exception):
    """A backend call failed."""


class UpstreamConnectError(UpstreamError):
    """No response: connection refused/reset or timed out before the status line."""


class UpstreamTimeoutError(UpstreamConnectError):
    """The request was written but no response head came within the timeout: the backend has the
    request (it is not unreachable). The caller closes nothing more: the transport has already
    dropped the connection, which a vLLM-style engine takes as a cancelled request."""


class UpstreamBrokenError(UpstreamError):
    """The response body broke off (connection lost, timeout) after the headers."""


class UpstreamStalledError(UpstreamBrokenError):
    """No body byte came within the read timeout; the connection was up all along."""


class UpstreamTooLargeError(UpstreamBrokenError):
    """A response the router reads whole is larger than its limit (``max_response_bytes``): it is
    not read further, and its connection must be aborted, never reused."""


class UpstreamResponse(Protocol):
    """A response whose body is read at most once, by ``read`` or ``iter_chunks``.

    Exactly one of ``release`` (body fully read, keep the connection) or ``abort`` (drop the
    connection, which makes a vLLM-style engine cancel the request) must end its use; both are
    idempotent. ``ended``: the body is known to be complete with nothing left unread, so the chunk
    ``iter_chunks`` yielded last is the final one (False when not known yet; the relay then sends
    that chunk together with the end of its own stream, one write instead of two).
    """

    status: int
    content_type: str

    @property
    def ended(self) -> bool: ...

    async def read(self) -> bytes: ...

    def iter_chunks(self) -> AsyncIterator[bytes]: ...

    def release(self) -> None: ...

    def abort(self) -> None: ...


async def read_capped(chunks: AsyncIterator[bytes], limit: int | None, first: bytes = b"") -> bytes:
    """``first`` and the rest of a body from ``chunks`` (an :meth:`UpstreamResponse.iter_chunks`),
    joined; :class:`UpstreamTooLargeError` as soon as they are over ``limit`` bytes (None: no
    limit; the caller aborts the response), so an engine cannot make the router hold an unbounded
    answer in memory."""
    parts = [first]
    size = len(first)
    if limit is not None and size > limit:
        raise UpstreamTooLargeError(f"answer is larger than {limit} bytes")
    async for chunk in chunks:
        size += len(chunk)
        if limit is not None and size > limit:
            raise UpstreamTooLargeError(f"answer is larger than {limit} bytes")
        parts.append(chunk)
    return b"".join(parts)


class Transport(Protocol):
    """Sends one HTTP request to ``base_url + path``; raises :class:`UpstreamConnectError` when no
    response arrives within ``timeout_s`` (connect plus headers)."""

    async def send(
        self,
        base_url: str,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> UpstreamResponse: ...

    async def close(self) -> None: ...


class _AiohttpResponse:
    __slots__ = ("_resp", "content_type", "status")

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp
        self.status = resp.status
        self.content_type = resp.headers.get("Content-Type", "application/json")

    @property
    def ended(self) -> bool:
        return self._resp.content.at_eof()

    async def read(self) -> bytes:
        try:
            return await self._resp.read()
        except aiohttp.SocketTimeoutError as exc:
            raise UpstreamStalledError(f"response stalled: {exc!r}") from None
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise UpstreamBrokenError(f"response broke off: {exc!r}") from None

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        content = self._resp.content
        try:
            while True:
                chunk = await content.readany()
                if not chunk:
                    break
                yield chunk
        except aiohttp.SocketTimeoutError as exc:
            raise UpstreamStalledError(f"stream stalled: {exc!r}") from None
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise UpstreamBrokenError(f"stream broke off: {exc!r}") from None

    def release(self) -> None:
        self._resp.release()

    def abort(self) -> None:
        self._resp.close()


class AiohttpTransport:
    """The real transport: one pooled ``aiohttp.ClientSession`` (created lazily inside the loop)."""

    def __init__(self, connect_timeout_s: float = 2.0, read_timeout_s: float = 600.0, limit: int = 0) -> None:
        self._connect_timeout_s = connect_timeout_s
        self._read_timeout_s = read_timeout_s
        self._limit = limit
        self._session: aiohttp.ClientSession | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self._limit, limit_per_host=0, ttl_dns_cache=300)
            timeout = aiohttp.ClientTimeout(
                total=None, sock_connect=self._connect_timeout_s, sock_read=self._read_timeout_s
            )
            self._session = aiohttp.ClientSession(
                connector=connector, timeout=timeout, auto_decompress=False, skip_auto_headers=("User-Agent",)
            )
        return self._session

    async def send(
        self,
        base_url: str,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> UpstreamResponse:
        session = self._get_session()
        try:
            if timeout_s is not None:
                async with asyncio.timeout(timeout_s):
                    resp = await session.request(method, base_url + path, data=body, headers=headers)
            else:
                resp = await session.request(method, base_url + path, data=body, headers=headers)
        except aiohttp.SocketTimeoutError as exc:  # connected and sent; no head within sock_read
            raise UpstreamTimeoutError(f"{base_url}: no response in time: {exc!r}") from None
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise UpstreamConnectError(f"{base_url}: {exc!r}") from None
        return _AiohttpResponse(resp)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
