"""``kvroute serve --workers 2``: a real supervisor and its worker processes on one free loopback port,
in front of real emulated engines (in this process, on free ports). Every process is stopped by the
test (``RouterProc.close`` kills the supervisor; its workers notice it is gone and drain)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest

from kvroute.server.workers import WORKER_HEADER
from kvroute.tokenizer import Tokenizer

from .test_e2e import Cluster
from .test_shutdown import SLOW, RouterProc, stream_body


@pytest.fixture
async def engines() -> AsyncIterator[Cluster]:
    c = Cluster()
    yield c
    await c.close()


class Scrape:
    """One /metrics answer: which worker (and pid) answered, and its samples by ``name{labels}``."""

    def __init__(self, text: str) -> None:
        self.samples: dict[str, float] = {}
        self.worker = self.pid = ""
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                self.samples[key] = float(value)
                if key.startswith("kvroute_worker_info{"):
                    labels = dict(p.split("=") for p in key[len("kvroute_worker_info{") : -1].split(","))
                    self.worker, self.pid = labels["worker"].strip('"'), labels["pid"].strip('"')

    def load(self, backend: str) -> tuple[float, float, float]:
        """The machine-wide (waiting, running, queued prefill) on ``backend``."""
        return tuple(  # type: ignore[return-value]
            self.samples[f'kvroute_backend_{m}{{backend="{backend}"}}']
            for m in ("waiting", "running", "queued_prefill_tokens")
        )


async def scrape(url: str) -> Scrape:
    """/metrics on a new connection (so the kernel picks a worker afresh)."""
    async with (
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s,
        s.get(url + "/metrics") as r,
    ):
        return Scrape(await r.text())


async def scrape_worker(url: str, want: str | None = None, avoid: str | None = None) -> Scrape:
    """A scrape answered by worker ``want`` (or by any worker but ``avoid``)."""
    for _ in range(400):
        m = await scrape(url)
        if (want is None or m.worker == want) and (avoid is None or m.worker != avoid):
            return m
    raise AssertionError(f"no scrape from worker {want or 'other than ' + str(avoid)}")


class WorkersProc(RouterProc):
    """The supervisor; :meth:`close` (after a failed test) stops it with SIGTERM so that it stops
    its workers, and kills it only if that does not end it in time."""

    async def close(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.send_signal(signal.SIGTERM)  # the second one ends the drain at once
            try:
                await asyncio.wait_for(self.proc.communicate(), 20)
            except TimeoutError:
                await super().close()


async def start_workers(engines: Cluster, *flags: str) -> RouterProc:
    backends = [b.url for b in engines.specs]
    more = [x for b in backends[1:] for x in ("--backend", b)]
    events = [x for b in engines.specs if b.kv_events for x in ("--kv-events", f"{b.url}={b.kv_events}")]
    router = WorkersProc(backends[0], *more, *events, "--workers", "2", *flags)
    await router.start()
    await until_all_listen(router)
    return router


async def until_all_listen(router: RouterProc) -> list[bytes]:
    """The supervisor's stderr lines up to the one it prints once all workers listen (before it: a
    line per dead supervisor's leftovers it removed, if any)."""
    assert router.proc is not None and router.proc.stderr is not None
    lines: list[bytes] = []
    while not lines or b"workers=2" not in lines[-1]:
        lines.append(await asyncio.wait_for(router.proc.stderr.readline(), 60))
        assert lines[-1], f"stderr closed: {lines}"
        assert len(lines) < 50 and b"Traceback" not in lines[-1], lines
    return lines


