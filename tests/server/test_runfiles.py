"""A supervisor's run files (admin-journal folder, shared-memory load table, semaphore) are stamped with
its pid and locked while it lives; the next supervisor sweeps a dead one's. Tested on files, then by
SIGKILLing a real ``kvroute serve --workers 2`` and starting another."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvroute.server.state.runfiles import PREFIX, RunFiles, sweep
from kvroute.tokenizer import Tokenizer

from .test_e2e import Cluster
from .test_workers import WorkersProc, until_all_listen

SHM = Path("/dev/shm")
needs_shm = pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm on this machine (POSIX shared memory)")


def test_a_live_run_is_left_alone_and_a_dead_one_is_swept(tmp_path: Path) -> None:
    live = RunFiles.create(str(tmp_path))
    assert live.folder.name.startswith(f"{PREFIX}{os.getpid()}-")
    # a dead supervisor's folder: nobody holds its lock; it names a shared-memory object
    dead = tmp_path / f"{PREFIX}999999-abcd"
    dead.mkdir()
    (dead / "owner.lock").write_text("999999\n")
    name = f"kvroute-test-{os.getpid()}-leftover"
    with_shm = SHM.is_dir()
    if with_shm:
        (SHM / name).write_bytes(b"\0" * 64)
    (dead / "resources.json").write_text(json.dumps({"pid": 999999, "shm": [name], "semaphores": []}))
    (tmp_path / "kvroute-unrelated").mkdir()  # not a run folder: untouched
    assert sweep(str(tmp_path)) == [str(dead)]
    assert not dead.exists() and live.folder.exists() and (tmp_path / "kvroute-unrelated").exists()
    if with_shm:
        assert not (SHM / name).exists()
    live.remove()
    assert not live.folder.exists()
    assert sweep(str(tmp_path)) == []


@pytest.fixture
async def engines(tokenizer: Tokenizer) -> AsyncIterator[Cluster]:
    c = Cluster()
    await c.add_engine(tokenizer, events=False)
    yield c
    await c.close()


async def start_workers(engines: Cluster) -> tuple[WorkersProc, list[bytes]]:
    """A supervisor of 2 workers, once both listen; its stderr lines until then."""
    router = WorkersProc(engines.specs[0].url, "--workers", "2")
    await router.start(timeout_s=180)
    return router, await until_all_listen(router)


def _runs(tmp: Path) -> list[Path]:
    return sorted(tmp.glob(f"{PREFIX}*"))


@needs_shm
async def test_a_sigkilled_supervisors_leftovers_are_swept_by_the_next(
    engines: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    first, _ = await start_workers(engines)
    try:
        (run,) = _runs(tmp_path)
        res = json.loads((run / "resources.json").read_text())
        assert run.name.startswith(f"{PREFIX}{first.proc.pid}-")  # type: ignore[union-attr]
        assert res["pid"] == first.proc.pid  # type: ignore[union-attr]
        assert len(res["shm"]) == 2 and all((SHM / n).exists() for n in res["shm"])
        assert all(f"-{first.proc.pid}-" in n for n in res["shm"])  # type: ignore[union-attr]
        first.signal(signal.SIGKILL)
        await first.exit_status()
        await asyncio.sleep(3.0)  # its workers notice the supervisor is gone and leave
        assert run.exists()  # left behind
    finally:
        await first.close()
    second, lines = await start_workers(engines)
    try:
        assert any(b"removed the leftovers of a dead kvroute supervisor" in x for x in lines), lines
        assert not run.exists()
        assert not any((SHM / n).exists() for n in res["shm"])
        assert not any((SHM / f"sem.{s.lstrip('/')}").exists() for s in res["semaphores"])
        (run2,) = _runs(tmp_path)
        second.signal(signal.SIGTERM)
        code, err = await second.exit_status()
        assert code == 0, err
        assert not run2.exists()
        assert "Traceback" not in err
    finally:
        await second.close()
