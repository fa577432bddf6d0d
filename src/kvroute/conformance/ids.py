"""Request ids the suite can recognise anywhere in a byte stream.

Every request the suite sends carries ``X-Request-Id: cf-<12 hex digits>``; OpenAI-compatible
engines (the emulated one, vLLM, and :mod:`kvroute.conformance.upstream`) answer with
``cmpl-<id>`` / ``chatcmpl-<id>`` in the body's ``id``. Any ``cf-`` id in a response that is not the
request's own is a byte of another response.
"""

from __future__ import annotations

import os
import re

__all__ = ["FOREIGN_ID", "ID_PATTERN", "ids_in", "new_id"]

ID_PATTERN = re.compile(rb"cf-[0-9a-f]{12}")
"""What a suite request id looks like, in bytes."""

FOREIGN_ID = "cf-0000deadbeef"
"""The id of the responses a misbehaving upstream makes up (never one a client sent)."""


def new_id() -> str:
    """A fresh random request id (``cf-`` and 12 hex digits: 48 random bits)."""
    return "cf-" + os.urandom(6).hex()


def ids_in(data: bytes) -> set[str]:
    """Every suite request id that occurs in ``data``."""
    return {m.decode("ascii") for m in ID_PATTERN.findall(data)}