async def test_traffic_from_both_workers_and_the_shared_table_returns_to_zero(
    engines: Cluster, tokenizer: Tokenizer
) -> None:
    """Concurrent requests (each on its own connection) all succeed, both workers served some, each
    worker's own ok counter adds up to all of them, and the machine-wide gauges (the shared table,
    read from either worker) are back to zero."""
    await engines.add_engine(tokenizer, events=True)
    await engines.add_engine(tokenizer, events=True)
    router = await start_workers(engines)
    n = 48
    try:

        async def one(i: int) -> tuple[str, bytes]:
            body = {"model": "emu", "prompt": f"request {i} " * (5 + i % 7), "max_tokens": 4}
            body["stream"] = bool(i % 2)
            async with (
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s,
                s.post(router.url + "/v1/completions", json=body) as r,
            ):
                assert r.status == 200
                return r.headers[WORKER_HEADER], await r.read()

        results = await asyncio.gather(*(one(i) for i in range(n)))
        assert {w for w, _ in results} == {"1", "2"}
        for i, (_, raw) in enumerate(results):
            assert raw.rstrip().endswith(b"data: [DONE]") if i % 2 else b'"choices"' in raw
        ok = 0
        for worker in ("1", "2"):
            m = await scrape_worker(router.url, want=worker)
            ok += int(m.samples['kvroute_requests_total{outcome="ok"}'])
            batches = 0.0
            for b in engines.specs:
                assert m.load(b.url) == (0.0, 0.0, 0.0)
                batches += m.samples[f'kvroute_kv_event_batches_total{{backend="{b.url}"}}']
            assert batches >= 1  # each worker subscribes to the engines' KV events itself
        assert ok == n
        router.signal(signal.SIGTERM)
        status, err = await router.exit_status()
        assert status == 0 and "Traceback" not in err, err
    finally:
        await router.close()


async def test_a_stream_on_one_worker_is_seen_by_the_other_and_sigterm_drains_it(
    engines: Cluster, tokenizer: Tokenizer
) -> None:
    """A stream held through worker A counts in the load worker B's policy reads (B's machine-wide
    gauge); SIGTERM to the supervisor: the stream completes normally, every worker exits, exit 0."""
    await engines.add_engine(tokenizer, events=False, time_scale=SLOW)
    backend = engines.specs[0].url
    router = await start_workers(engines, "--drain-grace", "0.2", "--drain-timeout", "30")
    try:
        async with (
            aiohttp.ClientSession() as s,
            s.post(router.url + "/v1/completions", json=stream_body(60)) as r,
        ):
            assert r.status == 200
            held_by = r.headers[WORKER_HEADER]
            assert (await r.content.readline()).startswith(b"data: ")
            other = await scrape_worker(router.url, avoid=held_by)
            assert other.load(backend)[:2] == (0.0, 1.0)  # running 1: worker A's lease, seen by B
            assert other.samples[f'kvroute_backend_routed_total{{backend="{backend}"}}'] == 0.0
            router.signal(signal.SIGTERM)
            rest = await asyncio.wait_for(r.content.read(), 30)
        assert rest.rstrip().endswith(b"data: [DONE]") and b'"error"' not in rest
        status, err = await router.exit_status()
        assert status == 0, err
        assert err.count("shutting down gracefully") == 2 and "Traceback" not in err
    finally:
        await router.close()


async def test_a_killed_worker_is_restarted_and_its_load_zeroed(
    engines: Cluster, tokenizer: Tokenizer
) -> None:
    await engines.add_engine(tokenizer, events=False, time_scale=SLOW)
    backend = engines.specs[0].url
    router = await start_workers(engines, "--drain-grace", "0", "--drain-timeout", "1")
    try:
        async with (
            aiohttp.ClientSession() as s,
            s.post(router.url + "/v1/completions", json=stream_body(2000)) as r,
        ):
            held_by = r.headers[WORKER_HEADER]
            assert (await r.content.readline()).startswith(b"data: ")
            victim = await scrape_worker(router.url, want=held_by)
            assert victim.load(backend)[1] == 1.0
            os.kill(int(victim.pid), signal.SIGKILL)
            with pytest.raises(aiohttp.ClientError):
                await asyncio.wait_for(r.content.read(), 10)
        deadline = time.monotonic() + 10
        while True:  # the supervisor zeroes the dead worker's row once it has noticed the exit
            other = await scrape_worker(router.url, avoid=held_by)
            if other.load(backend) == (0.0, 0.0, 0.0) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        assert other.load(backend) == (0.0, 0.0, 0.0)
        deadline = time.monotonic() + 60
        while True:  # restarted: the same worker index answers from a new process
            m = await scrape(router.url)
            if (m.worker == held_by and m.pid != victim.pid) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        assert m.worker == held_by and m.pid != victim.pid and m.load(backend) == (0.0, 0.0, 0.0)
        router.signal(signal.SIGTERM)
        status, err = await router.exit_status()
        assert status == 0, err
        assert f"worker {held_by} (pid {victim.pid}) exited with status -9; restarting" in err
    finally:
        await router.close()


