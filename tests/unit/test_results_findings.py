"""The findings' templates (benchmarks/results/findings/): a template is filled with exactly the
values it names, and every template file parses into named one-line templates."""

from __future__ import annotations

import pytest

from benchmarks.results.findings import FOLDER, finding, templates


def test_a_finding_is_its_template_with_the_values_in_place() -> None:
    line = finding(
        "fidelity",
        "demo",
        rate_qps="11.8",
        measured_p99_ms="172",
        predicted_p99_ms="164",
        ratio="1.048",
        runs=3,
        low="0.866",
        high="1.054",
    )
    assert line == (
        "The demo cascade at its plan's rate (11.8 qps): measured P99 172 ms against 164 ms"
        " predicted, ratio 1.048 (median of 3 runs, 0.866-1.054)."
    )


def test_a_missing_or_unused_value_names_the_template() -> None:
    with pytest.raises(KeyError, match=r"fidelity.md, ## demo"):
        finding("fidelity", "demo", rate_qps="1")
    with pytest.raises(KeyError, match=r"## gear_family"):
        finding("controlplane", "gear_family", family="x", extra="y")


def test_every_template_file_has_named_one_line_templates() -> None:
    files = sorted(FOLDER.glob("*.md"))
    assert files
    for path in files:
        named = templates(path.stem)
        assert named, path
        assert all(text and "\n" not in text for text in named.values()), path
