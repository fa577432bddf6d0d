"""Backends that come and go, without sockets: reconcile (adds, drains, removals, KV events changes),
the index never reused, a policy swap, discovery sources with an injected resolver, the admin body
validation and the metrics of removed backends."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import orjson
import pytest

from kvroute.commands.settings import backends_from_text
from kvroute.errors import UserError
from kvroute.features.coldstart import ColdStartConfig
from kvroute.features.hotspot import HotspotConfig
from kvroute.features.loadadapt import LoadAdaptiveConfig
from kvroute.features.settings import FeatureConfig
from kvroute.server.app import RouterServer
from kvroute.server.config import BackendSpec, RouterConfig, parse_backend_url
from kvroute.server.observe.exporter import render_metrics
from kvroute.server.state.backends import ACTIVE, DRAINING, REMOVED, Lease
from kvroute.server.sync.admin import add_backend, delete_backend, spec_from_body
from kvroute.server.sync.discovery import Discovery, DnsSource, FileSource, make_source
from kvroute.server.sync.fleet import STATIC
from kvroute.server.wire.validate import ApiError
from kvroute.tokenizer import Tokenizer

from .fakes import FakeTransport, Scripted

A, B, C = "http://a:1", "http://b:1", "http://c:1"
CHAIN = (11, 12, 13)


def make_server(tokenizer: Tokenizer, *specs: BackendSpec, **kw: object) -> RouterServer:
    cfg = RouterConfig(backends=specs, port=0, **kw)  # type: ignore[arg-type]
    return RouterServer(cfg, transport=FakeTransport({}), tokenizer=tokenizer, background=False)


def states(server: RouterServer) -> list[tuple[int, str, str]]:
    return [(b.index, b.url, b.state) for b in server.state.backends]


def test_reconcile_adds_unhealthy_then_drains_and_removes_idle(tokenizer: Tokenizer) -> None:
    server = make_server(tokenizer, BackendSpec(A), BackendSpec(B))
    core, fleet = server.state, server.fleet
    changes = server.reconcile([BackendSpec(A), BackendSpec(C, "tcp://c:5557")])
    assert changes.added == (C,) and changes.drained == (B,)
    assert states(server) == [(0, A, ACTIVE), (1, B, REMOVED), (2, C, ACTIVE)]
    c = core.backends[2]
    assert not c.healthy and not c.routable  # admitted by its first good health check
    assert core.kv.num_backends == 3 and core.kv.mode(2, 0.0) == "exact"
    assert [b.url for b in core.live_backends()] == [A, C]
    assert not fleet.reap()  # nothing left to remove


def test_removal_waits_for_in_flight_then_clears_the_kv_view(tokenizer: Tokenizer) -> None:
    server = make_server(tokenizer, BackendSpec(A), BackendSpec(B))
    core, fleet = server.state, server.fleet
    core.kv.on_routed(1, CHAIN, 0.0)
    assert core.kv.match(CHAIN, 0.0)[1] == 3
    lease = Lease(core.backends[1], 100, 3)
    changes = server.reconcile([BackendSpec(A)])
    b = core.backends[1]
    assert changes.drained == (B,) and b.state == DRAINING and fleet.removing(1)
    assert not fleet.reap()  # a request still runs there
    lease.first_byte()
    assert b.state == DRAINING
    lease.release()
    assert [x.url for x in fleet.reap()] == [B]
    assert b.state == REMOVED and core.table.own(b.slot) == (0, 0, 0, 0)
    assert core.kv.match(CHAIN, 1.0)[1] == 0


def test_draining_backend_is_no_candidate_and_comes_back_when_listed_again(tokenizer: Tokenizer) -> None:
    server = make_server(tokenizer, BackendSpec(A), BackendSpec(B))
    core = server.state
    lease = Lease(core.backends[1], 10)
    server.reconcile([BackendSpec(A)])
    assert [b.url for b in core.backends if b.routable] == [A]
    changes = server.reconcile([BackendSpec(A), BackendSpec(B)])
    assert changes.reactivated == (B,) and not changes.added
    assert core.backends[1].state == ACTIVE and not server.fleet.removing(1)
    lease.release()
    assert not server.fleet.reap() and core.backends[1].state == ACTIVE


def test_index_is_never_reused_and_the_load_slot_is(tokenizer: Tokenizer) -> None:
    server = make_server(tokenizer, BackendSpec(A), BackendSpec(B))
    core = server.state
    slot = core.backends[1].slot
    server.reconcile([BackendSpec(A)])
    server.reconcile([BackendSpec(A), BackendSpec(B)])
    assert states(server) == [(0, A, ACTIVE), (1, B, REMOVED), (2, B, ACTIVE)]
    assert core.backends[2].slot == slot and core.find(B) is core.backends[2]


def test_kv_events_change_is_an_update_that_switches_the_view(tokenizer: Tokenizer) -> None:
    server = make_server(tokenizer, BackendSpec(A), BackendSpec(B))
    core = server.state
    core.kv.on_routed(1, CHAIN, 0.0)
    changes = server.reconcile([BackendSpec(A), BackendSpec(B, "tcp://b:5557")])
    assert changes.updated == (B,) and changes.resubscribed == (B,) and not changes.added
    assert core.specs[1].kv_events == "tcp://b:5557"
    assert core.kv.mode(1, core.clock()) == "recovering"  # history still counts for recovery_s
    assert core.kv.match(CHAIN, core.clock())[1] == 3
    changes = server.reconcile([BackendSpec(A), BackendSpec(B, tags=("spot",))])
    assert changes.resubscribed == (B,) and core.kv.mode(1, core.clock()) == "approx"
    assert core.tags == {1: frozenset({"spot"})}
    assert not server.reconcile([BackendSpec(A), BackendSpec(B, tags=("spot",))])


def test_sources_combine_and_static_ones_survive_discovery(tokenizer: Tokenizer) -> None:
    server = make_server(tokenizer, BackendSpec(A))
    fleet = server.fleet
    assert fleet.set_source("dns://x:1", [BackendSpec(B), BackendSpec(A, "tcp://a:1")]) is not None
    assert [b.url for b in server.state.live_backends()] == [A, B]
    assert server.state.specs[0].kv_events is None  # static first: its spec wins
    assert fleet.set_source("dns://x:1", [BackendSpec(B), BackendSpec(A, "tcp://a:1")]) is None
    changes = fleet.set_source("dns://x:1", [])
    assert changes is not None and changes.drained == (B,)
    assert [b.url for b in server.state.live_backends()] == [A]
    fleet.forget(A)
    assert fleet.deleted() == {STATIC: (A,)} and fleet.desired() == []


def test_an_admin_deletion_survives_reloads_until_the_source_lists_it_anew(tokenizer: Tokenizer) -> None:
    """Regression: a SIGHUP reload of the same file brought back a backend deleted through the admin
    API (on that replica only). Per source: only a change of that source's own entry brings it back."""
    server = make_server(tokenizer, BackendSpec(A), BackendSpec(B))
    fleet = server.fleet
    b = server.state.find(B)
    assert b is not None
    delete_backend(fleet, b)
    assert [x.url for x in server.state.live_backends()] == [A]
    assert fleet.set_source(STATIC, [BackendSpec(A), BackendSpec(B)]) is None  # the same file
    assert [x.url for x in server.state.live_backends()] == [A]
    changes = fleet.set_source(STATIC, [BackendSpec(A), BackendSpec(B), BackendSpec(C)])  # others change
    assert changes is not None and changes.added == (C,)
    assert [x.url for x in server.state.live_backends()] == [A, C]
    fleet.set_source("dns://x:1", [BackendSpec(B)])  # another source lists it: it comes back
    assert B in [x.url for x in server.state.live_backends()]
    fleet.set_source("dns://x:1", [])
    assert B not in [x.url for x in server.state.live_backends()]
    fleet.set_source(STATIC, [BackendSpec(A), BackendSpec(C)])  # the operator takes it off the file...
    assert fleet.deleted() == {}
    changes = fleet.set_source(STATIC, [BackendSpec(A), BackendSpec(C), BackendSpec(B)])  # ...and back
    assert changes is not None and changes.added == (B,)
    b = server.state.find(B)
    assert b is not None
    delete_backend(fleet, b)
    changes = fleet.set_source(STATIC, [BackendSpec(A), BackendSpec(C), BackendSpec(B, tags=("spot",))])
    assert changes is not None and changes.added == (B,)  # its entry changed: listed anew


