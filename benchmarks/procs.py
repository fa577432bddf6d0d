"""Real processes for the memory bench and the soak: emulated engines and routers started as
``python -m kvroute.cli ...`` with every process's output captured to a log file, their RSS read from
/proc, signals sent to one process (never to a group by name), and a small traffic mix.

Nothing here is a test double: the router under test is the installed ``kvroute serve``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from kvroute.server.cluster import free_port

__all__ = ["Fleet", "Proc", "Traffic", "rss_mib", "tree_rss_mib"]

TRACEBACK = "Traceback (most recent call last)"


def rss_mib(pid: int) -> float:
    """Resident set size of ``pid`` in MiB (0.0 once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0.0


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return []
    return [int(p) for p in text.split()]


def tree_rss_mib(pid: int) -> dict[int, float]:
    """RSS in MiB of ``pid`` and each of its descendants, by pid."""
    out: dict[int, float] = {}
    todo = [pid]
    while todo:
        p = todo.pop()
        out[p] = rss_mib(p)
        todo.extend(_children(p))
    return out


@dataclass
class Proc:
    """One started process: ``name``, its command, its log (stdout and stderr together)."""

    name: str
    cmd: list[str]
    log: Path
    popen: subprocess.Popen[bytes]
    url: str = ""
    kv: tuple[str, str] | None = None  # an engine's KV events (publisher, replay) endpoints

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, then SIGKILL after ``timeout_s``; the exit status."""
        self.signal(signal.SIGTERM)
        try:
            return self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            return self.popen.wait()

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


@dataclass
class Fleet:
    """The processes of one run, their logs under ``logs``."""

    logs: Path
    procs: list[Proc] = field(default_factory=list)
    retired: list[Proc] = field(default_factory=list)  # replaced (restarted) ones: their logs count too

    def spawn(self, name: str, args: list[str], url: str = "", env: dict[str, str] | None = None) -> Proc:
        self.logs.mkdir(parents=True, exist_ok=True)
        n = sum(p.name == name for p in [*self.procs, *self.retired])
        log = self.logs / (f"{name}.log" if n == 0 else f"{name}.{n}.log")
        cmd = [sys.executable, "-m", "kvroute.cli", *args]
        with log.open("wb") as out:
            popen = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
            )
        proc = Proc(name, cmd, log, popen, url)
        self.procs.append(proc)
        return proc

    def engine(self, name: str, time_scale: float = 200.0, kv_events: bool = True) -> Proc:
        port = free_port()
        args = ["engine", "--port", str(port), "--model", "emu", "--time-scale", str(time_scale)]
        args += ["--kv-blocks", "8192", "--max-model-len", "32768"]
        if kv_events:
            pub, rep = free_port(), free_port()
            args += ["--kv-events-endpoint", f"tcp://127.0.0.1:{pub}"]
            args += ["--kv-events-replay-endpoint", f"tcp://127.0.0.1:{rep}"]
        proc = self.spawn(name, args, f"http://127.0.0.1:{port}")
        if kv_events:
            proc.kv = (f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{rep}")
        return proc

    def restart(self, proc: Proc) -> Proc:
        """Start ``proc``'s command again (same ports), after it exited."""
        self.procs.remove(proc)
        self.retired.append(proc)
        n = sum(p.name == proc.name for p in [*self.procs, *self.retired])
        log = self.logs / f"{proc.name}.{n}.log"
        with log.open("wb") as out:
            popen = subprocess.Popen(proc.cmd, stdout=out, stderr=subprocess.STDOUT)
        new = Proc(proc.name, proc.cmd, log, popen, proc.url, proc.kv)
        self.procs.append(new)
        return new

    def stop_all(self) -> None:
        for p in reversed(self.procs):
            if p.alive():
                p.stop(timeout_s=20)

    def tracebacks(self) -> dict[str, int]:
        """Log file → how many tracebacks it holds (only files with some)."""
        out = {}
        for p in [*self.procs, *self.retired]:
            n = p.text().count(TRACEBACK)
            if n:
                out[p.log.name] = n
        return out


async def wait_http(
    url: str, path: str = "/health", timeout_s: float = 90.0, proc: Proc | None = None
) -> None:
    """Until ``url + path`` answers 200 (RuntimeError after ``timeout_s`` or when ``proc`` exits)."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            if proc is not None and not proc.alive():
                raise RuntimeError(
                    f"{proc.name} exited with status {proc.popen.returncode}: {proc.text()[-2000:]}"
                )
            with contextlib.suppress(aiohttp.ClientError, OSError, asyncio.TimeoutError):
                async with s.get(url + path, timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{url}{path} did not answer 200 within {timeout_s:.0f} s")


WORDS = [
    "cache",
    "router",
    "engine",
    "token",
    "block",
    "prefix",
    "request",
    "stream",
    "batch",
    "prompt",
    "model",
    "latency",
    "queue",
    "memory",
    "decode",
    "prefill",
    "chunk",
    "event",
    "replica",
    "worker",
    "policy",
    "score",
    "load",
    "instance",
    "session",
    "turn",
    "answer",
    "question",
    "system",
    "user",
    "assistant",
    "context",
    "window",
    "budget",
    "sample",
    "bound",
    "plateau",
]


class Traffic:
    """A seeded mix of valid requests: multi-turn chats (``users`` conversations of up to
    ``max_turns`` turns, then a fresh one), completions with new text, streamed or not."""

    def __init__(self, seed: int = 0, users: int = 500, max_turns: int = 6, words: int = 120) -> None:
        self.rng = random.Random(seed)
        self.users = users
        self.max_turns = max_turns
        self.words = words
        self.convs: dict[int, list[dict[str, str]]] = {}
        self.serial = 0

    def _text(self, n: int) -> str:
        self.serial += 1
        rng = self.rng
        return f"#{self.serial} " + " ".join(rng.choice(WORDS) for _ in range(n))

    def next(self) -> tuple[str, dict[str, Any]]:
        """``(path, body)`` of the next request."""
        rng = self.rng
        stream = rng.random() < 0.5
        max_tokens = rng.randint(2, 12)
        if rng.random() < 0.7:
            u = rng.randrange(self.users)
            conv = self.convs.get(u)
            if conv is None or len(conv) >= 2 * self.max_turns:
                conv = [{"role": "system", "content": f"You are assistant {u}. " + self._text(40)}]
            conv = [*conv, {"role": "user", "content": self._text(rng.randint(10, self.words))}]
            body: dict[str, Any] = {
                "model": "emu",
                "messages": conv,
                "max_tokens": max_tokens,
                "stream": stream,
            }
            self.convs[u] = [*conv, {"role": "assistant", "content": self._text(max_tokens)}]
            return "/v1/chat/completions", body
        prompt = self._text(rng.randint(50, 4 * self.words))
        return "/v1/completions", {
            "model": "emu",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "stream": stream,
        }


async def send(
    session: aiohttp.ClientSession,
    url: str,
    path: str,
    body: dict[str, Any],
    leave_after: int | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, bytes]:
    """POST ``body`` (with ``headers``); the status and body (``leave_after``: close after that many
    body bytes of a stream, as a client that goes away; status -1 when the connection failed)."""
    try:
        async with session.post(url + path, json=body, headers=headers) as r:
            if leave_after is not None and body.get("stream"):
                got = await r.content.read(leave_after)
                r.close()
                return r.status, got
            return r.status, await r.read()
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        return -1, repr(exc).encode()