def test_a_decision_in_one_worker_sees_the_load_another_reserved(tokenizer: Tokenizer) -> None:
    """Two routing cores on one shared table (rows 1 and 2, as two workers have): requests leased by
    the first weigh on the second's views and send its next request elsewhere; zeroing the first's
    row (it died) removes them."""
    import multiprocessing as mp

    import orjson

    from kvroute.policies.registry import make_policy
    from kvroute.prepare.tokenize import RequestTokenizer
    from kvroute.server.config import BackendSpec, RouterConfig
    from kvroute.server.stages.decide import decide
    from kvroute.server.stages.prepare import prepare_inline
    from kvroute.server.state.backends import Lease
    from kvroute.server.state.loadtable import LoadTable
    from kvroute.server.state.router import RouterState
    from kvroute.server.wire.validate import parse_request

    lock = mp.get_context("spawn").Lock()
    parent, spec = LoadTable.create_shared(3, lock, slots=8)
    tables = [LoadTable.attach(spec, k, lock) for k in (1, 2)]
    try:
        cfg = RouterConfig(backends=(BackendSpec("http://a:1"), BackendSpec("http://b:1")))
        a, b = (
            RouterState(cfg, RequestTokenizer(tokenizer), make_policy("lmetric"), table=t) for t in tables
        )
        req = parse_request(orjson.dumps({"model": "m", "prompt": "same prompt " * 40}), chat=False)
        first = decide(a, req, prepare_inline(a, req)).order[0]
        leases = [Lease(a.backends[first], 500) for _ in range(8)]
        view = b.backends[first].view(0.0, 1.0)
        assert (view.waiting, view.queued_prefill_tokens) == (8, 4000)
        assert b.backends[first].waiting == 0  # b's own row is untouched
        assert decide(b, req, prepare_inline(b, req)).order[0] != first
        parent.clear_row(1)
        assert b.backends[first].view(0.0, 1.0).waiting == 0
        del leases
    finally:
        for t in tables:
            t.close()
        parent.close(unlink=True)


async def admin_get(url: str, token: str) -> tuple[str, list[str]]:
    """GET /admin/backends on a new connection: which worker answered, and the URLs it lists."""
    headers = {"Authorization": f"Bearer {token}"}
    async with (
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s,
        s.get(url + "/admin/backends", headers=headers) as r,
    ):
        assert r.status == 200
        data = await r.json()
        return r.headers[WORKER_HEADER], [b["url"] for b in data["data"]]


async def test_an_admin_change_on_one_worker_reaches_the_other(
    engines: Cluster, tokenizer: Tokenizer
) -> None:
    """POST and DELETE land on one worker (one connection each); the other worker applies them from
    the machine's admin journal: every worker lists the added backend, then none does."""
    await engines.add_engine(tokenizer, events=False)
    await engines.add_engine(tokenizer, events=False)
    first, second = (b.url for b in engines.specs)
    token = "s3cret-token"
    router = await start_workers(engines, "--admin-token", token)  # starts with both engines...
    try:
        headers = {"Authorization": f"Bearer {token}"}
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
            # ... so take the second one away first, on whichever worker answers, then add it back
            async with s.get(router.url + "/admin/backends", headers=headers) as r:
                ident = {b["url"]: b["id"] for b in (await r.json())["data"]}
            async with s.delete(f"{router.url}/admin/backends/{ident[second]}", headers=headers) as r:
                assert r.status == 202
                by = r.headers[WORKER_HEADER]
            deadline = time.monotonic() + 10
            seen: set[str] = set()
            while seen != {"1", "2"}:  # both workers stop listing it
                assert time.monotonic() < deadline, f"only workers {seen} dropped {second} (changed on {by})"
                worker, urls = await admin_get(router.url, token)
                if second not in urls:
                    seen.add(worker)
            async with s.post(router.url + "/admin/backends", headers=headers, json={"url": second}) as r:
                assert r.status == 201, await r.text()
                by = r.headers[WORKER_HEADER]
            seen.clear()
            deadline = time.monotonic() + 10
            while seen != {"1", "2"}:  # both workers list it again
                assert time.monotonic() < deadline, f"only workers {seen} list {second} (added on {by})"
                worker, urls = await admin_get(router.url, token)
                if second in urls and first in urls:
                    seen.add(worker)
    finally:
        await router.close()