def test_apply_config_swaps_policy_keeps_kv_view_and_rejects_bad_features(tokenizer: Tokenizer) -> None:
    server = make_server(tokenizer, BackendSpec(A), BackendSpec(B))
    core = server.state
    core.kv.on_routed(0, CHAIN, 0.0)
    lease = Lease(core.backends[0], 5)
    kv = core.kv
    new = RouterConfig(
        backends=(BackendSpec(A), BackendSpec(C)),
        policy="round-robin",
        port=1234,
        features=FeatureConfig(hotspot=HotspotConfig()),
    )
    summary = server.apply_config(new)
    assert "+http://c:1" in summary and "-http://b:1" in summary and "round-robin" in summary
    assert "not applied until a restart: port" in summary
    assert core.kv is kv and core.kv.match(CHAIN, 0.0)[0] == 3 and core.backends[0].waiting == 1
    assert core.guard is not None and server.config.policy == "round-robin" and server.config.port == 0
    assert b"kvroute_hotspot_alarms_total" in render_metrics(server.registry)
    with pytest.raises(UserError):
        server.apply_config(RouterConfig(backends=()))
    # a feature the policy cannot take (load-adaptive needs lmetric): nothing changes
    feats = FeatureConfig(load_adaptive=LoadAdaptiveConfig())
    bad = RouterConfig(backends=(BackendSpec(A),), policy="round-robin", features=feats)
    with pytest.raises(UserError):
        server.apply_config(bad)
    assert server.config.policy == "round-robin" and [b.url for b in core.live_backends()] == [A, C]
    lease.release()


