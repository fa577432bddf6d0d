"""A stateful property test: random bursts of hostile and ordinary requests from concurrent clients
through the real router; the invariant on every response.

Each step is a burst of one to four actions run at once, each on its own connection: an ordinary
request (plain or streamed, completions or chat, to either target), a hostile client case, or an
upstream fault. Ordinary requests must always be a 200 with their own id; a hostile or faulty one
must keep the invariant its case states. A fault that makes the upstream look dead (it breaks before
its first byte) may cost the other requests of its burst to that upstream a 503; the next burst
waits until it is back. Bounded: a few examples of a few steps.

Every fault is drawn, ``late-response`` included: a response sent 30 ms late on a connection that
meanwhile carried the next request looks, to HTTP/1.1 framing, like that request's answer; the
upstream echoes each request's ``X-Request-Id`` (as vLLM does with ``--enable-request-id-headers``),
and the router drops an answer whose echoed id is not the one it sent."""

from __future__ import annotations

import asyncio
import importlib.util
from dataclasses import dataclass

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule, run_state_machine_as_test

from kvroute.conformance.clients import CLIENTS, Outcome, ordinary_request
from kvroute.conformance.faults import FAULTS
from kvroute.conformance.invariant import Expect
from kvroute.conformance.runner import Case, Target
from kvroute.conformance.world import World

# the admin API's guard takes a non-UTF-8 Authorization for a 401 since main's b2ac54c (server/wire/auth.py):
# not drawn before
_ADMIN_FIXED = importlib.util.find_spec("kvroute.server.wire.auth") is not None


@dataclass(frozen=True)
class _Ordinary:
    target: str
    chat: bool
    stream: bool


def _actions(world: World) -> st.SearchStrategy[object]:
    targets = st.sampled_from(["upstream", "engine"])
    ordinary = st.builds(_Ordinary, targets, st.booleans(), st.booleans())
    clients = [c for c in CLIENTS if c != "authorization-non-utf8" or _ADMIN_FIXED]
    hostile = [Case("client", c, t) for c in clients for t in world.targets]
    faulty = [Case("upstream", f, world.upstream, s) for f in FAULTS for s in (False, True)]
    return st.one_of(ordinary, ordinary, st.sampled_from(hostile), st.sampled_from(faulty))


async def _act(world: World, action: object) -> tuple[str, Target, list[Outcome]]:
    suite = world.suite
    if isinstance(action, _Ordinary):
        target = world.upstream if action.target == "upstream" or world.engine is None else world.engine
        out = await ordinary_request(suite.ctx(target), action.chat, action.stream)
        return "ordinary", target, [out]
    assert isinstance(action, Case)
    ctx = suite.ctx(action.target)
    if action.kind == "client":
        return action.id, action.target, await CLIENTS[action.name].run(ctx)
    fault = FAULTS[action.name]
    exp = Expect(None, action.stream, fault.allowed, client_fault=False)
    out = await ordinary_request(ctx, action.stream, action.stream, action.name, exp)
    return action.id, action.target, [out]


def _burst(world: World, burst: list[object]) -> None:
    """Run ``burst``'s actions at once; the invariant holds for every response and the front door."""
    since = world.door.mark()

    async def all_at_once() -> list[tuple[str, Target, list[Outcome]]]:
        return await asyncio.gather(*(_act(world, a) for a in burst))

    unknown = []
    ejects = any(isinstance(a, Case) and a.kind == "upstream" and FAULTS[a.name].ejects for a in burst)
    for case_id, target, outcomes in world.harness.call(all_at_once()):
        for o in outcomes:
            if ejects and target is world.upstream and o.response is not None and o.response.status == 503:
                continue  # the fault made the upstream look dead: no upstream for anyone a while
            unknown += [f"{case_id}: {v}" for v in world.suite.check(o, target)]
    faults = any(isinstance(a, Case) and a.kind == "upstream" for a in burst)
    unknown += world.door.problems(since, client_fault=not faults)
    assert not unknown, "\n".join(unknown)
    if ejects:  # the next burst starts with the upstream back in service
        world.harness.call(world.suite.ready([world.upstream], timeout_s=20.0))


def test_late_responses_among_concurrent_requests(conformance_world: World) -> None:
    """The case the random draw meets only now and then, every time: late responses (plain and
    streamed) beside ordinary requests to the same upstream, on the connections they leave behind."""
    world = conformance_world
    late = [Case("upstream", "late-response", world.upstream, s) for s in (False, True)]
    ordinary = [_Ordinary("upstream", chat, stream) for chat in (False, True) for stream in (False, True)]
    for _ in range(4):
        _burst(world, [*late, *ordinary])
        _burst(world, [*ordinary, late[0]])


def test_random_interleavings(conformance_world: World) -> None:
    world = conformance_world
    actions = _actions(world)

    class Interleavings(RuleBasedStateMachine):
        @rule(burst=st.lists(actions, min_size=1, max_size=4))
        def burst(self, burst: list[object]) -> None:
            _burst(world, burst)

    run_state_machine_as_test(
        Interleavings,
        settings=settings(
            max_examples=4,
            stateful_step_count=6,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        ),
    )
