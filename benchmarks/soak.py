"""`make soak`: a bounded chaos soak of the live router, as a new user would run it.

Topology: 2 router replicas (``kvroute serve --config FILE --workers 2``, sharing reservations over
``--peer-bind``/``--peers``) in front of 4 emulated engines (``kvroute engine`` with KV events), a fifth
engine added through the admin API during the run. Every process is a real one; each one's stdout and
stderr go to a log file.

Traffic: about ``REQUESTS`` valid requests (multi-turn chats and completions, half streamed, one in
25 a client that leaves mid-stream) from ``CONCURRENCY`` clients spread over the live replicas, and a
fuzzed corpus of bad inputs (:data:`BAD_KINDS` kinds: bad JSON, wrong types, huge bodies, deep
nesting, bad methods and paths, bad headers, raw malformed HTTP on a socket) to both.

Hostile clients: one case of the conformance suite's client catalogue
(:data:`kvroute.conformance.clients.CLIENTS`: ``Expect: 100-continue``, hop-by-hop and duplicated
headers, pipelining, disconnects mid-body and mid-stream, slow drips, partial and oversized heads, bad
chunking, non-UTF-8 headers) for every ``HOSTILE_EVERY`` valid requests, over raw sockets to a live
replica, each answer checked with the suite's invariant; and every valid request carries its own
``X-Request-Id``, so an answer with another request's id or bytes is caught.

Faults, at fixed points of the run: an engine SIGKILLed and restarted; SIGHUP with a valid config (a
new policy) and with a broken one; the admin API adds, drains, undrains and deletes a backend; a whole
replica (supervisor and workers) SIGKILLed, then started again (it sweeps the dead one's leftovers);
at the end SIGTERM with streams in flight (they finish or end with the drain's SSE error event).

Asserts (the exit status is 1 when one fails):

- nothing lost outside the killed replica (a request in flight on the SIGKILLed engine may end with
  an SSE error event or a 502: counted apart, at most the concurrency);
- no 5xx and no plain-text answer to bad input: each is a 4xx OpenAI-style JSON error;
- no valid request's answer carries another request's id or bytes; the hostile clients' answers keep
  the invariant (outside the killed replica and the engine kill's window);
- no traceback in any process's log;
- the in-flight gauges back to zero on both replicas (``kvroute_backend_waiting``/``running``) and
  on every engine (``vllm:num_requests_running``/``waiting``);
- every router process's RSS under ``RSS_BOUND_MIB``;
- nothing a router process holds open grows over the run: each process's descriptors at the end
  (after the clients closed and ``QUIET_S`` seconds), but its pooled connections to the engines, at
  most ``OTHER_SLACK`` above its count at the start (replica B's second life: at its restart); its
  pooled connections to each engine at most ``POOL_BOUND``; none left to the deleted engine;
- RSS levels off: replica A's router processes grow less than ``RSS_SLOPE_BOUND_MIB`` per 1,000 of
  its requests over the second half of its requests.

Descriptors and RSS are sampled by phase (start, after each fault, end): every router process's
(supervisor, resource tracker, each worker) descriptors by kind and its sockets by peer (client,
each engine's HTTP port, each engine's ZMQ KV events, the replicas' peer channel, the unix sockets
between a supervisor and its workers), read from ``/proc`` (:mod:`benchmarks.fdcensus`).

Writes ``benchmarks/results/soak.json`` (``--out`` another name). ``--requests`` (or
``KVROUTE_SOAK_REQUESTS``) changes the length; ``python -m benchmarks.soak --help``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import psutil

from benchmarks.common import table, write
from benchmarks.fdcensus import Peers, census
from benchmarks.procs import Fleet, Proc, Traffic, send, tree_rss_mib, wait_http
from kvroute.conformance.clients import CLIENTS, Ctx
from kvroute.conformance.ids import ids_in, new_id
from kvroute.conformance.invariant import check_response, completion_ids
from kvroute.server.cluster import free_port
from kvroute.server.state.loadtable import url_digest
from kvroute.server.workers import WORKER_HEADER

REQUESTS = int(os.environ.get("KVROUTE_SOAK_REQUESTS", "3000"))  # --requests
MAX_FACTOR = 4  # traffic goes on while the faults run, up to this many times REQUESTS
GAP_S = 1.5  # seconds between two faults
CONCURRENCY = 16
RSS_BOUND_MIB = 400.0
QUIET_S = 3.0  # seconds between the clients closing their connections and the last census
POOL_BOUND = CONCURRENCY + 5
"""Pooled connections a router process may hold to one engine at the end: the upstream pool keeps
each connection it opened for reuse (up to ``max_idle`` per backend) and opens one only when none is
idle, so it holds at most as many as the process once had in flight to that engine at the same
time: the ``CONCURRENCY`` valid clients, the hostile one and the bad-input one, and its own health
check, ``/metrics`` scrape and ``/v1/models`` read. They stay while the engine keeps them open (the
emulated engine, aiohttp's server: 75 s idle; vLLM's uvicorn: 5 s), so they are bounded, not
required to return to the start's count."""
OTHER_SLACK = 2
"""Descriptors other than pooled connections to the engines (files, pipes, eventfds, unix sockets,
ZMQ sockets, client connections after they closed) that a router process may hold at the end beyond
its start: the supervisors' links of the replicas' peer channel (ZMQ, a TCP connection each way) may
still be connecting at the start, and are made anew after replica B's restart."""
RSS_SLOPE_BOUND_MIB = 4.0
"""MiB per 1,000 requests that replica A's router processes (summed) may still grow over the second
half of its requests: its caches fill in the first (their bounds: ``tokenizer_cache_tokens`` and
``tokenizer_cache_entries`` set low in the soak's config, the decision log's ``decisions_kept``, the
KV view's engine-sized block sets); what grows after that is a leak."""
TOKENIZER_CACHE_TOKENS = (
    200_000  # the soak's bound per worker (the default 2,000,000 fills in ~10,000 requests)
)
HOSTILE_EVERY = 20  # valid requests per hostile client case
TOKEN = "soak-token"
MAX_BODY = 2 << 20  # bytes: the replicas' --max-body-bytes (a bigger body is a 413)
WORKER_START_S = 600.0  # the replicas' --worker-start-timeout: at load average 23 to 32 on 2 cores a
# worker took longer than the default 120 s to start listening
AUTH = {"Authorization": f"Bearer {TOKEN}"}

