"""Model pools: backends grouped by the models they serve; a request's ``model`` picks its pool.

What a backend serves is either **declared** in its config (``models: [...]``, ``lora_adapters:
[...]``, never refreshed) or **listed** by its own ``GET /v1/models``, which the monitor reads when
the backend is admitted and every ``models_interval_s`` seconds (a failed read keeps the last list).
A vLLM engine lists its LoRA adapters (``--lora-modules NAME=PATH``) as models whose ``parent`` is the
base model: those ids are adapters. A backend whose list is not known yet serves any model.

Selection (:meth:`ModelPools.select`), for a request naming ``model``:

- no ``model``: every routable backend (the engine then uses its default model);
- a model no live backend lists, while every live backend's list is known: 404
  ``model_not_found`` naming the served models (OpenAI's error shape);
- otherwise the routable backends that list it (or whose list is unknown); none: 503.

An adapter is part of the cache key (:func:`kvroute.blocks.extra_key`): a request for an adapter
hashes its blocks with the adapter's name, as vLLM does, and only backends that have the adapter
loaded take it. Not thread-safe: the router's event loop only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvroute.server.state.backends import BackendState
from kvroute.server.wire.validate import ApiError

__all__ = ["ModelPools", "ServedModels", "model_not_found", "parse_model_list"]


@dataclass(frozen=True, slots=True)
class ServedModels:
    """What one backend serves: ``models`` every id (base models and adapters), ``adapters`` the LoRA
    adapters among them; ``declared``: from the config (never refreshed); ``max_model_len``: the
    largest context length (tokens) its cards list (vLLM's ``max_model_len``; 0: none listed)."""

    models: frozenset[str]
    adapters: frozenset[str] = frozenset()
    declared: bool = False
    max_model_len: int = 0


def parse_model_list(body: Any) -> ServedModels | None:
    """A ``/v1/models`` JSON body → what it lists (None when it is not a model list). A card whose
    ``parent`` is another model is a LoRA adapter (vLLM's convention)."""
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        return None
    models: set[str] = set()
    adapters: set[str] = set()
    longest = 0
    for card in data:
        if not isinstance(card, dict) or not isinstance(card.get("id"), str):
            continue
        mid = card["id"]
        models.add(mid)
        n = card.get("max_model_len")
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            longest = max(longest, n)
        parent = card.get("parent")
        if isinstance(parent, str) and parent != mid:
            adapters.add(mid)
    return ServedModels(frozenset(models), frozenset(adapters), max_model_len=longest)


def model_not_found(model: str, served: Sequence[str]) -> ApiError:
    """OpenAI's 404 for an unknown model (``code: model_not_found``), naming the served models."""
    names = ", ".join(served) if served else "none"
    return ApiError(
        404,
        f"The model '{model}' does not exist or is not served here; served models: {names}",
        "model",
        etype="invalid_request_error",
        code="model_not_found",
    )


class ModelPools:
    """Per backend index, what it serves (module docstring). Mutated by :meth:`declare`,
    :meth:`listed` and :meth:`forget`."""

    def __init__(self) -> None:
        self._served: dict[int, ServedModels] = {}
        self._adapters: frozenset[str] = frozenset()

    def declare(self, index: int, models: Iterable[str], adapters: Iterable[str]) -> None:
        """Backend ``index``'s config lists what it serves (empty: nothing declared, learn it from its
        /v1/models)."""
        models, adapters = frozenset(models), frozenset(adapters)
        if models or adapters:
            self._served[index] = ServedModels(models | adapters, adapters, declared=True)
        elif self._served.get(index, ServedModels(frozenset())).declared:
            del self._served[index]
        self._update()

    def listed(self, index: int, served: ServedModels) -> bool:
        """Backend ``index``'s /v1/models said ``served`` (ignored when its config declares its
        models); True when that changed what it serves."""
        old = self._served.get(index)
        if old is not None and (old.declared or old == served):
            return False
        self._served[index] = served
        self._update()
        return True

    def forget(self, index: int) -> None:
        """Backend ``index`` is gone."""
        if self._served.pop(index, None) is not None:
            self._update()

    def _update(self) -> None:
        self._adapters = frozenset().union(*(s.adapters for s in self._served.values()))

    def served_by(self, index: int) -> ServedModels | None:
        """What backend ``index`` serves, None while unknown."""
        return self._served.get(index)

    @property
    def known(self) -> bool:
        """Some backend's models are known (pools are in use)."""
        return bool(self._served)

    @property
    def adapters(self) -> frozenset[str]:
        """The LoRA adapters of every backend."""
        return self._adapters

    def max_model_len(self) -> int:
        """The largest context length (tokens) any backend's /v1/models lists; 0 when none does."""
        return max((s.max_model_len for s in self._served.values()), default=0)

    def is_adapter(self, model: str | None) -> bool:
        """``model`` is a LoRA adapter on some backend."""
        return model is not None and model in self._adapters

    def served(self, live: Iterable[int]) -> list[str]:
        """Sorted ids served by the ``live`` backends whose lists are known."""
        out: set[str] = set()
        for i in live:
            s = self._served.get(i)
            if s is not None:
                out |= s.models
        return sorted(out)

    def select(
        self, model: str | None, live: Sequence[BackendState], routable: Sequence[BackendState]
    ) -> list[BackendState]:
        """The ``routable`` backends that may take a request for ``model`` (module docstring). ``live``:
        every backend not removed. Raises ApiError 404 (unknown model) or 503 (its backends are all
        unavailable)."""
        if model is None or not self._served:
            return list(routable)
        served = self._served
        out = [b for b in routable if (s := served.get(b.index)) is None or model in s.models]
        if out:
            return out
        if not any((s := served.get(b.index)) is None or model in s.models for b in live):
            raise model_not_found(model, self.served(b.index for b in live))
        raise ApiError(
            503, f"no healthy backend serves model '{model}'", "model", etype="service_unavailable"
        )
