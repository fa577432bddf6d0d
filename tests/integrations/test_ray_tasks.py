"""``kvroute compare --executor ray``: a small sweep on a local Ray equals the same sweep with --jobs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvroute.cli import main
from kvroute.errors import UserError
from kvroute.integrations.ray_tasks import parse_executor

TIMING = {"wall_seconds", "cpu_seconds"}


def test_parse_executor() -> None:
    assert parse_executor("local") == ("local", None)
    assert parse_executor("ray") == ("ray", None)
    assert parse_executor("ray:auto") == ("ray", "auto")
    assert parse_executor("ray:ray://head:10001") == ("ray", "ray://head:10001")
    for bad in ("ray:", "dask", ""):
        with pytest.raises(UserError, match="--executor"):
            parse_executor(bad)


def _runs(out: Path) -> list[dict[str, object]]:
    runs = json.loads((out / "results.json").read_text())["runs"]
    return [{k: v for k, v in r.items() if k not in TIMING} for r in runs]


def test_compare_on_local_ray_equals_jobs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")
    argv = ["compare", "--workload", "chatbot", "--duration", "6", "--instances", "2"]
    argv += ["--policies", "lmetric,round-robin", "--rate-scales", "0.5,1", "--no-progress"]
    assert main([*argv, "--jobs", "2", "--out", str(tmp_path / "jobs")]) == 0
    assert main([*argv, "--executor", "ray", "--out", str(tmp_path / "ray")]) == 0
    capsys.readouterr()
    jobs, ray_runs = _runs(tmp_path / "jobs"), _runs(tmp_path / "ray")
    assert len(jobs) == 4
    assert ray_runs == jobs
    import ray

    assert not ray.is_initialized()  # the runner stopped the Ray it started


def test_bad_executor_is_a_one_line_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    argv = ["compare", "--workload", "chatbot", "--duration", "2", "--policies", "lmetric"]
    assert main([*argv, "--executor", "spark", "--out", str(tmp_path), "--no-progress"]) != 0
    err = capsys.readouterr().err
    assert "--executor must be" in err and "Traceback" not in err
