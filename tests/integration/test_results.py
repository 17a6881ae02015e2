"""The results command (benchmarks/results): its quick mode writes every section, table
and plot; the README's results block is exactly what the committed docs/results/*.json give, so
every figure the README quotes comes from those outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.results.__main__ import (
    BEGIN,
    END,
    EXPERIMENTS,
    README,
    readme_block,
    replace_block,
    sections_in,
)
from benchmarks.results.common import DOCS_RESULTS, ROOT

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _readme_block() -> str:
    text = README.read_text()
    begin, end = text.find(BEGIN), text.find(END)
    assert 0 <= begin < end, "README.md lacks the results markers"
    return text[begin : end + len(END)]


def test_the_readme_quotes_the_committed_results() -> None:
    sections = sections_in(DOCS_RESULTS)
    assert [s.key for s in sections] == [key for _, key in EXPERIMENTS]
    assert not any(s.quick for s in sections), "docs/results holds a quick run"
    for section in sections:
        assert section.summary, section.key
        for figure in section.figures:
            assert (DOCS_RESULTS / figure.file).read_bytes()[:8] == PNG_MAGIC
    assert _readme_block() == readme_block(sections)


def test_a_missing_marker_is_an_error() -> None:
    with pytest.raises(ValueError, match="markers"):
        replace_block("no block here", readme_block([]))


def test_an_unknown_experiment_is_refused() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.results", "--only", "nope", "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2
    assert "unknown experiment(s): nope" in done.stderr
    assert "Traceback" not in done.stderr


def quick_run_writes(tmp_path: Path, modules: list[str], keys: list[str]) -> None:
    """``python -m benchmarks.results --quick --only MODULES`` writes each of ``keys``' section
    (JSON, Markdown, PNGs) and the index links them; the committed results and the README still
    agree after it."""
    pytest.importorskip("matplotlib")
    env = {**os.environ, "MPLBACKEND": "Agg"}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.results", "--quick", "--out", str(tmp_path),
         "--only", ",".join(modules)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    index = (tmp_path / "README.md").read_text()
    for key in keys:
        data = json.loads((tmp_path / f"{key}.json").read_text())
        assert data["quick"] is True
        assert data["summary"] and all(isinstance(line, str) for line in data["summary"])
        assert data["figures"], key
        for figure in data["figures"]:
            assert (tmp_path / figure["file"]).read_bytes()[:8] == PNG_MAGIC
        markdown = (tmp_path / f"{key}.md").read_text()
        assert "## What was measured, on what" in markdown
        assert "python -m benchmarks.results" in markdown
        assert f"]({key}.md)" in index
    assert _readme_block() == readme_block(sections_in(DOCS_RESULTS))


# The experiments in two halves of about equal time, each a test of its own file
# (tests/integration/test_results_more.py has the other half), so that two test processes run
# them at once: together they are every experiment.
FIRST_HALF = ("kairos", "inferline", "cascades", "cascadia", "infaas")


@pytest.mark.slow
def test_quick_mode_writes_the_first_half_of_the_sections(tmp_path: Path) -> None:
    chosen = [(module, key) for module, key in EXPERIMENTS if module in FIRST_HALF]
    quick_run_writes(tmp_path, [m for m, _ in chosen], [k for _, k in chosen])


def test_the_readme_states_the_held_out_autoscaling_figures_not_the_tuning_ones() -> None:
    (section,) = [s for s in sections_in(DOCS_RESULTS) if s.key == "autoscaling"]
    sets = section.data["sets"]
    test, tuning = (sets[name]["summary"]["policies"]["tuner"] for name in ("test", "tuning"))
    line = next(
        line for line in _readme_block().splitlines() if "(docs/results/autoscaling.md)" in line
    )
    assert f"{test['mean_cost_over_oracle']:.2f}x" in line
    assert f"{100 * test['mean_miss_share']:.2f}%" in line
    assert f"{100 * tuning['mean_miss_share']:.2f}%" not in line
