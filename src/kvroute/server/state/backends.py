"""Per-backend state: router-side counters, scraped engine metrics, health, and the merged load view.

Router-side counters (fresh, but only the routers' traffic), per backend, kept in a
:class:`~kvroute.server.state.loadtable.LoadTable` row of this process (the table is shared by the workers of
a machine and carries the load other replicas announced):

- ``waiting``: requests routed there whose first byte has not come back yet;
- ``queued_prefill``: the new (uncached) prompt tokens of those requests;
- ``running``: requests past their first byte and not yet ended;
- ``blocks``: the KV blocks (their prompts' blocks) of both, from routing to their end;
- ``pending``: the blocks of the ``waiting`` ones routed since the backend's last completed scrape
  *began*: requests the engine's last copy of its load cannot cover yet. A :class:`Lease` adds its
  blocks here when it is made and takes them out at the first of: its first byte, its release, or
  the completion of a scrape that began after it was made (:meth:`BackendState.settle`; that scrape
  covers it: its blocks are in the engine's ``kv_usage`` once the engine scheduled it, and while it
  waits in the engine's queue it holds none and counts in ``queued_prefill`` only).

A request moves waiting → running at its first response byte (for a streamed response that is the
first token; a non-streamed one stays waiting until it ends) and leaves at its end, whatever the end
(success, error, client disconnect, cancellation): :class:`Lease` makes each step happen at most once,
so the counters return to zero when traffic stops.

Scraped engine metrics (every ``scrape_interval_s``, from ``/metrics``; older but they include
traffic from other clients): ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc`` (or the older ``vllm:gpu_cache_usage_perc``), summed over label sets.
A scrape's time (:attr:`ScrapedMetrics.at`) is when it *began*: the engine's numbers describe some
moment between then and its completion.

**Merge** (:meth:`BackendState.view`; router counters summed over the table's rows: every worker of
this machine and the other replicas): the batch size is the larger of the two totals,
``BS = max(r_running + r_waiting, s_running + s_waiting)``; ``running = min(BS, max(r_running,
s_running))`` and ``waiting = BS − running`` (a request the engine already runs but that has not sent
its first byte is counted once, not twice). ``queued_prefill_tokens`` is the router's own (vLLM does not
export it); ``kv_usage`` is the engine's. ``decode_blocks`` is the *sum* of the engine's blocks in use
(``kv_usage`` × pool size, when the pool size is known; in the router's blocks, converted from the
engine's block size when its ``cache_config_info`` states it) and the ``pending`` blocks: the two
count disjoint sets of requests (a pending request was routed after the scrape began, so the engine's
copy does not hold its blocks; once a later scrape completes it leaves ``pending`` and the copy
covers it), so a sum counts each request once, where a max would drop a burst routed inside one
scrape interval. Without a fresh scrape (none yet, older than ``scrape_stale_s``, or a backend without
``/metrics``), ``decode_blocks`` is the router's ``blocks``: every request it has in flight there.

This mirrors the simulator's view (:meth:`kvroute.sim.cluster.ClusterSim._view`, the definition in
:attr:`~kvroute.views.InstanceView.decode_blocks`): the engine's blocks in use at its last copy plus
the blocks of the requests routed since that copy, until their first token or the next copy. What
is approximate: a scrape takes time (the simulator's copy is instantaneous), so a request routed
while a scrape is in flight stays pending until the next one (if the engine scheduled it before it
answered that scrape, its blocks count twice until then); a worker settles its own leases
(:meth:`BackendState.settle`: at its next decision, and within one ``scrape_interval_s`` on its
scrape loop), so another worker of the machine may count them up to that long after the scrape; a
replica's leases settle at its own scrapes and reach the others with its announcement.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from kvroute.server.state.loadtable import LoadTable
from kvroute.views import Hold, InstanceView

__all__ = [
    "ACTIVE",
    "DRAINING",
    "REMOVED",
    "SCRAPE_PATH",
    "STATES",
    "BackendState",
    "Lease",
    "ScrapedMetrics",
    "parse_vllm_metrics",
]

ACTIVE = "active"
"""Membership: takes new requests (when healthy)."""
DRAINING = "draining"
"""Membership: takes no new requests; its requests in flight run to their end, then it is removed."""
REMOVED = "removed"
"""Membership: gone; kept (never reused) so that its index stays unique in the process."""
STATES = (ACTIVE, DRAINING, REMOVED)

_RUNNING = b"vllm:num_requests_running"
_WAITING = b"vllm:num_requests_waiting"
_KV_USAGE = (b"vllm:kv_cache_usage_perc", b"vllm:gpu_cache_usage_perc")
_CACHE_CONFIG = b"vllm:cache_config_info"
# Candidates for the lines parse_vllm_metrics reads: one of the names above up to the end of its line.
# One regex scan in C (its literal prefix makes it a fast search) replaces a Python loop over every
# line (a vLLM page has hundreds, mostly histograms, and is scraped every 50 ms per backend); a match
# counts only at the start of a line as bytes.splitlines cuts them (after \n, \r or \r\n).
_CANDIDATE = re.compile(
    rb"vllm:(?:num_requests_running|num_requests_waiting|kv_cache_usage_perc"
    rb"|gpu_cache_usage_perc|cache_config_info)[^\r\n]*"
)
_EOL = b"\r\n"

SCRAPE_PATH = "/metrics?" + "&".join(
    "name%5B%5D=" + n
    for n in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "vllm:cache_config_info",
    )
)
"""What the router scrapes: ``/metrics`` restricted to the samples :func:`parse_vllm_metrics` reads.
``name[]`` is prometheus_client's own filter (vLLM and SGLang serve ``/metrics`` with its ASGI app):
the engine renders 5 samples instead of hundreds (vLLM's page is mostly histograms) and the router
receives and scans that much less, 20 times a second per backend (``make bench ONLY=scrape`` measures
both sides). A server that ignores the query sends the whole page, which parses the same."""


@dataclass(frozen=True, slots=True)
class ScrapedMetrics:
    """What one ``/metrics`` scrape said; ``at``: when the scrape began, the router's monotonic clock,
    seconds."""

    running: int
    waiting: int
    kv_usage: float
    at: float
    num_kv_blocks: int = 0
    block_size: int = 0  # the engine's block size, tokens (cache_config_info's block_size; 0: not sent)

    def pool(self, block_size: int = 0) -> tuple[int, int]:
        """(pool size, blocks in use = ``kv_usage`` × pool) in blocks of ``block_size`` tokens (the
        router's), converted from the engine's own blocks when both sizes are known and differ (vLLM's
        CPU build: 128 tokens, a router's 16), else in the engine's blocks. (0, 0): pool unknown."""
        n = self.num_kv_blocks
        if block_size > 0 and self.block_size > 0 and self.block_size != block_size:
            n = n * self.block_size // block_size
        return n, round(self.kv_usage * n)


def _sample_value(line: bytes) -> float | None:
    # "name{labels} value [timestamp]" -> value
    end = line.rfind(b"}")
    rest = line[end + 1 :] if end >= 0 else line.split(b" ", 1)[1] if b" " in line else b""
    parts = rest.split()
    if not parts:
        return None
    try:
        return float(parts[0])
    except ValueError:
        return None


def parse_vllm_metrics(text: bytes, at: float) -> ScrapedMetrics | None:
    """Parse vLLM's Prometheus text; None when it has neither running nor waiting gauges.

    Values of the same metric with different labels (e.g. several ``model_name``) are summed; the KV
    usage is the maximum. ``vllm:cache_config_info{num_gpu_blocks="N",block_size="B"}`` gives the pool
    size and the engine's block size if present.
    """
    running = waiting = 0.0
    usage = 0.0
    seen = False
    blocks = block_size = 0
    for match in _CANDIDATE.finditer(text):
        start = match.start()
        if start and text[start - 1] not in _EOL:
            continue  # inside a line (e.g. "# HELP vllm:...")
        line = match.group()
        if line.startswith(_RUNNING) and line[len(_RUNNING) : len(_RUNNING) + 1] in (b"{", b" "):
            v = _sample_value(line)
            if v is not None:
                running += v
                seen = True
        elif line.startswith(_WAITING) and line[len(_WAITING) : len(_WAITING) + 1] in (b"{", b" "):
            v = _sample_value(line)
            if v is not None:
                waiting += v
                seen = True
        elif line.startswith(_KV_USAGE):
            v = _sample_value(line)
            if v is not None:
                usage = max(usage, v)
        elif line.startswith(_CACHE_CONFIG):
            blocks = _label_int(line, b'num_gpu_blocks="')
            block_size = _label_int(line, b'block_size="')
    if not seen:
        return None
    usage = min(max(usage, 0.0), 1.0)
    return ScrapedMetrics(max(int(running), 0), max(int(waiting), 0), usage, at, blocks, block_size)


def _label_int(line: bytes, key: bytes) -> int:
    """The integer value of the label ``key`` (``name="``) in a sample line; 0 when absent or bad."""
    i = line.find(key)
    if i < 0 or (i and line[i - 1] not in b"{, "):  # block_size= inside e.g. cpu_block_size=
        return 0
    j = line.find(b'"', i + len(key))
    try:
        return max(int(line[i + len(key) : j]), 0)
    except ValueError:
        return 0


class BackendState:
    """Mutable state of one backend. Mutated only by :class:`Lease`, the scraper, the health
    checker and the membership operations of :class:`~kvroute.server.state.router.RouterState` (all on the
    router's event loop).

    ``state``: :data:`ACTIVE`, :data:`DRAINING` or :data:`REMOVED` (see those). ``healthy``: admitted by
    the health checks (a backend added at runtime starts unhealthy and is admitted by its first good
    check). Only an active, healthy backend is a routing candidate."""

    __slots__ = (
        "_pending",
        "failures",
        "healthy",
        "index",
        "requests_total",
        "slot",
        "state",
        "successes",
        "table",
        "url",
    )

    def __init__(self, index: int, url: str, table: LoadTable | None = None, healthy: bool = True) -> None:
        self.index = index
        self.url = url
        self.table = table if table is not None else LoadTable.local()
        self.slot = self.table.slot(url)
        self.requests_total = 0
        self.healthy = healthy
        self.state = ACTIVE
        self.failures = 0  # consecutive failed health checks
        self.successes = 0  # consecutive good health checks while ejected
        # this process's leases whose blocks are pending, in the order they were made (a dict as an
        # ordered set: a lease leaves it in O(1) at its first byte, release or settlement)
        self._pending: dict[Lease, None] = {}

    @property
    def scraped(self) -> ScrapedMetrics | None:
        """The engine's last scrape, from the load table: the machine's one scraper wrote it, maybe
        in another worker (:mod:`kvroute.server.sync.scrape`). None: not scraped yet."""
        got = self.table.scraped(self.slot)
        if got is None:
            return None
        at, running, waiting, usage, blocks, block_size = got
        return ScrapedMetrics(running, waiting, usage, at, blocks, block_size)

    @scraped.setter
    def scraped(self, value: ScrapedMetrics | None) -> None:
        if value is None:
            self.table.clear_scraped(self.slot)
        else:
            self.table.put_scraped(
                self.slot,
                value.at,
                value.running,
                value.waiting,
                value.kv_usage,
                value.num_kv_blocks,
                value.block_size,
            )

    # This process's own counters (what its leases hold; back to zero when its traffic stops).
    @property
    def waiting(self) -> int:
        return self.table.own(self.slot)[0]

    @property
    def running(self) -> int:
        return self.table.own(self.slot)[1]

    @property
    def queued_prefill(self) -> int:
        return self.table.own(self.slot)[2]

    @property
    def blocks(self) -> int:
        return self.table.own(self.slot)[3]

    @property
    def pending(self) -> int:
        return self.table.own_pending(self.slot)

    def settle(self, scrape: ScrapedMetrics | None = None) -> None:
        """Take out of ``pending`` the blocks of this process's leases made before ``scrape`` (default:
        the last one recorded) began: its copy of the engine's load covers them (module docstring).
        Idempotent; the scraper calls it after each scrape, every worker on its scrape loop and
        before each view."""
        q = self._pending
        if not q:
            return
        s = self.scraped if scrape is None else scrape
        if s is None or next(iter(q)).at >= s.at:  # the usual case on the request path: none to settle
            return
        for lease in list(q):
            if lease.at >= s.at:
                break
            lease.settle()

    @property
    def routable(self) -> bool:
        """Active and healthy: may take a new request."""
        return self.healthy and self.state == ACTIVE

    @property
    def idle(self) -> bool:
        """No request of this process in flight on it (its own LoadTable row is zero)."""
        return not any(self.table.own(self.slot))

    def view(self, now: float, stale_s: float, block_size: int = 0) -> InstanceView:
        """The merged load view (see the module docstring); ``now`` on the monotonic clock.
        ``block_size``: the router's (its leases' blocks are of that size); the engine's pool and
        blocks in use are converted to it (:meth:`ScrapedMetrics.pool`; 0: taken as they are).
        Settles this process's pending leases first (:meth:`settle`)."""
        s = self.scraped
        self.settle(s)
        r_wait, r_run, prefill, blocks = self.table.totals(self.slot)
        if s is not None and now - s.at <= stale_s:
            total = max(r_run + r_wait, s.running + s.waiting)
            running = min(total, max(r_run, s.running))
            pool, in_use = s.pool(block_size)
            return InstanceView(
                index=self.index,
                running=running,
                waiting=total - running,
                queued_prefill_tokens=prefill,
                kv_usage=s.kv_usage,
                kv_capacity_blocks=pool,
                decode_blocks=in_use + max(self.table.pending(self.slot), 0),
            )
        return InstanceView(
            index=self.index,
            running=r_run,
            waiting=r_wait,
            queued_prefill_tokens=prefill,
            decode_blocks=blocks,
        )

    def eject(self) -> bool:
        """Mark unhealthy; True if it was healthy."""
        was = self.healthy
        self.healthy = False
        self.successes = 0
        return was

    def check_failed(self, eject_after: int) -> bool:
        """Record a failed health check; True if this ejected the backend."""
        self.failures += 1
        self.successes = 0
        if self.healthy and self.failures >= eject_after:
            self.healthy = False
            return True
        return False

    def check_passed(self, readmit_after: int) -> bool:
        """Record a good health check; True if this re-admitted the backend."""
        self.failures = 0
        if self.healthy:
            return False
        self.successes += 1
        if self.successes >= readmit_after:
            self.healthy = True
            self.successes = 0
            return True
        return False


class Lease:
    """One routed attempt's share of a backend's counters, made at ``at`` (the router's monotonic
    clock, seconds; the default 0 is older than any scrape, so the first one settles it): +1 waiting, ``prefill`` queued tokens, ``blocks`` KV blocks and the same blocks
    ``pending`` on creation; → running at :meth:`first_byte` (the prefill and the pending blocks
    leave); gone at :meth:`release` (the blocks too, and the pending ones if still there). The pending
    blocks also leave when a scrape that began after ``at`` completes (:meth:`settle`, through
    :meth:`BackendState.settle`; module docstring). Each step is idempotent, so any exit path may call
    :meth:`release` (and ``finally`` always does), and the counters return to zero whatever the order.
    ``routed``: it counts in the backend's ``requests_total`` (a routed attempt); the wait stage's hold,
    which the attempt's own lease replaces, does not."""

    __slots__ = ("_clock", "_pending", "_state", "at", "backend", "blocks", "hold", "prefill")

    def __init__(
        self,
        backend: BackendState,
        prefill_tokens: int,
        blocks: int = 0,
        at: float = 0.0,
        routed: bool = True,
    ) -> None:
        self.backend = backend
        self.prefill = prefill_tokens
        self.blocks = blocks
        self.at = at
        self._state = 0  # 0 waiting, 1 running, 2 released
        self._pending = True  # its blocks (even 0: an adjustment may add some) count as pending
        # the policy's own bookkeeping of this attempt (RoutingCore.dispatched; None for most policies):
        # told of the first byte and of the release, at the router's clock (see attach)
        self.hold: Hold | None = None
        self._clock: Callable[[], float] | None = None
        backend.table.add(backend.slot, waiting=1, prefill=prefill_tokens, blocks=blocks, pending=blocks)
        backend._pending[self] = None
        if routed:
            backend.requests_total += 1

    def attach(self, hold: Hold | None, clock: Callable[[], float]) -> None:
        """Tell ``hold`` (the policy's bookkeeping of this attempt) of the first byte and the
        release, at ``clock()`` (monotonic seconds)."""
        self.hold = hold
        self._clock = clock

    @property
    def started(self) -> bool:
        """True once the first byte came back."""
        return self._state >= 1

    @property
    def pending(self) -> bool:
        """True while its blocks count in the backend's ``pending`` ones (not started, not released,
        not covered by a completed scrape)."""
        return self._pending

    def adjust(self, prefill_tokens: int, blocks: int | None = None) -> None:
        """The request's prefill turned out to be ``prefill_tokens`` and its prompt ``blocks`` blocks
        (both were estimated; None: the blocks stand): corrects the queued count while still waiting
        (afterwards there is none to correct), and the blocks (and the pending ones while pending)
        until the release."""
        b = self.backend
        d_prefill = prefill_tokens - self.prefill if self._state == 0 else 0
        d_blocks = blocks - self.blocks if blocks is not None and self._state != 2 else 0
        if d_prefill or d_blocks:
            b.table.add(b.slot, prefill=d_prefill, blocks=d_blocks, pending=d_blocks if self._pending else 0)
        if self._state == 0:
            self.prefill = prefill_tokens
        if d_blocks:
            self.blocks = blocks  # type: ignore[assignment]

    def settle(self) -> None:
        """A completed scrape covers this request: its blocks leave the backend's ``pending``."""
        if self._pending:
            self._unpend()
            self.backend.table.add(self.backend.slot, pending=-self.blocks)

    def _unpend(self) -> None:
        if self._pending:
            self._pending = False
            self.backend._pending.pop(self, None)

    def first_byte(self) -> None:
        """waiting → running: the prefill tokens and the pending blocks leave."""
        if self._state == 0:
            b = self.backend
            pending = -self.blocks if self._pending else 0
            self._unpend()
            b.table.add(b.slot, waiting=-1, running=1, prefill=-self.prefill, pending=pending)
            self._state = 1
            if self.hold is not None:
                self.hold.first_token(self._clock())  # type: ignore[misc]

    def release(self) -> None:
        """The attempt ended (any way)."""
        b = self.backend
        if self._state == 0:
            pending = -self.blocks if self._pending else 0
            b.table.add(b.slot, waiting=-1, prefill=-self.prefill, blocks=-self.blocks, pending=pending)
        elif self._state == 1:
            b.table.add(b.slot, running=-1, blocks=-self.blocks)
        self._unpend()
        if self._state != 2 and self.hold is not None:
            self.hold.finished(self._clock())  # type: ignore[misc]
        self._state = 2
