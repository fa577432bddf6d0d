"""Request classes (design §5.3): TTFT-sensitive and TPOT-sensitive requests weigh BS differently.

The LMetric score of a request of class ``c`` is ``P-token × (BS + 1) ^ w_c``:

- ``ttft`` (interactive chat; default ``w = 0.5``): the time to first token is mostly the prefill work
  queued ahead plus the request's own (both in P-token), so BS counts less;
- ``tpot`` (batch, long generations; default ``w = 2``): the time per output token grows with the
  batch it decodes in, so BS counts more;
- any other class (``default``): ``w = 1``, the paper's policy.

**Where the class comes from** (:func:`resolve_class`), first match wins: the request header
``x-kvroute-class``; a rule for the request's ``user`` field; a rule for its ``model``; else
``default``. A header naming a class without a weight is an error for the client (HTTP 400).
In the simulator the class is the workload's ``req_class``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvroute.errors import UserError

__all__ = ["CLASS_HEADER", "ClassConfig", "class_weight", "resolve_class"]

CLASS_HEADER = "x-kvroute-class"


@dataclass(frozen=True, slots=True)
class ClassConfig:
    """``weights``: class → BS exponent; ``users``/``models``: user or model name → class."""

    weights: tuple[tuple[str, float], ...] = (("ttft", 0.5), ("tpot", 2.0))
    users: tuple[tuple[str, str], ...] = ()
    models: tuple[tuple[str, str], ...] = ()

    def check(self) -> ClassConfig:
        names = {c for c, _ in self.weights}
        for c, w in self.weights:
            if not w >= 0 or not c:
                raise UserError(f"classes: weight of {c!r} must be >= 0 (got {w})")
        for _, c in (*self.users, *self.models):
            if c != "default" and c not in names:
                raise UserError(f"classes: rule names class {c!r}, which has no weight")
        return self

    @property
    def weight_map(self) -> Mapping[str, float]:
        return dict(self.weights)


def class_weight(req_class: str, weights: Mapping[str, float]) -> float:
    """The BS exponent of ``req_class`` (1.0 for classes without a weight, e.g. ``default``)."""
    return weights.get(req_class, 1.0)


def resolve_class(header: str | None, user: str | None, model: str | None, config: ClassConfig) -> str:
    """The request's class (see the module docstring). Raises ``ValueError`` for a header naming an
    unknown class."""
    if header is not None:
        h = header.strip().lower()
        if h != "default" and h not in config.weight_map:
            known = ", ".join(["default", *config.weight_map])
            raise ValueError(f"unknown request class {header!r} in {CLASS_HEADER}; known: {known}")
        return h
    if user is not None:
        for u, c in config.users:
            if u == user:
                return c
    if model is not None:
        for m, c in config.models:
            if m == model:
                return c
    return "default"
