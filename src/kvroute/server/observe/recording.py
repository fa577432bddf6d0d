"""``kvroute serve --record FILE``: the live traffic written as a replayable trace.

The file is a ``kvroute`` trace (:mod:`kvroute.workloads.record` has the format and the privacy rules:
block chains and ids keyed with a per-file secret salt). Every request the router *routed* is in it, with
its arrival on the router's clock, prompt tokens, output tokens (``usage.completion_tokens`` of the answer;
without usage, e.g. a stream that did not ask for it or a client that left, the request's ``max_tokens``,
else 1), the router's block chain, the model, the session (``x-session-id`` header), the user (the body's
``user``, else the API key of the ``Authorization`` header) and the status the client got. Requests refused
before routing (bad input, over quota, no backend) are not in it.

One writer per file: with ``--workers N > 1`` the option is refused (each worker would write its own
unordered header and lines into one file).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import IO

from kvroute.errors import UserError
from kvroute.server.wire.http import usage_count
from kvroute.server.wire.validate import ParsedRequest
from kvroute.workloads.record import RecordedRequest, TraceRecorder

__all__ = ["SESSION_HEADER", "TrafficRecording", "completion_tokens"]

SESSION_HEADER = "x-session-id"
"""The header that names a request's session (conversation) in a recorded trace."""


def completion_tokens(data: bytes) -> int | None:
    """``usage.completion_tokens`` from a JSON body or the last SSE event carrying usage in ``data`` (the
    tail of a stream); None when absent or unparsable."""
    return usage_count(data, "completion_tokens")


class TrafficRecording:
    """The router's recorder: opens ``path`` (truncating it), writes the trace as requests end, closes at
    shutdown. ``block_size``: the router's block size (tokens); ``clock``: the pipeline's clock
    (``time.perf_counter``, seconds), the one its arrival times are on."""

    def __init__(self, path: str, block_size: int, clock: Callable[[], float] = time.perf_counter) -> None:
        try:
            self._file: IO[bytes] = open(path, "wb")  # noqa: SIM115 - closed in close()
        except OSError as exc:
            raise UserError(f"cannot open the record file {path}: {exc.strerror}") from None
        self.path = path
        self._trace = TraceRecorder(self._file, block_size, clock, started_unix=time.time())

    @property
    def written(self) -> int:
        """Requests written so far."""
        return self._trace.written

    def begin(self, arrival: float) -> int:
        """A routed request that arrived at ``arrival`` (the clock's seconds): its ticket."""
        return self._trace.begin(arrival)[0]

    def end(
        self,
        ticket: int,
        arrival: float,
        parsed: ParsedRequest,
        chain: tuple[int, ...],
        prompt_tokens: int,
        headers: Mapping[str, str],
        status: int | None,
        end: bytes | None,
    ) -> None:
        """The request of ``ticket`` ended: ``chain``/``prompt_tokens`` as the router knew them, ``status``
        the client's (None: it left before one was sent, recorded as 499), ``end`` the answer's body or
        stream tail (for its usage)."""
        output = completion_tokens(end) if end is not None else None
        if output is None:
            output = parsed.max_tokens or 1
        user = parsed.user
        if user is None:
            auth = headers.get("Authorization")
            user = auth if auth else None
        self._trace.finish(
            ticket,
            RecordedRequest(
                arrival=self._trace.since_start(arrival),
                prompt_len=prompt_tokens,
                output_len=output,
                block_hashes=chain,
                model=parsed.model or "",
                session=headers.get(SESSION_HEADER) or None,
                user=user,
                status=status if status is not None else 499,
            ),
        )

    def close(self) -> None:
        """Write what has ended and close the file (requests still in flight are left out)."""
        self._trace.close()
        self._file.close()
