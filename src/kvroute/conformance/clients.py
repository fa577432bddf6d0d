"""The catalogue of hostile and odd clients, over raw sockets.

Each :class:`ClientCase` writes exact bytes to the front door and reads what comes back with bounded
waits; it returns one :class:`Outcome` per answer it waited for (none for a client that leaves).
Names are readable test ids. Every request that expects a completion carries a fresh suite id
(:func:`kvroute.conformance.ids.new_id`), so the invariant can tell whose bytes it got.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from kvroute.conformance.ids import new_id
from kvroute.conformance.invariant import Expect
from kvroute.conformance.rawhttp import (
    Hung,
    RawResponse,
    ResponseReader,
    completion_body,
    connect,
    request_bytes,
)

__all__ = ["CLIENTS", "LISTED_HEADER", "ClientCase", "Ctx", "Outcome", "exchange", "ordinary_request"]

LISTED_HEADER = "X-Conformance-Hop"
"""A header the hostile clients name in their ``Connection`` header: it must not be forwarded."""


@dataclass(frozen=True, slots=True)
class Ctx:
    """Where a case sends: the front door's ``host``:``port``; ``model``: the target's model;
    ``timeout_s``: the bound on every wait (seconds)."""

    host: str
    port: int
    model: str
    timeout_s: float = 10.0


@dataclass(frozen=True, slots=True)
class Outcome:
    """One request's answer (None: none came) and what it may be; ``error``: why none came
    (e.g. it hung), '' otherwise."""

    response: RawResponse | None
    expect: Expect
    error: str = ""


Write = bytes | float  # bytes to write, or seconds to wait


async def exchange(
    ctx: Ctx, writes: Sequence[Write], expects: Sequence[Expect], close: bool = True
) -> list[Outcome]:
    """Open a connection, carry out ``writes``, read one response per ``expects`` (in order)."""
    try:
        reader, writer = await connect(ctx.host, ctx.port, ctx.timeout_s)
    except (Hung, OSError) as exc:
        return [Outcome(None, e, f"connect: {exc!r}") for e in expects]
    rr = ResponseReader(reader)
    out: list[Outcome] = []
    try:
        for w in writes:
            if isinstance(w, float):
                await asyncio.sleep(w)
            else:
                writer.write(w)
                with contextlib.suppress(ConnectionError):
                    await writer.drain()
        for exp in expects:
            try:
                out.append(Outcome(await rr.next(ctx.timeout_s), exp))
            except Hung as exc:
                out.append(Outcome(None, exp, f"hung: {exc}"))
                break
    finally:
        if close:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
    out += [Outcome(None, e, "not read after an earlier hang") for e in expects[len(out) :]]
    return out


def _headers(
    rid: str | bytes | None, *extra: tuple[str | bytes, str | bytes]
) -> list[tuple[str | bytes, str | bytes]]:
    h: list[tuple[str | bytes, str | bytes]] = [("Host", "conformance"), ("Content-Type", "application/json")]
    if rid is not None:
        h.append(("X-Request-Id", rid))
    return h + list(extra)


def _path(chat: bool) -> str:
    return "/v1/chat/completions" if chat else "/v1/completions"


async def ordinary_request(
    ctx: Ctx, chat: bool, stream: bool, fault: str = "", expect: Expect | None = None
) -> Outcome:
    """One ordinary request on its own connection (``fault``: the upstream's fault marker)."""
    rid = new_id()
    body = completion_body(ctx.model, chat, stream, fault)
    exp = expect if expect is not None else Expect(rid, chat)
    exp = Expect(rid, chat, exp.allowed, exp.client_fault, exp.may_close)
    data = request_bytes("POST", _path(chat), _headers(rid), body)
    return (await exchange(ctx, [data], [exp]))[0]


# ---- the catalogue ------------------------------------------------------------------------------

Run = Callable[[Ctx], Awaitable[list[Outcome]]]


@dataclass(frozen=True, slots=True)
class ClientCase:
    """One hostile or odd client: ``run`` carries it out; ``doc`` says what it does."""

    name: str
    run: Run
    doc: str


def _simple(
    extra: Sequence[tuple[str | bytes, str | bytes]],
    allowed: frozenset[int] = frozenset({200}),
    chat: bool = False,
    stream: bool = False,
    rid_valid: bool = True,
    may_close: bool = False,
) -> Run:
    """A request with ``extra`` headers; ``rid_valid``: the front door keeps the client's id
    (else it may make its own, echoed in ``X-Request-Id``)."""

    async def run(ctx: Ctx) -> list[Outcome]:
        rid = new_id()
        body = completion_body(ctx.model, chat, stream)
        data = request_bytes("POST", _path(chat), [*_headers(rid), *extra], body)
        exp = Expect(rid if rid_valid else None, chat, allowed, True, may_close)
        return await exchange(ctx, [data], [exp])

    return run


def _raw(
    make: Callable[[Ctx, str], Sequence[Write]],
    allowed: frozenset[int],
    may_close: bool = True,
    rid_valid: bool = True,
) -> Run:
    """Bytes made by ``make(ctx, rid)``; one answer expected (or a close when ``may_close``);
    ``rid_valid``: as for :func:`_simple`."""

    async def run(ctx: Ctx) -> list[Outcome]:
        rid = new_id()
        exp = Expect(rid if rid_valid else None, False, allowed, True, may_close)
        return await exchange(ctx, make(ctx, rid), [exp])

    return run


def _leave(make: Callable[[Ctx, str], Sequence[Write]]) -> Run:
    """Bytes made by ``make(ctx, rid)``, then the client closes without reading."""

    async def run(ctx: Ctx) -> list[Outcome]:
        await exchange(ctx, make(ctx, new_id()), [])
        return []

    return run


def _expect_continue(stream: bool, spelling: tuple[str, str] = ("Expect", "100-continue")) -> Run:
    """``Expect: 100-continue``: the head, up to 1 s for a ``100 Continue``, then the body."""

    async def run(ctx: Ctx) -> list[Outcome]:
        rid = new_id()
        body = completion_body(ctx.model, chat=stream, stream=stream, max_tokens=48 if stream else 6)
        data = request_bytes("POST", _path(stream), [*_headers(rid), spelling], body)
        head, _, rest = data.partition(b"\r\n\r\n")
        return await exchange(ctx, [head + b"\r\n\r\n", 0.3, rest], [Expect(rid, stream)])

    return run


def _hop(name: str, value: str) -> Run:
    """Hop-by-hop header ``name`` three times, as lower, Title and UPPER case."""
    return _simple(
        [(name.lower(), value), (name.title(), value), (name.upper(), value)],
        allowed=frozenset({200, 400}),
    )


def _pipelined(first_stream: bool) -> Run:
    """Two requests in one write; both answered, in order."""

    async def run(ctx: Ctx) -> list[Outcome]:
        a, b = new_id(), new_id()
        one = request_bytes(
            "POST", _path(first_stream), _headers(a), completion_body(ctx.model, first_stream, first_stream)
        )
        two = request_bytes("POST", "/v1/completions", _headers(b), completion_body(ctx.model, False, False))
        return await exchange(ctx, [one + two], [Expect(a, first_stream), Expect(b, False)])

    return run


def _mid_stream(ctx_reads: int = 1) -> Run:
    """A long stream: the head and first bytes read, then the client closes."""

    async def run(ctx: Ctx) -> list[Outcome]:
        rid = new_id()
        body = completion_body(ctx.model, chat=True, stream=True, max_tokens=400)
        data = request_bytes("POST", "/v1/chat/completions", _headers(rid), body)
        try:
            reader, writer = await connect(ctx.host, ctx.port, ctx.timeout_s)
        except (Hung, OSError) as exc:
            return [Outcome(None, Expect(rid, True), f"connect: {exc!r}")]
        try:
            writer.write(data)
            for _ in range(ctx_reads):
                got = await asyncio.wait_for(reader.read(1024), ctx.timeout_s)
                if not got:
                    break
        except TimeoutError:
            return [Outcome(None, Expect(rid, True), "hung: no stream bytes")]
        finally:
            writer.transport.abort()
        return []

    return run


def _slow_request(ctx: Ctx, rid: str) -> list[Write]:
    data = request_bytes("POST", "/v1/completions", _headers(rid), completion_body(ctx.model, False, False))
    steps: list[Write] = []
    for i in range(0, len(data), 16):
        steps += [data[i : i + 16], 0.003]
    return steps


def _paused_head(ctx: Ctx, rid: str) -> list[Write]:
    data = request_bytes("POST", "/v1/completions", _headers(rid), _body(ctx))
    return [data[:30], 0.2, data[30:]]


def _body(ctx: Ctx) -> bytes:
    return completion_body(ctx.model, False, False)


def _chunked_request(ctx: Ctx, rid: str, size_line: bytes | None = None) -> list[Write]:
    body = _body(ctx)
    head = request_bytes(
        "POST", "/v1/completions", [*_headers(rid), ("Transfer-Encoding", "chunked")], b"", length=False
    )
    if size_line is not None:
        return [head + size_line + b"\r\n" + body + b"\r\n0\r\n\r\n"]
    half = len(body) // 2
    chunks = b"%x;ext=1\r\n%s\r\n%x\r\n%s\r\n0\r\nX-Trailer: 1\r\n\r\n" % (
        half,
        body[:half],
        len(body) - half,
        body[half:],
    )
    return [head + chunks]


BAD_REQUEST = frozenset({400})

_CASES = (
    ClientCase("expect-100-continue", _expect_continue(False), "Expect: 100-continue, body after a pause"),
    ClientCase(
        "expect-100-continue-stream", _expect_continue(True), "Expect: 100-continue on a 48-token chat stream"
    ),
    ClientCase(
        "expect-100-continue-upper",
        _expect_continue(False, ("EXPECT", "100-CONTINUE")),
        "Expect: 100-continue spelled in capitals",
    ),
    ClientCase(
        "expect-unknown",
        _simple([("Expect", "202-accepted")], allowed=frozenset({200, 417})),
        "an Expect the front door does not know",
    ),
    ClientCase(
        "connection-names-header",
        _simple([("Connection", f"keep-alive, {LISTED_HEADER}"), (LISTED_HEADER, "secret")]),
        "Connection names another header, which is hop-by-hop too",
    ),
    ClientCase("hop-keep-alive", _hop("Keep-Alive", "timeout=5, max=100"), "Keep-Alive in three cases"),
    ClientCase("hop-proxy-connection", _hop("Proxy-Connection", "keep-alive"), "Proxy-Connection"),
    ClientCase("hop-te", _hop("TE", "trailers"), "TE: trailers"),
    ClientCase("hop-trailer", _hop("Trailer", "X-Checksum"), "Trailer"),
    ClientCase(
        "hop-proxy-authorization", _hop("Proxy-Authorization", "Basic Zm9vOmJhcg=="), "proxy credentials"
    ),
    ClientCase("hop-proxy-authenticate", _hop("Proxy-Authenticate", "Basic"), "Proxy-Authenticate"),
    ClientCase("hop-http2-settings", _hop("HTTP2-Settings", "AAMAAABkAAQAAP__"), "HTTP2-Settings"),
    ClientCase(
        "hop-upgrade",
        _simple([("Connection", "Upgrade"), ("Upgrade", "h2c")], allowed=frozenset({200, 400})),
        "Connection: Upgrade, Upgrade: h2c on a POST",
    ),
    ClientCase("request-id-upper", _simple([]), "X-Request-Id (the usual spelling)"),
    ClientCase(
        "request-id-duplicate",
        _simple([("X-REQUEST-ID", "cf-00000000beef")], allowed=frozenset({200, 400}), rid_valid=False),
        "two different X-Request-Id headers",
    ),
    ClientCase(
        "request-id-too-long",
        _raw(
            lambda ctx, rid: [request_bytes("POST", "/v1/completions", _headers("x" * 300), _body(ctx))],
            frozenset({200, 400}),
            may_close=False,
            rid_valid=False,
        ),
        "a 300-character X-Request-Id",
    ),
    ClientCase(
        "request-id-non-utf8",
        _raw(
            lambda ctx, rid: [
                request_bytes("POST", "/v1/completions", _headers(b"\xff\xfe\x80id"), _body(ctx))
            ],
            frozenset({200, 400}),
            may_close=False,
            rid_valid=False,
        ),
        "an X-Request-Id of raw non-UTF-8 bytes",
    ),
    ClientCase(
        "header-non-utf8",
        _simple([("X-Note", b"caf\xe9 \xff\xfe")], allowed=frozenset({200, 400})),
        "a header value of raw non-UTF-8 bytes",
    ),
    ClientCase(
        "authorization-non-utf8",
        _raw(
            lambda ctx, rid: [
                request_bytes(
                    "GET", "/admin/backends", [("Host", "c"), ("Authorization", b"Bearer \xff\xfe\x80")]
                )
            ],
            frozenset({400, 401, 403, 404}),
        ),
        "a non-UTF-8 Authorization header on the admin API",
    ),
    ClientCase(
        "te-and-cl",
        _raw(
            lambda ctx, rid: [
                request_bytes(
                    "POST",
                    "/v1/completions",
                    [*_headers(rid), ("Transfer-Encoding", "chunked")],
                    b"0\r\n\r\n",
                )
            ],
            BAD_REQUEST,
        ),
        "Transfer-Encoding: chunked and Content-Length together",
    ),
    ClientCase(
        "te-not-chunked",
        _raw(
            lambda ctx, rid: [
                request_bytes(
                    "POST",
                    "/v1/completions",
                    [*_headers(rid), ("Transfer-Encoding", "xchunked")],
                    _body(ctx),
                    length=False,
                )
            ],
            BAD_REQUEST,
        ),
        "Transfer-Encoding: xchunked",
    ),
    ClientCase(
        "cl-conflict",
        _raw(
            lambda ctx, rid: [
                request_bytes(
                    "POST", "/v1/completions", [*_headers(rid), ("Content-Length", "3")], _body(ctx)
                )
            ],
            BAD_REQUEST,
        ),
        "two different Content-Length headers",
    ),
    ClientCase(
        "chunked-request",
        _raw(lambda ctx, rid: _chunked_request(ctx, rid), frozenset({200}), may_close=False),
        "a chunked body with chunk extensions and a trailer",
    ),
    ClientCase(
        "chunked-bad-size",
        _raw(lambda ctx, rid: _chunked_request(ctx, rid, b"zz"), BAD_REQUEST),
        "a chunk size that is not hex",
    ),
    ClientCase(
        "chunked-huge-size",
        _raw(lambda ctx, rid: _chunked_request(ctx, rid, b"f" * 20), frozenset({400, 413})),
        "a chunk size past 2**64",
    ),
    ClientCase("pipelined", _pipelined(False), "two requests in one write"),
    ClientCase("pipelined-stream-first", _pipelined(True), "a stream and a request in one write"),
    ClientCase(
        "disconnect-mid-body",
        _leave(
            lambda ctx, rid: [
                request_bytes("POST", "/v1/completions", _headers(rid), _body(ctx))[:-20],
                0.05,
            ]
        ),
        "Content-Length promised, 20 bytes short, then the client closes",
    ),
    ClientCase(
        "disconnect-before-answer",
        _leave(lambda ctx, rid: [request_bytes("POST", "/v1/completions", _headers(rid), _body(ctx))]),
        "the whole request, then the client closes at once",
    ),
    ClientCase("disconnect-mid-stream", _mid_stream(), "a 400-token stream, closed after its first bytes"),
    ClientCase(
        "slow-drip-request",
        _raw(_slow_request, frozenset({200}), may_close=False),
        "the request in 16-byte writes",
    ),
    ClientCase(
        "partial-head-close",
        _leave(lambda ctx, rid: [b"POST /v1/completions HTTP/1.1\r\nHost: c\r\nContent-Le", 0.05]),
        "half a head, then the client closes",
    ),
    ClientCase(
        "partial-head-pause",
        _raw(
            _paused_head,
            frozenset({200}),
            may_close=False,
        ),
        "half a head, 200 ms, the rest",
    ),
    ClientCase(
        "oversized-head",
        _simple([("X-Big", "a" * 70_000)], allowed=frozenset({400, 413, 431}), may_close=True),
        "a 70 kB header",
    ),
    ClientCase(
        "many-headers",
        _simple([(f"X-H{i}", "v") for i in range(150)], allowed=frozenset({200, 400, 431})),
        "150 extra headers",
    ),
    ClientCase(
        "obs-fold",
        _simple([("X-Fold", "a\r\n b")], allowed=BAD_REQUEST, may_close=True),
        "an obs-folded header",
    ),
    ClientCase(
        "nul-in-header",
        _simple([("X-Nul", b"a\x00b")], allowed=BAD_REQUEST, may_close=True),
        "a NUL in a header",
    ),
    ClientCase(
        "bare-lf",
        _raw(
            lambda ctx, rid: [
                request_bytes("POST", "/v1/completions", _headers(rid), _body(ctx)).replace(b"\r\n", b"\n")
            ],
            frozenset({200, 400}),
        ),
        "lines ended by a bare LF",
    ),
)

CLIENTS: dict[str, ClientCase] = {c.name: c for c in _CASES}
"""Every client case by name."""
