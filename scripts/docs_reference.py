"""The documentation site's Reference pages, generated from the code at build time (never committed):
every CLI command and flag (the argparse parsers), every router config key with its default (the config
dataclasses), every router metric with its type and labels (the Prometheus registry of a router), every
policy with its formula and source (the registry and the policies' docstrings).

Used two ways: as an MkDocs hook (``hooks:`` in ``mkdocs.yml``; :func:`on_files` adds the pages), and by
the tests (``tests/test_docs.py``), which check the pages against the same code.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import re
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _md(text: str) -> str:
    """reStructuredText bits of a docstring → Markdown: ``x`` → `x`, :role:`~a.b.c` → `c`."""
    text = re.sub(r":[a-z]+:`~?([^`]*?)`", lambda m: f"`{m.group(1).rsplit('.', 1)[-1]}`", text)
    return text.replace("``", "`")


def _cell(text: str) -> str:
    """One line for a Markdown table cell."""
    return _md(" ".join(text.split())).replace("|", "\\|")


# ---------------------------------------------------------------------------------------------- CLI


def _flags(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest}`"
    return ", ".join(f"`{o}`" for o in action.option_strings)


def _default(action: argparse.Action) -> str:
    if action.option_strings and action.nargs == 0:  # a switch
        return "off"
    if action.default in (None, argparse.SUPPRESS):
        return "—"
    return f"`{action.default}`"


def _help(action: argparse.Action, prog: str) -> str:
    text = action.help or ""
    if "%(" in text:
        params = {**vars(action), "prog": prog}
        with contextlib.suppress(KeyError, TypeError, ValueError):
            text = text % params
    if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
        text += f" (one of: {', '.join(map(str, action.choices))})"
    return _cell(text)


def cli_page() -> str:
    """Every command of ``kvroute`` and every flag, from :func:`kvroute.cli.build_parser`."""
    from kvroute.cli import build_parser

    parser = build_parser()
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {c.dest: c.help for c in sub._choices_actions}
    out = [
        "# Command line",
        "",
        "Generated from the command's own parsers when this site was built; `kvroute COMMAND --help` "
        "prints the same. A bad flag prints the command's usage line and one `kvroute: error:` line "
        "(exit status 2). `kvroute --version` prints the installed version.",
        "",
        "| command | what it does |",
        "|---|---|",
    ]
    out += [f"| [`kvroute {n}`](#kvroute-{n}) | {_cell(helps.get(n) or '')} |" for n in sub.choices]
    for name, p in sub.choices.items():
        out += [
            "",
            f"## kvroute {name}",
            "",
            _cell(p.description or ""),
            "",
            "```text",
            p.format_usage().strip(),
        ]
        out += ["```", "", "| flag | default | meaning |", "|---|---|---|"]
        for a in p._actions:
            if isinstance(a, argparse._HelpAction):
                continue
            out.append(f"| {_flags(a)} | {_default(a)} | {_help(a, p.prog)} |")
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------------------- config


def _bullets(doc: str) -> dict[str, str]:
    """``name`` → its text from a docstring's ``- ``a``, ``b``: text`` bullets (continuation lines
    joined)."""
    out: dict[str, str] = {}
    for item in re.split(r"\n\s*- ", "\n" + doc):
        head, sep, text = item.partition(":")
        if not sep:
            continue
        for name in re.findall(r"``([a-z_]+)``", head):
            out.setdefault(name, " ".join(text.split()))
    return out


def _value(f: dataclasses.Field[Any]) -> str:
    if f.default is not dataclasses.MISSING:
        value: Any = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    if dataclasses.is_dataclass(value):
        return "see below"
    if isinstance(value, tuple):
        value = list(value)
    return f"`{value!r}`" if isinstance(value, str) else f"`{value}`"


def _comments(cls: type) -> dict[str, str]:
    """Field → its trailing comment, from the class's source (``name: type = value  # comment``) and
    from its module docstring's YAML example (``name: value  # comment``)."""
    out: dict[str, str] = {}
    module = inspect.getmodule(cls)
    sources = [inspect.getsource(cls), inspect.getdoc(module) or ""]
    for text in sources:
        for m in re.finditer(r"^\s+([a-z_]+):[^#\n]*#\s*(.+)$", text, re.M):
            out.setdefault(m.group(1), m.group(2).strip())
    return out


def _fields_table(cls: type, skip: tuple[str, ...] = ()) -> list[str]:
    doc = inspect.getdoc(cls) or ""
    bullets = {**_comments(cls), **_bullets(doc)}
    hints = typing.get_type_hints(cls)
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        kind = re.sub(r"\b[a-z_.]+\.", "", str(hints[f.name]).replace("typing.", ""))
        kind = kind.replace("<class '", "").replace("'>", "")
        rows.append(f"| `{f.name}` | `{kind}` | {_value(f)} | {_cell(bullets.get(f.name, ''))} |")
    return rows


