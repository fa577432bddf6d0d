"""Log text a client cannot forge: escaping, redaction, and the formatter's one-line records."""

from __future__ import annotations

import io
import logging
import sys

from kvroute.logtext import SafeFormatter, configure_logging, escape, redact
from kvroute.server.wire.httperrors import RateLimitedLog


def test_escape_leaves_one_printable_line() -> None:
    raw = "GET /a\nFORGED\r\x1b[31m\x00\x7f\x85\u2028\u202e\ufeff\udcff/é ✓"
    out = escape(raw)
    assert out == "GET /a\\nFORGED\\r\\x1b[31m\\x00\\x7f\\x85\\u2028\\u202e\\ufeff\\xff/é ✓"
    assert out.isprintable()
    assert escape("plain text, ok") == "plain text, ok"
    assert escape("x" * 300, 200) == "x" * 200 + "…"


def test_redact_hides_credential_headers_only() -> None:
    msg = "Invalid header value char: b'Authorization: Bearer sk-live-123\\x01' ^"
    assert redact(msg) == "Invalid header value char: b'Authorization: <redacted>' ^"
    assert "sk-1" not in redact("proxy-authorization:Basic sk-1")
    assert "abc" not in redact("b'Cookie: session=abc'")
    assert redact("b'X-Request-Id: abc'") == "b'X-Request-Id: abc'"


def _record(msg: str, exc: BaseException | None = None) -> logging.LogRecord:
    info = (type(exc), exc, exc.__traceback__) if exc is not None else None
    return logging.LogRecord("kvroute.server", logging.ERROR, __file__, 1, "%s", (msg,), info)


def test_formatter_records_cannot_forge_lines() -> None:
    try:
        raise ValueError("bad path /x\nFORGED: admin login ok\x1b[2J")
    except ValueError as exc:
        caught = exc
    text = SafeFormatter("%(message)s").format(_record("internal error on GET /x\nFORGED line", caught))
    first, *rest = text.split("\n")
    assert first == "internal error on GET /x\\nFORGED line"
    assert rest and all(line.startswith("    ") for line in rest)  # the traceback, indented
    assert any("FORGED: admin login ok\\x1b[2J" in line for line in rest)
    assert all(line.isprintable() for line in text.split("\n"))


def test_rate_limited_lines_are_escaped_at_the_source(caplog) -> None:  # type: ignore[no-untyped-def]
    limiter = RateLimitedLog(logging.getLogger("kvroute.test"), interval_s=0.0)
    with caplog.at_level(logging.WARNING, "kvroute.test"):
        limiter.emit("k", "bad request /a\nFORGED\x1b")
    [rec] = caplog.records
    assert rec.getMessage() == "bad request /a\\nFORGED\\x1b"


def test_configure_logging_keeps_an_existing_handler() -> None:
    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers = []
    try:
        out = io.StringIO()
        assert configure_logging(out)
        assert not configure_logging(sys.stderr)  # one handler only
        logging.getLogger("kvroute.server").warning("client %s", "a\nFORGED")
        assert out.getvalue() == "client a\\nFORGED\n"
    finally:
        root.handlers = saved
