"""The reference docs against the code they describe, where the match can be checked mechanically:

- docs/service.md's settings table against :class:`~controlplane.settings.Settings` (and
  :class:`~controlplane.settings.Ec2Settings` as ``ec2.*``): a row per field, its variable, its
  default;
- docs/cli.md's "Every option" section against the command line's parsers: a heading per
  command, a line per option;
- docs/api.md's routes table (and docs/dashboard.md's, for the dashboard's routes) against the
  routers the service mounts: a row per method and path.

Each failure names the file, the place in it and what to add or remove there.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

import controlplane.api.routes as route_modules
from controlplane.cli import build_parser
from controlplane.dashboard import routes as dashboard_routes
from controlplane.settings import ENV_PREFIX, Ec2Settings, Settings

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _table_rows(text: str, header: str) -> list[list[str]]:
    """The cells of each row of the markdown table whose header row starts with ``header``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = re.split(r"(?<!\\)\|", line.strip().strip("|"))
        rows.append([cell.strip() for cell in cells])
    return rows


def _code(cell: str) -> str:
    """The first `code` span of a cell ("" when none)."""
    match = re.search(r"`([^`]*)`", cell)
    return match.group(1) if match else ""


# --- docs/service.md: the settings table ---------------------------------------------------------


def _settings_fields() -> Iterator[tuple[str, str, Any]]:
    """(documented name, environment variable, default) of every setting."""
    models: list[tuple[str, type[BaseModel], str]] = [
        ("", Settings, ENV_PREFIX),
        ("ec2.", Ec2Settings, f"{ENV_PREFIX}EC2_"),
    ]
    for prefix, model, env_prefix in models:
        for name, field in model.model_fields.items():
            yield f"{prefix}{name}", f"{env_prefix}{name.upper()}", field.default


def _shown_default(default: Any) -> str | None:
    """How the table shows a plain default; None for one computed or absent."""
    if default is PydanticUndefined or default is None or default == "":
        return None
    if isinstance(default, bool):
        return "true" if default else "false"
    if isinstance(default, int | float | str):
        return str(default)
    return None


def _same_default(documented: str, shown: str) -> bool:
    try:
        return float(documented) == float(shown)
    except ValueError:
        return documented == shown


def test_the_settings_table_has_a_row_per_field_with_its_variable_and_default() -> None:
    rows = _table_rows(
        (DOCS / "service.md").read_text(), "| field | environment variable | default |"
    )
    documented = {_code(row[0]): row for row in rows}
    problems = []
    fields = list(_settings_fields())
    for name, variable, default in fields:
        row = documented.get(name)
        if row is None:
            problems.append(
                f"no row for `{name}`: add `| `{name}` | `{variable}` |"
                f" `{_shown_default(default) or '...'}` | what it does, with its unit |`"
            )
            continue
        if variable not in row[1]:
            problems.append(f"the row of `{name}` does not name its variable `{variable}`")
        shown = _shown_default(default)
        if shown is not None and not _same_default(_code(row[2]), shown):
            problems.append(f"the row of `{name}` says the default is {row[2]!r}, the code {shown}")
    names = {name for name, _, _ in fields}
    problems += [
        f"a row for `{name}`, which Settings does not have: remove it"
        for name in documented
        if name not in names
    ]
    assert not problems, "docs/service.md, the settings table (## Settings):\n" + "\n".join(
        problems
    )


# --- docs/cli.md: every command and option ------------------------------------------------------


def _commands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[str, list[argparse.Action]]]:
    """("heteroplane COMMAND ...", its options) of the top level and of every command."""
    options = [
        action
        for action in parser._actions  # argparse keeps no public list of a parser's arguments
        if action.option_strings and not isinstance(action, argparse._HelpAction)
    ]
    children = [
        action for action in parser._actions if isinstance(action, argparse._SubParsersAction)
    ]
    if options or not children:
        yield " ".join(("heteroplane", *path)), options
    for child in children:
        for name, subparser in child.choices.items():
            yield from _commands(subparser, (*path, name))


def _option_line(action: argparse.Action) -> str:
    flag = max(action.option_strings, key=len)
    value = "" if action.nargs == 0 else f" {action.metavar or action.dest.upper()}"
    text = (action.help or "").replace("%(default)s", str(action.default))
    return f"- `{flag}{value}`: {text}"