def test_removed_backends_leave_the_metrics(tokenizer: Tokenizer) -> None:
    server = make_server(tokenizer, BackendSpec(A), BackendSpec(B))
    server.reconcile([BackendSpec(A)])
    text = render_metrics(server.registry).decode()
    assert 'kvroute_backend_healthy{backend="http://a:1"} 1.0' in text
    assert "http://b:1" not in text
    assert 'kvroute_backends{state="active"} 1.0' in text
    assert 'kvroute_backends{state="removed"} 1.0' in text


# ---- admin body --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b"[1]", None),
        (b"{", None),
        (b'{"url": "ftp://a:1"}', "url"),
        (b'{"url": "http://a"}', "url"),
        (b'{"url": "http://a:1/v1"}', "url"),
        (b'{"url": 3}', "url"),
        (b'{"url": "http://a:1", "kv_events": "ipc:///x"}', "kv_events"),
        (b'{"url": "http://a:1", "kv_events": "tcp://a"}', "kv_events"),
        (b'{"url": "http://a:1", "tags": "spot"}', "tags"),
        (b'{"url": "http://a:1", "weight": 2}', "weight"),
        # control characters, spaces, an empty query, port 0 or past 65535, a quote in the host
        (b'{"url": "http://a:1\\r"}', "url"),
        (b'{"url": "http://a:1\\n"}', "url"),
        (b'{"url": "http://a:1\\t"}', "url"),
        (b'{"url": "http://a :1"}', "url"),
        (b'{"url": "http://a:1?"}', "url"),
        (b'{"url": "http://a:1#"}', "url"),
        (b'{"url": "http://a:0"}', "url"),
        (b'{"url": "http://a:65536"}', "url"),
        (b'{"url": "http://a\\"b:1"}', "url"),
        (b'{"url": "http://\\u00e9:1"}', "url"),
        (b'{"url": "http://a:1", "kv_events": "tcp://a:5557\\r"}', "kv_events"),
    ],
)
def test_admin_body_errors_name_the_field(body: bytes, field: str | None) -> None:
    with pytest.raises(ApiError) as err:
        spec_from_body(body)
    assert err.value.status == 400 and err.value.param == field


@pytest.mark.parametrize(
    ("url", "canonical"),
    [
        ("http://a:1/", "http://a:1"),
        ("HTTP://A:1", "http://a:1"),
        ("http://a:0001", "http://a:1"),
        ("https://[FD00::1]:8000", "https://[fd00::1]:8000"),
    ],
)
def test_admin_urls_are_compared_in_one_form(tokenizer: Tokenizer, url: str, canonical: str) -> None:
    """One engine has one URL, however a client writes it: the 409 for a listed engine cannot be
    dodged by case, a leading zero or a trailing slash (nor, above, by a trailing control character)."""
    assert spec_from_body(orjson.dumps({"url": url})).url == canonical
    server = make_server(tokenizer, BackendSpec(parse_backend_url(url)))
    with pytest.raises(ApiError) as err:
        add_backend(server.fleet, spec_from_body(orjson.dumps({"url": canonical})))
    assert err.value.status == 409


