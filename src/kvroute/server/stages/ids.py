"""The request ids in flight on one router process, so that two requests in flight never reach an
engine under one id from it: a request whose id (the client's ``X-Request-Id``, or the router's
own, 128 random bits) is already held is refused with a 409 (:func:`in_flight`).

The guarantee is per process: with ``--workers`` or router replicas, two requests with one
client-chosen id that land on different processes both go through. vLLM keeps those apart (its
engine keys outputs by the id plus 8 random characters, and names both completions ``cmpl-<id>``),
and so does the emulated engine (the second gets a random id)."""

from __future__ import annotations

from kvroute.server.wire.validate import ApiError

__all__ = ["InFlightIds", "in_flight"]


class InFlightIds:
    """The ids held by the requests in flight (one event loop). Invariant: an id is held by at most
    one request, from :meth:`claim` until its :meth:`release`, which the holder calls on every
    path."""

    __slots__ = ("_held",)

    def __init__(self) -> None:
        self._held: set[str] = set()

    def claim(self, rid: str) -> bool:
        """Hold ``rid`` for a new request; False (nothing held) when a request in flight holds it."""
        held = self._held
        if rid in held:
            return False
        held.add(rid)
        return True

    def release(self, rid: str) -> None:
        """The request holding ``rid`` ended."""
        self._held.discard(rid)

    def __len__(self) -> int:
        return len(self._held)


def in_flight(rid: str) -> ApiError:
    """The 409 of a request whose ``X-Request-Id`` a request in flight already holds."""
    return ApiError(
        409,
        f"X-Request-Id {rid!r} is already in use by a request in flight; send a unique X-Request-Id",
        param="X-Request-Id",
        code="request_id_in_flight",
    )
