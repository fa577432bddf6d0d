"""Nothing ``kvroute serve --workers 2`` starts outlives its supervisor, however the supervisor ends:
SIGTERM (it stops its workers) and SIGKILL (each worker notices it is orphaned and drains and exits
by itself; multiprocessing's resource tracker exits once no process holds its pipe). Real processes;
the supervisor's children are found in ``/proc`` and must all be gone (a hang guard of 60 s, no
speed claim)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator

import pytest
from tests.commands.upproc import alive, children_of

from kvroute.tokenizer import Tokenizer

from .test_e2e import Cluster
from .test_workers import start_workers


@pytest.fixture
async def engines() -> AsyncIterator[Cluster]:
    c = Cluster()
    yield c
    await c.close()


async def _gone(pids: list[int], timeout_s: float = 60.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids):
            return []
        await asyncio.sleep(0.1)
    return [p for p in pids if alive(p)]


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
async def test_no_worker_outlives_its_supervisor(engines: Cluster, tokenizer: Tokenizer, how: str) -> None:
    await engines.add_engine(tokenizer, events=True)
    router = await start_workers(engines)
    assert router.proc is not None
    kids = children_of(router.proc.pid)
    try:
        assert len(kids) >= 2, kids  # the two workers (and the resource tracker)
        router.signal(signal.SIGKILL if how == "SIGKILL" else signal.SIGTERM)
        await asyncio.wait_for(router.proc.wait(), 60)
        assert await _gone(kids) == [], f"processes outlived a supervisor stopped by {how}"
    finally:
        for pid in kids:  # whatever a failed run left behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        await router.close()