def test_admin_body_ok() -> None:
    assert spec_from_body(b'{"url": "http://a:1/", "kv_events": "tcp://a:5557"}') == BackendSpec(
        "http://a:1", "tcp://a:5557"
    )


# ---- discovery sources ---------------------------------------------------------------------------


async def test_dns_source_addresses_template_and_failures(caplog: pytest.LogCaptureFixture) -> None:
    answers: list[object] = [[("10.0.0.1", 8000), ("fd00::2", 8000)], OSError("no such name"), OSError("x")]

    async def resolve(name: str, port: int) -> list[tuple[str, int]]:
        assert (name, port) == ("engines", 8000)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer  # type: ignore[return-value]

    src = make_source("dns://engines:8000", "tcp://{host}:5557", resolve)
    assert isinstance(src, DnsSource)
    assert await src.poll() == (
        BackendSpec("http://10.0.0.1:8000", "tcp://10.0.0.1:5557"),
        BackendSpec("http://[fd00::2]:8000", "tcp://[fd00::2]:5557"),
    )
    with caplog.at_level(logging.WARNING, "kvroute.server"):
        assert await src.poll() is None and await src.poll() is None
    assert sum("lookup failed" in r.message for r in caplog.records) == 1  # once per change of state


async def test_localhost_resolves_through_getaddrinfo() -> None:
    specs = await DnsSource("localhost", 8000).poll()
    assert specs is not None and any(s.url in ("http://127.0.0.1:8000", "http://[::1]:8000") for s in specs)


async def test_file_source_reads_yaml_and_lines_on_change(tmp_path: Path) -> None:
    path = tmp_path / "backends.yaml"
    path.write_text("- url: http://a:1\n  kv_events: tcp://a:5557\n- http://b:1\n")
    src = FileSource(str(path), backends_from_text)
    assert await src.poll() == (BackendSpec(A, "tcp://a:5557"), BackendSpec(B))
    assert await src.poll() is None  # unchanged
    path.write_text("# plain lines\nhttp://c:1\nhttp://b:1/v1\n")
    os.utime(path, ns=(1, 10**18))
    assert await src.poll() == (BackendSpec(C), BackendSpec(B))
    path.write_text("backends: [{url: 3}]\n")
    os.utime(path, ns=(1, 2 * 10**18))
    assert await src.poll() is None  # invalid: keep the current list
    path.unlink()
    assert await src.poll() is None


def test_bad_sources_are_refused() -> None:
    for bad in ("dns://x", "dns://x:y", "file://", "http://x:1"):
        with pytest.raises(UserError):
            make_source(bad)


async def test_discovery_poll_reconciles(tokenizer: Tokenizer) -> None:
    async def resolve(name: str, port: int) -> list[tuple[str, int]]:
        return [("127.0.0.1", 9001), ("127.0.0.1", 9002)]

    server = make_server(tokenizer, BackendSpec(A), discover=("dns://x:1",))
    disc = Discovery(server.config, server.fleet, resolve)
    await disc.poll(disc.sources[0])
    assert [b.url for b in server.state.live_backends()] == [
        A,
        "http://127.0.0.1:9001",
        "http://127.0.0.1:9002",
    ]


async def test_a_backend_added_at_runtime_enters_through_cold_start(tokenizer: Tokenizer) -> None:
    cfg = RouterConfig(
        backends=(BackendSpec(A),), port=0, features=FeatureConfig(cold_start=ColdStartConfig())
    )
    transport = FakeTransport({A: [Scripted()], C: [Scripted(status=503), Scripted()]})
    server = RouterServer(cfg, transport=transport, tokenizer=tokenizer, background=False)
    core = server.state
    state = server.fleet.add(BackendSpec(C))
    guard = core.guard
    assert guard is not None and guard.warmup is not None
    assert not guard.warmup.warming(state.index, core.clock())
    assert not await server.monitor.check_health(state) and not state.routable
    assert await server.monitor.check_health(state) and state.routable  # admitted: cold start
    assert guard.warmup.warming(state.index, core.clock()) and guard.counts["warmups"] == 1
