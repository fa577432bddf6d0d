"""``kvroute compare --executor ray[:ADDRESS]``: every simulation of a sweep as one Ray task.

:class:`RaySpecRunner` has :class:`~kvroute.sim.compare.SpecRunner`'s interface (a context manager
whose ``run(specs)`` returns summaries in the order of the specs and calls ``on_done`` in completion
order), so the comparison and the paper preset run unchanged on it. Each task runs
:func:`kvroute.sim.compare.run_one`, the function ``--jobs`` worker processes run, on a frozen
:class:`RunSpec`: the simulations are deterministic, so the results equal ``--jobs``'s except for
the timing fields (``wall_seconds``, ``cpu_seconds``).

``address``: ``None`` starts a local Ray (``ray.init()``, stopped on exit); otherwise it is passed to
``ray.init(address=...)`` (``auto``, ``ray://host:10001``, ``host:6379``) and the cluster is left
running. ``num_cpus`` caps a *local* Ray's CPUs (None: all). Workers of a remote cluster need
kvroute installed (or a ``runtime_env``), and traces at the same paths.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

from kvroute.errors import UserError
from kvroute.sim.compare import Summary, run_one
from kvroute.sim.runner import RunSpec

__all__ = ["RaySpecRunner", "parse_executor"]


def parse_executor(value: str) -> tuple[str, str | None]:
    """``local`` → (``local``, None); ``ray`` / ``ray:ADDRESS`` → (``ray``, address or None)."""
    if value == "local":
        return "local", None
    if value == "ray":
        return "ray", None
    if value.startswith("ray:") and len(value) > 4:
        return "ray", value[4:]
    raise UserError(f"--executor must be 'local', 'ray' or 'ray:ADDRESS', got {value!r}")


class RaySpecRunner:
    """Runs batches of specs as Ray tasks (module docstring)."""

    def __init__(
        self,
        address: str | None = None,
        on_done: Callable[[RunSpec, Summary], None] | None = None,
        num_cpus: int | None = None,
    ) -> None:
        self.address = address
        self.on_done = on_done
        self.num_cpus = num_cpus
        self._started = False
        self._task: Any = None

    def __enter__(self) -> RaySpecRunner:
        try:
            import ray
        except ImportError:
            raise UserError("--executor ray needs Ray: pip install 'kvroute[ray]'") from None
        if not ray.is_initialized():
            try:
                if self.address is None:
                    ray.init(num_cpus=self.num_cpus, include_dashboard=False, logging_level=logging.WARNING)
                else:
                    ray.init(address=self.address, logging_level=logging.WARNING)
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise UserError(
                    f"--executor ray: cannot reach Ray at {self.address or 'local'}: {exc}"
                ) from None
            self._started = True
        self._task = ray.remote(num_cpus=1, max_retries=0)(run_one)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._started:
            import ray

            ray.shutdown()
            self._started = False

    def run(self, specs: Sequence[RunSpec]) -> list[Summary]:
        """Run every spec as a task; raises the first error (a UserError stays a UserError)."""
        import ray

        if self._task is None:
            raise RuntimeError("RaySpecRunner.run outside its 'with' block")
        refs = [self._task.remote(s) for s in specs]
        where = {ref: i for i, ref in enumerate(refs)}
        results: list[Summary | None] = [None] * len(specs)
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            for ref in done:
                i = where[ref]
                try:
                    out = ray.get(ref)
                except ray.exceptions.RayTaskError as err:
                    for r in pending:
                        ray.cancel(r)
                    cause = err.as_instanceof_cause()
                    if isinstance(cause, UserError):
                        raise UserError(str(cause)) from None
                    raise
                results[i] = out
                if self.on_done is not None:
                    self.on_done(specs[i], out)
        return [r for r in results if r is not None]