def config_page() -> str:
    """Every key of the router's YAML file (``kvroute serve --config``) with its type and default, from
    :class:`~kvroute.server.config.RouterConfig` and the dataclasses nested in it."""
    from kvroute.features.mapping import FEATURES
    from kvroute.routing.queue import QueueConfig
    from kvroute.server import config as cfgmod

    first = (inspect.getdoc(cfgmod.RouterConfig) or "").split("\n", 1)[0]
    out = [
        "# Router configuration",
        "",
        "Generated from the configuration dataclasses when this site was built. The YAML file given to "
        "`kvroute serve --config FILE` takes these keys (every key but `backends` is optional); a flag "
        "given on the command line wins over the file. Units: seconds for every `*_s` key, tokens for "
        "`block_size`, bytes for `max_body_bytes`.",
        "",
        f"## Top level (`RouterConfig`)\n\n{_cell(first)}\n",
        *_fields_table(cfgmod.RouterConfig),
        "",
        "## A backend (`backends:` items)",
        "",
        "A bare URL, or a mapping:",
        "",
        *_fields_table(cfgmod.BackendSpec),
        "",
        "## `router_queue:` (`QueueConfig`)",
        "",
        _cell((inspect.getdoc(QueueConfig) or "").split("\n\n", 1)[0]),
        "",
        *_fields_table(QueueConfig),
        "",
        "## `features:`",
        "",
        "Production features, all off by default; each key turns one on (`true`, or a mapping of its "
        "settings).",
    ]
    for name, cls in FEATURES.items():
        doc = (inspect.getdoc(cls) or "").split("\n\n", 1)[0]
        out += ["", f"### `features.{name}`", "", _cell(doc), "", *_fields_table(cls)]
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------------------ metrics


def _families() -> Iterator[tuple[str, str, str, list[str]]]:
    """(name, type, help, label names) of every metric a router with one backend exposes."""
    from kvroute.server.app import RouterServer
    from kvroute.server.config import BackendSpec, RouterConfig
    from kvroute.tokenizer import load_tokenizer

    server = RouterServer(
        RouterConfig(backends=(BackendSpec("http://127.0.0.1:9"),), port=0), tokenizer=load_tokenizer()
    )
    seen: dict[str, tuple[str, str, set[str]]] = {}  # name -> (type, help, label names)
    for fam in server.registry.collect():
        labels = {k for s in fam.samples for k in s.labels} | set(getattr(fam, "_labelnames", ()))
        kind, doc, known = seen.get(fam.name, (fam.type, fam.documentation, set()))
        seen[fam.name] = (kind, doc, known | (labels - {"le", "quantile"}))
    for collector in list(server.registry._collector_to_names):  # declared labels of unused series
        names = getattr(collector, "_labelnames", None)
        base = getattr(collector, "_name", None)
        if names and base in seen:
            seen[base][2].update(names)
    for name in sorted(seen):
        kind, doc, labels = seen[name]
        yield name, kind, doc, sorted(labels)


def metrics_page() -> str:
    out = [
        "# Router metrics",
        "",
        "Generated from the Prometheus registry of a router when this site was built: what "
        "`GET /metrics` on `kvroute serve` exposes (counters carry the `_total` suffix on the wire).",
        "",
        "| metric | type | labels | meaning |",
        "|---|---|---|---|",
    ]
    for name, kind, doc, labels in _families():
        shown = ", ".join(f"`{x}`" for x in labels) or "—"
        out.append(f"| `{name}` | {kind} | {shown} | {_cell(doc)} |")
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------------------- policies


def policies_page() -> str:
    from kvroute.policies.registry import DEFAULT_POLICY, POLICIES, make_policy

    out = [
        "# Policies",
        "",
        "Generated from the policy registry and the policies' own docstrings when this site was built. "
        "Choose one with `--policy NAME` (`sim`, `serve`, `up`) or `policy:` in the router's YAML; "
        f"the default is **`{DEFAULT_POLICY}`**. Every score is computed per instance from the request's "
        "cached prefix there and the instance's load.",
        "",
        "| name | class | source |",
        "|---|---|---|",
    ]
    seen: dict[type, str] = {}
    for name in POLICIES:
        cls = type(make_policy(name))
        src = Path(inspect.getsourcefile(cls) or "").resolve()
        rel = src.relative_to(ROOT) if src.is_relative_to(ROOT) else Path(src.name)
        out.append(f"| [`{name}`](#{name}) | `{cls.__name__}` | `{rel}` |")
        seen.setdefault(cls, name)
    for name in POLICIES:
        cls = type(make_policy(name))
        doc = inspect.getdoc(cls) or inspect.getdoc(inspect.getmodule(cls)) or ""
        mod = inspect.getdoc(inspect.getmodule(cls)) or ""
        out += ["", f"## {name}", ""]
        if name == DEFAULT_POLICY:
            out += ["**The default policy.**", ""]
        if seen[cls] != name:
            out += [f"Same class as [`{seen[cls]}`](#{seen[cls]}), with another parameter.", ""]
            continue
        out += [_md(doc), ""]
        if mod and mod != doc:
            out += ["From its module:", "", *[f"> {_md(line)}".rstrip() for line in mod.splitlines()], ""]
    return "\n".join(out) + "\n"


PAGES: dict[str, Callable[[], str]] = {
    "reference/cli.md": cli_page,
    "reference/config.md": config_page,
    "reference/metrics.md": metrics_page,
    "reference/policies.md": policies_page,
}
"""Site path → the function that writes the page."""


def on_files(files: Any, config: Any) -> Any:
    """MkDocs hook: add the generated Reference pages to the site's files."""
    from mkdocs.structure.files import File

    for path, page in PAGES.items():
        files.append(File.generated(config, path, content=page()))
    return files
