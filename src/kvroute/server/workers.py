"""`kvroute serve --workers N`: N router processes on one port, one in-flight load table per machine.

Layout
------
- The **supervisor** (the process the user started) binds ``host:port`` itself with ``SO_REUSEPORT``
  and keeps that socket bound but never listening (the kernel spreads connections over *listening*
  sockets only): port 0 becomes a concrete port the workers then share, a taken port fails at once,
  and the port stays reserved while a worker restarts. It creates the machine's shared
  :class:`~kvroute.server.state.loadtable.LoadTable` with ``N + 1`` writer rows: row 0 is the supervisor's
  and stays zero (it routes nothing), worker ``k`` writes row ``k`` (1 ≤ k ≤ N), and the remote row
  after them is for other replicas' announced load. It spawns the workers with the ``multiprocessing``
  spawn context (a fresh interpreter each, given a picklable :class:`WorkerSpec` and the table's
  registry lock) and waits until each has bound the port: ``worker_start_timeout_s`` (120 s by
  default, ``--worker-start-timeout``) for each, else it stops them all and exits with an error.
- Each **worker** is a whole router (:class:`~kvroute.server.app.RouterServer` on uvloop) listening on
  the same port with ``SO_REUSEPORT``; the kernel picks a worker per new connection (a hash of its
  addresses: a kept-alive connection stays with one worker). Its leases add to its own row and its
  policy reads the sums over all rows, so a decision sees the whole machine's in-flight load. Every
  response carries ``x-kvroute-worker: k``.
- **Admin API**: a call reaches one worker, which also appends the change to the machine's admin
  journal (a file in a folder the supervisor creates and removes, :mod:`kvroute.server.sync.journal`); the
  other workers follow it within ~0.1 s, and a restarted worker replays it whole.
- **Router replicas** (``--peer-bind``/``--peers``, :mod:`kvroute.server.sync.peers`): the supervisor binds
  ``--peer-bind`` and writes the other replicas' load into the table's remote row, once for the
  machine; every worker publishes its own reservations under the machine's replica id.
- **Signals**: SIGTERM/SIGINT to the supervisor are forwarded to every worker, which drains as a single
  process does (:meth:`~kvroute.server.app.RouterServer.shutdown`); a second one is forwarded too (end
  the drain now). A worker still starting gets SIGTERM either way: before its handlers are installed
  that ends it at once, where a SIGINT would interrupt it mid-start. A worker says it listens only
  once its handlers are in place, and the supervisor prints its ``kvroute serve: URL ... workers=N``
  line once every worker has said so. The supervisor exits 0 once every worker has exited. SIGHUP is
  forwarded to every worker once it listens (a worker still starting has no handler yet: it gets the
  SIGHUP when it says it listens). Workers run in their own process group, so a terminal's Ctrl-C reaches each once (through
  the supervisor), not twice; a worker whose supervisor vanished (SIGKILL) drains and exits by itself
  (checked every ``ORPHAN_CHECK_S``).
- **Restarts**: a worker that exits while the supervisor is not stopping is restarted after a backoff
  (``RESTART_MIN_S`` doubling up to ``RESTART_MAX_S``; back to the minimum once a worker has lived
  ``RESTART_RESET_S``). Its table row is zeroed as soon as it is gone: its requests died with it.
  It starts with the config the others run: the start-up one with what the last SIGHUP reloaded
  (the supervisor re-reads and checks the file too), then replays the admin journal.
- The shared memory is unlinked when the supervisor exits, on errors too. What a supervisor owns (its
  run folder with the admin journal, the table's shared memory and semaphore) is stamped with its pid
  and locked while it lives; the next supervisor to start removes a dead one's
  (:mod:`kvroute.server.state.runfiles`).

KV events: once per worker
--------------------------
Each worker subscribes to every engine's ZMQ PUB itself and keeps its own KV view, as a single router
does. Once per machine (one subscriber forwarding to the workers) would save only the decoding: each
worker's KV view lives in its own memory, so each would still apply every batch, and applying is most
of the cost. Measured by ``make bench ONLY=workers`` (``event_batch_us``; one request's new blocks,
about 16 blocks of 2048-token chatbot prompts, 2-core machine): decode ≈ 18 µs, apply ≈ 37 µs. At
1000 requests/s that is ≈ 55 ms of CPU per second per worker (5 % of a core), ≈ 18 ms of which a
forwarder could save, while the forwarding itself (receive once, send N times, receive in each worker)
costs about what decoding does, and adds a hop. So: once per worker, N × the decode CPU, no extra hop.

Metrics
-------
A scrape of ``/metrics`` lands on one worker. The per-backend load gauges (``kvroute_backend_waiting``,
``_running``, ``_queued_prefill_tokens``) are the machine's (summed over the table's rows); every other
metric is the answering worker's own, and ``kvroute_worker_info{worker,workers,pid}`` says which worker
answered. See the README for scraping.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import multiprocessing
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from aiohttp import web
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvroute.errors import UserError
from kvroute.logtext import configure_logging
from kvroute.server.app import RouterServer
from kvroute.server.config import RouterConfig, queue_note
from kvroute.server.run import Reloader, run_loop, serve_until_signal
from kvroute.server.state.loadtable import LoadTable, SharedTableSpec
from kvroute.server.state.runfiles import RunFiles, sweep
from kvroute.server.sync.discovery import ParseBackends
from kvroute.server.sync.peers import PeerReceiver, new_replica_id

__all__ = ["WORKER_HEADER", "Supervisor", "WorkerSpec", "reserve_port", "run_worker", "serve_workers"]

WORKER_HEADER = "x-kvroute-worker"
RESTART_MIN_S = 0.1
RESTART_MAX_S = 10.0
RESTART_RESET_S = 30.0
ORPHAN_CHECK_S = 1.0


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What a worker process needs (picklable): its config (with the supervisor's concrete port), the
    shared table's spec, its index ``worker`` (its table row, 1..workers) and how many there are;
    ``replica``: the machine's router-replica id (the workers publish their reservations under it, the
    supervisor receives the other replicas'); ``reloader``: what SIGHUP reloads; ``parse_backends``:
    the reader of discovery files; ``admin_journal``: the file the workers share admin changes through
    (:mod:`kvroute.server.sync.journal`)."""

    config: RouterConfig
    table: SharedTableSpec
    worker: int
    workers: int
    replica: str = ""
    reloader: Reloader | None = None
    parse_backends: ParseBackends | None = None
    admin_journal: str | None = None


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` with ``SO_REUSEPORT``, not listening (port 0: the OS picks);
    raises OSError when the port is taken without ``SO_REUSEPORT`` (or by another user)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


# ---------------------------------------------------------------------------------------- worker


class WorkerCollector(Collector):
    """``kvroute_worker_info{worker,workers,pid} 1``: which worker answered this scrape."""

    def __init__(self, worker: int, workers: int) -> None:
        self.labels = [str(worker), str(workers), str(os.getpid())]

    def collect(self) -> Iterator[Metric]:
        fam = GaugeMetricFamily(
            "kvroute_worker_info",
            "The worker of kvroute serve --workers N that answered (1..N); other counters are its own",
            labels=["worker", "workers", "pid"],
        )
        fam.add_metric(self.labels, 1.0)
        yield fam


class WorkerServer(RouterServer):
    """A router that is worker ``spec.worker`` of a supervisor: the machine's table, the shared port
    (``SO_REUSEPORT``), ``x-kvroute-worker`` on every response, ``kvroute_worker_info`` on /metrics."""

    def __init__(self, spec: WorkerSpec, table: LoadTable) -> None:
        super().__init__(
            spec.config,
            table=table,
            reuse_port=True,
            parse_backends=spec.parse_backends,
            peer_replica=spec.replica or None,
            peer_worker=spec.worker,
            peer_receive=False,  # the supervisor receives the other replicas' load for the machine
            admin_journal=spec.admin_journal,
        )
        self.worker = str(spec.worker)
        self.registry.register(WorkerCollector(spec.worker, spec.workers))

    def make_app(self) -> web.Application:
        app = super().make_app()
        app.on_response_prepare.append(self._stamp)
        return app

    async def _stamp(self, request: web.Request, response: web.StreamResponse) -> None:
        response.headers[WORKER_HEADER] = self.worker


def run_worker(spec: WorkerSpec, lock: Any, ready: Connection) -> None:
    """A worker process's entry point: attach to the table, serve on the shared port until SIGTERM
    (drain) or until the supervisor is gone. Sends ``("ready", url)`` or ``("error", message)`` on
    ``ready`` once it listens or failed to start."""
    os.setpgid(0, 0)  # a terminal's Ctrl-C goes to the supervisor's group only; it forwards
    configure_logging()  # a spawned process starts without the parent's handler

    table = LoadTable.attach(spec.table, spec.worker, lock)
    try:
        run_loop(lambda: _serve(spec, table, ready))
    finally:
        table.close()
        ready.close()


async def _serve(spec: WorkerSpec, table: LoadTable, ready: Connection) -> int:
    parent = os.getppid()
    server: WorkerServer | None = None
    try:
        server = WorkerServer(spec, table)
        await server.start()
    except Exception as exc:  # report, then exit non-zero: the supervisor gives up at startup
        if server is not None:
            await server.stop()
        with contextlib.suppress(OSError):
            ready.send(("error", f"{type(exc).__name__}: {exc}"))
        raise
    url = server.url
    watch = asyncio.create_task(_orphan_watch(parent))
    try:  # "ready" once SIGTERM/SIGINT drain (kvroute.server.run: readiness)
        await serve_until_signal(server, spec.reloader, lambda: ready.send(("ready", url)))
    finally:
        watch.cancel()
    return 0


async def _orphan_watch(parent: int) -> None:
    """SIGTERM this worker (a graceful drain) once its supervisor is gone."""
    while True:
        await asyncio.sleep(ORPHAN_CHECK_S)
        if os.getppid() != parent:
            print("kvroute worker: supervisor gone; shutting down", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
            return


# ------------------------------------------------------------------------------------ supervisor


@dataclass
class _Worker:
    index: int
    process: BaseProcess
    ready: Connection
    started: float
    listening: bool = False  # it reported "ready": its signal handlers are installed
    pending_hup: bool = False  # a SIGHUP came while it was starting: forwarded once it listens


class Supervisor:
    """Runs ``workers`` router processes on ``config``'s port (see the module docstring).
    :meth:`run` returns the exit status; ``clock`` is monotonic seconds (restart backoff)."""

    def __init__(
        self,
        config: RouterConfig,
        workers: int,
        clock: Any = time.monotonic,
        reloader: Reloader | None = None,
        parse_backends: ParseBackends | None = None,
    ) -> None:
        if workers < 1:
            raise UserError("--workers must be >= 1")
        self.config = config.validate()
        self.reloader = reloader
        self.parse_backends = parse_backends
        self.replica = new_replica_id()
        self.receiver: PeerReceiver | None = None
        self.workers = workers
        self.clock = clock
        self.ctx = multiprocessing.get_context("spawn")
        self.url = ""
        self.restarts = 0
        self._procs: dict[int, _Worker] = {}
        self._backoff = dict.fromkeys(range(1, workers + 1), RESTART_MIN_S)
        self._stopping = False
        self._all_exited = asyncio.Event()
        self._table: LoadTable | None = None
        self._spec: SharedTableSpec | None = None
        self._lock: Any = None
        self._journal: str | None = None
        self._watchers: set[asyncio.Task[None]] = set()  # restarted workers awaited until they listen

    async def run(self) -> int:
        cfg = self.config
        try:
            sock = reserve_port(cfg.host, cfg.port)
        except OSError as exc:
            raise UserError(f"cannot listen on {cfg.host}:{cfg.port}: {exc.strerror or exc}") from None
        port = sock.getsockname()[1]
        self.config = dataclasses.replace(cfg, port=port)
        sweep()  # the leftovers of supervisors that died without cleaning up (SIGKILL)
        run = RunFiles.create()
        prefix = run.shm_prefix()
        run.record(shm=(f"{prefix}-counts", f"{prefix}-urls"))  # names first, then the segments
        self._lock = self.ctx.Lock()
        semaphore = getattr(getattr(self._lock, "_semlock", None), "name", None)
        if isinstance(semaphore, str):
            run.record(semaphores=(semaphore,))
        self._table, self._spec = LoadTable.create_shared(self.workers + 1, self._lock, name_prefix=prefix)
        self._journal = run.journal
        loop = asyncio.get_running_loop()
        receiving: asyncio.Task[None] | None = None
        try:
            if cfg.peer_bind is not None:  # one receiver per machine: the other replicas' load
                self.receiver = PeerReceiver(self._table, self.replica, time.monotonic, cfg.peer_expiry_s)
                self.receiver.bind(cfg.peer_bind)
                receiving = asyncio.create_task(self.receiver.run())
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.add_signal_handler(sig, self._on_signal, sig)
            for k in range(1, self.workers + 1):
                self._spawn(k)
            for k in range(1, self.workers + 1):
                await self._await_ready(k)
            host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
            self.url = f"http://{host}:{port}"
            modes = ", ".join(f"{b.url} ({'exact' if b.kv_events else 'approx'})" for b in cfg.backends)
            if not self._stopping:  # every worker drains a SIGINT/SIGTERM from now on (they said so)
                print(
                    f"kvroute serve: {self.url}/v1 policy={cfg.policy} {queue_note(cfg)} workers={self.workers} "
                    f"backends: {modes}",
                    file=sys.stderr,
                    flush=True,
                )
            await self._all_exited.wait()
            return 0
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                    loop.remove_signal_handler(sig)
            self._kill_all()
            if receiving is not None:
                receiving.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await receiving
            if self.receiver is not None:
                self.receiver.close()
            self._table.close(unlink=True)
            run.remove()
            sock.close()

    def table(self) -> LoadTable | None:
        """The supervisor's view of the machine's table (None before :meth:`run` created it)."""
        return self._table

    # ---- processes ------------------------------------------------------------------------------

    def _spawn(self, k: int) -> None:
        assert self._spec is not None
        spec = WorkerSpec(
            self.config,
            self._spec,
            k,
            self.workers,
            self.replica,
            self.reloader,
            self.parse_backends,
            self._journal,
        )
        recv, send = self.ctx.Pipe(duplex=False)
        proc = self.ctx.Process(
            target=run_worker, args=(spec, self._lock, send), name=f"kvroute-worker-{k}", daemon=False
        )
        proc.start()
        send.close()
        self._procs[k] = _Worker(k, proc, recv, self.clock())
        asyncio.get_running_loop().add_reader(proc.sentinel, self._on_exit, k)

    async def _await_ready(self, k: int) -> None:
        """Wait until worker ``k`` listens; raises UserError if it reports an error or exits. Returns
        at once when stopping (every worker is told to stop; none is awaited, and its pipe may be
        closed)."""
        w = self._procs.get(k)
        limit = self.config.worker_start_timeout_s
        deadline = self.clock() + limit
        while True:
            if self._stopping:
                return
            if w is None:
                raise UserError(f"worker {k} exited while starting")
            if w.ready.poll():
                break
            if not w.process.is_alive() and not w.ready.poll():
                raise UserError(f"worker {k} exited while starting (status {w.process.exitcode})")
            if self.clock() > deadline:
                raise UserError(
                    f"worker {k} did not start within {limit:g} s (--worker-start-timeout, "
                    "worker_start_timeout_s in the config)"
                )
            await asyncio.sleep(0.05)
        try:
            kind, detail = w.ready.recv()
        except EOFError:
            kind, detail = "error", "exited while starting"
        if kind != "ready":
            raise UserError(f"worker {k}: {detail}")
        self._listening(w)

    def _listening(self, w: _Worker) -> None:
        """Worker ``w`` listens (its handlers are installed): a SIGHUP held for it goes now."""
        w.listening = True
        if w.pending_hup and w.process.pid is not None:
            w.pending_hup = False
            with contextlib.suppress(ProcessLookupError):
                os.kill(w.process.pid, signal.SIGHUP)

    async def _watch_restart(self, k: int) -> None:
        """A restarted worker: mark it listening once it says so (it may die first: then nothing)."""
        w = self._procs.get(k)
        while w is not None and self._procs.get(k) is w and not self._stopping:
            try:
                if w.ready.poll():
                    kind, _ = w.ready.recv()
                    if kind == "ready":
                        self._listening(w)
                    return
            except (EOFError, OSError):
                return
            await asyncio.sleep(0.05)

    def _on_exit(self, k: int) -> None:
        """Worker ``k``'s process ended: zero its row; restart it unless stopping."""
        w = self._procs.pop(k)
        loop = asyncio.get_running_loop()
        loop.remove_reader(w.process.sentinel)
        w.process.join()
        assert self._table is not None
        self._table.clear_row(k)
        if not self.url and not self._stopping:
            return  # still starting: _await_ready reports it (and the pipe stays open for it)
        w.ready.close()
        if self._stopping:
            if not self._procs:
                self._all_exited.set()
            return
        lived = self.clock() - w.started
        if lived >= RESTART_RESET_S:
            self._backoff[k] = RESTART_MIN_S
        delay = self._backoff[k]
        self._backoff[k] = min(2 * delay, RESTART_MAX_S)
        print(
            f"kvroute serve: worker {k} (pid {w.process.pid}) exited with status {w.process.exitcode}; "
            f"restarting in {delay:.3g} s",
            file=sys.stderr,
            flush=True,
        )
        loop.call_later(delay, self._restart, k)

    def _restart(self, k: int) -> None:
        if self._stopping or k in self._procs:
            return
        self.restarts += 1
        self._spawn(k)
        task = asyncio.get_running_loop().create_task(self._watch_restart(k))
        self._watchers.add(task)
        task.add_done_callback(self._watchers.discard)

    def _follow_reload(self) -> None:
        """A SIGHUP: workers spawned from now on (restarts) start with the reloaded file's
        :data:`~kvroute.server.config.RELOADABLE` fields, as the running workers apply them, not with
        the start-up config. A file the workers reject (each says so) changes nothing here either."""
        if self.reloader is None or self.reloader.path is None:
            return
        try:
            new = self.reloader.checked()
        except (UserError, ValueError, TypeError):
            return
        self.config = self.config.reloaded(new)

    def _on_signal(self, sig: signal.Signals) -> None:
        name = signal.Signals(sig).name
        if sig == signal.SIGHUP:
            self._follow_reload()
        else:
            if not self._stopping:
                print(
                    f"kvroute serve: {name}: stopping {len(self._procs)} workers", file=sys.stderr, flush=True
                )
            self._stopping = True
            if not self._procs:
                self._all_exited.set()
        for w in list(self._procs.values()):
            forward = sig
            if not w.listening:  # still starting: its handlers may not be installed yet
                if sig == signal.SIGHUP:  # it would kill it: held until it listens
                    w.pending_hup = True
                    continue
                forward = signal.SIGTERM  # ends it at once, where SIGINT raised mid-start (a traceback)
            if w.process.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.process.pid, forward)

    def _kill_all(self, grace_s: float = 5.0) -> None:
        """Last resort on the way out (errors, or workers still alive): SIGTERM, then SIGKILL."""
        self._stopping = True
        procs = list(self._procs.values())
        for w in procs:
            if w.process.is_alive():
                w.process.terminate()
        deadline = time.monotonic() + grace_s
        for w in procs:
            w.process.join(max(deadline - time.monotonic(), 0.0))
            if w.process.is_alive():
                w.process.kill()
                w.process.join()
            with contextlib.suppress(ValueError, OSError):
                asyncio.get_running_loop().remove_reader(w.process.sentinel)
            w.ready.close()
        self._procs.clear()


def serve_workers(
    config: RouterConfig,
    workers: int,
    reloader: Reloader | None = None,
    parse_backends: ParseBackends | None = None,
) -> int:
    """``kvroute serve --workers N`` (N ≥ 2): run a :class:`Supervisor` until it is stopped."""

    async def main() -> int:
        return await Supervisor(config, workers, reloader=reloader, parse_backends=parse_backends).run()

    return asyncio.run(main())
