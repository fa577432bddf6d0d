"""The policy interface and small helpers shared by the policies.

A policy is pure: ``choose`` reads a :class:`~kvroute.views.RequestView` and the candidate
:class:`~kvroute.views.InstanceView` list and returns a :class:`~kvroute.views.Choice`. It does no
I/O and reads no clock. Stateful policies (round-robin counter, RNG) keep that state on the object.

Tie-break convention used by every deterministic policy unless its docstring says otherwise: among
equal scores, the lower ``InstanceView.index`` wins (deterministic replacement for the random
tie-breaks some reference routers use).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from kvroute.views import Choice, Hold, InstanceView, RequestView

__all__ = ["Policy", "Tracking", "argbest", "check_inputs", "minmax_normalise"]


@runtime_checkable
class Policy(Protocol):
    """Chooses one instance for a request.

    ``name`` is the registry name (including any parameter, e.g. ``"linear:0.7"``).
    ``choose`` returns a :class:`Choice` whose ``choice`` is a position in ``instances``; it may
    mutate only the policy's own state (counters, RNG). ``instances`` must be non-empty and
    ``request.cached_tokens`` must have one entry per instance.
    """

    name: str

    def choose(self, request: RequestView, instances: Sequence[InstanceView]) -> Choice: ...


@runtime_checkable
class Tracking(Protocol):
    """A policy that keeps its own per-instance bookkeeping of the requests it dispatched (the peers'
    routers count pending tokens or prefill work themselves instead of reading the engine's queue).

    Every driver calls :meth:`dispatched` through
    :meth:`kvroute.routing.core.RoutingCore.dispatched` once a request is sent to ``instance`` (an
    ``InstanceView.index``), and then the returned :class:`~kvroute.views.Hold`'s ``first_token`` and
    ``finished``. ``request`` is the view the policy chose with (its ``cached_tokens`` in the order of
    the candidates it was given; ``position`` is the chosen candidate's place in that order); ``now``
    is the driver's time in seconds.
    """

    def dispatched(self, request: RequestView, position: int, instance: int, now: float) -> Hold: ...


def check_inputs(request: RequestView, instances: Sequence[InstanceView]) -> int:
    """Return ``len(instances)``; raise ``ValueError`` if it is 0 or ``cached_tokens`` does not match."""
    n = len(instances)
    if n == 0:
        raise ValueError("no instances to choose from")
    if len(request.cached_tokens) != n:
        raise ValueError(f"cached_tokens has {len(request.cached_tokens)} entries for {n} instances")
    return n


def argbest(
    keys: Sequence[Sequence[float]],
    instances: Sequence[InstanceView],
    *,
    lower_is_better: bool = True,
) -> int:
    """Position of the best instance under lexicographic ``keys``, then lower ``InstanceView.index``.

    ``keys`` is a list of per-instance key columns (primary first). With ``lower_is_better=False``
    every key column is maximised (the index tie-break still prefers the lower index).
    """
    sign = 1.0 if lower_is_better else -1.0
    return min(
        range(len(instances)),
        key=lambda i: (*(sign * col[i] for col in keys), instances[i].index),
    )


def minmax_normalise(values: Sequence[float]) -> tuple[float, ...]:
    """Min-max normalise to [0, 1] across instances; all equal → all 0."""
    lo = min(values)
    span = max(values) - lo
    if span <= 0:
        return tuple(0.0 for _ in values)
    return tuple((v - lo) / span for v in values)