# ---- the corpus of bad inputs ----------------------------------------------------------------------

J = {"Content-Type": "application/json"}
C, CH = "/v1/completions", "/v1/chat/completions"


def _http(
    method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
) -> tuple[str, Any]:
    return "http", (method, path, body, J if headers is None else headers)


def _raw(data: bytes) -> tuple[str, Any]:
    return "raw", data


BAD: dict[str, tuple[str, Any]] = {
    "empty body": _http("POST", C, b""),
    "not json": _http("POST", C, b"hello"),
    "truncated json": _http("POST", C, b'{"prompt": "x"'),
    "json array": _http("POST", C, b"[1, 2]"),
    "json string": _http("POST", CH, b'"hi"'),
    "json null": _http("POST", CH, b"null"),
    "no prompt": _http("POST", C, b'{"model": "emu"}'),
    "prompt number": _http("POST", C, b'{"prompt": 5}'),
    "prompt empty list": _http("POST", C, b'{"prompt": []}'),
    "prompt bools": _http("POST", C, b'{"prompt": [true, false]}'),
    "prompt negative ids": _http("POST", C, b'{"prompt": [1, -2]}'),
    "prompt mixed list": _http("POST", C, b'{"prompt": ["a", 1]}'),
    "stream string": _http("POST", C, b'{"prompt": "x", "stream": "yes"}'),
    "max_tokens string": _http("POST", C, b'{"prompt": "x", "max_tokens": "9"}'),
    "max_tokens negative": _http("POST", C, b'{"prompt": "x", "max_tokens": -1}'),
    "max_tokens float": _http("POST", C, b'{"prompt": "x", "max_tokens": 1.5}'),
    "model number": _http("POST", C, b'{"prompt": "x", "model": 3}'),
    "stream_options list": _http("POST", C, b'{"prompt": "x", "stream_options": []}'),
    "no messages": _http("POST", CH, b'{"model": "emu"}'),
    "messages empty": _http("POST", CH, b'{"messages": []}'),
    "messages string": _http("POST", CH, b'{"messages": "hi"}'),
    "message not object": _http("POST", CH, b'{"messages": [1]}'),
    "message no role": _http("POST", CH, b'{"messages": [{"content": "x"}]}'),
    "content number": _http("POST", CH, b'{"messages": [{"role": "user", "content": 5}]}'),
    "content bad part": _http("POST", CH, b'{"messages": [{"role": "user", "content": [{"type": "text"}]}]}'),
    "deep prompt": _http("POST", C, b'{"prompt": ' + b"[" * 990 + b"]" * 990 + b"}"),
    "deep content": _http(
        "POST", CH, b'{"messages": [{"role": "user", "content": ' + b"[" * 990 + b"]" * 990 + b"}]}"
    ),
    "deeper than orjson": _http("POST", C, b'{"prompt": ' + b"[" * 3000 + b"]" * 3000 + b"}"),
    "deep object": _http("POST", C, b'{"prompt": "x", "extra": ' + b'{"a":' * 200 + b"1" + b"}" * 200 + b"}"),
    "huge body": _http("POST", C, b'{"prompt": "' + b"x" * (MAX_BODY + 1024) + b'"}'),
    "huge chat body": _http("POST", CH, b'{"messages": "' + b"y" * (MAX_BODY + 1024) + b'"}'),
    "GET completions": _http("GET", C),
    "PUT completions": _http("PUT", C, b"{}"),
    "DELETE chat": _http("DELETE", CH),
    "PATCH chat": _http("PATCH", CH, b"{}"),
    "POST models": _http("POST", "/v1/models", b"{}"),
    "unknown path": _http("GET", "/v2/nothing"),
    "admin no token": _http("GET", "/admin/backends", b"", {}),
    "admin wrong token": _http("GET", "/admin/backends", b"", {"Authorization": "Bearer nope"}),
    "admin bad body": _http("POST", "/admin/backends", b'{"url": 5}', {**J, **AUTH}),
    "admin bad url": _http("POST", "/admin/backends", b'{"url": "ftp://x"}', {**J, **AUTH}),
    "admin unknown id": _http("DELETE", "/admin/backends/000000000000", b"", AUTH),
    "raw control char header": _raw(b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\x01b\r\n\r\n"),
    "raw header over 8190": _raw(b"GET /health HTTP/1.1\r\nHost: x\r\nX-B: " + b"a" * 9000 + b"\r\n\r\n"),
    "raw body after close": _raw(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n{}"),
    "raw negative length": _raw(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n"),
    "raw bad chunk": _raw(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"
    ),
    "raw tls hello": _raw(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(32)) + b"\r\n\r\n"),
    "raw bad version": _raw(b"GET /health HTTP/9.9\r\nHost: x\r\n\r\n"),
    "raw bad method": _raw(b"G@T /health HTTP/1.1\r\nHost: x\r\n\r\n"),
    "raw space in header name": _raw(b"GET /health HTTP/1.1\r\nHost: x\r\nBad Name: v\r\n\r\n"),
    "raw two lengths": _raw(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}"
    ),
}
BAD_KINDS = len(BAD)


def _json_error(status: int, ctype: str, body: bytes) -> str | None:
    """Why this answer to bad input is not a 4xx OpenAI-style JSON error (None: it is)."""
    if not 400 <= status < 500:
        return f"status {status}"
    if not ctype.startswith("application/json"):
        return f"content type {ctype!r}: {body[:80]!r}"
    try:
        err = orjson.loads(body)["error"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return f"not an error object: {body[:80]!r}"
    if not isinstance(err, dict) or set(err) != {"message", "type", "param", "code"}:
        return f"error fields {sorted(err) if isinstance(err, dict) else err!r}"
    return None


async def _raw_answer(port: int, data: bytes) -> tuple[int, str, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        lines = head.decode("latin-1").split("\r\n")
        headers = {
            k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:] if ":" in x)
        }
        body = await asyncio.wait_for(reader.readexactly(int(headers.get("content-length", "0"))), 10)
        return int(lines[0].split()[1]), headers.get("content-type", ""), body
    finally:
        writer.close()


# ---- the run ---------------------------------------------------------------------------------------


@dataclass
class Replica:
    name: str
    config: Path
    port: int
    peer: str
    proc: Proc | None = None
    alive: bool = False
    generation: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class Result:
    replica: str
    generation: int
    start: float
    end: float
    status: int
    outcome: str  # ok, leaver, error_event, upstream_5xx, conn_error, bad_answer, wrong_client


@dataclass
class Hostile:
    """One hostile client case's run: the replica, when, and the invariant's violations."""

    case: str
    replica: str
    generation: int
    start: float
    end: float
    violations: list[str]


@dataclass
class Soak:
    logs: Path
    requests: int = REQUESTS  # valid requests to send at least (the faults run at fractions of it)
    fleet: Fleet = field(init=False)
    engines: list[Proc] = field(default_factory=list)
    replicas: list[Replica] = field(default_factory=list)
    results: list[Result] = field(default_factory=list)
    hostile: list[Hostile] = field(default_factory=list)
    wrong_client: list[str] = field(default_factory=list)  # valid answers with another request's id
    bad_results: Counter[str] = field(default_factory=Counter)
    bad_failures: list[str] = field(default_factory=list)
    events: list[tuple[float, str]] = field(default_factory=list)
    rss_peak: dict[str, float] = field(default_factory=dict)
    phases: list[dict[str, Any]] = field(default_factory=list)  # censuses by phase (Soak.phase)
    rss_series: list[tuple[int, float]] = field(default_factory=list)  # (A's requests, A's RSS MiB)
    done_by: Counter[str] = field(default_factory=Counter)  # requests answered, by replica
    done: int = 0
    engine_kill: tuple[float, float] = (0.0, 0.0)  # when the engine was killed .. back
    replica_kill: float = 0.0
    sent: int = 0
    faults_done: bool = False
    quiet: bool = False  # the traffic is over (A's RSS series ends)
    killed_name: str = ""  # the replica SIGKILLed (its answers may be lost)
    swept: bool = False  # its restart removed the dead one's leftovers
    t0: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.fleet = Fleet(self.logs)

    def note(self, what: str) -> None:
        t = time.monotonic() - self.t0
        self.events.append((round(t, 2), what))
        print(f"  [{t:6.1f} s] {what}", flush=True)

    # ---- processes -----------------------------------------------------------------------------

    def _backends_yaml(self, engines: list[Proc]) -> str:
        lines = ["backends:"]
        for e in engines:
            assert e.kv is not None
            lines += [f"  - url: {e.url}", f"    kv_events: {e.kv[0]}", f"    kv_replay: {e.kv[1]}"]
        return "\n".join(lines) + "\n"

    def write_config(self, r: Replica, policy: str = "lmetric-kv", broken: bool = False) -> None:
        if broken:
            r.config.write_text("backends: [http://127.0.0.1:1\npolicy: [\n")
            return
        others = ",".join(x.peer for x in self.replicas if x is not r)
        r.config.write_text(
            self._backends_yaml(self.engines[:4])
            + f"policy: {policy}\nadmin_token: {TOKEN}\nmax_body_bytes: {MAX_BODY}\n"
            + "health_interval_s: 0.2\ndrain_grace_s: 0.5\ndrain_timeout_s: 8\n"
            + f"peer_bind: {r.peer}\npeers: [{others}]\npeer_expiry_s: 2.0\npeer_refresh_s: 0.5\n"
            + f"tokenizer_cache_tokens: {TOKENIZER_CACHE_TOKENS}\n"
        )

    def start_replica(self, r: Replica) -> None:
        args = ["serve", "--config", str(r.config), "--workers", "2", "--port", str(r.port)]
        args += ["--worker-start-timeout", str(WORKER_START_S)]
        r.proc = self.fleet.spawn(f"replica-{r.name}", args, r.url)
        r.generation += 1

    async def wait_replica(self, r: Replica) -> None:
        assert r.proc is not None
        await wait_http(r.url, proc=r.proc, timeout_s=WORKER_START_S + 60)  # the first worker answers
        for _ in range(600):  # every worker up and answering (fresh connections spread over the
            # listening ones: a worker still starting gets none), every backend admitted
            ok = 0
            workers: set[str] = set()
            for _ in range(12):
                conn = aiohttp.TCPConnector(force_close=True)
                async with aiohttp.ClientSession(connector=conn) as fresh, fresh.get(r.url + "/health") as h:
                    body = await h.json()
                    ok += h.status == 200 and body["healthy_backends"] >= 4
                    workers.add(h.headers.get(WORKER_HEADER, ""))
            if ok == 12 and workers == {"1", "2"}:
                break
            await asyncio.sleep(0.2)
        r.alive = True

    # ---- descriptors and RSS by phase ------------------------------------------------------------

    def peers(self) -> Peers:
        """The ports the census names sockets by: the replicas', the engines' (HTTP, ZMQ), the peers'."""
        engines = {int(e.url.rsplit(":", 1)[1]): f"engine{k}" for k, e in enumerate(self.engines)}
        zmq = {
            int(ep.rsplit(":", 1)[1]): f"engine{k}" for k, e in enumerate(self.engines) for ep in e.kv or ()
        }
        return Peers(
            frozenset(r.port for r in self.replicas),
            engines,
            zmq,
            frozenset(int(r.peer.rsplit(":", 1)[1]) for r in self.replicas),
        )

    def processes(self, r: Replica) -> dict[str, int]:
        """Role → pid of replica ``r``'s processes: ``supervisor``, ``tracker`` (multiprocessing's
        resource tracker), ``worker1``, ``worker2`` (by pid)."""
        if r.proc is None or not r.proc.alive():
            return {}
        out = {"supervisor": r.proc.pid}
        workers = []
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(r.proc.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    if any("resource_tracker" in part for part in child.cmdline()):
                        out["tracker"] = child.pid
                    else:
                        workers.append(child.pid)
        out.update({f"worker{k}": pid for k, pid in enumerate(sorted(workers), 1)})
        return out

    def phase(self, label: str) -> None:
        """Record every live router process's descriptors and RSS now, as phase ``label``."""
        peers = self.peers()
        replicas: dict[str, Any] = {}
        fds: dict[str, int] = {}
        for r in self.replicas:
            if r.proc is None or not r.proc.alive():
                continue
            procs = {role: census(pid, peers) for role, pid in self.processes(r).items()}
            replicas[r.name] = {
                "generation": r.generation,
                "processes": {role: c.as_json() for role, c in procs.items()},
            }
            fds[r.name] = sum(c.fds for c in procs.values())
        t = round(time.monotonic() - self.t0, 2)
        self.phases.append({"phase": label, "t": t, "requests": self.done, "replicas": replicas})
        print(f"  [{t:6.1f} s] census {label}: descriptors by replica {fds}", flush=True)

    def kill_tree(self, proc: Proc) -> None:
        """SIGKILL ``proc`` and all its descendants (each by its pid), all at once."""
        for pid in tree_rss_mib(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.popen.wait()

    # ---- traffic -------------------------------------------------------------------------------

    def pick(self, i: int) -> Replica:
        live = [r for r in self.replicas if r.alive]
        return live[i % len(live)]

    async def client(self, session: aiohttp.ClientSession, traffic: Traffic, enough: asyncio.Event) -> None:
        """Send requests until ``enough`` is set (the faults are done and ``REQUESTS`` were sent) or
        ``MAX_FACTOR`` times ``REQUESTS`` were."""
        while not enough.is_set() and self.sent < MAX_FACTOR * self.requests:
            i = self.sent
            self.sent += 1
            if self.sent >= self.requests and self.faults_done:
                enough.set()
            r = self.pick(i)
            path, body = traffic.next()
            leave = 48 if i % 25 == 3 else None
            rid = new_id()
            start = time.monotonic()
            status, data = await send(
                session, r.url, path, body, leave_after=leave, headers={"X-Request-Id": rid}
            )
            end = time.monotonic()
            outcome = _outcome(status, body, data, leave)
            whose = _not_own(rid, "chatcmpl-" if "messages" in body else "cmpl-", status, data)
            if whose:
                self.wrong_client.append(f"{rid} → {r.name}: {whose}")
                outcome = "wrong_client"
            self.results.append(Result(r.name, r.generation, start, end, status, outcome))
            self.done += 1
            self.done_by[r.name] += 1

    async def hostile_clients(self, enough: asyncio.Event) -> None:
        """One client case of the catalogue for every ``HOSTILE_EVERY`` valid requests, in turn."""
        names = sorted(CLIENTS)
        n = 0
        while not enough.is_set():
            if self.done < n * HOSTILE_EVERY:
                await asyncio.sleep(0.05)
                continue
            name = names[n % len(names)]
            r = self.pick(n)
            n += 1
            gen, start = r.generation, time.monotonic()
            outcomes = await CLIENTS[name].run(Ctx("127.0.0.1", r.port, "emu", timeout_s=30.0))
            found = [
                v
                for o in outcomes
                for v in ([o.error] if o.error else []) + check_response(o.response, o.expect)
            ]
            self.hostile.append(Hostile(name, r.name, gen, start, time.monotonic(), found))

    async def bad_inputs(self, session: aiohttp.ClientSession, rounds: int) -> None:
        names = sorted(BAD)
        n = 0
        for _k in range(rounds):
            for name in names:
                live = [r for r in self.replicas if r.alive]
                r = live[n % len(live)]
                n += 1
                kind, spec = BAD[name]
                try:
                    if kind == "raw":
                        status, ctype, body = await _raw_answer(r.port, spec)
                    else:
                        method, path, raw, headers = spec
                        async with session.request(method, r.url + path, data=raw, headers=headers) as resp:
                            status, ctype, body = (
                                resp.status,
                                resp.headers.get("Content-Type", ""),
                                await resp.read(),
                            )
                except (TimeoutError, aiohttp.ClientError, OSError, asyncio.IncompleteReadError) as exc:
                    if not r.alive or r.name == self.killed_name:
                        continue  # the replica died under it
                    self.bad_failures.append(f"{name} → {r.name}: no answer ({exc!r})")
                    continue
                why = _json_error(status, ctype, body)
                self.bad_results[name] += 1
                if why is not None:
                    self.bad_failures.append(f"{name} → {r.name}: {why}")
                await asyncio.sleep(0.05)

    async def rss_sampler(self, stop: asyncio.Event) -> None:
        """Every second: each router process's peak RSS, and replica A's RSS (its processes summed)
        against the requests it answered."""
        while not stop.is_set():
            for r in self.replicas:
                if r.proc is not None and r.proc.alive():
                    tree = tree_rss_mib(r.proc.pid)
                    for pid, mib in tree.items():
                        key = f"{r.name}:{pid}"
                        self.rss_peak[key] = max(self.rss_peak.get(key, 0.0), mib)
                    if r.name == "A" and not self.quiet:
                        self.rss_series.append((self.done_by["A"], round(sum(tree.values()), 1)))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)

    # ---- faults --------------------------------------------------------------------------------

    async def at(self, frac: float) -> None:
        while self.done < frac * self.requests:
            await asyncio.sleep(0.05)

    async def faults(self, session: aiohttp.ClientSession) -> None:
        a, b = self.replicas
        await self.at(0.10)
        victim = self.engines[3]
        self.note(f"SIGKILL engine3 (pid {victim.pid})")
        t_kill = time.monotonic()
        self.kill_tree(victim)
        await asyncio.sleep(2.0)
        self.engines[3] = self.fleet.restart(victim)
        await wait_http(self.engines[3].url, proc=self.engines[3], timeout_s=240)
        self.engine_kill = (t_kill, time.monotonic() + 3.0)
        self.note("engine3 restarted")
        self.phase("engine killed and restarted")
        await self.at(0.25)
        await asyncio.sleep(GAP_S)
        self.write_config(a, policy="lmetric")
        a.proc.signal(signal.SIGHUP)  # type: ignore[union-attr]
        self.note("SIGHUP replica A: a valid config (policy lmetric)")
        await self.at(0.30)
        await asyncio.sleep(GAP_S)
        self.write_config(a, broken=True)
        a.proc.signal(signal.SIGHUP)  # type: ignore[union-attr]
        self.note("SIGHUP replica A: a broken config")
        await asyncio.sleep(GAP_S)
        self.write_config(a)
        self.phase("SIGHUP: a valid and a broken config")
        await self.at(0.35)
        extra = self.engines[4]
        assert extra.kv is not None
        spec = {"url": extra.url, "kv_events": extra.kv[0], "kv_replay": extra.kv[1]}
        for r in (a, b):
            async with session.post(r.url + "/admin/backends", json=spec, headers=AUTH) as resp:
                self.note(f"admin add engine4 on {r.name}: {resp.status}")
        await self.at(0.42)
        self.phase("engine4 added")
        await asyncio.sleep(GAP_S)
        bid = url_digest(extra.url)
        async with session.post(f"{a.url}/admin/backends/{bid}/drain", headers=AUTH) as resp:
            self.note(f"admin drain engine4 on A: {resp.status}")
        await asyncio.sleep(0.5)
        async with session.post(f"{a.url}/admin/backends/{bid}/undrain", headers=AUTH) as resp:
            self.note(f"admin undrain engine4 on A: {resp.status}")
        await self.at(0.50)
        await asyncio.sleep(GAP_S)
        for r in (a, b):
            async with session.delete(f"{r.url}/admin/backends/{bid}", headers=AUTH) as resp:
                self.note(f"admin delete engine4 on {r.name}: {resp.status}")
        await self.at(0.55)
        await asyncio.sleep(GAP_S)
        self.phase("engine4 deleted")
        b.alive = False  # the load balancer stops sending to it first, as a health check would
        self.killed_name = "B"
        self.replica_kill = time.monotonic()
        assert b.proc is not None
        self.note(f"SIGKILL replica B: supervisor and workers ({sorted(tree_rss_mib(b.proc.pid))})")
        self.kill_tree(b.proc)
        await asyncio.sleep(1.0)
        self.start_replica(b)
        await self.wait_replica(b)
        swept = "removed the leftovers of a dead kvroute supervisor" in b.proc.text()
        self.note(f"replica B started again (swept the dead one's leftovers: {swept})")
        self.swept = swept
        self.phase("replica B restarted")
        await asyncio.sleep(GAP_S)  # some traffic through the restarted replica
        self.faults_done = True


def _outcome(status: int, body: dict[str, Any], data: bytes, leave: int | None) -> str:
    if status == -1:
        return "conn_error"
    if status >= 500:
        return "upstream_5xx"
    if status != 200:
        return "bad_answer"
    if leave is not None and body.get("stream"):
        return "leaver"
    if body.get("stream"):
        if b'"error"' in data:
            return "error_event"
        return "ok" if data.rstrip().endswith(b"data: [DONE]") else "bad_answer"
    try:
        return "ok" if orjson.loads(data).get("choices") else "bad_answer"
    except orjson.JSONDecodeError:
        return "bad_answer"


def _not_own(rid: str, prefix: str, status: int, data: bytes) -> str:
    """Why the answer ``data`` to request ``rid`` is not its own ('' when nothing says so): another
    suite id in it, or a 200 completion whose ids are not ``prefix + rid``."""
    foreign = ids_in(data) - {rid}
    if foreign:
        return f"carries {sorted(foreign)}"
    ids = completion_ids(data) if status == 200 else None
    wrong = sorted({i for i in ids or () if i != prefix + rid})
    return f"completion id {wrong}" if wrong else ""


def _log(soak: Soak, name: str) -> str:
    return "".join(p.text() for p in [*soak.fleet.procs, *soak.fleet.retired] if p.name == name)


async def _gauges(url: str, names: tuple[str, ...], times: int = 6) -> float:
    """The largest sum of the samples named ``names`` over ``times`` fresh connections."""
    worst = 0.0
    for _ in range(times):
        conn = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(connector=conn) as s, s.get(url + "/metrics") as r:
            text = await r.text()
        total = sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(names) and not line.startswith("#")
        )
        worst = max(worst, total)
    return worst


async def _run(soak: Soak) -> dict[str, Any]:
    fleet = soak.fleet
    soak.engines = [fleet.engine(f"engine{k}", time_scale=100.0) for k in range(5)]
    for e in soak.engines:
        await wait_http(e.url, proc=e, timeout_s=240)  # a loaded machine starts them slowly
    tmp = soak.logs
    soak.replicas = [
        Replica(n, tmp / f"replica-{n}.yaml", free_port(), f"tcp://127.0.0.1:{free_port()}")
        for n in ("A", "B")
    ]
    for r in soak.replicas:
        soak.write_config(r)
        soak.start_replica(r)
    for r in soak.replicas:
        await soak.wait_replica(r)
    soak.note("2 replicas x 2 workers up, 4 engines admitted")
    soak.t0 = time.monotonic()
    soak.phase("start")
    stop = asyncio.Event()
    sampler = asyncio.create_task(soak.rss_sampler(stop))
    traffic = Traffic(seed=11, users=300, max_turns=6, words=150)
    enough = asyncio.Event()
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        faults = asyncio.create_task(soak.faults(session))
        bad = asyncio.create_task(soak.bad_inputs(session, rounds=max(1, soak.requests // 300)))
        hostile = asyncio.create_task(soak.hostile_clients(enough))
        await asyncio.gather(*(soak.client(session, traffic, enough) for _ in range(CONCURRENCY)))
        enough.set()  # (also when MAX_FACTOR ended the traffic first)
        soak.quiet = True
        await hostile
        soak.note(f"{soak.sent} requests done")
        await faults
        await bad
        soak.note("bad inputs done")
        # quiet: the gauges come back to zero on both replicas and every engine
        gauges: dict[str, float] = {}
        for _ in range(100):
            for r in soak.replicas:
                gauges[f"replica {r.name}"] = await _gauges(
                    r.url, ("kvroute_backend_waiting", "kvroute_backend_running")
                )
            for k, e in enumerate(soak.engines):
                gauges[f"engine{k}"] = await _gauges(
                    e.url, ("vllm:num_requests_running", "vllm:num_requests_waiting"), 1
                )
            if not any(gauges.values()):
                break
            await asyncio.sleep(0.2)
        soak.note(f"gauges: {gauges}")
    # the clients' connections are closed: what the routers still hold after a quiet moment stays
    await asyncio.sleep(QUIET_S)
    soak.phase("end")
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        # SIGTERM with streams in flight: each ends with [DONE] (finished, or the drain's error event)
        a = soak.replicas[0]
        long_body = {
            "model": "emu",
            "prompt": "a long answer please " * 20,
            "max_tokens": 3000,
            "stream": True,
        }
        streams = [asyncio.create_task(send(session, a.url, "/v1/completions", long_body)) for _ in range(6)]
        await asyncio.sleep(1.0)
        assert a.proc is not None
        a.proc.signal(signal.SIGTERM)
        soak.note("SIGTERM replica A with 6 streams in flight")
        ends = await asyncio.gather(*streams)
        # (status, ended with [DONE], ended by the drain's SSE error event rather than finishing)
        drained = [
            (status, data.rstrip().endswith(b"data: [DONE]"), b'"error"' in data) for status, data in ends
        ]
        code_a = await asyncio.to_thread(a.proc.popen.wait, 60)
        soak.note(f"replica A exited {code_a}; streams: {drained}")
    stop.set()
    await sampler
    b = soak.replicas[1]
    assert b.proc is not None
    code_b = b.proc.stop(60)
    for e in soak.engines:
        e.stop(20)
    return {"gauges": gauges, "drained": drained, "exit_a": code_a, "exit_b": code_b}


def fd_growth(phases: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``replica:role`` → its descriptors at its start (replica A: phase ``start``; B, SIGKILLed and
    started again: phase ``replica B restarted``) and at the ``end``, the growth, and its sockets by
    peer at both."""
    by = {p["phase"]: p["replicas"] for p in phases}
    out: dict[str, dict[str, Any]] = {}
    for name, first in (("A", "start"), ("B", "replica B restarted")):
        start, end = by.get(first, {}).get(name), by.get("end", {}).get(name)
        if start is None or end is None:
            continue
        for role, c0 in start["processes"].items():
            c1 = end["processes"].get(role)
            if c1 is None:
                continue
            pooled0, pooled1 = (
                sum(n for peer, n in c["by_peer"].items() if peer.startswith("engine")) for c in (c0, c1)
            )
            out[f"{name}:{role}"] = {
                "start": c0["fds"],
                "end": c1["fds"],
                "growth": c1["fds"] - c0["fds"],
                "growth_not_pooled": (c1["fds"] - pooled1) - (c0["fds"] - pooled0),
                "pooled_end": {peer: n for peer, n in c1["by_peer"].items() if peer.startswith("engine")},
                "sockets_start": c0["by_peer"],
                "sockets_end": c1["by_peer"],
            }
    return out


def rss_slopes(series: list[tuple[int, float]]) -> tuple[float, float, int]:
    """MiB per 1,000 requests over the first and the second half of ``series`` ((requests answered,
    RSS MiB) samples), and the requests it spans; (0, 0, n) when too short."""
    if len(series) < 3 or series[-1][0] < 100:
        return 0.0, 0.0, series[-1][0] if series else 0
    n = series[-1][0]
    r0 = series[0][1]
    mid = min(series, key=lambda x: abs(x[0] - n / 2))
    r1 = series[-1][1]
    first = (mid[1] - r0) / max(mid[0] - series[0][0], 1) * 1000
    second = (r1 - mid[1]) / max(n - mid[0], 1) * 1000
    return round(first, 2), round(second, 2), n


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.soak",
        description="a bounded chaos soak of kvroute serve (2 replicas x 2 workers, 4 emulated engines)",
    )
    parser.add_argument(
        "--requests", type=int, default=REQUESTS, help=f"valid requests at least (default {REQUESTS})"
    )
    parser.add_argument("--out", default="soak.json", help="results file under benchmarks/results")
    args = parser.parse_args(argv)
    if args.requests < 100:
        parser.error("--requests: at least 100")
    logs = Path(tempfile.mkdtemp(prefix="kvroute-soak-"))
    print(
        f"soak: {args.requests} requests, {CONCURRENCY} clients, {BAD_KINDS} kinds of bad input; logs in {logs}"
    )
    soak = Soak(logs, requests=args.requests)
    t_start = time.monotonic()
    try:
        end = asyncio.run(_run(soak))
    finally:
        soak.fleet.stop_all()
    wall = time.monotonic() - t_start
    res = soak.results
    outcomes = Counter(r.outcome for r in res)
    bad_outcomes = ("upstream_5xx", "conn_error", "bad_answer", "error_event")
    lost_killed = [
        r
        for r in res
        if r.outcome in bad_outcomes
        and r.replica == "B"
        and r.generation == 1
        and r.start <= soak.replica_kill
    ]
    t_kill, t_back = soak.engine_kill
    engine_broken = [
        r
        for r in res
        if r.outcome in ("error_event", "upstream_5xx")
        and r.start <= t_back
        and r.end >= t_kill
        and r not in lost_killed
    ]
    lost = [r for r in res if r.outcome in bad_outcomes and r not in lost_killed and r not in engine_broken]
    # a hostile case on the killed replica, or while the engine was down, may get what they got
    hostile_failed = [
        h
        for h in soak.hostile
        if h.violations
        and not (h.replica == "B" and h.generation == 1 and h.start <= soak.replica_kill)
        and not (h.start <= t_back and h.end >= t_kill)
    ]
    tracebacks = soak.fleet.tracebacks()
    log_a = _log(soak, "replica-A")
    reloads = (log_a.count("SIGHUP: reloaded"), log_a.count("rejected, keeping the old config"))
    rss_peak = max(soak.rss_peak.values(), default=0.0)
    growth = fd_growth(soak.phases)
    ends = [p for p in soak.phases if p["phase"] == "end"]
    to_deleted = {
        f"{name}:{role}": n
        for name, rep in (ends[0]["replicas"] if ends else {}).items()
        for role, c in rep["processes"].items()
        if (n := c["by_peer"].get("engine4", 0) + c["by_peer"].get("zmq:engine4", 0))
    }
    rss_first, rss_second, rss_span = rss_slopes(soak.rss_series)
    checks = {
        "nothing lost outside the killed replica": not lost,
        "engine kill broke at most the requests in flight": len(engine_broken) <= CONCURRENCY,
        "bad input: 4xx JSON errors only": not soak.bad_failures,
        "no answer carries another request's id or bytes": not soak.wrong_client,
        "hostile clients: the invariant held": not hostile_failed,
        "no traceback in any log": not tracebacks,
        "gauges back to zero": not any(end["gauges"].values()),
        f"router RSS under {RSS_BOUND_MIB:.0f} MiB": rss_peak < RSS_BOUND_MIB,
        "SIGTERM: every stream ended with [DONE]": all(s == 200 and ok for s, ok, _ in end["drained"]),
        "replicas exited 0": end["exit_a"] == 0 and end["exit_b"] == 0,
        "a restarted replica swept the dead one's leftovers": soak.swept,
        "SIGHUP: the valid config applied, the broken one refused": reloads == (2, 2),
        f"at least {soak.requests} requests": len(res) >= soak.requests,
        f"descriptors: each process's pooled connections to one engine at most {POOL_BOUND}": bool(growth)
        and all(n <= POOL_BOUND for g in growth.values() for n in g["pooled_end"].values()),
        f"descriptors but pooled upstream connections: at most {OTHER_SLACK} above the start": bool(growth)
        and all(g["growth_not_pooled"] <= OTHER_SLACK for g in growth.values()),
        "descriptors: none left to the deleted engine": bool(ends) and not to_deleted,
        f"RSS: second half under {RSS_SLOPE_BOUND_MIB:.0f} MiB per 1,000 requests": rss_span > 0
        and rss_second < RSS_SLOPE_BOUND_MIB,
    }
    table([(k, "ok" if v else "FAILED", "") for k, v in checks.items()], ("check", "result", ""))
    figures = {
        "requests": len(res),
        "wall_s": round(wall, 1),
        "outcomes": dict(outcomes),
        "lost_on_killed_replica": len(lost_killed),
        "broken_by_engine_kill": len(engine_broken),
        "lost_elsewhere": len(lost),
        "lost_examples": [r.__dict__ for r in lost[:10]],
        "bad_inputs_sent": sum(soak.bad_results.values()),
        "bad_input_kinds": BAD_KINDS,
        "bad_input_failures": soak.bad_failures[:20],
        "wrong_client": soak.wrong_client[:20],
        "hostile_cases_run": len(soak.hostile),
        "hostile_case_kinds": len({h.case for h in soak.hostile}),
        "hostile_failures": [f"{h.case} → {h.replica}: {h.violations}" for h in hostile_failed[:20]],
        "tracebacks": tracebacks,
        "gauges_at_end": end["gauges"],
        "rss_peak_mib": round(rss_peak, 1),
        "rss_bound_mib": RSS_BOUND_MIB,
        "rss_peak_by_process": {k: round(v, 1) for k, v in sorted(soak.rss_peak.items())},
        "pool_bound": POOL_BOUND,
        "other_slack": OTHER_SLACK,
        "fd_growth": growth,
        "fds_to_deleted_engine": to_deleted,
        "rss_replica_a_mib_per_1000": {
            "first_half": rss_first,
            "second_half": rss_second,
            "requests": rss_span,
        },
        "rss_slope_bound_mib_per_1000": RSS_SLOPE_BOUND_MIB,
        "rss_replica_a_series": soak.rss_series[:: max(1, len(soak.rss_series) // 200)],
        "tokenizer_cache_tokens": TOKENIZER_CACHE_TOKENS,
        "phases": soak.phases,
        "loadavg_end": Path("/proc/loadavg").read_text().split()[:3],
        "sigterm_streams": end["drained"],
        "sighup_reloaded_refused": reloads,
        "events": soak.events,
        "checks": checks,
        "ok": all(checks.values()),
        "logs": str(logs),
    }
    print(
        f"lost on the killed replica {len(lost_killed)}, broken by the engine kill {len(engine_broken)}, "
        f"lost elsewhere {len(lost)}; RSS peak {rss_peak:.0f} MiB; {wall:.0f} s"
    )
    print(
        "descriptors start → end: "
        + ", ".join(f"{k} {g['start']}→{g['end']}" for k, g in growth.items())
        + f"; replica A RSS {rss_first} then {rss_second} MiB per 1,000 of its {rss_span} requests"
    )
    write(args.out, figures)
    if lost:
        print("lost:", [r.__dict__ for r in lost[:5]], file=sys.stderr)
    for name, n in tracebacks.items():
        print(f"tracebacks in {name}: {n}", file=sys.stderr)
    return 0 if figures["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
