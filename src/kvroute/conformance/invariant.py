"""The invariant every response through a front door must keep, as pure checks that return the
violations they find (an empty list: it holds).

For one response (:func:`check_response`):

- it is a well-formed HTTP response that ended (no hang: the reader's waits are bounded);
- it carries no suite request id but its own (:mod:`kvroute.conformance.ids`): never a byte of
  another response;
- a 200 completion carries its own id in every ``id`` (``cmpl-<id>`` / ``chatcmpl-<id>``), the id the
  client sent or, when the front door replaced an unusable one, the one it echoes in ``X-Request-Id``;
- its status is one the case allows, and never a 5xx for a client's fault; a 4xx or 5xx the front
  door makes is OpenAI-style JSON (``{"error": {...}}``).

For what reached an upstream (:func:`check_forwarded`): no hop-by-hop header (RFC 9110 §7.6.1),
no ``Expect``, exactly one ``X-Request-Id``, at most one ``traceparent``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import orjson

from kvroute.conformance.ids import ids_in
from kvroute.conformance.rawhttp import RawResponse

__all__ = ["HOP_BY_HOP", "Expect", "check_forwarded", "check_response", "completion_ids"]

HOP_BY_HOP = frozenset(
    {
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "upgrade",
        "proxy-authorization",
        "proxy-authenticate",
        "http2-settings",
        "expect",
    }
)
"""Header names that must never reach an upstream from a client (``Connection`` and
``Transfer-Encoding`` are the front door's own and checked by :func:`check_forwarded` apart)."""


@dataclass(frozen=True, slots=True)
class Expect:
    """What one request may get. ``rid``: the id it sent (None: the front door makes one);
    ``chat``: a chat completion; ``allowed``: the final statuses allowed (empty: any but a 5xx);
    ``client_fault``: a 5xx is a violation; ``may_close``: no response at all is acceptable (the
    front door closed the connection)."""

    rid: str | None
    chat: bool = False
    allowed: frozenset[int] = frozenset({200})
    client_fault: bool = True
    may_close: bool = False


def completion_ids(body: bytes) -> list[str] | None:
    """The ``id`` of a JSON completion, or of every SSE event that has one (None: neither parses)."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        obj = None
    if isinstance(obj, dict):
        return [obj["id"]] if isinstance(obj.get("id"), str) else []
    ids = []
    found = False
    for line in body.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            found = True
            continue
        try:
            event = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return None
        found = True
        if isinstance(event, dict) and isinstance(event.get("id"), str):
            ids.append(event["id"])
    return ids if found else None


def _own_id(resp: RawResponse, exp: Expect) -> str | None:
    echoed = resp.header("x-request-id")
    return exp.rid if exp.rid is not None else echoed


def check_response(resp: RawResponse | None, exp: Expect) -> list[str]:
    """The violations of the invariant (module docstring) by ``resp``, the answer to a request
    that expects ``exp`` (None: the connection closed without an answer)."""
    if resp is None:
        return [] if exp.may_close else ["the connection closed without a response"]
    out = []
    if resp.malformed:
        out.append(resp.malformed)
    own = _own_id(resp, exp)
    foreign = ids_in(resp.body) | ids_in(b"".join(v.encode("latin-1") for _, v in resp.headers))
    foreign.discard(own or "")
    if foreign:
        out.append(f"carries another response's id: {sorted(foreign)}")
    status = resp.status
    if exp.allowed and status not in exp.allowed:
        out.append(f"status {status}, expected one of {sorted(exp.allowed)}")
    if exp.client_fault and status >= 500:
        out.append(f"a {status} for a client's fault")
    if status < 200:
        out.append(f"an interim {status} as the final answer")
    if exp.rid is not None and resp.header("x-request-id") not in (None, exp.rid):
        out.append(f"echoed X-Request-Id {resp.header('x-request-id')!r}, sent {exp.rid!r}")
    if status == 200:
        out += _check_ids(resp, own, exp.chat, exp.client_fault)
    elif status >= 400 and resp.complete:
        out += _check_error_json(resp)
    return out


def _check_ids(resp: RawResponse, own: str | None, chat: bool, strict: bool) -> list[str]:
    if own is None:
        return ["a 200 without an X-Request-Id to tell whose it is"]
    want = ("chatcmpl-" if chat else "cmpl-") + own
    ids = completion_ids(resp.body)
    if ids is None:
        if not resp.complete or not strict:
            return []  # broke off, or an upstream's own bad body passed on: no foreign id is enough
        return [f"a 200 whose body is neither JSON nor SSE: {resp.body[:80]!r}"]
    if not ids:
        return [f"a 200 without a completion id: {resp.body[:80]!r}"]
    wrong = sorted({i for i in ids if i != want})
    return [f"completion id {wrong}, expected {want!r}"] if wrong else []


def _check_error_json(resp: RawResponse) -> list[str]:
    ctype = resp.header("content-type") or ""
    try:
        obj = orjson.loads(resp.body)
    except orjson.JSONDecodeError:
        obj = None
    if not (isinstance(obj, dict) and isinstance(obj.get("error"), dict)) or "json" not in ctype:
        return [f"a {resp.status} that is not an OpenAI-style JSON error: {resp.body[:80]!r}"]
    return []


def check_forwarded(headers: Iterable[tuple[str, str]], listed: Iterable[str] = ()) -> list[str]:
    """The violations by one request's ``headers`` as an upstream received them (module
    docstring); ``listed``: header names the client named in its own ``Connection`` header."""
    pairs = [(k.lower(), v) for k, v in headers]
    names = [k for k, _ in pairs]
    out = []
    hop = sorted(
        {n for n in names if n in HOP_BY_HOP} | {n for n in names if n in {x.lower() for x in listed}}
    )
    if hop:
        out.append(f"hop-by-hop headers reached the upstream: {hop}")
    n_ids = names.count("x-request-id")
    if n_ids != 1:
        out.append(f"{n_ids} X-Request-Id headers reached the upstream")
    if names.count("traceparent") > 1:
        out.append(f"{names.count('traceparent')} traceparent headers reached the upstream")
    if "transfer-encoding" in names and "content-length" in names:
        out.append("both Transfer-Encoding and Content-Length reached the upstream")
    return out