def _cli_sections() -> dict[str, str]:
    """The text under each ``### `heteroplane ...``` heading of the "Every option" section."""
    text = (DOCS / "cli.md").read_text()
    start = text.index("\n## Every option\n")
    end = text.find("\n## ", start + 1)
    section = text[start : end if end >= 0 else len(text)]
    parts = re.split(r"^### `([^`]+)`\s*$", section, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_the_cli_docs_have_every_command_and_option_and_none_other() -> None:
    sections = _cli_sections()
    problems = []
    commands = dict(_commands(build_parser()))
    for command, options in commands.items():
        body = sections.get(command)
        if body is None:
            problems.append(
                f"no heading ### `{command}`: add it with a line per option"
                + "".join(f"\n    {_option_line(action)}" for action in options)
            )
            continue
        for action in options:
            if not any(f"`{flag}" in body for flag in action.option_strings):
                problems.append(
                    f"### `{command}` lacks {action.option_strings[-1]}: add"
                    f"\n    {_option_line(action)}"
                )
        known = {flag for action in options for flag in action.option_strings}
        for flag in re.findall(r"^- `(-[-\w]+)", body, flags=re.MULTILINE):
            if flag not in known:
                problems.append(f"### `{command}` documents {flag}, which it does not take")
    problems += [
        f"### `{command}` is not a command: remove it"
        for command in sections
        if command not in commands
    ]
    assert not problems, 'docs/cli.md, section "Every option":\n' + "\n".join(problems)


# --- docs/api.md and docs/dashboard.md: the routes ----------------------------------------------


def _routes(router: Any, keep: Callable[[Any], bool] = lambda _route: True) -> set[tuple[str, str]]:
    return {
        (method, re.sub(r"\{[^}]*\}", "{}", route.path))
        for route in router.routes
        if keep(route)
        for method in sorted(route.methods - {"HEAD"})
    }


def _api_routes(keep: Callable[[Any], bool] = lambda _route: True) -> set[tuple[str, str]]:
    """The API's routes (every module of ``controlplane.api.routes``) that ``keep`` keeps."""
    found: set[tuple[str, str]] = set()
    for module in pkgutil.iter_modules(route_modules.__path__):
        router = importlib.import_module(f"{route_modules.__name__}.{module.name}").router
        found |= _routes(router, keep)
    return found


def _documented_rows(file: str, header: str) -> Iterator[tuple[tuple[str, str], list[str]]]:
    """Each row of the routes table under ``header`` in ``docs/FILE``: its route, as
    :func:`_routes` writes one, and its cells."""
    for row in _table_rows((DOCS / file).read_text(), header):
        method, _, path = _code(row[0]).partition(" ")
        path = re.split(r"[\[?]", path, maxsplit=1)[0]
        yield (method, re.sub(r"\{[^}]*\}|\b[A-Z]+\b$", "{}", path)), row


def _documented_routes(file: str, header: str) -> set[tuple[str, str]]:
    return {route for route, _row in _documented_rows(file, header)}


def _difference(file: str, code: set[tuple[str, str]], docs: set[tuple[str, str]]) -> list[str]:
    return [f"{file}: no row for `{m} {p}`" for m, p in sorted(code - docs)] + [
        f"{file}: a row for `{m} {p}`, which the service does not serve: remove it"
        for m, p in sorted(docs - code)
    ]


def test_the_api_docs_have_a_row_per_route_and_none_other() -> None:
    problems = _difference(
        "docs/api.md (## Routes)",
        _api_routes(),
        _documented_routes("api.md", "| method and path | scope |"),
    ) + _difference(
        "docs/dashboard.md (its routes table)",
        _routes(dashboard_routes.router),
        _documented_routes("dashboard.md", "| route | auth | answer |"),
    )
    assert not problems, "\n".join(problems)


def test_a_route_with_a_number_in_its_path_lists_the_422_a_bad_one_answers() -> None:
    """A path's number (a model's version, a plan's or a rollout's id) out of range or not a
    number is a 422 ``invalid_request`` naming it, as any bad parameter: the row says so."""
    numbered = _api_routes(
        lambda route: any(p.field_info.annotation is int for p in route.dependant.path_params)
    )
    assert ("GET", "/v1/models/{}/versions/{}") in numbered
    missing = [
        f"`{method} {path}`"
        for (method, path), row in _documented_rows("api.md", "| method and path | scope |")
        if (method, path) in numbered and "422" not in row[-1]
    ]
    assert not missing, "docs/api.md: no 422 listed for " + ", ".join(missing)


# --- docs/: no issue numbers ---------------------------------------------------------------------


def test_the_docs_cite_no_issue_numbers() -> None:
    """An issue number means nothing to a reader of the docs: they say what instead."""
    cited = [
        f"{path.relative_to(DOCS.parent)}:{number}: {line.strip()[:100]}"
        for path in sorted(DOCS.rglob("*.md"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\bissues? #?\d+", line, flags=re.IGNORECASE)
    ]
    assert not cited, "issue numbers in docs/ (say what they stood for instead):\n" + "\n".join(
        cited
    )


# --- benchmarks/README.md: every command ------------------------------------------------------


def test_the_benchmarks_readme_names_every_script_and_package() -> None:
    """Each script of benchmarks/ (or module shared by them) and each package run with ``-m`` is
    in benchmarks/README.md, so that a reader finds which one answers their question."""
    benchmarks = DOCS.parent / "benchmarks"
    readme = (benchmarks / "README.md").read_text()
    missing = [
        f"benchmarks/{path.name}"
        for path in sorted(benchmarks.glob("*.py"))
        if path.name != "__init__.py" and f"{path.stem}.py`" not in readme
    ] + [
        f"python -m benchmarks.{path.parent.name}"
        for path in sorted(benchmarks.glob("*/__main__.py"))
        if f"benchmarks.{path.parent.name}" not in readme
    ]
    assert not missing, "benchmarks/README.md does not name: " + ", ".join(missing)
