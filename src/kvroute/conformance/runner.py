"""The runner: every case against a front door, the invariant on every response, then ordinary
requests over the same pooled upstream connections.

A :class:`Target` is one model behind the front door: either served by a
:class:`~kvroute.conformance.upstream.MisbehavingUpstream` (its faults can be asked for, and what it
received is checked with :func:`~kvroute.conformance.invariant.check_forwarded`) or by a real engine.
:func:`cases` lists every (case, target) pair: each client case against every target, each upstream
fault (plain completions and streamed chat) against every misbehaving upstream.

:meth:`Suite.run` carries out one case, waits ``settle_s`` (so bytes a misbehaving upstream sends
late reach the front door while its connection is idle), then sends ordinary follow-ups to the same
target: two one after another (the front door's pool hands out the connection used last first),
then three at once. A follow-up answered 503 after a fault that breaks before the first byte
(``Fault.ejects``: the upstream looks dead) is retried for up to ``recover_s`` (the front door may
have taken it out of service a while); otherwise every one must
be a 200 with its own id. Finally the front door's log since the case began must be clean.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Coroutine, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from kvroute.conformance.clients import CLIENTS, LISTED_HEADER, Ctx, Outcome, ordinary_request
from kvroute.conformance.faults import FAULTS
from kvroute.conformance.frontdoor import FrontDoor
from kvroute.conformance.invariant import Expect, check_forwarded, check_response
from kvroute.conformance.upstream import MisbehavingUpstream

__all__ = ["Case", "Harness", "Report", "Suite", "Target", "cases"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Target:
    """A model behind the front door; ``upstream``: ours when it serves the model (None: a real
    engine, which knows no faults)."""

    name: str
    model: str
    upstream: MisbehavingUpstream | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class Case:
    """One case: a client case (``kind == "client"``) or an upstream fault (``"upstream"``, sent as
    a streamed chat when ``stream``), against ``target``."""

    kind: Literal["client", "upstream"]
    name: str
    target: Target
    stream: bool = False

    @property
    def id(self) -> str:
        """A readable test id, e.g. ``client-expect-100-continue@engine``."""
        tail = "-stream" if self.stream else ""
        return f"{self.kind}-{self.name}{tail}@{self.target.name}"


@dataclass(frozen=True, slots=True)
class Report:
    """What one case did: ``violations`` (empty: the invariant held), ``responses`` checked."""

    case: str
    violations: tuple[str, ...]
    responses: int


def cases(
    targets: Sequence[Target], clients: Sequence[str] | None = None, faults: Sequence[str] | None = None
) -> list[Case]:
    """Every (case, target) pair (module docstring), optionally only the named ``clients`` and
    ``faults``."""
    out = [Case("client", c, t) for c in (clients if clients is not None else CLIENTS) for t in targets]
    for f in faults if faults is not None else FAULTS:
        for t in targets:
            if t.upstream is not None:
                out += [Case("upstream", f, t, stream=False), Case("upstream", f, t, stream=True)]
    return out


class Suite:
    """Runs cases through ``door`` (module docstring). ``timeout_s``: the bound on every wait."""

    def __init__(
        self,
        door: FrontDoor,
        timeout_s: float = 10.0,
        settle_s: float = 0.15,
        recover_s: float = 10.0,
    ) -> None:
        self.door = door
        self.timeout_s = timeout_s
        self.settle_s = settle_s
        self.recover_s = recover_s

    def ctx(self, target: Target) -> Ctx:
        return Ctx(self.door.host, self.door.port, target.model, self.timeout_s)

    async def ready(self, targets: Sequence[Target], timeout_s: float = 60.0) -> None:
        """Wait until every target answers an ordinary request with a 200 (RuntimeError if not)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        for t in targets:
            while True:
                out = await ordinary_request(self.ctx(t), chat=False, stream=False)
                if out.response is not None and out.response.status == 200:
                    break
                if loop.time() > deadline:
                    got = out.response.status if out.response else out.error
                    raise RuntimeError(f"{t.name} ({t.model}) not served through the front door: {got}")
                await asyncio.sleep(0.1)

    async def run(self, case: Case) -> Report:
        """One case, its follow-ups and the log check."""
        since = self.door.mark()
        ctx = self.ctx(case.target)
        client_fault = case.kind == "client"
        if client_fault:
            outcomes = await CLIENTS[case.name].run(ctx)
        else:
            fault = FAULTS[case.name]
            exp = Expect(None, case.stream, fault.allowed, client_fault=False)
            outcomes = [
                await ordinary_request(ctx, chat=case.stream, stream=case.stream, fault=case.name, expect=exp)
            ]
        violations = [f"{case.name}: {v}" for o in outcomes for v in self.check(o, case.target)]
        await asyncio.sleep(self.settle_s)
        follow = await self.follow_ups(case.target, recover=not client_fault and FAULTS[case.name].ejects)
        violations += [f"follow-up: {v}" for o in follow for v in self.check(o, case.target)]
        violations += self.door.problems(since, client_fault)
        return Report(case.id, _counted(violations), len(outcomes) + len(follow))

    def check(self, out: Outcome, target: Target) -> list[str]:
        """The invariant on one outcome, and on what our upstream received for it."""
        found = [out.error] if out.error else []
        found += check_response(out.response, out.expect)
        up = target.upstream
        resp = out.response
        if up is not None and resp is not None and resp.status == 200:
            rid = out.expect.rid or resp.header("x-request-id") or ""
            for rec in up.received_for(rid):
                found += check_forwarded(rec.headers, (LISTED_HEADER,))
        return found

    async def follow_ups(self, target: Target, recover: bool) -> list[Outcome]:
        """Ordinary requests after a case: two in a row, then three at once."""
        ctx = self.ctx(target)
        out = []
        for chat, stream in ((False, False), (True, True)):
            out.append(await self._ordinary(ctx, chat, stream, recover))
        out += await asyncio.gather(*(self._ordinary(ctx, i == 1, i == 2, False) for i in range(3)))
        return out

    async def _ordinary(self, ctx: Ctx, chat: bool, stream: bool, recover: bool) -> Outcome:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.recover_s if recover else 0.0)
        while True:
            out = await ordinary_request(ctx, chat, stream)
            resp = out.response
            if not (recover and resp is not None and resp.status == 503 and loop.time() < deadline):
                return out
            await asyncio.sleep(0.1)


def _counted(violations: list[str]) -> tuple[str, ...]:
    """Each distinct violation once, with how many times it occurred."""
    seen: dict[str, int] = {}
    for v in violations:
        seen[v] = seen.get(v, 0) + 1
    return tuple(v if n == 1 else f"{v} (x{n})" for v, n in seen.items())


class Harness:
    """An event loop on a background thread, for callers without one (pytest's plain tests,
    hypothesis' state machines): :meth:`call` runs a coroutine there and waits for it, bounded."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="conformance-loop", daemon=True)
        self._thread.start()

    def call(self, coro: Coroutine[Any, Any, T] | Awaitable[T], timeout_s: float = 120.0) -> T:
        fut: Future[T] = asyncio.run_coroutine_threadsafe(_wrap(coro), self.loop)
        return fut.result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


async def _wrap(aw: Awaitable[T]) -> T:
    return await aw
