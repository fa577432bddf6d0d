"""What a misbehaving upstream writes: one plan of steps per fault, and what a client may then get.

A plan is a tuple of steps: ``bytes`` (written as one ``write``), a ``float`` (sleep, seconds) or
:data:`CLOSE` (close the connection; the rest of the plan is dropped). Every plan starts from the
ordinary answer to the request (:class:`Answer`): JSON for a plain request, chunked SSE events for a
streamed one, the request id in every ``id``.

Each :class:`Fault` says which final statuses a client of a correct front door may see
(``allowed``) and whether the front door may need a while to use the upstream again afterwards
(``ejects``: it broke before its first body byte, which a router may take as a dead backend).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import orjson

from kvroute.conformance.ids import foreign_id

__all__ = ["CLOSE", "FAULTS", "Answer", "Fault", "Step"]


class _Close:
    def __repr__(self) -> str:
        return "CLOSE"


CLOSE = _Close()
"""The step that closes the connection."""

Step = bytes | float | _Close


@dataclass(frozen=True, slots=True)
class Answer:
    """The ordinary answer to one request: ``rid`` (its ``X-Request-Id``), chat or completions,
    streamed or not, the model's name."""

    rid: str
    chat: bool
    stream: bool
    model: str

    @property
    def oid(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.rid

    def body(self) -> bytes:
        """The plain JSON body."""
        text = f" ok {self.rid}"
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "stop"}
            obj = "text_completion"
        usage = {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
        return orjson.dumps(
            {
                "id": self.oid,
                "object": obj,
                "created": 0,
                "model": self.model,
                "choices": [choice],
                "usage": usage,
            }
        )

    def events(self) -> list[bytes]:
        """The SSE events of the streamed answer, ``[DONE]`` last."""
        out = []
        for i, piece in enumerate((" ok", f" {self.rid}", "")):
            last = i == 2
            if self.chat:
                delta = {} if last else {"content": piece}
                choice = {"index": 0, "delta": delta, "finish_reason": "stop" if last else None}
                obj = "chat.completion.chunk"
            else:
                choice = {
                    "index": 0,
                    "text": piece,
                    "logprobs": None,
                    "finish_reason": "stop" if last else None,
                }
                obj = "text_completion"
            event = {"id": self.oid, "object": obj, "created": 0, "model": self.model, "choices": [choice]}
            out.append(b"data: " + orjson.dumps(event) + b"\n\n")
        out.append(b"data: [DONE]\n\n")
        return out

    def pieces(self) -> list[bytes]:
        """The body in the pieces it is sent in (events, or the JSON in three parts)."""
        if self.stream:
            return self.events()
        body = self.body()
        third = len(body) // 3
        return [body[:third], body[third : 2 * third], body[2 * third :]]

    @property
    def content_type(self) -> bytes:
        return b"text/event-stream" if self.stream else b"application/json"

    def head(self, status: bytes = b"200 OK", extra: bytes = b"", framing: bytes | None = None) -> bytes:
        """A response head, with ``X-Request-Id`` echoing the request's id (as vLLM's with
        ``--enable-request-id-headers``); ``framing``: the framing header line(s) (default: chunked
        for a stream, the body's Content-Length otherwise)."""
        if framing is None:
            framing = (
                b"Transfer-Encoding: chunked\r\n"
                if self.stream
                else b"Content-Length: %d\r\n" % len(self.body())
            )
        return (
            b"HTTP/1.1 "
            + status
            + b"\r\nContent-Type: "
            + self.content_type
            + b"\r\n"
            + framing
            + b"X-Request-Id: "
            + self.rid.encode("latin-1")
            + b"\r\n"
            + extra
            + b"\r\n"
        )

    def whole(self) -> bytes:
        """The ordinary response, head and body, in bytes."""
        if self.stream:
            return self.head() + chunked(self.events())
        return self.head() + self.body()

    def foreign(self, tag: str = "beef") -> bytes:
        """A complete response for a request nobody sent (id :func:`~kvroute.conformance.ids.foreign_id`
        of ``tag``, 4 hex digits: which fault made it)."""
        return Answer(foreign_id(tag), self.chat, self.stream, self.model).whole()


def chunked(
    pieces: list[bytes],
    size: Callable[[int], bytes] = lambda n: b"%x" % n,
    ext: bytes = b"",
    trailers: bytes = b"",
) -> bytes:
    """``pieces`` in chunked transfer coding (``size`` writes a chunk's size line, ``ext`` follows
    it, ``trailers`` are header lines after the last chunk)."""
    out = [size(len(p)) + ext + b"\r\n" + p + b"\r\n" for p in pieces if p]
    return b"".join(out) + b"0\r\n" + trailers + b"\r\n"


def _body(a: Answer, **kw: object) -> bytes:
    """The body, chunked with ``kw`` (a plain answer is chunked too)."""
    return chunked(a.pieces(), **kw)  # type: ignore[arg-type]


_CHUNKED = b"Transfer-Encoding: chunked\r\n"


def _drip(data: bytes, size: int = 24, pause_s: float = 0.002) -> tuple[Step, ...]:
    steps: list[Step] = []
    for i in range(0, len(data), size):
        steps += [data[i : i + size], pause_s]
    return tuple(steps)


@dataclass(frozen=True, slots=True)
class Fault:
    """One way to misbehave: ``plan`` makes the steps from the answer; ``allowed``: the final
    statuses a client may see through a correct front door; ``ejects``: the front door may take the
    upstream for dead a while; ``doc``: what it does, for the case's description."""

    name: str
    plan: Callable[[Answer], tuple[Step, ...]]
    allowed: frozenset[int]
    doc: str
    ejects: bool = False


OK = frozenset({200})
BAD_GATEWAY = frozenset({502, 503})

_FAULTS = (
    Fault("none", lambda a: (a.whole(),), OK, "an ordinary answer"),
    Fault("interim-100", lambda a: (b"HTTP/1.1 100 Continue\r\n\r\n" + a.whole(),), OK, "100 Continue first"),
    Fault(
        "interim-102",
        lambda a: (b"HTTP/1.1 102 Processing\r\n\r\n", 0.01, a.whole()),
        OK,
        "102 Processing first",
    ),
    Fault(
        "interim-103",
        lambda a: (b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n" + a.whole(),),
        OK,
        "103 Early Hints first",
    ),
    Fault(
        "interim-many",
        lambda a: (
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 102 Processing\r\n\r\n",
            0.01,
            b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\nHTTP/1.1 100 Continue\r\n\r\n" + a.whole(),
        ),
        OK,
        "100, 102, 103 and 100 again before the final",
    ),
    Fault(
        "switch-101",
        lambda a: (
            b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n\x81\x05hello",
            1.0,
            CLOSE,
        ),
        BAD_GATEWAY,
        "101 Switching Protocols to a request that asked for no upgrade",
    ),
    Fault(
        "trailing-garbage", lambda a: (a.whole() + b"JUNK\r\n\r\n",), OK, "bytes past the end of the response"
    ),
    Fault(
        "second-response",
        lambda a: (a.whole() + a.foreign(),),
        OK,
        "a second, foreign response in the same write",
    ),
    Fault(
        "late-response",
        lambda a: (a.whole(), 0.03, a.foreign("1a7e")),
        OK,
        "a foreign response 30 ms later, while idle",
    ),
    Fault(
        "dangling-head",
        lambda a: (a.whole() + b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Le",),
        OK,
        "the start of another response head past the end",
    ),
    Fault("close-before-head", lambda a: (CLOSE,), BAD_GATEWAY, "closes without answering", ejects=True),
    Fault(
        "close-mid-head",
        lambda a: (a.head()[:20], 0.01, CLOSE),
        BAD_GATEWAY,
        "closes inside the response head",
        ejects=True,
    ),
    Fault(
        "close-mid-body",
        lambda a: (
            a.head() + (_body(a)[:60] if a.stream else a.body()[:40]),
            0.01,
            CLOSE,
        ),
        frozenset({200, 502}),
        "closes inside the body (a stream: inside a chunk)",
    ),
    Fault(
        "close-between-chunks",
        lambda a: (a.head(framing=_CHUNKED) + _body(a)[:-5], 0.01, CLOSE),
        frozenset({200, 502}),
        "a chunked body without its last chunk",
    ),
    Fault(
        "no-content-with-body",
        lambda a: (b"HTTP/1.1 204 No Content\r\n\r\n" + a.body(),),
        frozenset({204, 502}),
        "204 followed by body bytes",
    ),
    Fault(
        "not-modified-with-body",
        lambda a: (b"HTTP/1.1 304 Not Modified\r\nContent-Length: 7\r\n\r\n" + a.body(),),
        frozenset({304, 502}),
        "304 (a Content-Length too) followed by body bytes",
    ),
    Fault(
        "chunk-extensions",
        lambda a: (a.head(framing=_CHUNKED) + _body(a, ext=b';name=value;x="q"'),),
        OK,
        "chunk extensions on every size line",
    ),
    Fault(
        "chunk-trailers",
        lambda a: (
            a.head(b"200 OK", b"Trailer: X-Checksum\r\n", _CHUNKED) + _body(a, trailers=b"X-Checksum: 1\r\n"),
        ),
        OK,
        "a trailer section after the last chunk",
    ),
    Fault(
        "chunk-leading-zeros",
        lambda a: (a.head(framing=_CHUNKED) + _body(a, size=lambda n: b"%08x" % n),),
        OK,
        "chunk sizes written with leading zeros",
    ),
    Fault(
        "chunk-one-byte",
        lambda a: (a.head(framing=_CHUNKED) + chunked([bytes([c]) for c in b"".join(a.pieces())]),),
        OK,
        "one byte per chunk",
    ),
    Fault(
        "chunk-zero-early",
        lambda a: (a.head(framing=_CHUNKED) + chunked(a.pieces()[:1]) + chunked(a.pieces()[1:]),),
        frozenset({200, 502}),
        "a zero-size chunk before the body is over (the rest is past the end)",
    ),
    Fault(
        "chunk-huge-size",
        lambda a: (a.head(framing=_CHUNKED) + b"ffffffffffffffffffff\r\n" + a.body(), 1.0, CLOSE),
        BAD_GATEWAY,
        "a chunk size past 2**64",
        ejects=True,
    ),
    Fault(
        "chunk-bad-size",
        lambda a: (a.head(framing=_CHUNKED) + b"zz\r\n" + a.body(), 1.0, CLOSE),
        BAD_GATEWAY,
        "a chunk size that is not hex",
        ejects=True,
    ),
    Fault("slow-drip", lambda a: _drip(a.whole()), OK, "the response in 24-byte writes 2 ms apart"),
    Fault(
        "close-delimited",
        lambda a: (
            a.head(b"200 OK", b"Connection: close\r\n", b""),
            0.005,
            b"".join(a.pieces()),
            0.005,
            CLOSE,
        ),
        OK,
        "no Content-Length, no chunking: the body ends at close",
    ),
    Fault(
        "xchunked",
        lambda a: (a.head(framing=b"Transfer-Encoding: xchunked\r\n") + b"".join(a.pieces()), 0.005, CLOSE),
        OK,
        "Transfer-Encoding: xchunked (not chunked): the body ends at close",
    ),
    Fault(
        "close-header-kept-open",
        lambda a: (
            a.head(extra=b"Connection: close\r\n") + (_body(a) if a.stream else a.body()),
            0.03,
            a.foreign("c105"),
        ),
        OK,
        "says Connection: close, keeps the socket open and sends a foreign response",
    ),
)

FAULTS: dict[str, Fault] = {f.name: f for f in _FAULTS}
"""Every fault by name."""
