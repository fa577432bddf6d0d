"""Fix 3 (issue 21): one scraper per machine, on an interval that adapts; its records live in the
shared load table. Units, then a real emulated engine scraped by the router's scraper."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time
from collections.abc import Callable

from kvroute.emulator.server import EmulatorServer, EmulatorSettings
from kvroute.engine import cost as costmod
from kvroute.engine.types import EngineConfig
from kvroute.policies.registry import make_policy
from kvroute.prepare.tokenize import RequestTokenizer
from kvroute.server.config import BackendSpec, RouterConfig
from kvroute.server.state.backends import Lease, ScrapedMetrics
from kvroute.server.state.loadtable import LoadTable
from kvroute.server.state.router import RouterState
from kvroute.server.sync.monitor import Monitor
from kvroute.server.sync.scrape import Scraper, ScrapeSchedule, next_interval
from kvroute.server.wire.h1 import H1Transport
from kvroute.tokenizer import Tokenizer

COST = costmod.get_profile(costmod.DEFAULT_PROFILE).cost


def test_interval_is_fast_while_busy_and_doubles_to_the_slow_one_while_idle() -> None:
    sched = ScrapeSchedule.of(0.05, 1.0)
    intervals = [0.05]
    for _ in range(6):
        intervals.append(next_interval(intervals[-1], False, sched))
    assert intervals == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    assert next_interval(1.0, True, sched) == 0.05
    assert ScrapeSchedule.of(0.5, 0.1).slow_s == 0.5  # never slower than fast
    assert sched.takeover_s == 3.0


def test_scraped_records_and_the_scraper_role_are_shared_by_the_machine_s_writers() -> None:
    lock = mp.get_context("spawn").Lock()
    parent, spec = LoadTable.create_shared(3, lock)
    one, two = LoadTable.attach(spec, 1, lock), LoadTable.attach(spec, 2, lock)
    try:
        slot = one.slot("http://e:1")
        assert two.slot("http://e:1") == slot and two.scraped(slot) is None
        one.put_scraped(slot, 12.5, 3, 1, 0.25, 4096, 128)
        assert two.scraped(slot) == (12.5, 3, 1, 0.25, 4096, 128)
        one.clear_scraped(slot)
        assert two.scraped(slot) is None
        assert one.claim_scraper(10.0, 3.0) and one.claim_scraper(11.0, 3.0)
        assert not two.claim_scraper(12.0, 3.0)  # one's heartbeat is 1 s old
        assert two.claim_scraper(14.5, 3.0)  # 3.5 s without one's heartbeat: two takes over
        assert not one.claim_scraper(14.6, 3.0)
        two.release_scraper()
        assert one.claim_scraper(14.7, 3.0)
    finally:
        one.close()
        two.close()
        parent.close(unlink=True)


def test_a_backend_s_scrape_is_read_from_the_table() -> None:
    table = LoadTable.local()
    cfg = RouterConfig(backends=(BackendSpec("http://a:1"),))
    state = RouterState(cfg, RequestTokenizer.__new__(RequestTokenizer), make_policy("lmetric"), table=table)
    b = state.backends[0]
    b.scraped = ScrapedMetrics(2, 1, 0.5, 3.0, 100, 32)
    other = RouterState(cfg, RequestTokenizer.__new__(RequestTokenizer), make_policy("lmetric"), table=table)
    assert other.backends[0].scraped == ScrapedMetrics(2, 1, 0.5, 3.0, 100, 32)
    assert other.backends[0].view(3.5, 1.0).running == 2


async def _until(cond: Callable[[], bool], limit_s: float = 60.0) -> None:
    """Poll ``cond`` every 20 ms until true; fail after ``limit_s`` (a hang guard, no speed claim)."""
    deadline = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


async def test_scraper_slows_down_while_idle_and_speeds_up_with_requests_in_flight(
    tokenizer: Tokenizer,
) -> None:
    """A real emulated engine: idle, the interval doubles up to the slow one (few scrapes); with a
    request in flight it is back to the fast one at once; a second scraper over the same table only
    follows (it learns the engine's block size from the first one's records)."""
    eng = EmulatorServer(
        EmulatorSettings(
            model_name="emu", engine=EngineConfig(num_kv_blocks=512, block_size=32, report_tokens=True)
        ),
        COST,
        tokenizer,
    )
    port = await eng.start("127.0.0.1", 0)
    cfg = RouterConfig(backends=(BackendSpec(f"http://127.0.0.1:{port}"),))
    lock = mp.get_context("spawn").Lock()
    parent, spec = LoadTable.create_shared(3, lock)
    tables = [LoadTable.attach(spec, k, lock) for k in (1, 2)]  # two workers of one machine
    transport = H1Transport()
    states = [RouterState(cfg, RequestTokenizer(tokenizer), make_policy("lmetric"), table=t) for t in tables]
    monitors = [Monitor(s, transport) for s in states]
    scrapers = [Scraper(s, m, ScrapeSchedule.of(0.05, 0.4)) for s, m in zip(states, monitors, strict=True)]
    tasks = [asyncio.create_task(sc.run()) for sc in scrapers]
    try:
        # idle: 0.05, 0.1, 0.2, 0.4, 0.4, ...: the interval reaches the slow one (polled: a loaded
        # machine may stall the loop, which only delays it), then at most one scrape per 0.4 s
        await _until(lambda: scrapers[0].interval_s == 0.4)
        assert scrapers[0].scraping and not scrapers[1].scraping and monitors[1].scrapes == 0
        start, t0 = monitors[0].scrapes, time.monotonic()
        await asyncio.sleep(1.0)
        idle, window = monitors[0].scrapes - start, time.monotonic() - t0
        assert idle <= window / 0.4 + 1, (idle, window)  # not one per 50 ms (a stall only lowers it)
        assert states[1].kv.engine_block_size(0) == 32 and states[0].kv.engine_block_size(0) == 32
        follower = states[1].backends[0]
        lease = Lease(follower, 100, blocks=5, at=states[1].clock())  # another worker's request in flight
        assert follower.pending == 5
        # busy: back to the fast interval, and many more scrapes than the idle rate allows
        before = monitors[0].scrapes
        await _until(lambda: scrapers[0].interval_s == 0.05 and monitors[0].scrapes - before >= 8)
        # the scraper's scrapes since covered it; the follower's loop settled its pending blocks
        # (no view of the follower's ran)
        await _until(lambda: not lease.pending and parent.pending(follower.slot) == 0)
        lease.release()
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await transport.close()
        await eng.stop()
        for t in tables:
            t.close()
        parent.close(unlink=True)
