"""Bugs still open on this branch, and how they show in the suite's violations."""

from __future__ import annotations

from collections.abc import Iterable
from fnmatch import fnmatch

OPEN: tuple[tuple[str, str, str], ...] = (
    (
        "*",
        "X-Request-Id headers reached the upstream",
        "the client's X-Request-Id is forwarded beside the router's",
    ),
    (
        "client-request-id-*@engine",
        "completion id",
        "the client's X-Request-Id is forwarded beside the router's",
    ),
    ("client-request-id-duplicate@engine", "another response's id", "the client's X-Request-Id is forwarded"),
    ("*", "hop-by-hop headers reached the upstream", "hop-by-hop headers (and Expect) are forwarded"),
    (
        "client-expect-100-continue*@engine",
        "",
        "Expect is forwarded; the engine's 100 Continue becomes the answer",
    ),
    ("upstream-interim-*", "", "an upstream's 1xx is relayed as the final answer"),
    ("upstream-switch-101*", "", "a 101 is relayed as the answer, with a traceback"),
    ("upstream-second-response*", "", "bytes past a response's end reach the client"),
    ("upstream-xchunked@*", "status 502", "Transfer-Encoding: xchunked is judged length-delimited"),
    ("client-expect-unknown@*", "not an OpenAI-style JSON error", "aiohttp's own 417 is plain text"),
)
"""(case id pattern, violation substring, the open bug that explains it)."""


def explained(case_id: str, violations: Iterable[str]) -> tuple[set[str], list[str]]:
    """The open bugs that explain some of ``violations`` of case ``case_id``, and the violations
    none explains."""
    known: set[str] = set()
    unknown: list[str] = []
    for v in violations:
        why = [r for pat, sub, r in OPEN if fnmatch(case_id, pat) and sub in v]
        if why:
            known.add(why[0])
        else:
            unknown.append(v)
    return known, unknown


NOT_DRAWN: tuple[str, ...] = (
    "client-expect-100-continue*",
    "upstream-interim-*",
    "upstream-switch-101*",
    "upstream-second-response*",
    # bytes past a response's end stay on the pooled connection: a concurrent request may get a 503
    "upstream-trailing-garbage*",
    "upstream-dangling-head*",
    "upstream-late-response*",
    "upstream-no-content-with-body*",
    "upstream-not-modified-with-body*",
    "upstream-chunk-zero-early*",
    "upstream-close-header-kept-open*",
)
"""Cases whose open bug can spoil another request's answer: the property test does not draw them
while the bug is open (the suite runs each alone, its follow-ups checked)."""


def drawn(case_id: str) -> bool:
    """Whether the property test may draw case ``case_id``."""
    return not any(fnmatch(case_id, pat) for pat in NOT_DRAWN)
