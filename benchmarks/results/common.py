"""What every result experiment shares (benchmarks/results, docs/results).

An experiment is a module of this package with a ``run(ctx: Context) -> Section`` function and a
``main`` that runs it alone (``experiment_main``). ``run`` computes its numbers, draws its plots
into ``ctx.out_dir`` (``save_figure``) and returns a Section: the markdown body (tables), the
figures, the README summary lines and the raw numbers as JSON-able data. ``write_section`` turns
a Section into ``<key>.md`` and ``<key>.json`` in the output folder; the runner
(``python -m benchmarks.results``) does that for every experiment, then writes the index and the
README's results block from the JSON files, so every number the README quotes comes from them.

``ctx.quick`` asks for a small version of the same experiment (CI runs it: seconds, not minutes):
fewer queries per probe, fewer models or points, shorter traces. Quick outputs go to a scratch
folder, never to docs/results.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.paths import ROOT as ROOT  # re-exported: the experiments import these from here
from benchmarks.paths import kairos_samples as kairos_samples
from benchmarks.paths import shared_dir as shared_dir

DOCS_RESULTS = ROOT / "docs" / "results"
QUICK_RESULTS = ROOT / "build" / "results-quick"


def machine() -> str:
    """One line naming this machine: CPU model and cores (every table says where it ran)."""
    from benchmarks.cascade_family import cpu_model

    return f"{cpu_model()}, {os.cpu_count()} cores, Python {platform.python_version()}"


@dataclass
class Context:
    quick: bool
    out_dir: Path
    started: float = field(default_factory=time.perf_counter)

    def log(self, message: str) -> None:
        """Progress on stderr (the runner's terminal), prefixed with the elapsed time."""
        elapsed = time.perf_counter() - self.started
        print(f"[{elapsed:6.0f} s] {message}", file=sys.stderr, flush=True)


@dataclass
class Figure:
    file: str  # a PNG in the output folder
    caption: str


@dataclass
class Section:
    key: str  # file stem: docs/results/<key>.md, .json
    title: str
    what: str  # what was measured, on what (markdown, a paragraph or a list)
    rerun: str  # the command that regenerates this section alone
    body: str  # tables and notes (markdown)
    summary: list[str]  # README lines: one finding each, with its numbers
    data: dict[str, Any]  # the raw numbers (JSON)
    figures: list[Figure] = field(default_factory=list)
    quick: bool = False
    seconds: float = 0.0
    machine: str = field(default_factory=machine)


def md_table(headers: Sequence[str], rows: Iterable[Sequence[object]], right: str = "") -> str:
    """A markdown table; columns whose index is in ``right`` ("1,2") are right-aligned."""
    aligned = {int(i) for i in right.split(",") if i.strip()}
    lines = [
        "| " + " | ".join(headers) + " |",
        "| " + " | ".join("---:" if i in aligned else "---" for i in range(len(headers))) + " |",
    ]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# The PNGs' resolution; quick mode's (the test suite's: the figures are indicative) is lower, which
# draws them faster.
DPI = 110
QUICK_DPI = 72


def save_figure(ctx: Context, fig: Any, file: str, caption: str) -> Figure:
    """Write ``fig`` as ``<out_dir>/<file>`` (PNG, :data:`DPI` dots per inch, :data:`QUICK_DPI`
    in quick mode) and close it."""
    ctx.out_dir.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(ctx.out_dir / file, dpi=QUICK_DPI if ctx.quick else DPI)
    pyplot().close(fig)
    return Figure(file, caption)


def section_markdown(section: Section) -> str:
    lines = [
        f"# {section.title}",
        "",
        f"Regenerate: `{section.rerun}`"
        + (" (quick mode)" if section.quick else "")
        + f"; this run took {section.seconds / 60:.1f} min on {section.machine}.",
        "",
        "## What was measured, on what",
        "",
        section.what.strip(),
        "",
        "## Findings",
        "",
        *[f"- {line}" for line in section.summary],
        "",
        "## Tables",
        "",
        section.body.strip(),
        "",
    ]
    for figure in section.figures:
        lines += [f"![{figure.caption}]({figure.file})", "", f"*{figure.caption}*", ""]
    return "\n".join(lines)


def write_section(ctx: Context, section: Section) -> Path:
    """``<key>.md`` and ``<key>.json`` in the output folder; returns the markdown's path."""
    ctx.out_dir.mkdir(parents=True, exist_ok=True)
    path = ctx.out_dir / f"{section.key}.md"
    path.write_text(section_markdown(section))
    (ctx.out_dir / f"{section.key}.json").write_text(
        json.dumps(asdict(section), indent=1, sort_keys=True) + "\n"
    )
    return path


def load_section(path: Path) -> Section:
    raw = json.loads(path.read_text())
    raw["figures"] = [Figure(**f) for f in raw.get("figures", [])]
    return Section(**raw)


def base_parser(description: str) -> argparse.ArgumentParser:
    """``--quick`` and ``--out``, the options every results command takes."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--quick", action="store_true", help="the small version CI runs (seconds, not minutes)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"output folder (default {DOCS_RESULTS.relative_to(ROOT)}, "
        f"or {QUICK_RESULTS.relative_to(ROOT)} with --quick)",
    )
    return parser


def output_dir(quick: bool, out: Path | None) -> Path:
    return out if out is not None else (QUICK_RESULTS if quick else DOCS_RESULTS)


def experiment_main(
    run: Callable[[Context], Section], description: str, argv: list[str] | None = None
) -> int:
    """Run one experiment alone: ``python -m benchmarks.results.<key> [--quick] [--out DIR]``."""
    args = base_parser(description).parse_args(argv)
    ctx = Context(quick=args.quick, out_dir=output_dir(args.quick, args.out))
    section = run_section(ctx, run)
    print(section_markdown(section))
    return 0


def run_section(ctx: Context, run: Callable[[Context], Section]) -> Section:
    start = time.perf_counter()
    section = run(ctx)
    section.quick = ctx.quick
    section.seconds = time.perf_counter() - start
    path = write_section(ctx, section)
    ctx.log(f"wrote {path} ({section.seconds:.0f} s)")
    return section