def test_sighup_waits_for_a_starting_worker_to_listen(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: a SIGHUP forwarded to a worker still starting (no handler installed yet) killed
    it, and at startup the supervisor with it. A starting worker gets it once it says it listens."""
    from types import SimpleNamespace

    from kvroute.server.config import BackendSpec, RouterConfig
    from kvroute.server.workers import Supervisor, _Worker

    sent: list[tuple[int, int]] = []
    monkeypatch.setattr("kvroute.server.workers.os.kill", lambda pid, sig: sent.append((pid, sig)))
    sup = Supervisor(RouterConfig(backends=(BackendSpec("http://127.0.0.1:1"),), port=0), 2)
    up = _Worker(1, SimpleNamespace(pid=101), None, 0.0, listening=True)  # type: ignore[arg-type]
    starting = _Worker(2, SimpleNamespace(pid=102), None, 0.0)  # type: ignore[arg-type]
    sup._procs = {1: up, 2: starting}
    sup._on_signal(signal.SIGHUP)
    assert sent == [(101, signal.SIGHUP)] and starting.pending_hup
    sup._listening(starting)
    assert sent == [(101, signal.SIGHUP), (102, signal.SIGHUP)] and not starting.pending_hup
    sup._on_signal(signal.SIGTERM)  # a stop reaches every worker, starting or not
    assert sent[-2:] == [(101, signal.SIGTERM), (102, signal.SIGTERM)]


def test_a_worker_restarted_after_a_sighup_starts_with_the_reloaded_config(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression: a restarted worker ran the start-up config, not what the last SIGHUP reloaded.
    The supervisor keeps the reloaded file's reloadable fields for the workers it spawns next; a
    file the workers would reject leaves them as they were."""
    import dataclasses

    from kvroute.errors import UserError
    from kvroute.server.config import BackendSpec, RouterConfig
    from kvroute.server.run import Reloader
    from kvroute.server.workers import Supervisor

    monkeypatch.setattr("kvroute.server.workers.os.kill", lambda pid, sig: None)
    start = RouterConfig(backends=(BackendSpec("http://127.0.0.1:1"),), port=0, policy="lmetric")
    files = [dataclasses.replace(start, backends=(BackendSpec("http://127.0.0.1:2"),), policy="vllm", port=9)]

    def load() -> RouterConfig:
        if isinstance(files[-1], Exception):
            raise files[-1]
        return files[-1]

    sup = Supervisor(start, 2, reloader=Reloader("router.yaml", load))
    sup.config = dataclasses.replace(sup.config, port=4321)  # as run() sets the concrete port
    sup._on_signal(signal.SIGHUP)
    assert sup.config.policy == "vllm" and sup.config.backends == files[0].backends
    assert sup.config.port == 4321  # not reloadable: the supervisor's bound port stays
    files.append(dataclasses.replace(files[0], policy="no-such-policy"))
    sup._on_signal(signal.SIGHUP)  # the workers reject it: nothing changes for the next spawns
    assert sup.config.policy == "vllm"
    files.append(UserError("router.yaml: line 3: bad"))  # type: ignore[arg-type]
    sup._on_signal(signal.SIGHUP)
    assert sup.config.policy == "vllm"
    nothing = Supervisor(start, 2, reloader=Reloader(None, load))  # no --config: nothing to follow
    nothing._on_signal(signal.SIGHUP)
    assert nothing.config == start


def test_a_worker_not_listening_in_time_is_one_error_line_naming_the_flag() -> None:
    """``--worker-start-timeout`` (the config's ``worker_start_timeout_s``, default 120 s): a worker
    that does not listen within it (none can in 10 ms: a spawned interpreter imports the router
    first) stops the supervisor with one error line naming the flag, exit status 2, no traceback,
    and no process of its session left. A real process; a hang guard of 120 s."""
    import sys

    from .sessionproc import run_in_session

    argv = [sys.executable, "-m", "kvroute.cli", "serve", "--backend", "http://127.0.0.1:9", "--port", "0"]
    rc, text, left = run_in_session([*argv, "--workers", "2", "--worker-start-timeout", "0.01"])
    errors = [ln for ln in text.splitlines() if "error" in ln]
    assert rc == 2 and errors == [
        "kvroute: error: worker 1 did not start within 0.01 s "
        "(--worker-start-timeout, worker_start_timeout_s in the config)"
    ], text
    assert "Traceback" not in text, text
    assert left == [], f"processes left behind: {left}"
