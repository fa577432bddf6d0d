"""The README and the documentation site: the README stays short and speaks to users, its links and
its result table point at committed files, the example config loads, and the generated Reference
pages cover every command, flag, config key, metric and policy of the code they are built from."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from kvroute.cli import build_parser
from kvroute.policies.registry import DEFAULT_POLICY, POLICIES
from kvroute.server.config import BackendSpec, RouterConfig

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
ISSUE = re.compile(r"\bissues?\s*#?\d+|\(#\d+\)|\bitem \d+ as written", re.I)


def _user_pages() -> list[Path]:
    return [README, ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_readme_is_short() -> None:
    assert len(README.read_text().splitlines()) <= 200


@pytest.mark.parametrize("page", _user_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_mentions_an_issue_number(page: Path) -> None:
    bad = [f"{i}: {line}" for i, line in enumerate(page.read_text().splitlines(), 1) if ISSUE.search(line)]
    assert not bad, "\n".join(bad)


def test_readme_names_the_default_policy() -> None:
    assert f"The default policy, `{DEFAULT_POLICY}`," in README.read_text()


def test_readme_links_point_at_committed_files() -> None:
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README.read_text())
    local = [x for x in links if not x.startswith(("http://", "https://"))]
    assert local, "the README links into the docs"
    missing = [x for x in local if not (ROOT / x).exists()]
    assert not missing


def test_readme_result_table_is_the_committed_run() -> None:
    """Every row of the README's result table is a line of the committed main-job output."""
    text = README.read_text()
    run = (ROOT / "docs/results/demo-run.txt").read_text().splitlines()
    quick = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in quick.splitlines() if line.startswith("|")]
    assert len(rows) >= 4
    assert [r for r in rows if r not in run] == []


def test_the_readme_commands_exist() -> None:
    blocks = "\n".join(re.findall(r"```sh\n(.*?)```", README.read_text(), re.S))
    commands = set(re.findall(r"^kvroute (\w+)", blocks, re.M))
    assert {"up", "serve", "bench"} <= commands
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert commands <= set(sub.choices)
    make = (ROOT / "Makefile").read_text()
    for target in re.findall(r"^make (\w+)", blocks, re.M):
        assert re.search(rf"^{target}:", make, re.M), target


def test_the_example_router_config_loads() -> None:
    from kvroute.commands.serve import config_from_args
    from kvroute.commands.settings import load_config_file

    path = ROOT / "examples/router.yaml"
    cfg = load_config_file(path)
    assert [b.url for b in cfg.backends] == ["http://127.0.0.1:8000", "http://127.0.0.1:8001"]
    assert all(b.kv_events for b in cfg.backends) and cfg.policy == DEFAULT_POLICY
    served = config_from_args(build_parser().parse_args(["serve", "--config", str(path)]))
    assert served.backends == cfg.backends and served.port == 8080
    quoted = README.read_text().split("# examples/router.yaml\n", 1)[1].split("```", 1)[0]
    assert yaml.safe_load(quoted)["backends"] == yaml.safe_load(path.read_text())["backends"]


# ---- the generated Reference ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference() -> object:
    import scripts.docs_reference as ref

    return ref


def test_cli_reference_has_every_command_and_flag(reference: object) -> None:
    page = reference.cli_page()  # type: ignore[attr-defined]
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in sub.choices.items():
        assert f"## kvroute {name}\n" in page
        section = page.split(f"## kvroute {name}\n", 1)[1].split("\n## ", 1)[0]
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            for flag in action.option_strings:
                assert f"`{flag}`" in section, (name, flag)


def test_config_reference_has_every_key_with_its_default(reference: object) -> None:
    page = reference.config_page()  # type: ignore[attr-defined]
    for cls in (RouterConfig, BackendSpec):
        for f in dataclasses.fields(cls):
            assert f"| `{f.name}` |" in page, f.name
    assert "| `port` | `int` | `8080` |" in page
    assert f"| `policy` | `str` | `'{DEFAULT_POLICY}'` |" in page
    from kvroute.features.mapping import FEATURES

    for name in FEATURES:
        assert f"### `features.{name}`" in page


def test_metrics_reference_has_every_router_metric(reference: object) -> None:
    page = reference.metrics_page()  # type: ignore[attr-defined]
    from kvroute.server.observe import exporter

    listed = (exporter.__doc__ or "").split("Metric names", 1)[1].split("Each router owns", 1)[0]
    named = {n.removesuffix("_total") for n in re.findall(r"``([a-z_]+)(?:\{[^}]*\})?``", listed)}
    named -= {*exporter.STATES, "kvroute_"}  # the values of backends{state}; the prefix itself
    assert named and all(f"`kvroute_{n}`" in page for n in named), named
    assert "| `kvroute_backend_waiting` | gauge | `backend` |" in page
    assert "| `kvroute_requests` | counter | `outcome` |" in page


def test_policy_reference_has_every_policy_and_its_source(reference: object) -> None:
    page = reference.policies_page()  # type: ignore[attr-defined]
    for name in POLICIES:
        assert f"\n## {name}\n" in page
    assert "`src/kvroute/policies/lmetric.py`" in page and "P-token" in page
    assert f"the default is **`{DEFAULT_POLICY}`**" in page
