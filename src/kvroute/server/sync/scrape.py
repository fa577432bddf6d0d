"""The engines' ``/metrics`` scraper: one per machine, on an interval that adapts to the load.

A scrape is not free for the engine: vLLM 0.32 ignores ``/metrics?name[]=`` filters, so every scrape
renders its whole page (~53 KB) and costs its API server (the process that also tokenizes and streams
every request) 4.3–4.7 ms of CPU. At a fixed 50 ms, per backend and per router worker, that is about
9 % of a core per worker. The load view needs far fewer: between scrapes it has the router's own
in-flight counters (the shared :class:`~kvroute.server.state.loadtable.LoadTable`) and the KV events,
and a scrape adds only the engine's view of traffic the router did not send.

- **One scraper per machine**: the workers of ``kvroute serve --workers N`` share the load table; one
  of them (the first to claim it, :meth:`LoadTable.claim_scraper`; another takes over when its
  heartbeat is older than ``takeover_s``) scrapes and writes the scraped records into the table, which
  every worker's load view reads. The others only copy the engines' block sizes into their KV views.
- **Adaptive interval** (:func:`next_interval`): ``fast_s`` (``scrape_interval_s``, 50 ms by default)
  while any request is in flight on the machine, or an engine reports running or waiting requests,
  or a scrape changed what the last one said; doubling up to ``slow_s`` (``scrape_idle_interval_s``,
  1 s) while nothing moves. An idle engine's record says 0 running and 0 waiting, which is what the
  view assumes once a record is stale, so the slow interval loses nothing.

The loop wakes every ``fast_s`` to check the table (no I/O), and scrapes when the interval is due.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvroute.server.state.router import RouterState
from kvroute.server.sync.monitor import Monitor

__all__ = ["ScrapeSchedule", "Scraper", "ScraperCollector", "next_interval"]

log = logging.getLogger("kvroute.server")


@dataclass(frozen=True, slots=True)
class ScrapeSchedule:
    """Seconds: ``fast_s`` while the load moves, ``slow_s`` at most while idle; ``takeover_s``: a
    scraper silent that long is replaced by another worker."""

    fast_s: float
    slow_s: float
    takeover_s: float

    @classmethod
    def of(cls, fast_s: float, slow_s: float) -> ScrapeSchedule:
        slow = max(fast_s, slow_s)
        return cls(fast_s, slow, max(3 * slow, 1.0))


def next_interval(current_s: float, busy: bool, schedule: ScrapeSchedule) -> float:
    """The interval after a scrape round: ``fast_s`` when ``busy`` (requests in flight, the engines
    report work, or the scrape changed anything), else twice ``current_s`` up to ``slow_s``. Pure."""
    if busy:
        return schedule.fast_s
    return min(schedule.slow_s, max(current_s, schedule.fast_s) * 2)


class Scraper:
    """Runs the machine's scrape schedule for ``state``'s backends through ``monitor`` (module
    docstring). Counters: ``rounds`` (scrape rounds this process ran); ``interval_s`` the current
    interval; ``scraping`` whether this process is the machine's scraper. Mutates the load table's
    scraped records (through the backends) and the KV view's engine block sizes."""

    def __init__(self, state: RouterState, monitor: Monitor, schedule: ScrapeSchedule) -> None:
        self.state = state
        self.monitor = monitor
        self.schedule = schedule
        self.interval_s = schedule.fast_s
        self.scraping = False
        self.rounds = 0
        self._last: dict[int, tuple[int, int]] = {}  # backend -> (running, waiting) last scraped

    def busy(self) -> bool:
        """Requests in flight on any routable backend (any worker's, or another replica's), or an
        engine that last reported running or waiting requests."""
        for b in self.state.backends:
            if not b.routable:
                continue
            waiting, running, _, _ = b.table.totals(b.slot)
            if waiting or running:
                return True
            last = self._last.get(b.index)
            if last is not None and any(last):
                return True
        return False

    async def scrape_round(self) -> bool:
        """Scrape every routable backend together; True when any engine's running/waiting changed."""
        backends = [b for b in self.state.backends if b.routable]
        await asyncio.gather(*(self.monitor.scrape(b) for b in backends))
        self.rounds += 1
        changed = False
        for b in backends:
            s = b.scraped
            now = (s.running, s.waiting) if s is not None else (0, 0)
            if self._last.get(b.index, (0, 0)) != now:
                changed = True
            self._last[b.index] = now
        return changed

    def _follow(self) -> None:
        """Not the scraper: learn the engines' block sizes from the records the scraper wrote, and
        settle this process's pending leases against them (:meth:`BackendState.settle`)."""
        kv = self.state.kv
        for b in self.state.backends:
            s = b.scraped
            if s is not None:
                b.settle(s)
            if s is not None and b.routable and s.block_size:
                kv.set_engine_block_size(b.index, s.block_size)

    async def run(self) -> None:
        """The loop (module docstring); cancel it to stop (it then gives up the scraper's role)."""
        clock = self.state.clock
        sched = self.schedule
        last = float("-inf")
        try:
            while True:
                now = clock()
                mine = self.state.table.claim_scraper(now, sched.takeover_s)
                if mine != self.scraping:
                    self.scraping = mine
                    log.info("this process %s the machine's scraper", "is" if mine else "is no longer")
                if mine:
                    busy = self.busy()
                    due = sched.fast_s if busy else self.interval_s
                    if now - last >= due * 0.999:
                        last = now
                        changed = await self.scrape_round()
                        self.interval_s = next_interval(self.interval_s, busy or changed, sched)
                else:
                    self._follow()
                await asyncio.sleep(sched.fast_s)
        finally:
            if self.scraping:
                self.state.table.release_scraper()


class ScraperCollector(Collector):
    """``kvroute_scrapes_total`` / ``kvroute_scrape_failures_total`` (this process's),
    ``kvroute_scraper`` (1 when this process is the machine's scraper) and
    ``kvroute_scrape_interval_seconds`` (its current interval)."""

    def __init__(self, scraper: Scraper) -> None:
        self.scraper = scraper

    def collect(self) -> Iterator[Metric]:
        sc, mon = self.scraper, self.scraper.monitor
        yield CounterMetricFamily(
            "kvroute_scrapes", "Engine /metrics scrapes by this process", value=mon.scrapes
        )
        yield CounterMetricFamily(
            "kvroute_scrape_failures", "Engine /metrics scrapes that failed", value=mon.scrape_failures
        )
        yield GaugeMetricFamily(
            "kvroute_scraper",
            "1 when this process is its machine's scraper",
            value=1.0 if sc.scraping else 0.0,
        )
        yield GaugeMetricFamily(
            "kvroute_scrape_interval_seconds", "The scraper's current interval", value=sc.interval_s
        )
