"""A raw-socket HTTP/1.1 client side: requests written as exact bytes, responses read with llhttp
(``httptools``) and every wait bounded.

:class:`ResponseReader` reads responses off one connection in order: interim 1xx responses are
collected into the next final one; a ``101`` ends the connection's HTTP; a body without length
ends at close. A wait longer than its bound raises :class:`Hung`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import httptools
import orjson

__all__ = ["Hung", "RawResponse", "ResponseReader", "completion_body", "connect", "request_bytes"]


class Hung(Exception):
    """No (complete) response within the bound."""


@dataclass(frozen=True, slots=True)
class RawResponse:
    """One final response: ``status``; ``headers`` as (lowercased name, value) pairs, latin-1;
    ``body`` de-chunked; ``interim``: the 1xx statuses before it; ``complete``: its framing ended
    properly (False: the connection closed inside it); ``malformed``: the parser's complaint about
    the bytes after the last good point ('' when none)."""

    status: int
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""
    interim: tuple[int, ...] = ()
    complete: bool = True
    malformed: str = ""

    def header(self, name: str) -> str | None:
        """The first value of ``name`` (lowercase), None when absent."""
        for k, v in self.headers:
            if k == name:
                return v
        return None


@dataclass
class _Partial:
    status: int = 0
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: list[bytes] = field(default_factory=list)
    delimited: bool = False


class ResponseReader:
    """Responses of one connection (module docstring). ``bodyless``: how many of the next
    responses answer a HEAD (not used by the suite: always 0)."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self.reader = reader
        self.parser = httptools.HttpResponseParser(self)
        self.done: list[RawResponse] = []
        self.interim: list[int] = []
        self.cur: _Partial | None = None
        self.eof = False
        self.broken = ""  # why the parser gave up
        self.raw = bytearray()  # every byte received

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.cur = _Partial()

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.cur is not None
        low = name.decode("latin-1").lower()
        self.cur.headers.append((low, value.decode("latin-1")))
        if low == "content-length" or (
            low == "transfer-encoding" and "chunked" in value.decode("latin-1").lower()
        ):
            self.cur.delimited = True

    def on_headers_complete(self) -> None:
        assert self.cur is not None
        self.cur.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        assert self.cur is not None
        self.cur.body.append(body)

    def on_message_complete(self) -> None:
        cur = self.cur
        assert cur is not None
        self.cur = None
        if 100 <= cur.status < 200 and cur.status != 101:
            self.interim.append(cur.status)
            return
        self._finish(cur, complete=True)

    def _finish(self, cur: _Partial, complete: bool, malformed: str = "") -> None:
        self.done.append(
            RawResponse(
                cur.status, tuple(cur.headers), b"".join(cur.body), tuple(self.interim), complete, malformed
            )
        )
        self.interim = []

    def _feed(self, data: bytes) -> None:
        self.raw += data
        if self.broken:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            cur = self.cur
            if cur is not None:  # 101: what follows is not HTTP
                self.cur = None
                self._finish(cur, complete=True)
            self.broken = "upgraded"
        except httptools.HttpParserError as exc:
            self.broken = f"malformed response bytes: {exc}"
            cur = self.cur or _Partial()
            self.cur = None
            self._finish(cur, complete=False, malformed=self.broken)

    def _at_eof(self) -> None:
        self.eof = True
        cur = self.cur
        if cur is not None and cur.status:
            self.cur = None
            # a body with no length ends at close; one with a length or chunking broke off
            self._finish(cur, complete=not cur.delimited)

    async def next(self, timeout_s: float) -> RawResponse | None:
        """The next final response; None when the connection closed (or upgraded) before one
        began; raises :class:`Hung` after ``timeout_s`` seconds without one."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self.done:
            if self.eof or self.broken:
                return None
            left = deadline - loop.time()
            if left <= 0:
                raise Hung(f"no complete response within {timeout_s} s")
            try:
                data = await asyncio.wait_for(self.reader.read(65536), left)
            except TimeoutError:
                raise Hung(f"no complete response within {timeout_s} s") from None
            except (ConnectionError, OSError):
                data = b""
            if data:
                self._feed(data)
            else:
                self._at_eof()
        return self.done.pop(0)

    async def closed(self, timeout_s: float) -> bool:
        """Whether the peer closes the connection within ``timeout_s`` (bytes meanwhile are parsed)."""
        with contextlib.suppress(Hung):
            while not self.eof:
                try:
                    data = await asyncio.wait_for(self.reader.read(65536), timeout_s)
                except TimeoutError:
                    raise Hung("still open") from None
                except (ConnectionError, OSError):
                    data = b""
                if data:
                    self._feed(data)
                else:
                    self._at_eof()
        return self.eof


async def connect(
    host: str, port: int, timeout_s: float
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A TCP connection to ``host:port`` (:class:`Hung` when it takes over ``timeout_s``)."""
    try:
        return await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    except TimeoutError:
        raise Hung(f"no connection within {timeout_s} s") from None


def _b(x: str | bytes) -> bytes:
    return x if isinstance(x, bytes) else x.encode("latin-1")


def request_bytes(
    method: str,
    path: str,
    headers: Sequence[tuple[str | bytes, str | bytes]],
    body: bytes = b"",
    length: bool = True,
) -> bytes:
    """A request as bytes: the request line, ``headers`` exactly as given (plus ``Content-Length``
    of ``body`` when ``length``), a blank line, ``body``."""
    lines = [b"%s %s HTTP/1.1" % (_b(method), _b(path))]
    lines += [_b(k) + b": " + _b(v) for k, v in headers]
    if length:
        lines.append(b"Content-Length: %d" % len(body))
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def completion_body(
    model: str, chat: bool, stream: bool, fault: str = "", max_tokens: int = 6, text: str = "hello there"
) -> bytes:
    """An ordinary OpenAI request body; ``fault`` adds the marker that picks a misbehaving
    upstream's fault (:mod:`kvroute.conformance.upstream`)."""
    prompt = f"{text} conformance-fault={fault}" if fault else text
    obj: dict[str, object] = {"model": model, "max_tokens": max_tokens, "stream": stream}
    if chat:
        obj["messages"] = [{"role": "user", "content": prompt}]
    else:
        obj["prompt"] = prompt
    if stream:
        obj["stream_options"] = {"include_usage": True}
    return orjson.dumps(obj)
