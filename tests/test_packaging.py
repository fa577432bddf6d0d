"""The package's metadata builds without a screen of setuptools deprecation warnings (regression:
``project.license`` as a table and ``setuptools>=69`` printed one on every ``pip install -e .``).

Builds the metadata the way pip's build backend hook does (``prepare_metadata_for_build_wheel``), in
a copy of the project, with every warning an error."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

BUILD = """
import warnings
warnings.simplefilter("error")
from setuptools import build_meta
print(build_meta.prepare_metadata_for_build_wheel("out"))
"""


def _build(tmp: Path, pyproject: str) -> subprocess.CompletedProcess[str]:
    (tmp / "pyproject.toml").write_text(pyproject)
    shutil.copy(ROOT / "README.md", tmp / "README.md")
    (tmp / "src" / "kvroute").mkdir(parents=True, exist_ok=True)
    (tmp / "src" / "kvroute" / "__init__.py").write_text("")
    (tmp / "out").mkdir(exist_ok=True)
    return subprocess.run(
        [sys.executable, "-W", "error", "-c", BUILD], cwd=tmp, capture_output=True, text=True, timeout=120
    )


def test_build_requires_a_setuptools_that_reads_an_spdx_license() -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["build-system"]["requires"] == ["setuptools>=77"]
    assert meta["project"]["license"] == "Apache-2.0"


def test_metadata_builds_without_deprecation_warnings(tmp_path: Path) -> None:
    import setuptools

    if int(setuptools.__version__.split(".")[0]) < 77:  # the dev extra pins a newer one
        pytest.skip(
            f"setuptools {setuptools.__version__} predates PEP 639 licenses (pip install -e '.[dev]')"
        )
    done = _build(tmp_path, (ROOT / "pyproject.toml").read_text())
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Deprecat" not in done.stderr, done.stderr[-3000:]
    (dist,) = (tmp_path / "out").glob("*.dist-info")
    assert "License-Expression: Apache-2.0" in (dist / "METADATA").read_text()


def test_the_old_license_table_would_fail_this_check(tmp_path: Path) -> None:
    """The check can fail: the old form of the license raises the deprecation as an error."""
    import setuptools

    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"setuptools {setuptools.__version__} predates PEP 639 licenses")
    text = (ROOT / "pyproject.toml").read_text()
    old = text.replace('license = "Apache-2.0"', 'license = { text = "Apache-2.0" }')
    assert old != text
    done = _build(tmp_path, old)
    assert done.returncode != 0 and "license" in done.stderr.lower()
