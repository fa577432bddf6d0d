"""Log lines that a client cannot forge: client-controlled text (paths, ids, headers, exception messages
that quote them) is escaped before it reaches a log stream.

- :func:`escape` turns one piece of text into one printable line: control characters (C0, DEL, C1),
  line and paragraph separators, bidirectional overrides and zero-width characters become ``\\n``,
  ``\\r``, ``\\t``, ``\\xNN`` or ``\\uNNNN``; a byte that was not UTF-8 (decoded by aiohttp with
  ``surrogateescape`` as U+DC80..U+DCFF) becomes ``\\xNN`` of that byte. Backslashes stay as they are.
- :func:`redact` hides credentials quoted in a message (an HTTP parser's error quotes the bad header
  line: ``Authorization: Bearer sk-…`` becomes ``Authorization: <redacted>``; also
  ``Proxy-Authorization``, ``Cookie``, ``Set-Cookie``, ``X-Api-Key``, ``Api-Key``).
- :class:`SafeFormatter` applies both to every record: the message is one line; a traceback (or stack)
  follows on lines indented by four spaces, each escaped, so no continuation line can pass for a record
  of its own. Invariant: in the output, a line that does not start with a space begins a record.
- :func:`configure_logging` installs one such handler on the root logger (stderr, ``%(message)s``,
  WARNING: what Python's last-resort handler prints) unless the process already has handlers.
"""

from __future__ import annotations

import logging
import re
import sys
from typing import IO

__all__ = ["SafeFormatter", "configure_logging", "escape", "redact"]

# C0 and C1 controls, DEL, soft hyphen, zero-width and bidi controls, line/paragraph separators, BOM,
# and surrogates (undecodable bytes under surrogateescape, or lone surrogates)
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\xad\u200b-\u200f\u2028-\u202e\u2060-\u206f\ufeff\ud800-\udfff]")
# a credential header's name, its separator, and its value up to the end of the quoted line
_CREDENTIAL = re.compile(
    r"(?i)\b((?:proxy-)?authorization|(?:set-)?cookie|x-api-key|api-key)([ \t]*:[ \t]*)[^'\"\r\n]*"
)
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
_INDENT = "    "


def _one(match: re.Match[str]) -> str:
    c = match.group()
    named = _NAMED.get(c)
    if named is not None:
        return named
    code = ord(c)
    if 0xDC80 <= code <= 0xDCFF:  # an undecodable byte, carried by surrogateescape
        return f"\\x{code - 0xDC00:02x}"
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def escape(text: str, limit: int | None = None) -> str:
    """``text`` as one printable line (module docstring); cut to ``limit`` characters of the input
    (then ``…`` marks the cut) when given."""
    cut = limit is not None and len(text) > limit
    if cut:
        text = text[:limit]
    out = _UNSAFE.sub(_one, text)
    return out + "…" if cut else out


def redact(text: str) -> str:
    """``text`` with the value of every credential header it quotes replaced by ``<redacted>``."""
    return _CREDENTIAL.sub(r"\1\2<redacted>", text)


class SafeFormatter(logging.Formatter):
    """A formatter whose records are one escaped line, any traceback below it indented (module
    docstring). Does not mutate the record's ``msg``/``args``; sets ``record.message`` like the base."""

    def format(self, record: logging.LogRecord) -> str:
        record.message = escape(redact(record.getMessage()))
        if self.usesTime():
            record.asctime = self.formatTime(record, self.datefmt)
        head = self.formatMessage(record)
        extra: list[str] = []
        if record.exc_info:
            extra.append(self.formatException(record.exc_info))
        elif record.exc_text:
            extra.append(record.exc_text)
        if record.stack_info:
            extra.append(self.formatStack(record.stack_info))
        lines = [escape(redact(line)) for block in extra for line in block.splitlines()]
        return "\n".join([escape(head), *(_INDENT + line for line in lines)])


def configure_logging(stream: IO[str] | None = None, level: int = logging.WARNING) -> bool:
    """One :class:`SafeFormatter` handler on ``stream`` (default: stderr) for the root logger, unless
    the root logger already has a handler (an embedding application's choice stands). Mutates the
    process's logging configuration; True if it installed the handler."""
    root = logging.getLogger()
    if root.handlers:
        return False
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(SafeFormatter("%(message)s"))
    handler.setLevel(level)
    root.addHandler(handler)
    if root.level == logging.NOTSET or root.level > level:
        root.setLevel(level)
    return True
