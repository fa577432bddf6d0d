"""Load-only baselines: round-robin, random, power-of-two-choices, least-requests.

BS / load here is ``running + waiting`` (requests). None of these looks at the cache.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from kvroute.policies.base import argbest, check_inputs
from kvroute.views import Choice, InstanceView, RequestView

__all__ = ["LeastRequests", "PowerOfTwo", "RandomChoice", "RoundRobin"]


def _one_hot(n: int, choice: int) -> tuple[float, ...]:
    return tuple(1.0 if i == choice else 0.0 for i in range(n))


class RoundRobin:
    """Positions 0, 1, 2, … in turn (counter modulo the current list length); state: the counter.

    Scores are one-hot (1 for the chosen position, higher is better).
    """

    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, request: RequestView, instances: Sequence[InstanceView]) -> Choice:
        """Choose position ``counter % len(instances)`` and advance the counter."""
        n = check_inputs(request, instances)
        choice = self._next % n
        self._next += 1
        return Choice(choice=choice, scores=_one_hot(n, choice), policy=self.name, lower_is_better=False)


class RandomChoice:
    """Uniformly random position from the injected RNG; scores are one-hot (higher is better)."""

    name = "random"

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def choose(self, request: RequestView, instances: Sequence[InstanceView]) -> Choice:
        """Choose ``rng.randrange(len(instances))``."""
        n = check_inputs(request, instances)
        choice = self._rng.randrange(n)
        return Choice(choice=choice, scores=_one_hot(n, choice), policy=self.name, lower_is_better=False)


class PowerOfTwo:
    """Power of two choices: sample two distinct positions, keep the lower BS = running + waiting.

    Ties between the two → lower ``InstanceView.index``. One instance → it. Scores are BS for every
    instance (lower is better); ``detail["sampled"]`` is 1 for the two sampled positions, else 0.
    """

    name = "p2c"

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def choose(self, request: RequestView, instances: Sequence[InstanceView]) -> Choice:
        """Sample two positions with ``rng.sample`` and choose the less loaded of them."""
        n = check_inputs(request, instances)
        bs = tuple(float(inst.running + inst.waiting) for inst in instances)
        if n == 1:
            return Choice(choice=0, scores=bs, policy=self.name, detail={"sampled": (1.0,)})
        a, b = self._rng.sample(range(n), 2)
        ka = (bs[a], instances[a].index)
        kb = (bs[b], instances[b].index)
        choice = a if ka <= kb else b
        sampled = tuple(1.0 if i in (a, b) else 0.0 for i in range(n))
        return Choice(choice=choice, scores=bs, policy=self.name, detail={"sampled": sampled})


class LeastRequests:
    """Lowest running + waiting (requests); ties → lower ``InstanceView.index``."""

    name = "least-requests"

    def choose(self, request: RequestView, instances: Sequence[InstanceView]) -> Choice:
        """Choose the instance with the fewest outstanding requests."""
        check_inputs(request, instances)
        load = tuple(float(inst.running + inst.waiting) for inst in instances)
        return Choice(choice=argbest([load], instances), scores=load, policy=self.name)
